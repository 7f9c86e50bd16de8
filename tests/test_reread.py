"""Loads in two passes (engine/load.py, land_tensors and _reread): where every file is read through
the page cache and the staging pool holds no buffer as large as the rank's bytes (a restarted
process), the load verifies every byte in a first pass and reads them again to install them in a
second, through one reused buffer of REREAD_BATCH bytes. The tests shrink REREAD_BATCH (and
REREAD_MIN) so that states of kilobytes take that path."""
from __future__ import annotations

import math
import random

import pytest
import torch

import omnickpt
from dist import run_ranks
from omnickpt import ShardSpec
from omnickpt.errors import CorruptCheckpointError
from omnickpt.layout import Box

BATCH = 4096


@pytest.fixture
def small_batch(monkeypatch):
    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "REREAD_BATCH", BATCH)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)


def _tiles(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """`shape` cut into a grid of random boxes."""
    cuts = [sorted({0, n, *(rng.randint(1, n - 1) for _ in range(rng.randint(0, 3)) if n > 1)}) for n in shape]
    boxes = [Box((), ())]
    for c in cuts:
        boxes = [Box(b.offsets + (lo,), b.lengths + (hi - lo,)) for b in boxes for lo, hi in zip(c, c[1:])]
    return boxes


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]


def _saved(tmp_path, seed: int):
    """A checkpoint of random tensors cut into random boxes (some larger than BATCH; t0, of 10,000
    elements, in boxes of 10 rows), and random boxes of them to load: (path, tensors, wanted)."""
    rng = random.Random(seed)
    full, state = {}, {}
    for i in range(6):
        shape = (rng.randint(1, 40), rng.randint(1, 40)) if i else (100, 100)
        dtype = rng.choice([torch.float32, torch.float16, torch.int64, torch.int8])
        gen = torch.Generator().manual_seed(seed * 10 + i)
        full[f"t{i}"] = torch.randint(-100, 100, shape, generator=gen).to(dtype)
        tiles = _tiles(rng, shape) if i else [Box((r, 0), (10, 100)) for r in range(0, 100, 10)]
        for k, b in enumerate(tiles):
            state[f"t{i}.{k}"] = ShardSpec(_region(full[f"t{i}"], b).clone(), b.offsets, shape, name=f"t{i}")
    path = str(tmp_path / f"ck{seed}")
    omnickpt.save(path, state)
    wanted = [(n, Box.full(t.shape)) for n, t in full.items()]
    for n, t in full.items():
        lo = tuple(rng.randint(0, s - 1) for s in t.shape)
        wanted.append((n, Box(lo, tuple(rng.randint(1, s - o) for s, o in zip(t.shape, lo)))))
    return path, full, wanted


def _largest_box(path: str) -> int:
    from omnickpt.formats import read_manifest
    from omnickpt.storage import storage_for
    return max(b.nbytes for e in read_manifest(storage_for(path)).tensors.values() for b in e.boxes)


def _total(wanted, full) -> int:
    return sum(math.prod(b.lengths) * full[n].element_size() for n, b in wanted)


def _land(path, wanted, dests, *, records=False, pool=None, shared=True, budget=None):
    """land_tensors of `wanted` into `dests`, every file read through the page cache (`shared`):
    (the Landing, the timer)."""
    from omnickpt.engine.load import land_tensors
    from omnickpt.formats import read_manifest
    from omnickpt.monitor import PhaseTimer
    from omnickpt.planner import plan_reads
    from omnickpt.storage import storage_for
    storage = storage_for(path)
    manifest = read_manifest(storage)
    plan = plan_reads(manifest, wanted)
    timer = PhaseTimer()
    more = {} if budget is None else {"budget": budget}
    landing = land_tensors(storage, manifest, list(plan) if records else plan, [b for _, b in wanted], dests,
                           None, verify=True, timer=timer, pool=pool,
                           shared_files=range(len(manifest.files)) if shared else (), **more)
    return landing, timer


