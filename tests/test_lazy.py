"""Lazy snapshots (save(async_save=True), snapshot="lazy" by default) and the staging budget.

A lazy save returns after planning and an eager copy of what training can change at any time
(buffers, user tensors, objects); parameters and optimizer state are copied in the background
while every optimizer's step() waits for that copy. The checkpoint must hold exactly the values of
the save call although optimizer steps (and forwards that move BatchNorm statistics) ran before
wait(). To make that a real test, the background copy is held back (`_hold_copier`): without the
fence the steps would run before the copy and reach the checkpoint.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import omnickpt
from dist import run_ranks
from models import ToyMLP, apply_layout
from omnickpt.errors import CheckpointError


class BNMLP(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: forward changes the running statistics."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.bn = nn.BatchNorm1d(13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def fsdp_units(self) -> list[nn.Module]:
        return [self.fc1, self.fc2]


def _hold_copier(ckpt: omnickpt.Checkpointer, seconds: float = 0.3) -> None:
    """Keep the Checkpointer's background threads (the snapshot thread, and the persist thread,
    which makes the copy itself if it comes first) busy for `seconds`: a lazy copy submitted now
    starts only after that, so that whatever the training thread does meanwhile races with it."""
    gate = threading.Event()
    ckpt._snapshot_thread().submit(gate.wait)
    ckpt._persist.submit(gate.wait)
    threading.Timer(seconds, gate.set).start()


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def local_values(model: nn.Module, opt) -> dict:
    """This rank's own memory of every parameter, buffer and optimizer state tensor, by position
    (a fresh model in the same layout holds the same local shards)."""
    out = {f"param{i}": _local(p) for i, p in enumerate(model.parameters())}
    out.update({f"buffer{i}": _local(b) for i, b in enumerate(model.buffers())})
    inner = getattr(opt, "optimizer", opt)
    params = [p for g in inner.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in inner.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"optim{i}/{k}"] = _local(v)
    return out


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _build(kind: str, seed: int, env: dict):
    torch.manual_seed(seed)
    if kind == "tp":
        model = apply_layout(ToyMLP(), "tp", mesh=env["mesh"])
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = BNMLP()
        model.fc1 = FSDP(model.fc1, device_id=torch.device("cpu"))
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        model = apply_layout(BNMLP(), kind, mesh=env["mesh"])
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model, opt, step: int, rank: int, forward: bool = True) -> None:
    """A forward (BatchNorm statistics move), a backward, an optimizer step. forward=False:
    gradients from the parameters alone (ToyMLP's 13 columns do not split evenly for a TP forward)."""
    if forward:
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * step))   # replicated buffers stay equal
        model(x).square().mean().backward()
    else:
        for p in model.parameters():
            p.grad = torch.cos(p.detach() * (3.0 + step)) * 0.1
    opt.step()
    opt.zero_grad(set_to_none=True)


def _frameworks(rank, world_size, root):
    from torch.distributed.device_mesh import DeviceMesh
    env = {"mesh": DeviceMesh("cpu", torch.arange(world_size))}
    out = {}
    ckpt = omnickpt.Checkpointer()
    for kind in ("ddp", "fsdp2", "tp", "fsdp1"):
        model, opt = _build(kind, 0, env)
        fwd = kind != "tp"
        _train(model, opt, 0, rank, fwd)
        state = {"model": model, "optim": opt, "extra": {"counter": torch.tensor([kind == "tp"]), "note": kind}}
        want = local_values(model, opt)
        _hold_copier(ckpt)
        handle = ckpt.save(f"{root}/{kind}", state, async_save=True)
        for step in (1, 2, 3):
            _train(model, opt, step, rank, fwd)   # each step waits for the lazy copy; forwards change BN at once
        moved = _differ(want, local_values(model, opt))
        report = handle.wait()
        fresh, fresh_opt = _build(kind, 7, env)
        _train(fresh, fresh_opt, 9, rank, fwd)
        ckpt.load(f"{root}/{kind}", {"model": fresh, "optim": fresh_opt, "extra": {}}, strict=False)
        out[kind] = {"moved": moved, "differ": _differ(want, local_values(fresh, fresh_opt)),
                     "lazy_phase": "snapshot_lazy" in report["phases"],
                     "hooks_left": sum(len(o._optimizer_step_pre_hooks) for o in [opt])}
    ckpt.close()
    return out


