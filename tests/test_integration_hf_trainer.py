"""The Hugging Face Trainer saving and resuming through omnickpt (omnickpt/integrations/hf_trainer.py).

The real `transformers.Trainer` on 2 gloo ranks (CPU), a synthetic dataset of 3 batches per epoch and
a 2-layer Llama with attention dropout in two layouts: DDP (the Trainer's default) over the model built
from a config, and FSDP2 over the same model sharded at load time by transformers
(`from_pretrained(distributed_config=...)`). For each, an uninterrupted run of STEPS steps is the
reference. Runs stopped partway (saves every 2 steps) and resumed by new Trainers with differently
initialised models must log the same losses, gradient norms and learning rates and end with the same
parameters, bit for bit: that needs the weights, Adam's moments, the scheduler, every rank's RNG
streams (dropout) and the Trainer's own state (step, epoch, the batches to skip) back. A DDP
checkpoint resumed under FSDP2 matches to float rounding. One spawn of the two ranks runs every
scenario (importing transformers costs seconds a process).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from dist import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 8            # 3 optimizer steps an epoch: the runs cross two epoch boundaries
SAVE_EVERY = 2
VOCAB, SEQ = 128, 8
PER_DEVICE_BATCH = 2
SAMPLES = 3 * 2 * PER_DEVICE_BATCH   # 3 steps an epoch on 2 ranks


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(init_seed: int):
    """A 2-layer Llama (hidden 32, vocab 128) with attention dropout, built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(init_seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.1)
    return LlamaForCausalLM(config)


def _trainer(out: str, *, init_seed: int = 0, stop_at: int | None = None, save: bool = True,
             save_total_limit: int | None = None, options=None, plain: bool = False, model=None,
             evaluate: bool = False, load_best: bool = False):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from omnickpt.integrations.hf_trainer import OmnickptTrainer

    class StopAt(TrainerCallback):
        # A job that ends after step `stop_at` (its save of that step is made first).
        def on_step_end(self, args, state, control, **kw):
            if stop_at is not None and state.global_step >= stop_at:
                control.should_training_stop = True

    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=PER_DEVICE_BATCH, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, logging_steps=1,
        save_strategy="steps" if save else "no", save_steps=SAVE_EVERY, save_total_limit=save_total_limit,
        use_cpu=True, ddp_find_unused_parameters=False, report_to=[], disable_tqdm=True, seed=7,
        dataloader_num_workers=0,
        # "best" is the highest eval loss: an early checkpoint, not the last state, so that loading it
        # at the end changes the parameters
        **(dict(eval_strategy="steps", eval_steps=SAVE_EVERY, metric_for_best_model="loss", greater_is_better=True,
                load_best_model_at_end=load_best) if evaluate else {}),
    )
    kwargs = dict(model=model if model is not None else _model(init_seed), args=args, train_dataset=_Tokens(),
                  eval_dataset=_Tokens() if evaluate else None, callbacks=[StopAt()])
    if plain:
        return Trainer(**kwargs)
    return OmnickptTrainer(**kwargs, omnickpt_options=options)


def _logged(trainer) -> tuple[int, dict[int, tuple]]:
    """The step training started from, and step -> (loss, grad_norm, learning_rate) as the Trainer
    logged them (averaged over ranks; a resumed run's history starts with the checkpoint's)."""
    return trainer._initial_global_step, {h["step"]: (h["loss"], h["grad_norm"], h["learning_rate"])
                                          for h in trainer.state.log_history if "loss" in h}


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _listing(out: str) -> dict[str, list[str]]:
    return {d: sorted(os.listdir(os.path.join(out, d))) for d in sorted(os.listdir(out)) if d.startswith("checkpoint-")}


