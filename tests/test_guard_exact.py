"""guard() saves exactly the state of the step it names, or nothing (and says why); a failing save
counts as the cadence's attempt; manager.failures is bounded (issue 17).

The step named is N, the last step given to save(); what a save() call that did not save leaves
for guard() is omnickpt/failure.py's StepCapture. Each test makes the next step move something
before the failure (the batch fetched, BatchNorm statistics, the RNG, a schedule written at the top
of the step, the optimizer's update, NaN weights) and checks what reaches storage."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import omnickpt
from dist import run_ranks
from omnickpt.cadence import Cadence, backoff
from omnickpt.errors import StorageError

FAIL = 7          # the step in progress when the job fails: step FAIL - 1 is the one to save
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")   # torchdata's own


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _loader():
    from torchdata.stateful_dataloader import StatefulDataLoader
    data = torch.arange(400, dtype=torch.float32).reshape(100, 4) / 100
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))


def _state(seed: int = 0, opt_class=torch.optim.Adam) -> dict:
    model = _model(seed)
    return {"model": model, "optimizer": opt_class(model.parameters(), lr=0.01), "data": _loader(),
            "rng": omnickpt.RNGState(), "extra": {"counter": torch.zeros(3), "seen": []}}


def _values(state: dict) -> dict:
    """What must be step N's in the checkpoint: every tensor of the model, the learning rate, the
    torch RNG, the user value."""
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["lr"] = torch.tensor(state["optimizer"].param_groups[0]["lr"])
    out["rng"] = torch.get_rng_state()
    out["counter"] = state["extra"]["counter"].clone()
    out["seen"] = torch.tensor(state["extra"]["seen"])
    return out


def _train(root, fail: str | None, *, steps: int = 10, state: dict | None = None, nan_at: int | None = None,
           at_fail=None):
    """Steps 0..steps-1, save() called after each with every=100 (only step 0 is saved by the
    cadence: the others are captured); at step FAIL the job fails at point `fail` (`at_fail()` is
    called at the top of that step). Returns the manager, the state, its values at each save()
    call and the batches the loop saw."""
    state = state or _state()
    model, opt = state["model"], state["optimizer"]
    mgr = omnickpt.CheckpointManager(str(root), every=100)
    at_save, batches = {}, []
    it = iter(state["data"])
    try:
        with mgr.guard(state, grace=1):
            for step in range(steps):
                if step == FAIL and at_fail is not None:
                    at_fail()
                for g in opt.param_groups:          # a schedule written at the top of the step (nanoGPT)
                    g["lr"] = 0.01 / (1 + step)
                state["extra"]["counter"].fill_(step)
                state["extra"]["seen"].append(step)
                x = next(it)
                batches.append(x)
                if step == FAIL and fail == "fetched":
                    raise ValueError("a bad batch")
                noise = torch.randn_like(x) * 0.01  # the RNG moves
                loss = model(x + noise).square().mean()   # BatchNorm statistics move
                if step == nan_at:
                    loss = loss * float("nan")
                if step == FAIL and fail == "forward":
                    raise FloatingPointError("the loss check after the forward")
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == FAIL and fail == "stepped":
                    raise FloatingPointError("a NaN check after the optimizer step")
                mgr.save(step, state)
                at_save[step] = _values(state)
    except (ValueError, FloatingPointError, RuntimeError):
        pass
    return mgr, state, at_save, batches


def _load(root, step: int) -> tuple[dict, torch.Tensor]:
    """The checkpoint of `step` loaded into a fresh state: its values, and the next batch its loader gives."""
    fresh = _state(seed=9)
    omnickpt.CheckpointManager(str(root), read_only=True).load(step, fresh)
    return _values(fresh), next(iter(fresh["data"]))


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------------- what is saved: step N exactly
@pytest.mark.parametrize("fail", ["fetched", "forward"])
def test_a_failure_in_the_next_step_saves_the_named_step_exactly(tmp_path, fail):
    """Before: step 6 was saved with the loader at step 7's position (a batch skipped on resume),
    and with step 7's BatchNorm statistics, RNG, learning rate and user values."""
    mgr, state, at_save, batches = _train(tmp_path, fail)
    assert mgr.failure_save["saved"] is True and mgr.failure_save["step"] == FAIL - 1, mgr.failure_save
    assert mgr.steps() == [0, FAIL - 1]
    values, next_batch = _load(tmp_path, FAIL - 1)
    assert torch.equal(next_batch, batches[FAIL]), "resuming would skip the batch of the step that failed"
    assert _same(values, at_save[FAIL - 1]) == []
    assert "data" in mgr.failure_save["captured"] and mgr.failure_save["trigger"].startswith(
        "ValueError" if fail == "fetched" else "FloatingPointError")
    # the live objects were not changed by the failure save (buffers and lr were swapped back)
    assert state["optimizer"].param_groups[0]["lr"] == pytest.approx(0.01 / (1 + FAIL))
    if fail == "forward":
        assert not torch.equal(state["model"][1].running_mean, at_save[FAIL - 1]["model/1.running_mean"])