def test_lazy_snapshot_holds_the_values_of_the_save_call_ddp_fsdp2_tp_fsdp1(tmp_path):
    results = run_ranks(2, _frameworks, str(tmp_path))
    for rank, res in enumerate(results):
        for kind, r in res.items():
            assert r["moved"], (rank, kind, "the steps after the save changed nothing: the test tests nothing")
            assert any(k.startswith("param") for k in r["moved"]), (rank, kind, r["moved"])
            if kind != "tp":
                assert any(k.startswith("buffer") for k in r["moved"]), (rank, kind, "BatchNorm did not move")
            assert r["differ"] == [], (rank, kind, r["differ"])
            assert r["lazy_phase"], (rank, kind)
            assert r["hooks_left"] == 0, (rank, kind)   # wait() took the fence's hooks off


def _megatron(rank, world_size, root):
    import test_megatron as tm
    model = tm.build(2, 1, tm.padded(tm.VOCAB, 2), seed=0)
    opt = tm.megatron_fp32_optimizer(model)
    tm.train_step(model, opt, 0)
    ckpt = omnickpt.Checkpointer()
    want = local_values(model, opt)
    _hold_copier(ckpt)
    handle = ckpt.save(f"{root}/m", {"model": model, "optim": opt}, async_save=True)
    for step in (1, 2):
        tm.train_step(model, opt, step)
    moved = _differ(want, local_values(model, opt))
    handle.wait()
    fresh = tm.build(2, 1, tm.padded(tm.VOCAB, 2), seed=3)
    fresh_opt = tm.megatron_fp32_optimizer(fresh)
    tm.train_step(fresh, fresh_opt, 5)
    ckpt.load(f"{root}/m", {"model": fresh, "optim": fresh_opt})
    ckpt.close()
    return moved, _differ(want, local_values(fresh, fresh_opt))


def test_lazy_snapshot_megatron_tp2(tmp_path):
    pytest.importorskip("megatron.core")
    for rank, (moved, differ) in enumerate(run_ranks(2, _megatron, str(tmp_path))):
        assert moved, rank
        assert differ == [], (rank, differ)


# ---------------------------------------------------------------------- one process
def _plain(seed: int = 0):
    torch.manual_seed(seed)
    model = BNMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, opt, 0, 0)
    return model, opt


def _load_values(ckpt, path: str) -> dict:
    model, opt = _plain(5)
    ckpt.load(path, {"model": model, "optim": opt})
    return local_values(model, opt)


def test_fence_then_in_place_edit_does_not_reach_the_checkpoint(tmp_path):
    model, opt = _plain()
    with omnickpt.Checkpointer() as ckpt:
        want = local_values(model, opt)
        _hold_copier(ckpt, 0.2)
        handle = ckpt.save(tmp_path / "a", {"model": model, "optim": opt}, async_save=True)
        handle.fence()   # waits for the background copy
        assert not opt._optimizer_step_pre_hooks   # and took the hooks off from this thread
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)
        handle.wait()
        assert _differ(want, _load_values(ckpt, str(tmp_path / "a"))) == []


def test_eager_snapshot_copies_everything_before_returning(tmp_path):
    model, opt = _plain()
    with omnickpt.Checkpointer() as ckpt:
        want = local_values(model, opt)
        _hold_copier(ckpt, 0.2)   # an eager snapshot does not use the copier: nothing waits for it
        handle = ckpt.save(tmp_path / "e", {"model": model, "optim": opt}, async_save=True, snapshot="eager")
        assert handle._fence is None and not opt._optimizer_step_pre_hooks
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)   # right after the call: the eager contract allows it
        report = handle.wait()
        assert "snapshot_lazy" not in report["phases"]
        assert _differ(want, _load_values(ckpt, str(tmp_path / "e"))) == []


def test_the_next_save_and_load_wait_for_the_lazy_copy(tmp_path):
    model, opt = _plain()
    with omnickpt.Checkpointer() as ckpt:
        want = local_values(model, opt)
        _hold_copier(ckpt, 0.3)
        h1 = ckpt.save(tmp_path / "a", {"model": model, "optim": opt}, async_save=True)
        assert opt._optimizer_step_pre_hooks   # the fence holds the step
        # a load into the same objects must not be copied by the save still in flight
        ckpt.save(tmp_path / "b", {"model": BNMLP()}).wait()
        assert not opt._optimizer_step_pre_hooks   # the next save removed them
        ckpt.load(tmp_path / "b", {"model": model})
        h1.wait()
        assert _differ(want, _load_values(ckpt, str(tmp_path / "a"))) == []


