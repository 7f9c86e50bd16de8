"""Live DeepSpeed engines through omnickpt.save/load (omnickpt/adapters/deepspeed.py and
omnickpt/integrations/deepspeed.py): bitwise resume at ZeRO 0-3, other data-parallel sizes and
stages, a plain module + torch AdamW and FSDP2, and back. Real engines on gloo ranks (CPU)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from dist import run_ranks

pytest.importorskip("deepspeed")
if shutil.which("g++") is None:
    pytest.skip("DeepSpeed compiles a C++ op on first use and no g++ is installed", allow_module_level=True)

LR = 1e-2
SIZES = (5, 7, 3)    # odd: ZeRO partitions split parameters and leave padding at DP 2
STEPS = 3


class _Shift(nn.Module):
    """A frozen parameter and a buffer: saved as the module adapter names them, not from the optimizer."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5, requires_grad=False)
        self.register_buffer("offset", torch.rand(n))

    def forward(self, x):
        return x * self.weight + self.offset


def _model(sizes=SIZES, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.ReLU(), nn.Linear(sizes[1], sizes[2]), _Shift(sizes[2]))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _engine(stage: int, *, bf16: bool | str = False, seed: int = 0, sizes=SIZES):
    """bf16="fp32-accum": bf16 with fp32 gradient accumulation, which DeepSpeed runs with its
    BF16_Optimizer at ZeRO-1 (its other bf16 ZeRO-1/2 path is DeepSpeedZeroOptimizer)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(sizes, seed)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
           # the lr changes every step: a resume that lost the scheduler's state steps with another lr
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": LR}},
           "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if bf16 == "fp32-accum":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=_trainable(model), config=cfg)
    return engine


def _batch(step: int, rank: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, SIZES[0], generator=g).to(dtype)


def _train_step(engine, step: int, rank: int) -> torch.Tensor:
    dtype = next(engine.module.parameters()).dtype
    loss = engine(_batch(step, rank, dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _local_state(engine) -> list[torch.Tensor]:
    """This rank's fp32 masters, their Adam moments and the model's parameters, bitwise comparable
    between two engines of the same layout. Padding is left out: DeepSpeed never initialises it."""
    from omnickpt.adapters.deepspeed import engine_layout
    layout = engine_layout(engine)
    opt = layout.optimizer
    out = []
    for i, part in enumerate(layout.partitions):
        st = layout.inner.state[part.master]
        lp = opt.fp16_partitioned_groups_flat[i] if layout.kind.endswith("Stage3") else None
        for piece in part.pieces:
            held = slice(piece.offset, piece.offset + piece.numel)
            out += [part.flat[held].clone(), st["exp_avg"].view(-1)[held].clone(),
                    st["exp_avg_sq"].view(-1)[held].clone()]
            if lp is not None:
                out.append(lp[held].clone())
        out.append(st["step"].clone())
    if not layout.kind.endswith("Stage3"):
        out += [p.detach().clone() for p in engine.module.parameters()]
    return out


def _full_state(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    """fqn -> (fp32 master, exp_avg, exp_avg_sq), whole, by DeepSpeed's own gathering helpers (an
    independent reference: collectives, not omnickpt's boxes). Every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if engine.zero_optimization_stage() == 0:
            st = engine.optimizer.state[p]
            out[name] = (p.detach().float().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone())
        else:
            out[name] = (safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone(),
                         safe_get_full_optimizer_state(p, "exp_avg_sq").clone())
    return out


# ---- resume at the same size ----------------------------------------------------------------------

