"""A restarted job's first save finds its staging memory warm (issue 22). A buffer's first use
faults every page in, and a lazy snapshot's copy into it is what the next optimizer step waits for
("held" in the report). After a load the staging pool warms, in the background, a buffer of the size
this rank wrote into the loaded checkpoint (StagingPool.warm), giving it up to a save that asks for
it meanwhile, and never making a second buffer beside one in use."""
from __future__ import annotations

import ctypes
import threading
import time

import torch

import omnickpt
from omnickpt.engine import staging
from omnickpt.engine.staging import StagingPool

MB = 1 << 20


def test_a_warmed_buffer_is_what_the_next_acquire_gets():
    pool = StagingPool()
    assert pool.warm(3 * MB, slack=MB)
    assert pool.idle_largest() == 4 * MB
    warmed = pool._free[-1].data_ptr()
    buf = pool.acquire(3 * MB)
    assert buf.data_ptr() == warmed and pool.held == 4 * MB + staging._PAGE   # one buffer, not two
    pool.release(buf)


def test_warm_does_nothing_where_memory_is_there_or_in_use_or_over_budget():
    pool = StagingPool()
    assert pool.warm(2 * MB)
    assert not pool.warm(2 * MB)               # an idle buffer as large is there
    assert not pool.warm(MB)
    buf = pool.acquire(2 * MB)
    assert not pool.warm(8 * MB)               # a save holds its staging: no second buffer beside it
    pool.release(buf)
    assert pool.warm(8 * MB)                   # the smaller idle one makes way, as acquire() would
    assert pool.held == 8 * MB + staging._PAGE
    small = StagingPool(budget=4 * MB)
    assert not small.warm(8 * MB)


def _warming_held(pool: StagingPool, monkeypatch) -> tuple[threading.Event, list, threading.Thread]:
    """A warm() of 64 MiB in 1 MiB chunks on a thread, held inside its first chunk until the
    returned event is set: (that event, the chunk sizes touched so far, the thread)."""
    in_chunk, go, chunks = threading.Event(), threading.Event(), []
    real = ctypes.memset

    def slow_memset(addr, value, n):
        chunks.append(n)
        in_chunk.set()
        go.wait(10)
        return real(addr, value, n)
    monkeypatch.setattr(staging.ctypes, "memset", slow_memset)
    warmer = threading.Thread(target=pool.warm, args=(64 * MB,), kwargs={"chunk": MB})
    warmer.start()
    assert in_chunk.wait(10)
    return go, chunks, warmer


def test_an_acquire_while_warming_takes_the_buffer_being_warmed(monkeypatch):
    """The save does not wait for the whole buffer, and does not get fresh memory beside it: warm()
    stops at the end of its chunk and hands the buffer over."""
    pool = StagingPool()
    go, chunks, warmer = _warming_held(pool, monkeypatch)
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(pool.acquire(64 * MB)))
    taker.start()
    time.sleep(0.1)
    assert not got            # it waits for the chunk under way...
    go.set()
    taker.join(10)
    warmer.join(10)
    assert len(got) == 1 and got[0].numel() == 64 * MB
    assert len(chunks) < 64   # ...not for the whole buffer
    assert pool.held == 64 * MB + staging._PAGE
    pool.release(got[0])


def _state(layers: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def _wait_warm(pool: StagingPool, nbytes: int) -> None:
    deadline = time.monotonic() + 30
    while pool.idle_largest() < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)


def test_after_a_load_the_first_save_stages_into_warm_memory(tmp_path, monkeypatch):
    import omnickpt.engine.load as engine_load
    # a load in two passes through a small buffer, as a restarted process's large load runs: the
    # pool then holds nothing as large as the next save's staging
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 64 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    omnickpt.save(tmp_path / "base", _state()).wait()
    state = _state()
    allocated = []
    real = staging._page_aligned
    monkeypatch.setattr(staging, "_page_aligned", lambda n, pin: (allocated.append(n), real(n, pin))[1])
    with omnickpt.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "base", state)
        _wait_warm(ckpt._pool, 2 * MB)
        assert ckpt._pool.idle_largest() > 2 * MB
        before = list(allocated)
        h = ckpt.save(tmp_path / "next", state, async_save=True)
        h.wait()
        assert allocated == before, "the first save after the load faulted fresh staging in"
    assert omnickpt.is_committed(str(tmp_path / "next"))