def test_a_step_held_by_the_lazy_copy_is_reported_beside_the_stall(tmp_path):
    """An optimizer step that waits at the fence for the background copy is training's loss to the
    save as much as the stall: the report counts it ("held", drawn beside the phases like the
    stall, not in a rank's total). A step taken once the copy is done is not held."""
    from omnickpt.monitor.report import ENVELOPES, rank_total
    model, opt = _plain()
    with omnickpt.Checkpointer() as ckpt:
        _hold_copier(ckpt, 0.4)
        h = ckpt.save(tmp_path / "a", {"model": model, "optim": opt}, async_save=True)
        t0 = time.perf_counter()
        _train(model, opt, 1, 0)
        stepped = time.perf_counter() - t0
        seconds = h.wait()["per_rank"][0]["seconds"]
        assert 0.05 < seconds["held"] < stepped
        assert "held" in ENVELOPES
        assert rank_total(seconds) == pytest.approx(sum(v for k, v in seconds.items() if k not in ("stall", "held")))

        h = ckpt.save(tmp_path / "b", {"model": model, "optim": opt}, async_save=True)
        deadline = time.monotonic() + 30
        while not h.staged() and time.monotonic() < deadline:
            time.sleep(0.01)
        _train(model, opt, 2, 0)
        assert "held" not in h.wait()["per_rank"][0]["seconds"]


def test_a_failed_background_copy_releases_the_fence_and_fails_the_save(tmp_path, monkeypatch):
    from omnickpt.engine import save as engine_save
    model, opt = _plain()
    real = engine_save._copy_into
    calls = []

    def failing(buf, shards, plan):
        calls.append(len(plan))
        if len(calls) == 2:   # the lazy copy (the first is the eager one)
            raise RuntimeError("simulated copy failure")
        return real(buf, shards, plan)
    monkeypatch.setattr(engine_save, "_copy_into", failing)
    with omnickpt.Checkpointer() as ckpt:
        handle = ckpt.save(tmp_path / "f", {"model": model, "optim": opt}, async_save=True)
        _train(model, opt, 1, 0)   # released (with the error): the step goes on
        with pytest.raises(CheckpointError, match="simulated copy failure"):
            handle.wait()
        assert not omnickpt.is_committed(str(tmp_path / "f"))
        assert len(calls) == 2


def test_snapshot_keyword_is_checked(tmp_path):
    model, opt = _plain()
    with pytest.raises(ValueError, match="snapshot="):
        omnickpt.save(tmp_path / "x", {"model": model}, async_save=True, snapshot="later")


# ---------------------------------------------------------------------- the staging budget
def _big_state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("snapshot", ["lazy", "eager"])
def test_a_budget_smaller_than_the_state_saves_exactly_and_holds(tmp_path, snapshot):
    model, opt = _big_state()
    extra = {"table": torch.randn(300)}
    want = local_values(model, opt)
    want_extra = extra["table"].clone()
    budget = 256 << 10   # the state is ~3.2 MB
    with omnickpt.Checkpointer(staging_budget=budget) as ckpt:
        for i in range(2):   # the second save reuses what the first left in the pool
            handle = ckpt.save(tmp_path / f"s{i}", {"model": model, "optim": opt, "extra": extra},
                               async_save=True, snapshot=snapshot)
            if snapshot == "eager":
                with torch.no_grad():   # save() waited until everything was written: nothing reaches it
                    for p in model.parameters():
                        p.add_(1.0)
                    extra["table"].add_(1.0)
            else:
                model(torch.randn(8, 256)).square().mean().backward()
                opt.step()   # held until the parts written from the tensors' own memory are written
                opt.zero_grad()
            report = handle.wait()
            assert ckpt._pool.peak <= budget
            assert ckpt._pool.held <= budget
            fresh, fresh_opt = _big_state(3)
            got_extra = {"table": torch.zeros(300)}
            ckpt.load(tmp_path / f"s{i}", {"model": fresh, "optim": fresh_opt, "extra": got_extra})
            assert _differ(want, local_values(fresh, fresh_opt)) == []
            assert torch.equal(got_extra["table"], want_extra)
            want, want_extra = local_values(model, opt), extra["table"].clone()
        if "peak_rss_mb" in report:
            assert len(report["peak_rss_mb"]) == 1 and report["peak_rss_mb"][0] > 0