def test_a_failure_after_the_next_optimizer_step_saves_nothing_and_says_why(tmp_path, caplog):
    """Before: step 7's weights were saved as "step 6"."""
    with caplog.at_level(logging.ERROR, logger="omnickpt"):
        mgr, *_ = _train(tmp_path, "stepped")
    fs = mgr.failure_save
    assert fs["saved"] is False and fs["step"] == FAIL - 1
    assert "optimizer step" in fs["reason"] and "Adam.step()" in fs["reason"], fs
    assert mgr.steps() == [0] and mgr.latest_step() == 0
    assert "not saving step 6" in caplog.text


class _HalfStep(torch.optim.SGD):
    """An optimizer whose step raises after updating its first parameter once `fail` is set (an
    out-of-memory error halfway through the step)."""
    fail = False

    def step(self, closure=None):
        if not self.fail:
            return super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)
        raise RuntimeError("CUDA out of memory (in the middle of the step)")


def test_an_exception_inside_the_optimizer_step_saves_nothing(tmp_path):
    """Before: a half-applied step was saved as step 6."""
    state = _state(opt_class=_HalfStep)
    mgr, *_ = _train(tmp_path, None, state=state, at_fail=lambda: setattr(state["optimizer"], "fail", True))
    fs = mgr.failure_save
    assert fs["saved"] is False and "did not complete" in fs["reason"] and fs["trigger"].startswith("RuntimeError")
    assert mgr.steps() == [0]


def test_nan_weights_are_never_saved_at_failure(tmp_path):
    """Before: the NaN weights of step 6 became the newest step, and load_latest() resumed from them."""
    mgr, state, *_ = _train(tmp_path, "fetched", nan_at=FAIL - 1)
    assert torch.isnan(state["model"][0].weight).all()
    fs = mgr.failure_save
    assert fs["saved"] is False and "NaN or Inf" in fs["reason"] and "'model/" in fs["reason"], fs
    assert mgr.latest_step() == 0


def test_user_values_are_the_named_steps_or_refused_by_name(tmp_path):
    """Small tensors and plain values inside user entries are copied at every call: the step in
    progress editing them in place does not reach the checkpoint. A large tensor (saved as a tensor
    of its own) is kept by reference, not copied at every call: edited in place since save(N), the
    failure save is refused naming the entry."""
    state = _state()
    state["big"] = {"table": torch.zeros(1 << 19)}          # 2 MiB
    mgr, _, at_save, _ = _train(tmp_path / "a", "fetched", state=state)
    assert mgr.failure_save["saved"] is True
    values, _ = _load(tmp_path / "a", FAIL - 1)
    assert values["seen"].tolist() == list(range(FAIL)) and values["counter"].tolist() == [FAIL - 1] * 3

    state = _state()
    state["big"] = {"table": torch.zeros(1 << 19)}
    mgr, *_ = _train(tmp_path / "b", "fetched", state=state, at_fail=lambda: state["big"]["table"].add_(1.0))
    fs = mgr.failure_save
    assert fs["saved"] is False and "'big'" in fs["reason"] and "changed in place" in fs["reason"], fs


def test_a_clean_exit_saves_nothing_and_a_failing_exit_or_ctrl_c_saves_the_named_step(tmp_path):
    """Before: sys.exit(0) (and a generator loop closed by its consumer) saved a checkpoint "at failure"."""
    def run(root, exc):
        state = _state()
        mgr = omnickpt.CheckpointManager(str(root), every=100)
        try:
            with mgr.guard(state, grace=1):
                for step in range(FAIL + 1):
                    if step == FAIL:
                        raise exc
                    mgr.save(step, state)
        except BaseException as e:
            assert e is exc
        return mgr
    for i, exc in enumerate([SystemExit(0), SystemExit(None), SystemExit()]):
        mgr = run(tmp_path / f"clean{i}", exc)
        assert mgr.failure_save["saved"] is False and "clean exit" in mgr.failure_save["reason"]
        assert mgr.steps() == [0]
    for i, exc in enumerate([SystemExit(3), SystemExit("fatal: config"), KeyboardInterrupt()]):
        mgr = run(tmp_path / f"fail{i}", exc)
        assert mgr.failure_save["saved"] is True and mgr.steps() == [0, FAIL - 1], (exc, mgr.failure_save)

    state = _state()
    mgr = omnickpt.CheckpointManager(str(tmp_path / "gen"), every=100)

    def loop():
        with mgr.guard(state, grace=1):
            for step in range(100):
                mgr.save(step, state)
                yield step
    gen = loop()
    for step in gen:
        if step == FAIL - 1:
            break
    gen.close()        # GeneratorExit at the yield, inside the guard
    assert mgr.failure_save["saved"] is False and "clean exit" in mgr.failure_save["reason"]
    assert mgr.steps() == [0]