def _saved_as_views(engine) -> bool:
    """Whether every tensor the engine's entries save is a view of DeepSpeed's own memory (its fp32
    partitions, optimizer state, the module's tensors): no gather, no copy on the stall path."""
    from omnickpt.adapters import collect_save
    from omnickpt.adapters.deepspeed import engine_layout
    layout = engine_layout(engine)
    own = [part.master for part in layout.partitions] + [t for st in layout.inner.state.values()
                                                         for t in st.values() if isinstance(t, torch.Tensor)]
    own += list(engine.module.parameters()) + list(engine.module.buffers())
    own += [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    storages = {t.untyped_storage().data_ptr() for t in own}
    saved = collect_save({"model": engine, "optimizer": engine.optimizer})
    # the masters and moments change only in the inner optimizer's step: an async save copies them
    # lazily, behind the fence, not on the stall path
    from omnickpt.fence import step_stable_storages
    stable = step_stable_storages({"model": engine, "optimizer": engine.optimizer})
    lazy = [part.master for part in layout.partitions]
    if not all(t.untyped_storage().data_ptr() in stable for t in lazy if t.numel()):
        return False
    # (empty boxes, for parameters with nothing in this rank's partition, have no storage)
    return all(s.local.untyped_storage().data_ptr() in storages for _, items in saved for s in items.shards
               if s.local.numel())


def _scale(engine):
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return None if scaler is None else scaler.cur_scale


def _resume(rank, world, stage, bf16, async_save, path):
    import omnickpt
    from omnickpt.integrations.deepspeed import engine_state
    a = _engine(stage, bf16=bf16, seed=0)
    for step in range(STEPS):
        _train_step(a, step, rank)
    views = _saved_as_views(a)
    if getattr(a.optimizer, "loss_scaler", None) is not None:
        a.optimizer.loss_scaler.cur_scale = 2.0    # a scaler state other than a fresh engine's: it must travel
    manager = None
    if async_save == "manager":     # the training-loop way: CheckpointManager, async, lazy snapshot
        manager = omnickpt.CheckpointManager(path)
        manager.save(STEPS, engine_state(a, {"epoch": 7, "note": "resume"}), async_save=True)
    else:
        handle = omnickpt.save(path, engine_state(a, {"epoch": 7, "note": "resume"}), async_save=async_save)
    # with a lazy snapshot this step waits (the fence) until its copy is done; then the state moves on
    loss_a = _train_step(a, STEPS, rank)
    if manager is not None:
        manager.wait()
    elif async_save:
        handle.wait()
    expected = _local_state(a)
    counters_a = (a.global_steps, a.global_samples, a.micro_steps, a.get_lr(), _scale(a))

    b = _engine(stage, bf16=bf16, seed=1)      # other initial weights: only the load makes them equal
    state = engine_state(b, {"epoch": 0, "note": ""})
    if manager is not None:
        manager.load_latest(state)
        manager.close()
    else:
        omnickpt.load(path, state)
    client = (state["epoch"], state["note"])
    loss_b = _train_step(b, STEPS, rank)
    got = _local_state(b)
    return {"loss": torch.equal(loss_a, loss_b), "state": [torch.equal(x, y) for x, y in zip(expected, got)],
            "n": (len(expected), len(got)), "counters": counters_a == (b.global_steps, b.global_samples,
                                                                        b.micro_steps, b.get_lr(), _scale(b)),
            "client": client, "views": views, "optimizer": type(a.optimizer).__name__}


# (stage, bf16, async_save) by name; all run in the same two processes (each start imports deepspeed: seconds)
_RESUMES = {"zero0-manager": (0, False, "manager"), "zero1-async": (1, False, True), "zero2-bf16": (2, True, False),
            "zero3-async": (3, False, True), "zero1-bf16-optimizer": (1, "fp32-accum", False)}


def _resume_all(rank, world, root):
    return {name: _resume(rank, world, *case, f"{root}/{name}") for name, case in _RESUMES.items()}


def test_resume_is_bitwise_at_dp2(tmp_path):
    for per_rank in run_ranks(2, _resume_all, str(tmp_path)):
        for name, r in per_rank.items():
            bf16 = _RESUMES[name][1]
            assert r["n"][0] == r["n"][1] and all(r["state"]), (name, r)
            assert r["loss"], f"{name}: the next step's loss differs from the uninterrupted run"
            assert r["counters"], f"{name}: global_steps / global_samples / micro_steps / lr / loss scale were not restored"
            assert r["client"] == (7, "resume"), name
            assert (r["optimizer"] == "BF16_Optimizer") == (bf16 == "fp32-accum"), (name, r["optimizer"])
            assert r["views"], f"{name}: a saved shard is not a view of the engine's own partitions (a gather or a copy)"


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory):
    """(path, fqn -> (master, exp_avg, exp_avg_sq) whole) of a ZeRO-2 bf16 engine trained at DP 2."""
    path = str(tmp_path_factory.mktemp("ds") / "ckpt")
    return path, run_ranks(2, _save_trained, 2, True, path)[0]


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """(path, fqn -> (weight, exp_avg, exp_avg_sq), Adam's step) of a plain module + torch AdamW."""
    path = str(tmp_path_factory.mktemp("plain") / "ckpt")
    (saved, step), = run_ranks(1, _save_plain, path)
    return path, saved, step