def test_a_step_held_until_the_write_over_the_budget_is_reported(tmp_path):
    """Over the staging budget, the step is held until the tensors written from their own memory
    are written: that wait reaches the report too (the fence opens after the write, and the
    timings are taken after it opens)."""
    model, opt = _big_state()
    with omnickpt.Checkpointer(staging_budget=256 << 10) as ckpt:
        _hold_copier(ckpt, 0.4)
        handle = ckpt.save(tmp_path / "s", {"model": model, "optim": opt}, async_save=True)
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        assert handle.wait()["per_rank"][0]["seconds"]["held"] > 0.1


def test_release_staging_frees_the_pool_after_each_save(tmp_path):
    model, opt = _big_state()
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        ckpt.save(tmp_path / "a", {"model": model, "optim": opt}, async_save=True).wait()
        assert ckpt._pool.held == 0
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "b", {"model": model, "optim": opt}, async_save=True).wait()
        assert ckpt._pool.held > 3 << 20   # kept warm for the next save (the state is ~3.2 MB)


def test_peak_rss_is_in_the_save_report(tmp_path):
    model, opt = _big_state()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here: the report leaves the peak out")
    report = omnickpt.save(tmp_path / "a", {"model": model, "optim": opt}).wait()
    assert len(report["peak_rss_mb"]) == 1 and report["peak_rss_mb"][0] > 1


def test_the_manager_passes_snapshot_through(tmp_path):
    model, opt = _plain()
    want = local_values(model, opt)
    with omnickpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        handle = mgr.save(1, {"model": model, "optim": opt}, async_save=True, snapshot="eager")
        assert handle._fence is None
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)
        mgr.wait()
        fresh, fresh_opt = _plain(5)
        mgr.load_latest({"model": fresh, "optim": fresh_opt})
    assert _differ(want, local_values(fresh, fresh_opt)) == []


def test_host_scalars_are_staged_together_with_everything_else_in_place():
    """Step counts (0-d host tensors) of several dtypes are copied into staging in one batch per
    dtype; other tensors, and scalars at offsets their dtype cannot be viewed at, one by one."""
    from types import SimpleNamespace as Item
    from omnickpt.engine import save as engine_save
    srcs = [torch.tensor(float(i)) for i in range(50)] + [torch.tensor(i, dtype=torch.int64) for i in range(7)]
    srcs += [torch.tensor(True), torch.arange(5, dtype=torch.float32), torch.tensor(2.5, dtype=torch.float64)]
    at, placed = 0, []
    for i, t in enumerate(srcs):
        n = t.numel() * t.element_size()
        at = at + 1 if i == len(srcs) - 1 else at   # the last float64 at an odd offset: one by one
        placed.append((Item(index=i, nbytes=n), at))
        at += 32
    buf = torch.zeros(at + 64, dtype=torch.uint8)
    shards = [Item(local=t) for t in srcs]
    engine_save._copy_into(buf, shards, engine_save._copy_plan(shards, placed))
    for (w, at), t in zip(placed, srcs):
        got = buf[at:at + w.nbytes].clone().view(t.dtype).view(t.shape)
        assert torch.equal(got, t), (w.index, got, t)