@pytest.mark.parametrize("in_place", [False, True], ids=["batched", "in-place"])
@pytest.mark.parametrize("records", [False, True], ids=["columns", "records"])
def test_a_load_in_two_passes_installs_what_one_pass_installs(tmp_path, small_batch, monkeypatch, records, in_place):
    # Random tilings, random wanted boxes, a tensor of 10,000 elements: cut into pieces of at most
    # 4 KB (or one stored box, where larger: a box smaller than a checksum chunk lands whole), read
    # twice and installed; the same bytes as the one-pass load (a warm pool buffer as large as the
    # load) and as the tensors saved. `in_place`: the second pass reads whole boxes that are one run of
    # their destination straight into it (the column way; here boxes of any size, not only >= 1 MB).
    import omnickpt.engine.load as engine_load
    from omnickpt.engine.staging import StagingPool
    monkeypatch.setattr(engine_load, "IN_PLACE_MIN", 0 if in_place else 1 << 62)
    for seed in range(4):
        path, full, wanted = _saved(tmp_path, seed)
        out = []
        for warm in (False, True):
            pool = StagingPool()
            if warm:
                pool.release(pool.acquire(1 << 20))
            dests = [torch.full(b.lengths, -7, dtype=full[n].dtype) for n, b in wanted]
            landing, timer = _land(path, wanted, dests, records=records, pool=pool)
            landing.install()
            assert ("reread" in timer.seconds) is not warm, (seed, warm, timer.seconds)
            if not warm:   # one buffer of a batch's size (or a box's, where larger), reused
                assert pool.peak <= max(BATCH, _largest_box(path)) + 3 * 4096 < _total(wanted, full), pool.peak
            for (n, b), d in zip(wanted, dests):
                assert torch.equal(d, _region(full[n], b)), (seed, warm, n, b)
            out.append(dests)
        assert all(torch.equal(a, b) for a, b in zip(*out))


def test_files_read_from_the_device_and_small_loads_land_once(tmp_path, small_batch, monkeypatch):
    # A file only this rank reads goes from the device into the landing buffer (O_DIRECT): there
    # is no page cache to read it again from, so it lands once; so does a load of at most two
    # batches, and one of at most REREAD_MIN bytes.
    import omnickpt.engine.load as engine_load
    path, full, wanted = _saved(tmp_path, 1)
    monkeypatch.setattr(engine_load, "REREAD_MIN", _total(wanted, full) * 2)
    landing, timer = _land(path, wanted, [torch.zeros(b.lengths, dtype=full[n].dtype) for n, b in wanted])
    landing.install()
    assert "reread" not in timer.seconds
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    dests = [torch.zeros(b.lengths, dtype=full[n].dtype) for n, b in wanted]
    landing, timer = _land(path, wanted, dests, shared=False)
    landing.install()
    assert "reread" not in timer.seconds
    small = [(n, b) for n, b in wanted if math.prod(b.lengths) * full[n].element_size() < BATCH][:1]
    dests = [torch.zeros(b.lengths, dtype=full[n].dtype) for n, b in small]
    landing, timer = _land(path, small, dests)
    landing.install()
    assert "reread" not in timer.seconds and torch.equal(dests[0], _region(full[small[0][0]], small[0][1]))


def _flip(path: str, tensor: str, box: int, at: int) -> str:
    """Flip one bit of saved tensor `tensor`'s box number `box`, `at` bytes into it: the file's path."""
    from omnickpt.formats import read_manifest
    from omnickpt.storage import storage_for
    return _flip_box(path, read_manifest(storage_for(path)).tensors[tensor].boxes[box], at)


def _flip_box(path: str, box, at: int) -> str:
    import os

    from omnickpt.formats import read_manifest
    from omnickpt.storage import storage_for
    name = read_manifest(storage_for(path)).files[box.file].path
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(box.offset + at)
        byte = f.read(1)[0]
        f.seek(box.offset + at)
        f.write(bytes([byte ^ 0x10]))
    return name