def test_a_memory_tier_step_is_not_saved_to_root_from_the_live_state(tmp_path, monkeypatch):
    """The tiered manager shares guard(): a step saved to shared memory is copied to root by the
    tier (flush at close), never written there again from the live state. Before: root's step 5
    held the weights of the step after it."""
    import uuid

    from omnickpt.storage.shm import clear_memory
    monkeypatch.setenv("OMNICKPT_SHM_DIR", str(tmp_path / "shm"))
    job = f"guard-{uuid.uuid4().hex[:8]}"
    model = _model()
    mgr = omnickpt.TieredCheckpointManager(str(tmp_path / "root"), memory=f"shm://{job}")
    try:
        try:
            with mgr.guard({"model": model}, grace=1):
                mgr.save(5, {"model": model})
                want = {k: v.clone() for k, v in model.state_dict().items()}
                with torch.no_grad():
                    model[0].weight.add_(1.0)      # step 6's update, then the failure
                raise ValueError("a bad batch")
        except ValueError:
            pass
        mgr.close()
        got = _model(5)
        omnickpt.CheckpointManager(str(tmp_path / "root"), read_only=True).load(5, {"model": got})
        assert all(torch.equal(got.state_dict()[k], want[k]) for k in want), "root's step 5 is not step 5"
        fs = mgr.failure_save
        assert fs["saved"] is False and fs["by_save"] is True and "saved by save()" in fs["reason"], fs
    finally:
        clear_memory(job)


# ---------------------------------------------------------------------------- cadence and the failure list
def test_backoff_and_a_failed_attempt_counts_for_the_cadence():
    assert [backoff(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]
    c = Cadence(10)
    assert c.due(0, False)
    c.failed(0)
    assert not c.due(1, False) and c.due(10, False)
    c.failed(10)
    assert not c.due(20, False) and c.due(30, False)
    c.started(30, stall_s=0.0)
    c.succeeded()
    assert c.due(40, False) and c.report().failures_in_a_row == 0


def test_a_save_that_keeps_failing_is_attempted_at_due_steps_with_backoff(tmp_path, monkeypatch):
    """Before: with every=10 and on_error="warn", a failing save was attempted at every step."""
    ckpt = omnickpt.Checkpointer()
    mgr = omnickpt.CheckpointManager(str(tmp_path), every=10, on_error="warn", checkpointer=ckpt)
    attempts, broken = [], [True]
    real = ckpt.save

    def save(path, state, **kw):
        attempts.append(int(str(path).rsplit("_", 1)[1]))
        if broken[0]:
            raise StorageError(f"{path}: the file system is read-only")
        return real(path, state, **kw)
    monkeypatch.setattr(ckpt, "save", save)
    state = {"model": nn.Linear(2, 2)}
    for step in range(100):
        mgr.save(step, state)
    assert attempts == [0, 10, 30, 70]           # the interval, then 2, 4, 8 intervals apart
    assert mgr.failure_count == 4 and mgr.cadence_report()["failures_in_a_row"] == 4
    broken[0] = False
    for step in range(100, 171):
        mgr.save(step, state)
    assert attempts == [0, 10, 30, 70, 150, 160, 170] and mgr.steps() == [150, 160, 170]
    assert mgr.cadence_report()["failures_in_a_row"] == 0
    mgr.close()
    ckpt.close()


def test_the_failure_list_keeps_the_newest_and_counts_them_all(tmp_path, monkeypatch):
    from omnickpt.manager import FAILURES_KEPT
    ckpt = omnickpt.Checkpointer()
    mgr = omnickpt.CheckpointManager(str(tmp_path), on_error="warn", checkpointer=ckpt)

    def save(path, state, **kw):
        raise StorageError(f"{path}: no space left on device")
    monkeypatch.setattr(ckpt, "save", save)
    logging.getLogger("omnickpt").disabled = True
    try:
        for step in range(FAILURES_KEPT + 50):
            assert mgr.save(step, {"model": nn.Linear(2, 2)}) is None
    finally:
        logging.getLogger("omnickpt").disabled = False
    assert len(mgr.failures) == FAILURES_KEPT and mgr.failure_count == FAILURES_KEPT + 50
    assert mgr.failures[0]["step"] == 50 and mgr.failures[-1]["step"] == FAILURES_KEPT + 49
    mgr.close()
    ckpt.close()


# ---------------------------------------------------------------------------- several ranks (gloo)
class Position:
    """A StatefulDataLoader-like position (the generic adapter saves it per rank)."""

    def __init__(self):
        self.index = 0

    def next(self) -> int:
        self.index += 1
        return self.index - 1

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, sd: dict) -> None:
        self.index = sd["index"]