def test_no_warming_where_staging_is_released_after_each_save(tmp_path, monkeypatch):
    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 64 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    omnickpt.save(tmp_path / "base", _state()).wait()
    state = _state()
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        ckpt.load(tmp_path / "base", state)
        ckpt._persist.submit(int).result(10)   # anything the load queued has run
        assert ckpt._pool.idle_largest() < 2 * MB


def test_a_save_right_after_the_load_gets_one_buffer_not_two(tmp_path, monkeypatch):
    """A save that comes before the warming is done takes the buffer as far as it is warm; a
    warming queued after a save took its staging makes nothing."""
    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 64 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    omnickpt.save(tmp_path / "base", _state(8)).wait()
    state = _state(8)
    with omnickpt.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "base", state)
        ckpt.save(tmp_path / "next", state, async_save=True).wait()
        ckpt._persist.submit(int).result(10)
        assert sum(1 for b in ckpt._pool._free if b is not None) == 1
        assert ckpt._pool.held == ckpt._pool.idle_largest() + staging._PAGE


def test_a_load_without_an_optimizer_warms_nothing(tmp_path, monkeypatch):
    """A load for inference never saves: it is not given memory of its checkpoint's size."""
    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 64 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    omnickpt.save(tmp_path / "base", _state()).wait()
    with omnickpt.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "base", {"model": _state()["model"]}, strict=False)
        ckpt._persist.submit(int).result(10)
        assert ckpt._pool.idle_largest() < 2 * MB


def test_closing_stops_a_warming_under_way(monkeypatch):
    pool = StagingPool()
    go, chunks, warmer = _warming_held(pool, monkeypatch)
    pool.stop_warming()
    go.set()
    warmer.join(10)
    assert not warmer.is_alive() and len(chunks) == 1
    assert not pool.warm(MB)   # and none after


def test_a_warm_does_not_start_beside_an_acquire_waiting_for_a_slot():
    """A save waiting for a slot while the last buffer in use comes back must not then wait for a
    whole warming that started in between."""
    pool = StagingPool(slots=1)
    held = pool.acquire(MB)
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(pool.acquire(2 * MB)))
    taker.start()
    time.sleep(0.1)   # it waits for the one slot
    pool.release(held)
    assert not pool.warm(8 * MB)
    taker.join(10)
    assert got and pool.held == 2 * MB + staging._PAGE
    pool.release(got[0])


def test_a_warmed_buffer_no_save_used_goes_at_a_sync_save(tmp_path, monkeypatch):
    """Warmed after a load for an async save; a job that saves synchronously packs small buffers
    and would keep the warmed one for nothing."""
    pool = StagingPool()
    assert pool.warm(4 * MB)
    pool.drop_speculative()
    assert pool.held == 0 and pool.idle_largest() == 0
    assert pool.warm(4 * MB)
    pool.release(pool.acquire(4 * MB))   # used by a save: kept, as every staging buffer is
    pool.drop_speculative()
    assert pool.idle_largest() == 4 * MB

    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 64 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    omnickpt.save(tmp_path / "base", _state()).wait()
    state = _state()
    with omnickpt.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "base", state)
        _wait_warm(ckpt._pool, 2 * MB)
        assert ckpt._pool.idle_largest() > 2 * MB
        ckpt.save(tmp_path / "sync", state).wait()
        assert ckpt._pool.idle_largest() < 2 * MB


# ------------------------------------------------------------------ ahead of a save (release_staging=True)
def _allocations(monkeypatch) -> list[int]:
    """The sizes of the staging buffers allocated from now on (each one is faulted in at first use)."""
    allocated: list[int] = []
    real = staging._page_aligned
    monkeypatch.setattr(staging, "_page_aligned", lambda n, pin: (allocated.append(n), real(n, pin))[1])
    return allocated


def test_with_staging_released_warm_staging_readies_the_next_saves_memory(tmp_path, monkeypatch):
    """release_staging=True frees each save's staging; warm_staging() faults in, in the background, a
    buffer of the last async save's size, and the next save copies into it instead of fresh memory."""
    state = _state()
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        assert not ckpt.warm_staging()                 # no async save yet: no size to warm
        ckpt.save(tmp_path / "a", state, async_save=True).wait()
        pool = ckpt._pool
        expected = pool.expected
        assert expected and expected >= 2 * MB and pool.held == 0 and pool.cold() == expected
        allocated = _allocations(monkeypatch)
        assert ckpt.warm_staging()
        ckpt._persist.submit(int).result(10)           # the warm has run
        assert pool.idle_largest() >= expected and pool.cold() == 0 and allocated
        assert not ckpt.warm_staging()                 # warm already
        before = list(allocated)
        ckpt.save(tmp_path / "b", state, async_save=True).wait()
        assert allocated == before, "the save after warm_staging() faulted fresh staging in"
        assert pool.held == 0                          # and released after it, as asked
    assert omnickpt.is_committed(str(tmp_path / "b"))