def test_a_corrupt_byte_found_in_the_first_pass_installs_nothing(tmp_path, small_batch):
    # The corrupt chunk lies in a middle batch: the first pass fails before any byte is installed,
    # in every destination (those of the batches before it included), naming the file and tensor.
    path, full, wanted = _saved(tmp_path, 2)
    name = _flip(path, "t0", 5, 100)
    dests = [torch.full(b.lengths, -7, dtype=full[n].dtype) for n, b in wanted]
    with pytest.raises(CorruptCheckpointError) as err:
        _land(path, wanted, dests)
    assert "checksum mismatch" in str(err.value) and name in str(err.value) and "'t0'" in str(err.value)
    assert "changed" not in str(err.value)
    assert all((d == -7).all() for d in dests)


@pytest.mark.parametrize("in_place", [False, True], ids=["batched", "in-place"])
def test_bytes_that_change_between_the_passes_fail_the_install_by_name(tmp_path, small_batch, monkeypatch,
                                                                      in_place):
    # The file is written to after the first pass verified it: the second pass verifies again and
    # fails, saying the file changed during the load and that part of the target may hold it; for a
    # box read straight into its destination too (t0's boxes are whole rows of a plain destination).
    import omnickpt.engine.load as engine_load
    monkeypatch.setattr(engine_load, "IN_PLACE_MIN", 0 if in_place else 1 << 62)
    path, full, wanted = _saved(tmp_path, 3)
    dests = [torch.full(b.lengths, -7, dtype=full[n].dtype) for n, b in wanted]
    landing, _ = _land(path, wanted, dests)
    name = _flip(path, "t0", 9, 50)
    with pytest.raises(CorruptCheckpointError) as err:
        landing.install()
    msg = str(err.value)
    assert "checksum mismatch" in msg and name in msg and "changed during the load" in msg
    assert "'t0' box offsets=[90, 0]" in msg


def _two_ranks(rank, world, path, corrupt):
    """Tensors "a" and "b" of 2 rows, row r saved by rank r (one file each); rank 0 loads all of "a",
    rank 1 all of "b", both reading both files (through the page cache), in 4 KB batches. With
    `corrupt`, a byte of b's row 1, which only rank 1 reads, is flipped first."""
    import torch.distributed as dist

    import omnickpt.engine.load as engine_load
    engine_load.REREAD_BATCH, engine_load.REREAD_MIN = BATCH, 0   # this process only
    shape = (2, 1 << 18)               # a row: 1 MB, one checksum chunk
    full = {n: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * k for k, n in ((1, "a"), (3, "b"))}
    omnickpt.save(path, {n: ShardSpec(t[rank:rank + 1].clone(), (rank, 0), shape, name=n) for n, t in full.items()})
    if corrupt and rank == 0:
        from omnickpt.formats import read_manifest
        from omnickpt.storage import storage_for
        box = [b for b in read_manifest(storage_for(path)).tensors["b"].boxes if b.offsets[0] == 1][0]
        _flip_box(path, box, 1000)
    dist.barrier()
    mine = "ab"[rank]
    dest = torch.full(shape, -1.0)
    try:
        report = omnickpt.load(path, {mine: ShardSpec(dest, (0, 0), shape, name=mine)}).report
    except CorruptCheckpointError as e:
        return "corrupt", str(e), bool((dest == -1).all())
    return "ok", sorted(report["per_rank"][rank]["seconds"]), torch.equal(dest, full[mine])


def test_two_ranks_loading_in_two_passes_install_all_or_nothing(tmp_path):
    # Rank 0's bytes are sound and rank 1's are not: rank 0 installs nothing either (the ranks agree
    # after the first pass, before either reads again to install).
    for rank, (kind, seconds, exact) in enumerate(run_ranks(2, _two_ranks, str(tmp_path / "ok"), False)):
        assert kind == "ok" and exact and "reread" in seconds, (rank, seconds)
    for rank, (kind, msg, untouched) in enumerate(run_ranks(2, _two_ranks, str(tmp_path / "bad"), True)):
        assert kind == "corrupt" and untouched, (rank, msg)
        assert "checksum mismatch" in msg and ("failed on another rank: rank 1" in msg) == (rank == 0), (rank, msg)


