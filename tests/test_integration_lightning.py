"""The Lightning strategies of omnickpt.integrations.lightning, with a real lightning.Trainer on 2 gloo
ranks (CPU): fit 6 steps without a break; fit 4 steps with ModelCheckpoint saving omnickpt folders
(every 2 steps, top 2 by step, save_last); a fresh Trainer and a freshly initialised model resume
with ckpt_path="last" and train to 6. The resumed steps' losses and the final parameters equal the
uninterrupted run's exactly, the dict Lightning gets back on load equals the one it saved, and
ModelCheckpoint's retention (which removes checkpoints through the strategy) leaves the same
folders as in the uninterrupted run. DDP (async saves) and ModelParallelStrategy with FSDP2 or
tensor parallelism (sync saves); a 2-rank checkpoint is also resumed by one process.

Data: 16 samples, batch 4, DistributedSampler shuffling per epoch: 2 steps an epoch on 2 data-parallel
ranks (4 with tensor parallelism), so step 4 falls on an epoch end (Lightning restarts a plain
DataLoader's epoch on resume; its position inside an epoch is not part of any checkpoint). No
dropout: Lightning saves no RNG state.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from dist import run_ranks

pytest.importorskip("lightning")

STEPS, STOP_AT, SAMPLES, BATCH = 6, 4, 16, 4
# DDP (async saves); ModelParallelStrategy with FSDP2 (data parallel 2) and with tensor parallelism
# (tensor parallel 2: both ranks see every batch, so an epoch is 4 steps)
KINDS = ("ddp", "fsdp2", "tp")


def _folders(kind: str) -> list[str]:
    """What ModelCheckpoint keeps at step 6: the top 2 by step and last.ckpt."""
    if kind == "tp":
        return ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    return ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]


def _make_module(layout: str = "plain"):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self, width: int = 16, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
            self.loaded: dict | None = None

        def configure_model(self):
            if layout == "tp":
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
                parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
            if layout == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[2]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def val_dataloader(self):
            return self.train_dataloader()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            x = torch.randn(SAMPLES, 8, generator=g)
            data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
            return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)

        def on_load_checkpoint(self, checkpoint):
            self.loaded = _snapshot(checkpoint)   # what the strategy's load_checkpoint gave Lightning

    return Net


def _make_recorder():
    import lightning as L

    class Recorder(L.Callback):
        """Each step's (global step, loss) on this rank; a copy of the dict of the last save."""

        def __init__(self):
            self.losses: list[tuple[int, float]] = []
            self.saved: dict | None = None
            self.started: dict | None = None

        def on_train_start(self, trainer, pl_module):   # after Lightning restored everything
            self.started = _snapshot({"state_dict": pl_module.state_dict(),
                                      "optimizer_states": [o.state_dict() for o in trainer.optimizers]})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append((trainer.global_step, outputs["loss"].item()))

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.saved = _snapshot(checkpoint)

    return Recorder


def _snapshot(checkpoint: dict) -> dict:
    """A deep copy of Lightning's checkpoint dict, tensors (DTensor shards as their full value) cloned."""
    from torch.distributed.tensor import DTensor

    def copy_value(v):
        if isinstance(v, DTensor):
            return v.full_tensor().detach().clone()
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: copy_value(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(copy_value(x) for x in v)
        return copy.deepcopy(v)
    out = {k: copy_value(v) for k, v in checkpoint.items()}
    # ModelCheckpoint's state (best_k_models, last_model_path...) under a short key, for the asserts
    out["model_checkpoint"] = {k: v for k, v in out.pop("callbacks", {}).items() if k.startswith("ModelCheckpoint")}
    return out


def _trainer(strategy, world: int, max_steps: int, dirpath: str, recorder):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                           save_last=True)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=max_steps,
                     callbacks=[ckpt, recorder], logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=dirpath, num_sanity_val_steps=0,
                     limit_val_batches=0)