class _AllReduceSGD(torch.optim.SGD):
    """A step with a collective in the middle (clipping by the global gradient norm, say)."""

    def step(self, closure=None):
        import torch.distributed as dist
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            params[0].add_(params[0].grad, alpha=-0.1)
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            dist.all_reduce(norm)
            for p in params[1:]:
                p.add_(p.grad, alpha=-0.1)


def _ddp_job(rank: int, world: int, root: str, mode: str):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(_model(), forward_sync_buffers=False)   # forward moves BN, no collective
    opt = (_AllReduceSGD if mode == "mid_step" else torch.optim.Adam)(model.parameters(), lr=0.01)
    pos = Position()
    state = {"model": model, "optimizer": opt, "data": pos}
    mgr = omnickpt.CheckpointManager(root, every=100)
    at_save, role = None, None
    try:
        with mgr.guard(state, grace=5):
            for step in range(6):
                if rank == 1 and step == 4 and mode == "fetched":
                    raise ValueError("rank 1: a bad batch")
                i = pos.next()
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * i + rank))
                model(x).square().mean().backward()   # rank 0 fetched and ran the forward: stuck here
                if rank == 1 and step == 4:
                    raise ValueError("rank 1: NaN gradients")
                opt.step()                            # mid_step: rank 0 stuck in the step's collective
                opt.zero_grad(set_to_none=True)
                mgr.save(step, state)
                at_save = {**{k: v.clone() for k, v in model.module.state_dict().items()}, "index": pos.index}
    except ValueError:
        role = "failed"
    except RuntimeError:
        role = "survivor"
    return role, mgr.failure_save, at_save


def test_a_survivor_saves_the_data_position_and_buffers_of_the_named_step(tmp_path):
    """DDP, 2 ranks: rank 1 fails at step 4 before fetching; rank 0 fetched step 4's batch and ran
    its forward (BatchNorm moved) before its backward's all-reduce failed. Before: step 3 was saved
    with step 4's position and statistics."""
    out = run_ranks(2, _ddp_job, str(tmp_path), "fetched", timeout=300)
    (role0, fs0, want), (role1, _, _) = out
    assert (role0, role1) == ("survivor", "failed")
    assert fs0["saved"] is True and fs0["step"] == 3, fs0
    model, pos = _model(7), Position()
    omnickpt.load(str(tmp_path / "global_step_3"), {"model": model, "data": pos})
    assert pos.index == want["index"] == 4
    got = model.state_dict()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert "data" in fs0["captured"]


def test_a_survivor_stopped_inside_the_optimizer_step_saves_nothing(tmp_path):
    """DDP, 2 ranks: rank 0 is stopped by rank 1's failure inside the step's collective, its first
    parameter already updated. Before: that half-applied step was saved as step 3."""
    out = run_ranks(2, _ddp_job, str(tmp_path), "mid_step", timeout=300)
    (role0, fs0, _), (role1, _, _) = out
    assert (role0, role1) == ("survivor", "failed")
    assert fs0["saved"] is False and fs0["step"] == 3 and "did not complete" in fs0["reason"], fs0
    assert omnickpt.CheckpointManager(str(tmp_path), read_only=True).steps() == [0]


def _fsdp2_job(rank: int, world: int, root: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)         # the root's BatchNorm parameters stay unsharded after a forward
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    mgr = omnickpt.CheckpointManager(root, every=100)
    want = None
    try:
        with mgr.guard(state, grace=1):
            for step in range(10):
                loss = model(torch.randn(4, 4, generator=torch.Generator().manual_seed(step))).square().mean()
                if step == FAIL:
                    raise FloatingPointError("the loss check after the forward")
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                mgr.save(step, state)
                want = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                        for k, v in model.state_dict().items()}
    except FloatingPointError:
        pass
    return mgr.failure_save, want


def test_fsdp2_failure_after_the_forward_saves_the_named_step(tmp_path):
    """FSDP2 registers unsharded parameters on the root during a forward: the failure save still
    saves the sharded ones of step N, and BatchNorm statistics as of save(N). Before: the
    statistics of the failed step's forward were saved as step 6's."""
    (fs, want), = run_ranks(1, _fsdp2_job, str(tmp_path), timeout=300)
    assert fs["saved"] is True and fs["step"] == FAIL - 1, fs
    got = _model(5)
    omnickpt.load(str(tmp_path / f"global_step_{FAIL - 1}"), {"model": got})
    assert [k for k, v in got.state_dict().items() if not torch.equal(v, want[k])] == []