def _sharded_model(root: str, init_seed: int):
    """_model(init_seed) sharded at load time by transformers itself (`from_pretrained(distributed_config=)`:
    FSDP2 over the 2 ranks, DTensor parameters), the FSDP path of transformers 5 that runs on CPU; the
    plain Trainer refuses to checkpoint its optimizer. The weights come from a folder rank 0 writes
    (nothing is downloaded)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    folder = os.path.join(root, f"llama-init-{init_seed}")
    if dist.get_rank() == 0 and not os.path.isdir(folder):
        _model(init_seed).save_pretrained(folder)
    dist.barrier()
    return LlamaForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=2))


def _full_params(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule
    assert isinstance(trainer.model, FSDPModule)
    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()   # an evaluation at the end leaves the norm and head unsharded
    return {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}


def _worker(rank, world, root):
    import gc

    import torch.distributed as dist

    import omnickpt
    from omnickpt.integrations.hf_trainer import last_checkpoint
    # Trainer.train() starts with gc.collect() (Accelerator.free_memory): over transformers' import,
    # about a second a call. Frozen, the import's objects are not traversed again.
    gc.freeze()
    # Accelerate gives each CPU rank several threads unless OMP_NUM_THREADS is set: on a shared
    # 2-core machine the ranks' threads then wait on each other (20 ms a tiny matmul).
    os.environ["OMP_NUM_THREADS"] = "1"

    def folder(name):
        return os.path.join(root, name)

    out = {}
    # DDP. A: the reference, uninterrupted, no saves.
    a = _trainer(folder("a"), save=False)
    a.train()
    out["a"] = (_logged(a), _params(a))

    # P: the plain Trainer, its own checkpoint of step 2. B switches to omnickpt: resumes from that
    # folder (True), saves every 2 steps, at most 2 kept, the job ends after step 6; C resumes (True).
    p = _trainer(folder("b"), stop_at=2, plain=True)
    p.train()
    out["p_files"] = sorted(os.listdir(folder("b/checkpoint-2")))
    b = _trainer(folder("b"), init_seed=99, stop_at=6, save_total_limit=2)
    b.train(resume_from_checkpoint=True)
    out["b"] = _logged(b)
    out["b_listing"] = _listing(folder("b"))
    out["b_last"] = last_checkpoint(folder("b"))
    dist.barrier()
    if rank == 0:
        # A save of step 8 that was interrupted: its data written, never committed (no manifest, and
        # so no trainer_state.json either). transformers' get_last_checkpoint would pick it.
        shutil.copytree(folder("b/checkpoint-6"), folder("b/checkpoint-8"))
        os.remove(folder("b/checkpoint-8/manifest.json"))
        os.remove(folder("b/checkpoint-8/trainer_state.json"))
    dist.barrier()
    c = _trainer(folder("b"), init_seed=99)
    try:
        c.train(resume_from_checkpoint=folder("b/checkpoint-8"))
        out["uncommitted_refused"] = None
    except omnickpt.NotCommittedError as e:
        out["uncommitted_refused"] = str(e)
    c.train(resume_from_checkpoint=True)
    out["c"] = (_logged(c), _params(c))

    # FSDP2 (sharded at load time). A': the reference. D: async saves, the job ends after step 4;
    # E resumes from that folder, named, into a model initialised differently.
    # All three evaluate every 2 steps; D also loads the best checkpoint (the highest eval loss:
    # step 2's) when it ends.
    a = _trainer(folder("fa"), save=False, evaluate=True, model=_sharded_model(root, 0))
    a.train()
    out["fa"] = (_logged(a), _full_params(a))
    async_save = omnickpt.SaveOptions(async_save=True)
    d = _trainer(folder("fd"), stop_at=4, options=async_save, evaluate=True, load_best=True,
                 model=_sharded_model(root, 0))
    d.train()
    out["fd_committed"] = omnickpt.is_committed(folder("fd/checkpoint-4"))
    out["fd_data"] = sorted(os.listdir(folder("fd/checkpoint-4/data")))
    out["fd_best"] = d.state.best_model_checkpoint
    out["fd_end"] = _full_params(d)
    out["fd_saved"] = {}
    for step in (2, 4):
        with omnickpt.open(folder(f"fd/checkpoint-{step}")) as ckpt:
            out["fd_saved"][step] = {n: ckpt.get(f"model/{n}") for n in out["fd_end"]}
    e = _trainer(folder("fd"), options=async_save, evaluate=True, model=_sharded_model(root, 99))
    e.train(resume_from_checkpoint=folder("fd/checkpoint-4"))
    out["fe"] = (_logged(e), _full_params(e))

    # Across layouts: G, FSDP2, resumes from the DDP run's checkpoint-6 (omnickpt reshards at load).
    g = _trainer(folder("g"), model=_sharded_model(root, 99))
    g.train(resume_from_checkpoint=folder("b/checkpoint-6"))
    out["g"] = (_logged(g), _full_params(g))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    return run_ranks(2, _worker, str(root))


def _assert_resumed_exactly(reference, resumed, first_step):
    (_, ref_logs), ref_params = reference
    (started_at, logs), params = resumed
    assert started_at == first_step - 1
    assert sorted(logs) == list(range(1, STEPS + 1))
    for step in logs:
        assert logs[step] == ref_logs[step], f"step {step}: resumed {logs[step]} != uninterrupted {ref_logs[step]}"
    assert params.keys() == ref_params.keys()
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name


def test_sync_resume_from_latest_is_exact(runs):
    for rank_out in runs:
        _assert_resumed_exactly(rank_out["a"], rank_out["c"], first_step=7)


def test_switch_from_the_trainers_own_checkpoint_is_exact(runs):
    for rank_out in runs:
        assert "optimizer.pt" in rank_out["p_files"] and "manifest.json" not in rank_out["p_files"]
        started_at, logs = rank_out["b"]
        assert started_at == 2
        assert logs == {step: rank_out["a"][0][1][step] for step in range(1, 7)}


def test_fsdp2_async_resume_from_named_folder_is_exact(runs):
    for rank_out in runs:
        assert rank_out["fd_committed"]
        # each rank wrote its own shards: one data file per rank
        assert [name.rsplit("-", 1)[1] for name in rank_out["fd_data"]] == ["r00000.bin", "r00001.bin"]
        _assert_resumed_exactly(rank_out["fa"], rank_out["fe"], first_step=5)


def test_folders_keep_the_trainer_layout_and_retention(runs):
    listing = runs[0]["b_listing"]
    # save_total_limit=2: of checkpoint-2 (the plain Trainer's), -4, -6 the two newest remain
    assert sorted(listing) == ["checkpoint-4", "checkpoint-6"]
    for files in listing.values():
        for name in ("trainer_state.json", "config.json", "training_args.bin", "manifest.json", "data"):
            assert name in files
        # the Trainer's own weight, optimizer and per-rank RNG files are omnickpt's now
        assert not {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth"} & set(files)
    assert runs[0]["b_last"].endswith("checkpoint-6")


def test_uncommitted_folder_is_never_resumed(runs):
    for rank_out in runs:
        message = rank_out["uncommitted_refused"]
        assert message is not None and "checkpoint-8" in message and "checkpoint-6" in message


def test_load_best_model_at_end_loads_the_best_checkpoint(runs):
    for rank_out in runs:
        assert rank_out["fd_best"].endswith("checkpoint-2")
        best, last = rank_out["fd_saved"][2], rank_out["fd_saved"][4]
        for name, value in rank_out["fd_end"].items():
            assert torch.equal(value, best[name]), name
        assert any(not torch.equal(best[n], last[n]) for n in best)


def test_ddp_checkpoint_resumes_under_fsdp2(runs):
    # Same data, RNG streams and optimizer state; only the gradient reductions add in another order.
    for rank_out in runs:
        (_, ref_logs), ref_params = rank_out["a"]
        (started_at, logs), params = rank_out["g"]
        assert started_at == 6
        for step in (7, 8):
            assert logs[step] == pytest.approx(ref_logs[step], rel=1e-5, abs=1e-6), step
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6)