def test_with_staging_kept_warm_staging_has_nothing_to_do(tmp_path):
    state = _state()
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "a", state, async_save=True).wait()
        assert ckpt._pool.cold() == 0 and not ckpt.warm_staging()
        ckpt._persist.submit(int).result(10)
        assert ckpt._pool.held == ckpt._pool.idle_largest() + staging._PAGE   # still the one buffer
    assert not ckpt.warm_staging()                     # closed: nothing, and no error


def test_a_manager_warms_released_staging_a_few_calls_before_each_due_save(tmp_path, monkeypatch):
    """CheckpointManager(every=6) with release_staging=True: the staging of each due save is warmed
    warm_lead calls before it (2 for 3 MB and 50 ms steps), once, in the second half of the interval
    (released between saves), and that save allocates nothing. Closing frees a buffer warmed for a
    save that never came."""
    state = _state()
    warmed: list[int] = []
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        real_warm = ckpt.warm_staging
        monkeypatch.setattr(ckpt, "warm_staging", lambda: (warmed.append(step), real_warm())[1])
        allocated = _allocations(monkeypatch)
        mgr = omnickpt.CheckpointManager(str(tmp_path), checkpointer=ckpt, every=6)
        for step in range(11):
            time.sleep(0.05)                           # the training step
            saved = mgr.save(step, state, async_save=True)
            assert (saved is not None) == (step % 6 == 0)
            mgr.wait()
            ckpt._persist.submit(int).result(10)       # a warm asked for at this call has run
            if step in (0, 6):
                assert ckpt._pool.held == 0            # released after the save
            if 0 < step < 6:
                assert (ckpt._pool.idle_largest() > 0) == (step >= 4), step
        assert warmed == [4, 10]
        assert len(allocated) == 3, "the first save's staging, and the two warms; the save at 6 took the warmed one"
        assert ckpt._pool.idle_largest() > 0           # warmed at 10 for a save at 12
        mgr.close()
        ckpt._persist.submit(int).result(10)
        assert ckpt._pool.held == 0, "closing the manager keeps memory warmed for a save that will not come"


def test_warming_with_a_staging_budget_cuts_the_margin_not_the_warm():
    """A state staged up to the budget expects `largest` bytes: the warm's margin does not fit beside
    it, and is dropped rather than the warm."""
    pool = StagingPool(budget=4 * MB + 2 * staging._PAGE)
    assert pool.warm(pool.largest, slack=MB)
    assert pool.idle_largest() == pool.largest and pool.held <= pool.budget
    assert not StagingPool(budget=4 * MB).warm(8 * MB)   # larger than the budget: nothing


def _two_rank_warm_ahead(rank, world, root):
    """A DDP model on 2 gloo ranks, CheckpointManager(every=6) with released staging: the steps each rank
    warmed at, how many staging buffers it allocated, the steps it saved and those committed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]))
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optim": opt}
    warmed, saved = [], []
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        real = ckpt.warm_staging
        ckpt.warm_staging = lambda: (warmed.append(step), real())[1]
        allocated: list[int] = []
        plain = staging._page_aligned
        staging._page_aligned = lambda n, pin: (allocated.append(n), plain(n, pin))[1]
        try:
            with omnickpt.CheckpointManager(root, checkpointer=ckpt, every=6) as mgr:
                for step in range(13):
                    model(torch.randn(8, 256)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    time.sleep(0.05)
                    if mgr.save(step, state, async_save=True) is not None:
                        saved.append(step)
                    mgr.wait()
                    ckpt._persist.submit(int).result(10)
                    dist.barrier()
                committed = mgr.steps()
        finally:
            staging._page_aligned = plain
    return warmed, len(allocated), saved, committed


def test_each_rank_warms_its_own_staging_ahead_of_the_saves_both_make(tmp_path):
    from dist import run_ranks
    results = run_ranks(2, _two_rank_warm_ahead, str(tmp_path))
    for warmed, allocations, saved, committed in results:
        assert saved == committed == [0, 6, 12]
        assert warmed == [4, 10]
        # the first save's staging, then one warm per later save, which that save used
        assert allocations == 3