def _validate(model, ckpt_path: str) -> None:
    """trainer.validate(ckpt_path=...) in this process, with the single-device omnickpt strategy."""
    import lightning as L
    from omnickpt.integrations.lightning import OmnickptSingleDeviceStrategy
    trainer = L.Trainer(strategy=OmnickptSingleDeviceStrategy(torch.device("cpu")), accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    trainer.validate(model, ckpt_path=ckpt_path, verbose=False)


def _params(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.state_dict().items()}


def _strategy(kind: str):
    from omnickpt.integrations import lightning as integ
    if kind == "ddp":
        return integ.OmnickptDDPStrategy(async_save=True)
    dp = {"fsdp2": 2, "tp": 1}[kind]
    return integ.OmnickptModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2 // dp)


def _fit_stop_resume(rank: int, world: int, kind: str, root: str) -> dict:
    """Every rank: the uninterrupted run, the run stopped at STOP_AT, the resumed run."""
    import lightning as L
    Net, Recorder = _make_module(kind), _make_recorder()
    out = {}
    for run, max_steps, ckpt_path, seed in (("full", STEPS, None, 0), ("stopped", STOP_AT, None, 0),
                                            ("resumed", STEPS, "last", 1)):
        L.seed_everything(0, verbose=False)   # also the seed of Lightning's DistributedSampler's shuffle
        torch.manual_seed(seed)   # the resumed run starts from other weights: the load must count
        model, recorder = Net(), Recorder()
        dirpath = os.path.join(root, "full" if run == "full" else "run")
        trainer = _trainer(_strategy(kind), world, max_steps, dirpath, recorder)
        trainer.fit(model, ckpt_path=ckpt_path)
        out[run] = {"losses": recorder.losses, "params": _params(model), "saved": recorder.saved,
                    "loaded": model.loaded, "files": sorted(os.listdir(dirpath)), "global_step": trainer.global_step}
    return out


def _assert_same(a, b, where: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _all_runs(rank: int, world: int, root: str) -> dict:
    """Every rank: both layouts, in one set of processes (starting them, importing torch and
    Lightning, is most of the cost)."""
    return {kind: _fit_stop_resume(rank, world, kind, os.path.join(root, kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    return str(root), run_ranks(2, _all_runs, str(root))


@pytest.mark.parametrize("kind", KINDS)
def test_fit_stop_resume_is_exact(runs, kind):
    """DDP with async saves, ModelParallelStrategy (FSDP2, TP) with sync saves: after resuming from
    last.ckpt, each rank's losses of steps 5-6 and the final parameters are the uninterrupted run's."""
    for rank, r in enumerate(results[kind] for results in runs[1]):
        full, stopped, resumed = r["full"], r["stopped"], r["resumed"]
        assert stopped["losses"] == full["losses"][:STOP_AT]
        assert [s for s, _ in resumed["losses"]] == list(range(STOP_AT + 1, STEPS + 1))
        assert resumed["losses"] == full["losses"][STOP_AT:], rank
        _assert_same(full["params"], resumed["params"], f"rank {rank} final params")
        assert resumed["global_step"] == STEPS


@pytest.mark.parametrize("kind", KINDS)
def test_lightning_gets_back_the_dict_it_saved(runs, kind):
    """What the strategy's load_checkpoint gives Lightning (seen by on_load_checkpoint) equals what
    it saved at step 4 (seen by on_save_checkpoint): model and optimizer state, lr_schedulers, loops,
    ModelCheckpoint's state, hyper_parameters, epoch, global_step, pytorch-lightning_version."""
    for rank, r in enumerate(results[kind] for results in runs[1]):
        saved, loaded = r["stopped"]["saved"], r["resumed"]["loaded"]
        assert saved["global_step"] == STOP_AT and saved["hyper_parameters"] == {"width": 16, "lr": 0.05}
        assert saved["lr_schedulers"][0]["last_epoch"] == STOP_AT and saved["model_checkpoint"]
        _assert_same(saved, loaded, f"rank {rank} checkpoint dict")


@pytest.mark.parametrize("kind", KINDS)
def test_model_checkpoint_folders_retention_and_last(runs, kind):
    """ModelCheckpoint's files are omnickpt folders saved by both ranks; its top-2 retention removes
    step 2's through the strategy, after the resume too; ckpt_path="last" found last.ckpt."""
    root, results = runs
    for r in results:
        assert r[kind]["full"]["files"] == r[kind]["resumed"]["files"] == _folders(kind)
    import omnickpt
    for name in _folders(kind):
        path = os.path.join(root, kind, "run", name)
        # every rank wrote its part: no gather to rank 0 (with DDP, the replicas' writes are split)
        report = omnickpt.read_report(path)
        assert all(n > 0 for n in report["bytes_per_rank"])
        assert ("snapshot_lazy" in report["phases"]) == (kind == "ddp")   # DDP's saves were async
        with omnickpt.open(path) as reader:
            assert reader.layout["world_size"] == 2
            assert "state_dict/net.0.weight" in reader.names()
            assert "optimizer_0/state/net.0.weight/exp_avg" in reader.names()


def test_two_rank_fsdp2_checkpoint_resumes_in_one_process(runs):
    """The FSDP2 2-rank checkpoint of step 4, resumed by one process with the single-device strategy
    (resharded at load): the parameters, optimizer state and the rest of Lightning's dict come back
    exactly, and training goes on from step 4 to 6."""
    import lightning as L
    from omnickpt.integrations.lightning import OmnickptSingleDeviceStrategy
    root, results = runs
    saved = results[0]["fsdp2"]["stopped"]["saved"]
    Net, recorder = _make_module(), _make_recorder()()
    L.seed_everything(0, verbose=False)
    torch.manual_seed(1)
    model = Net()
    trainer = _trainer(OmnickptSingleDeviceStrategy(torch.device("cpu")), 1, STEPS, os.path.join(root, "one"),
                       recorder)
    trainer.fit(model, ckpt_path=os.path.join(root, "fsdp2", "run", "epoch=1-step=4.ckpt"))
    loaded = model.loaded
    # ModelCheckpoint's state differs between the two step-4 saves (last.ckpt's names itself)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters", "epoch",
                "global_step"):
        _assert_same(saved[key], loaded[key], key)
    assert trainer.global_step == STEPS and [s for s, _ in recorder.losses] == [STOP_AT + 1, STEPS]
    assert sorted(os.listdir(os.path.join(root, "one"))) == ["epoch=2-step=6.ckpt", "last.ckpt"]


def test_validate_from_a_checkpoint_loads_the_module_only(runs):
    """trainer.validate(ckpt_path=...) has no optimizers: the module's weights are loaded from the
    2-rank checkpoint, the saved optimizer state is left alone (no mismatch raised)."""
    root, results = runs
    saved = results[0]["ddp"]["stopped"]["saved"]
    torch.manual_seed(1)
    model = _make_module()()
    _validate(model, os.path.join(root, "ddp", "run", "epoch=1-step=4.ckpt"))
    _assert_same(saved["state_dict"], _params(model), "state_dict")
    assert "optimizer_states" not in model.loaded and model.loaded["global_step"] == STOP_AT


def test_lightning_ckpt_file_resumes_and_hook_edits_are_refused(tmp_path):
    """A Lightning .ckpt file (torch.save, from Lightning's own strategy) resumes through the omnickpt
    strategy (Lightning's restore path), and the run goes on saving omnickpt folders. A hook that
    adds a tensor to checkpoint["state_dict"] is refused: omnickpt saves the live module, and would
    lose it silently."""
    import lightning as L
    from omnickpt.errors import UnsupportedError
    from omnickpt.integrations.lightning import OmnickptSingleDeviceStrategy
    Net, recorder = _make_module(), _make_recorder()()
    L.seed_everything(0, verbose=False)
    first = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[recorder],
                      default_root_dir=str(tmp_path))
    first.fit(Net())
    first.save_checkpoint(str(tmp_path / "torch.ckpt"))
    saved = recorder.saved
    torch.manual_seed(1)
    model, recorder = Net(), _make_recorder()()
    trainer = _trainer(OmnickptSingleDeviceStrategy(torch.device("cpu")), 1, 4, str(tmp_path / "omni"), recorder)
    trainer.fit(model, ckpt_path=str(tmp_path / "torch.ckpt"))
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step"):
        _assert_same(saved[key], model.loaded[key], key)
    for key in ("state_dict", "optimizer_states"):   # Lightning's own restore put them in place
        _assert_same(saved[key], recorder.started[key], key)
    assert [s for s, _ in recorder.losses] == [3, 4]
    assert os.path.isdir(tmp_path / "omni" / "last.ckpt")
    # a weights-only save holds no optimizer; validate loads it
    trainer.save_checkpoint(str(tmp_path / "weights.ckpt"), weights_only=True)
    import omnickpt
    with omnickpt.open(str(tmp_path / "weights.ckpt")) as reader:
        assert not [n for n in reader.names() if not n.startswith("state_dict/")]
    torch.manual_seed(2)
    fresh = Net()
    _validate(fresh, str(tmp_path / "weights.ckpt"))
    _assert_same(_params(model), _params(fresh), "weights-only")

    class Edits(Net):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["state_dict"]["ema.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedError, match="on_save_checkpoint"):
        trainer = _trainer(OmnickptSingleDeviceStrategy(torch.device("cpu")), 1, 2, str(tmp_path / "edits"),
                           _make_recorder()())
        trainer.fit(Edits())
    assert not os.path.exists(tmp_path / "edits" / "last.ckpt")


def test_other_folders_are_refused_by_name(tmp_path):
    """A folder that is no committed omnickpt checkpoint (an interrupted save) and an omnickpt
    checkpoint not saved by these strategies are refused with errors naming them."""
    import omnickpt
    from omnickpt.errors import NotCommittedError, UnsupportedError
    model = _make_module()()
    omnickpt.save(str(tmp_path / "plain"), {"model": model.net}).wait()
    (tmp_path / "interrupted" / "data").mkdir(parents=True)
    for name, error, says in (("plain", UnsupportedError, "not one saved by a Lightning omnickpt strategy"),
                              ("interrupted", NotCommittedError, "without a committed omnickpt checkpoint")):
        with pytest.raises(error, match=f"{name}.*{says}"):
            _validate(model, str(tmp_path / name))


def test_save_last_link_with_async_saves(tmp_path):
    """ModelCheckpoint(save_last="link") links last.ckpt to the newest folder (no second save); its
    retention removes the old link, never the folder it names; ckpt_path="last" follows the link."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omnickpt.integrations.lightning import OmnickptSingleDeviceStrategy
    Net = _make_module()

    def fit(max_steps: int, recorder, ckpt_path=None):
        ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                               save_last="link")
        trainer = L.Trainer(strategy=OmnickptSingleDeviceStrategy(torch.device("cpu"), async_save=True),
                            accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[ckpt, recorder],
                            logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(Net(), ckpt_path=ckpt_path)
    first = _make_recorder()()
    fit(4, first)
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=0-step=4.ckpt"
    resumed = _make_recorder()()
    fit(6, resumed, "last")
    assert [s for s, _ in resumed.losses] == [5, 6]
    for key in ("state_dict", "optimizer_states"):   # the step-4 save, through the link
        _assert_same(first.saved[key], resumed.started[key], key)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=6.ckpt"