def test_save_names_like_plain_torch(ds_checkpoint, plain_checkpoint):
    """The engine's checkpoint holds exactly the tensor names a plain module + torch AdamW writes,
    the masters in float32 of the parameters' shapes, and records the frameworks."""
    import omnickpt
    ds, plain = omnickpt.open(ds_checkpoint[0]).manifest, omnickpt.open(plain_checkpoint[0]).manifest
    names = {n for n in plain.tensors}
    assert {n for n in ds.tensors} == names
    for n in names:
        assert ds.tensors[n].shape == plain.tensors[n].shape, n
        # trainable parameters and their state: fp32 masters; the frozen parameter: the bf16 model's
        # (DeepSpeed leaves buffers in fp32)
        frozen = n == "model/3.weight"
        assert (ds.tensors[n].dtype, frozen) in {(plain.tensors[n].dtype, False), ("bfloat16", True)}, n
    frameworks = ds.layout["frameworks"]
    assert frameworks["model"] == "deepspeed" and frameworks["optimizer"] == "torch.optim.adamw.AdamW"
    # at DP 2 the first weight (35 elements) is split across the ranks: more than one box, none padded
    w = ds.tensors["model/0.weight"]
    assert len(w.boxes) > 1 and sum(b.lengths[0] * b.lengths[1] for b in w.boxes) == 35


# ---- another size, another stage, other frameworks ------------------------------------------------

def _save_trained(rank, world, stage, bf16, path):
    import omnickpt
    engine = _engine(stage, bf16=bf16)
    for step in range(STEPS):
        _train_step(engine, step, rank)
    from omnickpt.integrations.deepspeed import engine_state
    omnickpt.save(path, engine_state(engine, {"epoch": 5}))
    return _full_state(engine)


def _load_dp1(rank, world, stage, path):
    """A DP-1 engine of another stage, and a plain module + torch AdamW, load the DP-2 checkpoint."""
    import omnickpt
    from omnickpt.integrations.deepspeed import engine_state
    engine = _engine(stage, seed=3)
    state = engine_state(engine, {"epoch": 0})
    # cast: the bf16 engine saved its frozen parameter and buffer in bf16 (trainable ones: fp32 masters)
    omnickpt.load(path, state, cast=True)
    model = _model(seed=4)
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    omnickpt.load(path, {"model": model, "optimizer": opt}, cast=True, include=["model", "optimizer"])
    plain = {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
             for n, p in model.named_parameters() if p.requires_grad}
    return {"engine": _full_state(engine), "plain": plain, "frozen": (model[3].weight.clone(), model[3].offset.clone()),
            "lr": opt.param_groups[0]["lr"], "engine_lr": engine.optimizer.param_groups[0]["lr"],
            "counters": (engine.global_steps, engine.lr_scheduler.last_batch_iteration, state["epoch"])}


def _load_fsdp2(rank, world, path):
    import omnickpt
    from torch.distributed.fsdp import fully_shard
    model = _model(seed=5)
    fully_shard(model)
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    omnickpt.load(path, {"model": model, "optimizer": opt}, cast=True, include=["model", "optimizer"])
    return {n: (p.full_tensor(), opt.state[p]["exp_avg"].full_tensor(), opt.state[p]["exp_avg_sq"].full_tensor())
            for n, p in model.named_parameters() if p.requires_grad}


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [f"{n}[{i}]" for n in a for i in range(3) if not torch.equal(a[n][i], b[n][i])]


def test_dp2_checkpoint_loads_at_dp1_other_stage_plain_and_fsdp2(ds_checkpoint):
    path, reference = ds_checkpoint                             # ZeRO-2, bf16 model, fp32 masters, DP 2
    (dp1,) = run_ranks(1, _load_dp1, 3, path)                   # ZeRO-3 at DP 1
    assert not _same(reference, dp1["engine"]), _same(reference, dp1["engine"])
    assert not _same(reference, dp1["plain"]), _same(reference, dp1["plain"])
    assert dp1["lr"] == dp1["engine_lr"] != LR     # the warmed-up lr of the param group came along
    # the engine's counters, scheduler and client state load at another size too
    assert dp1["counters"] == (STEPS, STEPS - 1, 5)
    shift = _model(seed=0)[3]      # what the saving engine held, in bf16
    assert torch.equal(dp1["frozen"][0], shift.weight.detach().bfloat16().float())
    assert torch.equal(dp1["frozen"][1], shift.offset)
    for got in run_ranks(2, _load_fsdp2, path):
        assert not _same(reference, got), _same(reference, got)


