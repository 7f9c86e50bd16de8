"""Cold loads: local files read from the device straight into page-aligned landing buffers
(LocalStorage.read_direct), each read request's checksum chunks verified by its reader as it lands,
the chunks that straddle two requests after all have landed."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import omnickpt
import omnickpt.engine.load as engine_load
from omnickpt.engine.load import _Extent, _Need, _assign_checks, _chunks_to_check
from omnickpt.errors import CorruptCheckpointError
from omnickpt.loading import replica_part, shared_files
from omnickpt.storage.local import LocalStorage

PAGE = 4096


def evict(root) -> None:
    """Drop the files under `root` from the page cache (fsync, then POSIX_FADV_DONTNEED)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def aligned(n: int, shift: int = 0) -> tuple[np.ndarray, memoryview]:
    raw = np.zeros(n + 2 * PAGE, dtype=np.uint8)
    at = -raw.ctypes.data % PAGE + shift
    return raw, memoryview(raw[at:at + n])


def resident(path) -> list[bool]:
    """Per page of `path`, whether the page cache holds it (mincore; asking with a read could
    itself bring pages in)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
        view = np.frombuffer(mm, dtype=np.uint8)
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        if failed:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return [bool(v & 1) for v in vec]


needs_direct = pytest.mark.skipif(not (hasattr(os, "O_DIRECT") and hasattr(os, "RWF_NOWAIT")),
                                  reason="O_DIRECT and RWF_NOWAIT are Linux's")


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=(9 << 20) + 12345, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    return tmp_path, data


# Offsets and lengths that are not multiples of a page, buffers whose address agrees with the file
# offset modulo a page (shift = offset % PAGE) and ones that do not.
CASES = [(0, None, 0), (100, -107, 100), (3 * PAGE + 5, 6 << 20, 5), (PAGE, 5 << 20, 0), (0, None, 64)]


@pytest.mark.parametrize("state", ["cold", "warm", "partly cached"])
@pytest.mark.parametrize("offset,length,shift", CASES)
def test_read_direct_gives_the_file_bytes(data_file, state, offset, length, shift):
    root, data = data_file
    n = len(data) - offset if length is None else (length if length > 0 else len(data) - offset + length)
    evict(root)
    if state == "warm":
        (root / "f").read_bytes()
    elif state == "partly cached":
        with open(root / "f", "rb") as f:
            f.seek(offset + (2 << 20) + 77)
            f.read(1 << 20)
    _, mv = aligned(n, shift)
    LocalStorage(str(root)).read_direct("f", offset, mv)
    assert bytes(mv) == data[offset:offset + n].tobytes()


@needs_direct
def test_a_cold_read_direct_bypasses_the_page_cache_and_a_warm_one_uses_it(data_file):
    root, data = data_file
    st = LocalStorage(str(root))
    evict(root)
    if _direct_unsupported(root / "f"):
        pytest.skip("this file system refuses O_DIRECT")
    _, mv = aligned(len(data))
    st.read_direct("f", 0, mv)
    assert bytes(mv) == data.tobytes()
    # The aligned pages went from the device into the buffer, not through the cache.
    pages = resident(root / "f")
    assert sum(pages) <= 2, f"{sum(pages)} of {len(pages)} pages cached after a cold read_direct"
    (root / "f").read_bytes()
    assert all(resident(root / "f"))
    _, mv = aligned(len(data))
    st.read_direct("f", 0, mv)
    assert bytes(mv) == data.tobytes()


def _direct_unsupported(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError:
        return True


def test_read_direct_past_the_end_is_a_truncated_file(data_file):
    root, data = data_file
    evict(root)
    _, mv = aligned(len(data) + 100)
    with pytest.raises(CorruptCheckpointError, match=r"data file .*f is truncated"):
        LocalStorage(str(root)).read_direct("f", 0, mv)


def test_read_direct_of_a_missing_file_names_it(tmp_path):
    _, mv = aligned(8 << 20)
    with pytest.raises(CorruptCheckpointError, match=r"data file .*gone is missing"):
        LocalStorage(str(tmp_path)).read_direct("gone", 0, mv)


# ---------------------------------------------------------------------------- whole loads

def make_state(seed: int) -> dict[str, torch.Tensor]:
    """Odd sizes: no tensor and no file is a whole number of pages; two are large enough for
    direct reads, the rest small."""
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(1537, 1031, generator=g), "odd": torch.randint(-100, 100, (3_000_017,), dtype=torch.int8,
                                                                              generator=g),
            "half": torch.randn(1201, 997, generator=g).to(torch.bfloat16),
            **{f"small{i}": torch.randn(17 + i, generator=g) for i in range(5)}}


def perturbed(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def saved(tmp_path, seed=0):
    state = make_state(seed)
    path = str(tmp_path / "ckpt")
    omnickpt.save(path, state).wait()
    return path, state


def data_files(path):
    return sorted(os.path.join(path, "data", f) for f in os.listdir(os.path.join(path, "data")))


def test_data_files_of_the_test_state_are_not_whole_pages(tmp_path):
    path, _ = saved(tmp_path)
    assert any(os.path.getsize(f) % PAGE for f in data_files(path))


@pytest.mark.parametrize("request_bytes", [256 << 10, 3 << 20, 16 << 20])
@pytest.mark.parametrize("landing", [1 << 20, 4 << 30])
@pytest.mark.parametrize("cold", [True, False])
def test_loads_in_many_requests_and_batches_equal_the_saved_state(tmp_path, monkeypatch, request_bytes, landing,
                                                                  cold, as_if_not_alone):
    """Requests smaller than a checksum chunk (every chunk straddles two: checked after all landed),
    a few chunks each, and large; one batch or many (a budget below one tensor)."""
    monkeypatch.setattr(engine_load, "DIRECT_REQUEST", request_bytes)
    path, state = saved(tmp_path)
    target = perturbed(state)
    if cold:
        evict(path)
    with omnickpt.Checkpointer(landing_bytes=landing) as ckpt:
        ckpt.load(path, target)
    for k, v in state.items():
        assert torch.equal(target[k].view(torch.uint8) if v.dtype == torch.bfloat16 else target[k],
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k


@pytest.fixture
def as_if_not_alone(monkeypatch):
    """A one-process load reads through the page cache (loading.shared_files); the tests of the
    direct path load as a rank would whose machine has other ranks reading their own files."""
    monkeypatch.setattr(omnickpt.loading, "shared_files", lambda rank, files_read, nfiles: set())


def _counting_direct_reads(monkeypatch) -> list:
    calls = []
    real = LocalStorage.read_direct

    def counting(self, rel, offset, buf):
        calls.append((rel, offset, len(buf)))
        return real(self, rel, offset, buf)

    monkeypatch.setattr(LocalStorage, "read_direct", counting)
    return calls


def test_the_direct_read_is_used_for_local_files(tmp_path, monkeypatch, as_if_not_alone):
    calls = _counting_direct_reads(monkeypatch)
    path, state = saved(tmp_path)
    target = perturbed(state)
    evict(path)
    omnickpt.load(path, target)
    assert torch.equal(target["big"], state["big"])
    assert sum(n for _, _, n in calls) >= state["big"].numel() * 4


def test_a_process_loading_alone_reads_through_the_page_cache(tmp_path, monkeypatch):
    calls = _counting_direct_reads(monkeypatch)
    path, state = saved(tmp_path)
    target = perturbed(state)
    evict(path)
    omnickpt.load(path, target)
    assert torch.equal(target["big"], state["big"]) and not calls


def _own_files_side_by_side(rank, world, path):
    """Each of 2 ranks saves and loads its own half of a tensor (FSDP-like): both read their own
    file at once, from the device."""
    from omnickpt import ShardSpec
    from omnickpt.storage.local import LocalStorage as Local
    full = torch.arange(2 * 1024 * 1024, dtype=torch.float32).reshape(2048, 1024)
    half = full[rank * 1024:(rank + 1) * 1024].clone()
    omnickpt.save(path, {"w": ShardSpec(half, (rank * 1024, 0), tuple(full.shape), name="w")}).wait()
    evict(path)
    torch.distributed.barrier()
    calls, real = [], Local.read_direct

    def counting(self, rel, offset, buf):
        calls.append(len(buf))
        return real(self, rel, offset, buf)

    Local.read_direct = counting
    try:
        dest = torch.zeros_like(half)
        omnickpt.load(path, {"w": ShardSpec(dest, (rank * 1024, 0), tuple(full.shape), name="w")})
    finally:
        Local.read_direct = real
    return torch.equal(dest, half), sum(calls)


def test_ranks_reading_their_own_files_side_by_side_read_from_the_device(tmp_path):
    from dist import run_ranks
    for ok, direct in run_ranks(2, _own_files_side_by_side, str(tmp_path / "ckpt")):
        assert ok and direct >= 1024 * 1024 * 4


def flip(path: str, at: float) -> int:
    """Flip one byte at fraction `at` of the largest data file; returns its offset."""
    f = max(data_files(path), key=os.path.getsize)
    off = int(os.path.getsize(f) * at)
    with open(f, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x40]))
    return off


@pytest.mark.parametrize("request_bytes", [256 << 10, 3 << 20])
@pytest.mark.parametrize("at", [0.02, 0.55, 0.97])
def test_a_corrupt_byte_in_any_request_fails_the_load_and_leaves_the_target_untouched(tmp_path, monkeypatch,
                                                                                     request_bytes, at,
                                                                                     as_if_not_alone):
    monkeypatch.setattr(engine_load, "DIRECT_REQUEST", request_bytes)
    path, state = saved(tmp_path)
    flip(path, at)
    target = perturbed(state)
    evict(path)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in .* for tensor '[^']+'"):
        omnickpt.load(path, target)
    assert all(not v.any() for v in target.values())   # all-or-nothing: nothing was installed


def test_a_corrupt_byte_in_a_later_batch_is_never_installed(tmp_path, monkeypatch, as_if_not_alone):
    """Past the landing budget earlier batches are installed, but never the corrupt one."""
    monkeypatch.setattr(engine_load, "DIRECT_REQUEST", 1 << 20)
    path, state = saved(tmp_path)
    flip(path, 0.97)
    target = perturbed(state)
    evict(path)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        with omnickpt.Checkpointer(landing_bytes=1 << 20) as ckpt:
            ckpt.load(path, target)


def test_verify_false_reads_through_the_same_path(tmp_path):
    path, state = saved(tmp_path)
    target = perturbed(state)
    evict(path)
    omnickpt.load(path, target, verify=False)
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["odd"], state["odd"])


# ---------------------------------------------------------------------------- pure parts

def test_every_checksum_chunk_is_checked_once_by_the_request_holding_it_or_after_all():
    from omnickpt.format.records import Sums
    from omnickpt.layout import Box
    from omnickpt.planner import ReadItem
    from omnickpt.format.records import SavedBox
    size, start, nbytes = 1 << 20, 4160, (5 << 20) + 300
    crcs = tuple(range(-(-nbytes // size)))
    sb = SavedBox((0,), (nbytes,), 0, start, nbytes, Sums(start, start + nbytes, size, crcs))
    item = ReadItem("t", 0, sb, Box((0,), (nbytes,)))
    ext = _Extent(0, start, start + nbytes, [_Need(0, start, start + nbytes, start, start + nbytes, 0, (1,))])
    for cut in (256 << 10, 1 << 20, 3 << 20, 64 << 20):
        requests, a = [], start
        while a < ext.end:
            b = min(ext.end, (a + cut) // PAGE * PAGE)
            requests.append((ext, a, b))
            a = b
        per, straddling = _assign_checks(requests, [item], verify=True)
        inside = [(r, c[1:]) for r, cs in enumerate(per) for c in cs]
        assert sorted([c for _, c in inside] + [c[1:] for c in straddling]) == sorted(
            zip(*_chunks_to_check(ext, [item])))
        for r, (a, b, _, _) in inside:
            assert requests[r][1] <= a and b <= requests[r][2]
        assert _assign_checks(requests, [item], verify=False) == ([[] for _ in requests], [])


def test_shared_files_are_those_another_rank_on_the_machine_reads_much_of():
    files = [("a", {0: 100, 1: 100}), ("a", {1: 100, 2: 100}), ("b", {0: 100, 2: 100}), ("a", {3: 100}),
             ("c", {5: 1000, 6: 10}), ("c", {5: 10, 6: 1000})]
    assert shared_files(0, files, 7) == {1}
    assert shared_files(1, files, 7) == {1}
    assert shared_files(2, files, 7) == {0, 2}    # alone on its machine: all through the cache
    assert shared_files(3, files, 7) == set()
    # FSDP2: each rank reads its own file, and a few replicated bytes of the other's
    assert shared_files(4, files, 7) == {6}
    assert shared_files(5, files, 7) == {5}
    # a process alone in its group tallies nothing and reads every file of the checkpoint through the cache
    assert shared_files(0, [None], 3) == {0, 1, 2}


def test_replicas_are_the_ranks_of_one_machine_whose_loads_read_alike():
    ranks = [("a", "x"), ("a", "y"), ("a", "x"), ("b", "x"), ("a", None), ("b", "x"), ("c", "x")]
    assert [replica_part(r, ranks) for r in range(len(ranks))] == [(0, 2), None, (1, 2), (0, 2), None, (1, 2), None]
    assert replica_part(0, [(None, None)]) is None