def test_a_reused_layout_sorts_its_copies_once_and_copies_the_values_of_each_save():
    """StageLayout.copies: the same shard and write lists get the plan made for them the first time
    (a reused layout does not sort 6,000 step counts again); new lists get a new plan; either way
    the copy reads the sources' values at the time of the copy."""
    from types import SimpleNamespace as Item
    from omnickpt.engine import save as engine_save
    srcs = [torch.tensor(float(i)) for i in range(6)] + [torch.arange(3, dtype=torch.int32)]
    shards = [Item(local=t) for t in srcs]
    writes = [Item(index=i, nbytes=t.numel() * t.element_size(), offset=16 * i) for i, t in enumerate(srcs)]
    layout = engine_save.StageLayout(128, 128, [w.offset for w in writes], [], False, False)
    plan = layout.copies(shards, writes, layout.now)
    assert layout.copies(shards, writes, layout.now) is plan
    assert len(plan.scalars) == 1 and len(plan.rest) == 1 and len(plan) == len(srcs)
    assert layout.copies(list(shards), writes, layout.now) is not plan
    for step in (0, 1):
        for t in srcs:
            t.add_(step)   # training moves the values between two saves of the same layout
        buf = torch.zeros(128, dtype=torch.uint8)
        engine_save._copy_into(buf, shards, layout.copies(shards, writes, layout.now))
        for w, t in zip(writes, srcs):
            assert torch.equal(buf[w.offset:w.offset + w.nbytes].view(t.dtype).view(t.shape), t), (step, w.index)


@pytest.mark.parametrize("then", ["save", "load"])
def test_a_finished_lazy_save_is_freed_by_reference_counting(tmp_path, then):
    """Once the Checkpointer's next save or load has taken the lazy save's fence off, nothing is
    left of the finished save (its snapshot holds views of the staging buffer): with the cyclic
    collector off, as it is during a load, a reference cycle would keep that buffer's memory after
    the pool dropped it for a larger one, beside the new one (+384 MB per rank on MLP/FSDP2)."""
    import gc

    from omnickpt.saving import _SaveJob
    model, opt = _big_state()
    state = {"model": model, "optim": opt}
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        with omnickpt.Checkpointer() as ckpt:
            ckpt.save(tmp_path / "lazy", state, async_save=True).wait()
            if then == "save":
                ckpt.save(tmp_path / "next", state)
            else:
                ckpt.load(tmp_path / "lazy", state)
            left = [o for o in gc.get_objects() if type(o) is _SaveJob and str(o.path).endswith("lazy")]
            assert left == [], "the finished lazy save is still alive (a reference cycle)"
    finally:
        if was:
            gc.enable()


def _record_acquires(ckpt: omnickpt.Checkpointer) -> list[int]:
    """The sizes the Checkpointer's staging pool is asked for from now on, in order."""
    asked: list[int] = []
    acquire = ckpt._pool.acquire
    ckpt._pool.acquire = lambda n, **kw: asked.append(n) or acquire(n, **kw)
    return asked


def test_a_sync_save_stages_through_an_idle_pool_buffer_and_takes_no_new_memory(tmp_path):
    """After an async save the pool keeps a warm buffer of the file's size: a sync save copies into
    it (then one aligned write) instead of writing from the tensors, and gives it back; a
    Checkpointer that only saves synchronously makes no such buffer. Both checkpoints hold the
    values of their save call."""
    model, opt = _big_state()
    state = {"model": model, "optim": opt}
    with omnickpt.Checkpointer() as ckpt:
        asked = _record_acquires(ckpt)
        ckpt.save(tmp_path / "async", state, async_save=True).wait()
        held, file_bytes = ckpt._pool.held, asked[-1]
        opt.step()   # new values: the sync save must hold these, not the async save's
        want = {k: v.clone() for k, v in model.state_dict().items()}
        asked.clear()
        ckpt.save(tmp_path / "sync", state)
        assert asked and asked[0] >= file_bytes, asked   # the file staged in the pool's buffer
        assert ckpt._pool.held == held and not ckpt._pool._out   # no new memory, and given back
    with omnickpt.Checkpointer() as only_sync:
        only_sync.save(tmp_path / "sync-only", state)
        assert only_sync._pool.held < file_bytes // 4   # small tensors packed at most: no staging buffer
    for path in ("sync", "sync-only"):
        fresh, fresh_opt = _big_state(seed=1)
        omnickpt.Checkpointer().load(tmp_path / path, {"model": fresh, "optim": fresh_opt})
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want[k]), (path, k)