def _save_plain(rank, world, path):
    import omnickpt
    model = _model(seed=6)
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    for step in range(STEPS):
        model(_batch(step, 0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    omnickpt.save(path, {"model": model, "optimizer": opt})
    return {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
            for n, p in model.named_parameters() if p.requires_grad}, opt.state[model[0].weight]["step"].clone()


def _load_into_engine(rank, world, stage, path):
    import omnickpt
    engine = _engine(stage, seed=7)
    omnickpt.load(path, {"model": engine, "optimizer": engine.optimizer})
    from omnickpt.adapters.deepspeed import engine_layout
    layout = engine_layout(engine)
    steps = [layout.inner.state[part.master]["step"].clone() for part in layout.partitions]
    # the model's own parameters were refreshed from the loaded masters: the forward uses them
    out = engine(_batch(0, 0)).detach()
    return _full_state(engine), steps, out


def test_plain_checkpoint_loads_into_zero3_engine(plain_checkpoint):
    path, saved, step = plain_checkpoint
    plain = _model(seed=6)      # the saved model's frozen parameter and buffer, which training leaves alone
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if p.requires_grad:
                p.copy_(saved[n][0])
        expected_out = plain(_batch(0, 0))
    for full, steps, out in run_ranks(2, _load_into_engine, 3, path):
        assert not _same(saved, full), _same(saved, full)
        assert all(torch.equal(s, step) for s in steps)
        assert torch.equal(out, expected_out)


# ---- what does not fit ------------------------------------------------------------------------------

def _wrong_shape(path) -> str | None:
    import omnickpt
    from omnickpt.errors import MismatchError
    other = _engine(0, sizes=(5, 8, 3), seed=2)
    try:
        omnickpt.load(path, {"model": other, "optimizer": other.optimizer})
    except MismatchError as e:
        return str(e)
    return None


def _checkpoint_calls(rank, world, path):
    from omnickpt.integrations.deepspeed import load_checkpoint, save_checkpoint
    from omnickpt.errors import UnsupportedError
    a = _engine(0, bf16=True)
    for step in range(2):
        _train_step(a, step, rank)
    save_checkpoint(a, path, client_state={"epoch": 2, "rng": torch.arange(3)}).wait()
    b = _engine(0, bf16=True, seed=9)
    b.global_steps = 0
    client = load_checkpoint(b, path)
    try:
        save_checkpoint(b, path + "2", client_state={"model": 1})
        clash = None
    except UnsupportedError as e:
        clash = str(e)
    return (client["epoch"], client["rng"].tolist(), b.global_steps, clash,
            all(torch.equal(x, y) for x, y in zip(_local_state(a), _local_state(b))), _wrong_shape(path))


def test_save_and_load_checkpoint_calls(tmp_path):
    """save_checkpoint / load_checkpoint of a ZeRO-0 bf16 engine (fp32 copies in FP16_UnfusedOptimizer),
    client state back, a client key that clashes refused, and a model of another shape named."""
    epoch, rng, steps, clash, same, mismatch = run_ranks(1, _checkpoint_calls, str(tmp_path / "ckpt"))[0]
    assert (epoch, rng, steps) == (2, [0, 1, 2], 2)
    assert same
    assert clash is not None and "'model'" in clash
    assert mismatch is not None, "loading a 7-wide layer into an 8-wide one did not raise MismatchError"
    assert "model/0.weight" in mismatch


def test_import_omnickpt_does_not_import_deepspeed():
    """The adapters recognise engines by class name: importing omnickpt (and its DeepSpeed integration)
    costs no DeepSpeed import, which takes seconds and compiles ops."""
    import subprocess
    import sys
    code = ("import sys, omnickpt, omnickpt.integrations.deepspeed; "
            "sys.exit(1 if 'deepspeed' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__))).returncode == 0