def _replicas(rank, world, path, corrupt_row):
    """Tensors "a" and "b" of 2 rows, row r saved by rank r (one file each); both ranks load both
    whole (replicas, as DDP ranks do), in two passes of 4 KB batches. With `corrupt_row`, a byte of
    b's row `corrupt_row` (in that rank's file) is flipped first."""
    import torch.distributed as dist

    import omnickpt.engine.load as engine_load
    engine_load.REREAD_BATCH, engine_load.REREAD_MIN = BATCH, 0   # this process only
    shape = (2, 1 << 18)               # a row: 1 MB, one checksum chunk
    full = {n: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * k for k, n in ((1, "a"), (3, "b"))}
    omnickpt.save(path, {n: ShardSpec(t[rank:rank + 1].clone(), (rank, 0), shape, name=n) for n, t in full.items()})
    if corrupt_row is not None and rank == 0:
        from omnickpt.formats import read_manifest
        from omnickpt.storage import storage_for
        box = [b for b in read_manifest(storage_for(path)).tensors["b"].boxes if b.offsets[0] == corrupt_row][0]
        _flip_box(path, box, 1000)
    dist.barrier()
    dests = {n: torch.full(shape, -1.0) for n in full}
    try:
        report = omnickpt.load(path, {n: ShardSpec(d, (0, 0), shape, name=n) for n, d in dests.items()}).report
    except CorruptCheckpointError as e:
        return "corrupt", str(e), all(bool((d == -1).all()) for d in dests.values())
    mine = report["per_rank"][rank]
    exact = all(torch.equal(dests[n], full[n]) for n in full)
    return "ok", (sorted(mine["seconds"]), mine["bytes"]), exact


def test_replicas_verify_a_part_each_in_the_first_pass_and_install_all_or_nothing(tmp_path):
    # Both ranks read the same 4 MB; each verifies half of it before anything is installed, then
    # reads and verifies all of it again to install it.
    whole = 4 << 20
    for rank, (kind, (seconds, counted), exact) in enumerate(run_ranks(2, _replicas, str(tmp_path / "ok"), None)):
        assert kind == "ok" and exact and "reread" in seconds, (rank, seconds)
        assert counted["read"] == whole // 2 and counted["reread"] == whole, (rank, counted)
    # A corrupt byte in either half: the rank whose half it lies in finds it in the first pass, and
    # the other rank, which never read it before the exchange, installs nothing either.
    for row in (0, 1):
        res = run_ranks(2, _replicas, str(tmp_path / f"bad{row}"), row)
        for rank, (kind, msg, untouched) in enumerate(res):
            assert kind == "corrupt" and untouched, (row, rank, msg)
            assert ("failed on another rank: rank " in msg) == (rank != row), (row, rank, msg)


def test_a_staging_budget_below_a_batch_bounds_the_batch_buffer(tmp_path, monkeypatch):
    # Checkpointer(staging_budget=...) below REREAD_BATCH: the batches are cut to the budget's largest
    # buffer, and the pool never holds more than the budget (a larger request would get memory
    # outside the pool, uncounted).
    import omnickpt.engine.load as engine_load
    from omnickpt.engine.staging import StagingPool
    monkeypatch.setattr(engine_load, "REREAD_BATCH", 256 << 10)
    monkeypatch.setattr(engine_load, "REREAD_MIN", 0)
    state = {f"w{i}": torch.randn(64, 128 + i) for i in range(40)}   # ~1.3 MB, boxes of ~33 KB
    path = str(tmp_path / "ck")
    omnickpt.save(path, {n: ShardSpec(t, (0, 0), t.shape, name=n) for n, t in state.items()})
    wanted = [(n, Box.full(t.shape)) for n, t in state.items()]

    class Asked(StagingPool):
        def acquire(self, nbytes, **kw):
            self.asked = max(getattr(self, "asked", 0), nbytes)
            return super().acquire(nbytes, **kw)

    pool = Asked(budget=96 << 10)
    dests = [torch.zeros(t.shape) for t in state.values()]
    landing, timer = _land(path, wanted, dests, pool=pool, budget=pool.largest)
    landing.install()
    assert "reread" in timer.seconds and pool.asked <= pool.largest and pool.peak <= 96 << 10, (pool.asked, pool.peak)
    assert all(torch.equal(d, t) for d, t in zip(dests, state.values()))