def _data_bytes(path) -> bytes:
    import os
    (name,) = os.listdir(os.path.join(path, "data"))
    with open(os.path.join(path, "data", name), "rb") as f:
        return f.read()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_staged_file_holds_zeros_between_its_tensors_whatever_the_buffer_held(tmp_path, async_save):
    """A staging buffer is reused (an earlier save's or a load's bytes are in it): the padding between
    tensors is zeroed, so a staged file is byte for byte the file of the same state written from the
    tensors (whose gaps are holes), never a trace of another checkpoint."""
    model, opt = _big_state()
    state = {"model": model, "optim": opt}
    omnickpt.Checkpointer().save(tmp_path / "from-tensors", state)   # a fresh pool: written from the tensors
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "warm", state, async_save=True).wait()
        (buf,) = [b for b in ckpt._pool._free if b is not None]
        buf.fill_(0xAB)   # what another checkpoint left in it
        ckpt.save(tmp_path / "staged", state, async_save=async_save).wait()
    want, got = _data_bytes(tmp_path / "from-tensors"), _data_bytes(tmp_path / "staged")
    assert len(got) == len(want)
    assert got.count(0xAB) == want.count(0xAB) and got == want


def test_a_compressed_sync_save_does_not_stage(tmp_path):
    """A compressed file is laid out by its writer from the tensors' bytes: staging them first would
    be one copy more, so a compressed sync save takes no buffer from the pool even when one is idle."""
    model, opt = _big_state()
    state = {"model": model, "optim": opt}
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "async", state, async_save=True).wait()
        idle = ckpt._pool.idle_largest()
        asked = _record_acquires(ckpt)
        ckpt.save(tmp_path / "zstd", state, compression="zstd")
        assert all(n < idle // 4 for n in asked), (asked, idle)
    fresh, fresh_opt = _big_state(seed=1)
    omnickpt.Checkpointer().load(tmp_path / "zstd", {"model": fresh, "optim": fresh_opt})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_objects_that_move_between_saves_of_one_layout_keep_their_bytes(tmp_path):
    """Two lazy saves of one layout whose objects swap sizes (the file's size the same, so the staging
    layout is reused): the second save's objects sit where the first one's padding was, and the
    padding zeroed with the lazy copies must not be the first save's."""
    model, opt = _big_state()
    with omnickpt.Checkpointer() as ckpt:
        for i, (x, y) in enumerate([(10, 70), (70, 10)]):
            state = {"model": model, "optim": opt, "a": {"v": "x" * x}, "b": {"v": "y" * y}}
            ckpt.save(tmp_path / str(i), state, async_save=True).wait()
            out = {"model": model, "optim": opt, "a": {}, "b": {}}
            omnickpt.Checkpointer().load(tmp_path / str(i), out)
            assert out["a"] == {"v": "x" * x} and out["b"] == {"v": "y" * y}, i


def test_a_lazy_save_that_fails_before_its_copies_never_copies_into_the_buffer_it_gave_back(tmp_path):
    """A lazy save whose persist fails before it made its copies (the checkpoint path held by
    another live job) gives its staging buffer back at once; its copy, still queued on the snapshot
    thread, must not run afterwards into that buffer, which the next save already uses: that save's
    file would hold the failed save's bytes under valid checksums."""
    from omnickpt.errors import CheckpointLockedError
    from omnickpt.lease import acquire
    big, big_opt = _big_state()
    small, small_opt = _big_state(seed=1)
    small_state = {"model": small[0]}   # a smaller file: it reuses the failed save's buffer
    other = omnickpt.Checkpointer()
    lease = acquire(str(tmp_path / "held"), other._job)
    try:
        with omnickpt.Checkpointer() as ckpt:
            copier_gate = threading.Event()
            ckpt._snapshot_thread().submit(copier_gate.wait)   # the failed save's copy waits behind this
            handle = ckpt.save(tmp_path / "held", {"model": big, "optim": big_opt}, async_save=True)
            with pytest.raises(CheckpointLockedError):
                handle.wait()
            persist_gate = threading.Event()
            ckpt._persist.submit(persist_gate.wait)   # the next save's write waits until the copy could land
            next_save = ckpt.save(tmp_path / "next", small_state, async_save=True, snapshot="eager")
            copier_gate.set()
            time.sleep(0.3)
            persist_gate.set()
            next_save.wait()
    finally:
        lease.release()
        other.close()
    fresh, _ = _big_state(seed=2)
    omnickpt.Checkpointer().load(tmp_path / "next", {"model": fresh[0]})
    for k, v in fresh[0].state_dict().items():
        assert torch.equal(v, small[0].state_dict()[k]), k
