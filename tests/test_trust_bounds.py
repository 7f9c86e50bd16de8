"""Untrusted input never costs more than its size says (issue 17): a stored chunk never inflates
past its raw size, an untrusted manifest decodes in O(n log n), a report of thousands of ranks
draws in time linear in them, lease records and index arguments that make no sense are refused,
and decoded objects cannot be crafted into quadratic dict building.

Cost: ~40 s, most of it drawing two timelines (300 and 8192 ranks) and decoding 40,000 boxes."""
from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from torch import nn

import omnickpt
from omnickpt.cli.verify import verify
from omnickpt.errors import CheckpointLockedError, CorruptCheckpointError
from omnickpt.format import CHUNK_BYTES, FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, TensorEntry, checksum
from omnickpt.format.codec import decompress_into
from omnickpt.format.manifest import _PRELUDE, BoxColumns, overlap_problem_arrays
from omnickpt.format.objects import MAX_SAME_HASH, decode_object, encode_object
from omnickpt.lease import DEFAULT_TTL, OWNER_RECORD, acquire
from omnickpt.storage import storage_for

from test_cli import _run

MiB = 1 << 20


# ------------------------------------------------------------------------------- helpers
def _manifest(path) -> Manifest:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return Manifest.decode(f.read())


def _write_manifest(path, m: Manifest) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(m.encode())


def _replace_chunk(path, name: str, stored: bytes) -> str:
    """Make `stored` the only chunk of tensor `name` (one box of one chunk), appended to its data
    file, with a CRC that matches: what a hostile or broken writer can do. Returns the file."""
    m = _manifest(path)
    entry = m.tensors[name]
    cols = entry.columns
    assert len(cols) == 1 and len(cols.crcs) == 1
    fi = int(cols.file[0])
    data = os.path.join(path, m.files[fi].path)
    offset = os.path.getsize(data)
    with open(data, "ab") as f:
        f.write(stored)
    m.files[fi].bytes = offset + len(stored)
    cols.offset[0], cols.stored[0], cols.crcs[0] = offset, len(stored), checksum(stored)
    _write_manifest(path, m)
    return m.files[fi].path


def _tensors(**values: torch.Tensor) -> dict:
    """Tensors stored as boxes (named "<key>/<name>"), not as values of an object."""
    return {k: omnickpt.ShardSpec(v, (0,) * v.dim(), v.shape) for k, v in values.items()}


def _bomb(declared: int, real: bool = True) -> bytes:
    """A zstd frame declaring `declared` bytes: their real compression (zeros: a few KiB for 64
    MiB), or (real=False) the blocks of 1 MiB of zeros behind a header that claims `declared`."""
    if real:
        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(bytes(declared))
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compress(bytes(MiB))
    blocks = frame[zstandard.frame_header_size(frame):]
    # descriptor 0xE0: an 8-byte content size, single segment, no checksum, no dictionary
    return b"\x28\xb5\x2f\xfd\xe0" + declared.to_bytes(8, "little") + blocks


def _traced_peak(fn) -> int:
    """Peak bytes Python allocated while fn() ran (zstandard's output buffers are Python bytes)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------ bounded inflation
def test_a_frame_claiming_a_tebibyte_is_refused_before_anything_is_allocated():
    out, bomb = memoryview(bytearray(64 << 10)), _bomb(1 << 40, real=False)
    errors = []

    def attempt():
        with pytest.raises(CorruptCheckpointError) as info:
            decompress_into(bomb, "zstd", 4, out, "ck/data/x.bin chunk 0 of 'model/w'")
        errors.append(str(info.value))

    assert _traced_peak(attempt) < 4 * MiB
    assert "ck/data/x.bin chunk 0 of 'model/w'" in errors[0] and "declares 1099511627776 bytes" in errors[0]


@pytest.mark.parametrize("codec", ["zstd", "bytesplit-zstd"])
def test_a_real_frame_of_more_than_its_chunk_is_never_inflated(codec):
    errors, bomb = [], _bomb(64 * MiB)

    def attempt():
        with pytest.raises(CorruptCheckpointError) as info:
            decompress_into(bomb, codec, 4, memoryview(bytearray(64 << 10)), "chunk 3 of 'model/w'")
        errors.append(str(info.value))

    assert _traced_peak(attempt) < 8 * MiB          # the 64 MiB it holds were never made
    assert "declares 67108864 bytes, the manifest says 65536" in errors[0]
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    with pytest.raises(CorruptCheckpointError, match="does not declare its size"):
        decompress_into(no_size, codec, 4, memoryview(bytearray(1000)), "chunk 0")
    trailing = zstandard.ZstdCompressor().compress(bytes(1000)) + b"\0" * 8
    with pytest.raises(CorruptCheckpointError, match="does not decompress"):
        decompress_into(trailing, codec, 4, memoryview(bytearray(1000)), "chunk 0")


@pytest.mark.parametrize("codec", ["zstd", "bytesplit-zstd"])
def test_a_compressed_checkpoint_with_a_bomb_chunk_fails_to_load_and_verify_names_it(tmp_path, codec):
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"t": _tensors(w=torch.zeros(16384), b=torch.ones(8))}, compression=codec)   # w: one chunk
    data_file = _replace_chunk(path, "t/w", _bomb(64 * MiB))
    errors = []
    with omnickpt.open(path, workers=1) as ckpt:
        def attempt():
            with pytest.raises(CorruptCheckpointError) as info:
                ckpt.get("t/w")
            errors.append(str(info.value))

        assert _traced_peak(attempt) < 8 * MiB
        assert torch.equal(ckpt.get("t/b"), torch.ones(8))   # the rest still reads
    assert data_file in errors[0] and "'t/w'" in errors[0] and "compressed chunk 0" in errors[0]
    assert "declares 67108864 bytes" in errors[0]
    report = verify(path)
    assert not report.ok and len(report.problems) == 1
    problem = str(report.problems[0])
    assert data_file in problem and "'t/w'" in problem and "declares 67108864 bytes, the manifest says 65536" in problem


def test_verify_reports_a_quantized_chunk_of_the_wrong_length(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(32, 48)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"model": model, "optim": opt}, quantize_optimizer="int8")
    m = _manifest(path)
    name = next(n for n in m.quantized if n.endswith("weight/exp_avg"))
    (box,) = m.tensors[name].boxes
    a, b = box.sums.file_chunk(0)
    with open(os.path.join(path, m.files[box.file].path), "rb") as f:
        f.seek(a)
        payload = f.read(b - a)
    assert verify(path).ok
    _replace_chunk(path, name, payload + b"\0")   # intact, checksummed, one byte too long
    report = verify(path)
    assert not report.ok and f"'{name}'" in str(report.problems[0]) and "quantized chunk" in str(report.problems[0])
    with pytest.raises(CorruptCheckpointError, match="wrong size"):
        omnickpt.open(path).get(name)


# --------------------------------------------------------------------------- the overlap check
def _staircase(n: int):
    """n + 1 disjoint boxes of shape (n + 1, 2n), a staircase: box i covers rows [i + 1, n + 1) of
    columns [2i, 2i + 2), so along the rows every box overlaps every later one; one more box, row 0
    of columns [1, 3), straddles two column blocks, so neither dimension is a grid."""
    i = np.arange(n)
    lo = np.concatenate([np.stack([i + 1, 2 * i], 1), [[0, 1]]]).astype(np.int64)
    ln = np.concatenate([np.stack([n - i, np.full(n, 2)], 1), [[1, 2]]]).astype(np.int64)
    return lo, ln


def _manifest_of_boxes(lo: np.ndarray, ln: np.ndarray, shape) -> bytes:
    n = len(lo)
    nbytes = ln.prod(axis=1)
    cols = BoxColumns(offsets=lo, lengths=ln, file=np.zeros(n, dtype=np.int64), offset=np.zeros(n, dtype=np.int64),
                      nbytes=nbytes, sums_start=np.arange(n + 1, dtype=np.int64), crcs=np.zeros(n, dtype=np.uint32))
    assert nbytes.max() <= CHUNK_BYTES   # one chunk per box
    m = Manifest(save_id="s", world_size=1, files=[FileEntry("data/s-r00000.bin", 0, int(nbytes.max()))],
                 tensors={"model/stairs": TensorEntry(tuple(shape), "uint8", columns=cols)}, objects={})
    return m.encode()


@pytest.mark.timeout(60)   # a generous bound: ~0.5 s here; the pairwise sweep it replaced took ~60 s
def test_forty_thousand_staircase_boxes_decode_in_n_log_n():
    n = 40_000
    lo, ln = _staircase(n)
    raw = _manifest_of_boxes(lo, ln, (n + 1, 2 * n))
    assert len(raw) < 1_300_000
    m = Manifest.decode(raw, where="ck/manifest.json")
    assert m.tensors["model/stairs"].box_count == n + 1
    ln[n // 2, 1] = 3     # columns [n, n + 3) now reach into the next box's, whose rows it covers
    with pytest.raises(CorruptCheckpointError, match=r"ck/manifest.json.*'model/stairs'.*overlap"):
        Manifest.decode(_manifest_of_boxes(lo, ln, (n + 1, 2 * n)), where="ck/manifest.json")


def test_the_overlap_check_agrees_with_comparing_every_pair():
    # Random boxes, grids with a moved or repeated box, staircases: grid grouping, the interval
    # test, the plane sweep and the candidate sweep must all give the verdict of the brute force.
    rng = np.random.default_rng(17)
    refused = 0
    for case in range(600):
        nd, n = int(rng.integers(1, 5)), int(rng.integers(2, 160))
        shape = rng.integers(1, 14, nd)
        if case % 3 == 0:   # a grid, often broken by one box
            cuts = [np.unique(np.concatenate([[0, s], rng.integers(0, s, 3)])) for s in shape]
            mesh = np.stack(np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij"), -1).reshape(-1, nd)
            lo = np.stack([cuts[d][mesh[:, d]] for d in range(nd)], 1)
            ln = np.stack([cuts[d][mesh[:, d] + 1] for d in range(nd)], 1) - lo
            if rng.random() < 0.7:
                k = int(rng.integers(len(lo)))
                lo = np.concatenate([lo, lo[k:k + 1] + (rng.random(nd) < 0.5)])
                ln = np.concatenate([ln, ln[k:k + 1]])
                lo[-1] = np.minimum(lo[-1], shape - ln[-1])
        elif case % 3 == 1 and nd >= 2:
            lo, ln = _staircase(n)
            if rng.random() < 0.5:
                k = int(rng.integers(n - 1))
                ln[k, 1] = 3
            lo = np.concatenate([lo, np.zeros((len(lo), nd - 2), dtype=np.int64)], 1)
            ln = np.concatenate([ln, np.ones((len(ln), nd - 2), dtype=np.int64)], 1)
        else:
            lo = np.stack([rng.integers(0, s, n) for s in shape], 1)
            ln = np.stack([rng.integers(1, s - lo[:, d] + 1) for d, s in enumerate(shape)], 1)
        lo, ln = lo.astype(np.int64), ln.astype(np.int64)
        hi = lo + ln
        hit = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(axis=2)
        np.fill_diagonal(hit, False)
        problem = overlap_problem_arrays(lo, ln)
        assert (problem is not None) == hit.any(), (case, lo.tolist(), ln.tolist())
        if problem:
            refused += 1
            named = [[json.loads(half) for half in part.split("+")]
                     for part in problem.removeprefix("boxes ").removesuffix(" overlap").split(" and ")]
            (ao, al), (bo, bl) = named
            rows = {(tuple(o), tuple(n)) for o, n in zip(lo.tolist(), ln.tolist())}
            assert (tuple(ao), tuple(al)) in rows and (tuple(bo), tuple(bl)) in rows   # a pair that does overlap
            assert all(x < y + m and y < x + k for x, k, y, m in zip(ao, al, bo, bl))
    assert refused > 100


def test_three_interleaved_dimensions_past_the_bound_are_refused_unchecked():
    # Three families of m nested boxes, each family disjoint along another dimension and the
    # families apart: disjoint, but every dimension has ~m^2 candidate pairs. No parallel layout
    # looks like this; proving it would cost m^2 comparisons on every rank, so it is refused.
    m = 3000
    i = np.arange(m)
    big = 4 * m
    fam_a = (np.stack([i, i, i], 1), np.stack([m - i, m - i, np.ones(m, dtype=np.int64)], 1))
    fam_b = (np.stack([big + i, big + i, i], 1), np.stack([np.ones(m, dtype=np.int64), m - i, m - i], 1))
    fam_c = (np.stack([i, 2 * big + i, i], 1), np.stack([m - i, np.ones(m, dtype=np.int64), m - i], 1))
    lo = np.concatenate([fam_a[0], fam_b[0], fam_c[0]]).astype(np.int64)
    ln = np.concatenate([fam_a[1], fam_b[1], fam_c[1]]).astype(np.int64)
    t0 = time.perf_counter()
    problem = overlap_problem_arrays(lo, ln)
    assert problem is not None and "refused unchecked" in problem and "3 dimensions" in problem
    assert time.perf_counter() - t0 < 30
    small = 100   # the same layout, small: checked, and disjoint
    keep = np.concatenate([np.arange(small), m + np.arange(small), 2 * m + np.arange(small)])
    assert overlap_problem_arrays(lo[keep], ln[keep]) is None


# ------------------------------------------------------------------------------ the version field
def _v3_with_version(prelude: int, header: int | None = None) -> bytes:
    m = Manifest(save_id="s", world_size=1, files=[], tensors={}, objects={})
    raw = bytearray(m.encode())
    magic, _, head_len, arrays_len, crc, res = _PRELUDE.unpack_from(raw)
    if header is not None:
        head = json.loads(raw[_PRELUDE.size:_PRELUDE.size + head_len])
        head["version"] = header
        text = json.dumps(head).encode()
        text += b" " * (-(len(text) + _PRELUDE.size) % 8)
        body = text + bytes(raw[_PRELUDE.size + head_len:])
        return _PRELUDE.pack(magic, prelude, len(text), arrays_len, checksum(body), res) + body
    _PRELUDE.pack_into(raw, 0, magic, prelude, head_len, arrays_len, crc, res)
    return bytes(raw)


@pytest.mark.parametrize("bit", [2, 3, 8, 20, 31])
def test_a_flipped_bit_in_the_version_field_is_damage_not_a_newer_format(bit):
    raw = _v3_with_version(FORMAT_VERSION ^ (1 << bit))   # outside the manifest's checksum: nothing else changed
    with pytest.raises(CorruptCheckpointError) as info:
        Manifest.decode(raw, where="ck/manifest.json")
    msg = str(info.value)
    assert "ck/manifest.json" in msg and "upgrade" not in msg and "damaged" in msg


def test_only_a_consistent_newer_version_says_upgrade():
    newer = _v3_with_version(FORMAT_VERSION + 1, header=FORMAT_VERSION + 1)
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json: format version 4 is newer .*; upgrade omnickpt"):
        Manifest.decode(newer, where="ck/manifest.json")
    doc = {"format": "omnickpt", "version": 10 ** 9, "files": [], "tensors": {}, "objects": {}}
    with pytest.raises(CorruptCheckpointError, match="ck/manifest.json: format version 1000000000 does not exist"):
        Manifest.decode(json.dumps(doc).encode(), where="ck/manifest.json")


# ------------------------------------------------------------------------------------- leases
def _owner(st, **fields) -> None:
    doc = {"holder": "other-job", "host": "other-host", "boot_id": "b", "pid_ns": None, "pid": 4242,
           "started": time.time() - 100, "renewed": time.time(), "what": "checkpoint", "ttl": DEFAULT_TTL,
           "lease": "L"}
    doc.update(fields)
    st.commit(OWNER_RECORD, json.dumps(doc).encode())


@pytest.mark.parametrize("fields", [{"ttl": float("inf")}, {"ttl": float("nan")}, {"ttl": 1e300}, {"ttl": "30"},
                                    {"ttl": -5}, {"renewed": float("inf")}, {"renewed": float("nan")},
                                    {"renewed": 10 ** 400}])
def test_a_record_whose_times_cannot_be_believed_never_locks_forever(tmp_path, fields):
    st = storage_for(str(tmp_path / "ck"))
    _owner(st, **fields)
    with pytest.warns(RuntimeWarning, match=r"'other-job'.*its times are damaged\): the record is damaged"):
        lease = acquire(st, "job-B")
    assert json.loads(st.read_bytes(OWNER_RECORD))["holder"] == "job-B"
    lease.release()


def test_an_absurd_ttl_is_refused_when_acquiring(tmp_path):
    for ttl in (float("inf"), float("nan"), 1e9, 0):
        with pytest.raises(ValueError, match="ttl"):
            acquire(str(tmp_path / "ck"), "job", ttl=ttl)


def test_a_dead_record_from_a_host_whose_clock_runs_ahead_is_taken_over_after_its_ttl(tmp_path):
    st = storage_for(str(tmp_path / "ck"))
    _owner(st, renewed=time.time() + 3600, ttl=0.5)      # its host's clock is an hour ahead; its job is dead
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"renewed at a time 3\d\d\d\.\d s ahead of this machine's clock\): it was "
                                            r"not renewed during the 0.5 s this job watched it"):
        lease = acquire(st, "job-B")
    assert 0.5 <= time.monotonic() - t0 < 10
    lease.release()


def test_a_live_owner_whose_clock_runs_ahead_is_refused_with_a_message_that_makes_sense(tmp_path):
    st = storage_for(str(tmp_path / "ck"))
    stop = threading.Event()

    def heartbeat():   # the other job, alive, on a host whose clock is an hour ahead
        while not stop.is_set():
            _owner(st, renewed=time.time() + 3600, ttl=0.6)
            stop.wait(0.05)

    _owner(st, renewed=time.time() + 3600, ttl=0.6)
    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        with pytest.raises(CheckpointLockedError) as info:
            acquire(st, "job-B")
    finally:
        stop.set()
        beat.join()
    msg = str(info.value)
    assert "'other-job' on host other-host" in msg and "ahead of this machine's clock" in msg
    assert " -3" not in msg and "from now" not in msg    # no negative age, no wait of the whole skew


# ---------------------------------------------------------------------------- reader indices
def test_reader_indices_are_numpy_like_and_refuse_booleans(tmp_path):
    path = str(tmp_path / "ck")
    w = torch.arange(12.0).reshape(3, 4)
    omnickpt.save(path, {"t": _tensors(w=w)})
    with omnickpt.open(path) as ckpt:
        for flag in (True, False, np.bool_(True), (0, True)):
            with pytest.raises(TypeError, match="boolean"):
                ckpt.get("t/w", box=flag)
        assert torch.equal(ckpt.get("t/w", box=np.int64(1)), w[1])
        assert torch.equal(ckpt.get("t/w", box=(np.int32(2), slice(1, 3))), w[2, 1:3])
        assert torch.equal(ckpt.get("t/w", box=(slice(None), np.uint8(3))), w[:, 3])
        assert torch.equal(ckpt.get("t/w", box=()), w) and torch.equal(ckpt.get("t/w", box=...), w)
        assert torch.equal(ckpt.get("t/w", box=(..., 1)), w[..., 1])
        assert torch.equal(ckpt.get("t/w", box=((1, 0), (2, 4))), w[1:3])     # (offsets, lengths) still works
        for bad in ((1.0,), ((0.5, 0), (1, 4)), ((True, 0), (1, 4))):
            with pytest.raises(ValueError):
                ckpt.get("t/w", box=bad)


def test_objects_whose_declared_size_the_file_lacks_are_refused_before_allocating(tmp_path):
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"extra": {"step": 3}})
    m = _manifest(path)
    (entry,) = m.objects["extra"]
    m.files[entry.file].bytes = 1 << 44
    entry.nbytes = (1 << 44) - entry.offset
    _write_manifest(path, m)
    with omnickpt.open(path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="truncated.*object 'extra'"):
            ckpt.objects()
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            ckpt.object_bytes("extra", entry)


# --------------------------------------------------------------------------------- reports
def _report(ranks: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    phases = ("plan", "exchange", "snapshot", "checksum", "write", "fsync")
    per_rank = []
    for r in range(ranks):
        d = rng.uniform(0.01, 0.2, len(phases))
        starts = np.concatenate([[0.0], np.cumsum(d)[:-1]])
        events = [[p, float(t), float(x)] for p, t, x in zip(phases, starts, d)] + [["stall", 0.0, float(d[:3].sum())]]
        per_rank.append({"seconds": {p: float(x) for p, x in zip(phases, d)} | {"stall": float(d[:3].sum())},
                         "bytes": {"written": 1000 + r}, "t0": 1000.0 + r * 1e-4, "events": events})
    return {"kind": "save", "save_id": "x", "seconds": 2.0, "per_rank": per_rank, "path": "ck"}


def _drawn(report: dict, tmp_path, monkeypatch):
    """The axes draw_png drew, after it wrote its PNG."""
    from matplotlib.figure import Figure

    from omnickpt.cli.report import draw_png
    drawn = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig.axes[0])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    out = tmp_path / "t.png"
    draw_png(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return drawn[0]


def test_the_timeline_draws_one_collection_per_phase_whatever_the_ranks(tmp_path, monkeypatch):
    ax = _drawn(_report(300), tmp_path, monkeypatch)
    assert len(ax.collections) <= 7 and len(ax.patches) == 0      # six phases and the stall
    assert sum(len(c.get_paths()) for c in ax.collections) == 300 * 7
    assert len(ax.get_yticks()) <= 40


@pytest.mark.timeout(120)   # generous: ~2 s here (drawing and saving); it took 9 minutes and more
def test_the_timeline_of_eight_thousand_ranks_groups_them_into_its_pixel_rows(tmp_path, monkeypatch):
    report = _report(8192)
    report["per_rank"][5000]["seconds"]["write"] = 9.0   # a straggler: its group's row is its own
    report["per_rank"][5000]["events"][4][2] = 9.0
    ax = _drawn(report, tmp_path, monkeypatch)
    rows = sum(len(c.get_paths()) for c in ax.collections) // 7
    assert rows < 8192 and "each row the slowest of" in ax.get_ylabel()
    assert any(label.get_text() for label in ax.get_yticklabels())
    assert max(p.vertices[:, 0].max() for c in ax.collections for p in c.get_paths()) >= 9.0   # its row is drawn


@pytest.mark.parametrize("doc", [
    {"per_rank": [{"seconds": {"plan": 1.0}, "bytes": [1]}]},
    {"per_rank": [{"seconds": {"plan": 1.0}, "bytes": {"written": "many"}}]},
    {"per_rank": [{"seconds": {"plan": 1.0}}], "seconds": "fast"},
    {"per_rank": [{"seconds": {"plan": 1e400}}]},
    {"per_rank": [{"seconds": {"plan": -1.0}}]},
])
def test_a_malformed_report_is_a_clear_error_naming_the_file(tmp_path, capsys, doc):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    rc, _, err = _run(["report", bad, "--png", tmp_path / "t.png"], capsys)
    assert rc == 1 and str(bad) in err and "Traceback" not in err and "damaged" in err


def test_report_png_into_a_folder_or_deep_json_is_a_clear_error(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_report(2)))
    rc, _, err = _run(["report", good, "--png", tmp_path], capsys)
    assert rc == 1 and "is a folder" in err and str(tmp_path) in err
    rc, _, err = _run(["report", good, "--png", tmp_path / "missing" / "t.png"], capsys)
    assert rc == 1 and "cannot write the timeline picture" in err
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    rc, _, err = _run(["report", deep], capsys)
    assert rc == 1 and "not valid JSON" in err and str(deep) in err


# --------------------------------------------------------------------------------- inspect
def test_inspect_survives_a_deep_name_and_a_creation_time_no_calendar_holds(tmp_path, capsys):
    from omnickpt.cli.inspect import format_tree, name_tree
    name = "a/" * 5000 + "w"    # 5000 levels: once a RecursionError, and quadratic copying of the name
    tree = name_tree([{"name": name, "shape": [1], "dtype": "float32", "bytes": 4}])
    (line,) = format_tree(tree)
    assert line.strip().startswith(name) and line.endswith("4 B")
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"t": {"w": torch.ones(2)}})
    m = _manifest(path)
    m.created = 1e300
    _write_manifest(path, m)
    rc, out, _ = _run(["inspect", path], capsys)
    assert rc == 0 and "at an unknown time" in out


# --------------------------------------------------------------------------------- objects
_M64 = (1 << 64) - 1
_X1, _X2, _X5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _colliding_pairs(n: int) -> list[tuple[int, int]]:
    """n distinct (a, b) with one hash: CPython's tuple hash (xxHash-like) is not randomised, so b
    is solved for each a (kept when it is an int whose hash is itself)."""
    def acc(a: int) -> int:
        return _rotl((_X5 + a * _X2) & _M64, 31) * _X1 & _M64

    target = _rotl(acc(1) & _M64, 31) * _X1 & _M64                       # the state after (1, 0)
    before = _rotl(target * pow(_X1, -1, 1 << 64) & _M64, 64 - 31)        # what acc(a) + b * X2 must be
    out, a = [], 1
    while len(out) < n:
        b = (before - acc(a)) * pow(_X2, -1, 1 << 64) & _M64
        if b < (1 << 61) - 2:
            out.append((a, b))
        a += 1
    return out


def _ext(code: int, value) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(value, use_bin_type=True))


def test_objects_crafted_for_quadratic_hashing_are_refused():
    keys = _colliding_pairs(3000)
    assert len({hash(k) for k in keys}) == 1 and len(set(keys)) == 3000
    packer = msgpack.Packer(use_bin_type=True)
    as_dict = packer.pack_map_pairs([(_ext(2, list(k)), 0) for k in keys])        # tuple keys
    with pytest.raises(CorruptCheckpointError, match=r"object 'sched'.*share one hash value"):
        decode_object(as_dict, where="sched")
    as_set = msgpack.packb(_ext(5, [_ext(2, list(k)) for k in keys]), use_bin_type=True)
    with pytest.raises(CorruptCheckpointError, match="share one hash value"):
        decode_object(as_set, where="sched")
    # complex numbers hash as hash(x) + 1000003 * hash(y): numpy complex scalars as dict keys
    scalars = [_ext(6, ["<c16", np.complex128(complex(1e9 - 1000003 * k, k)).tobytes()]) for k in range(3000)]
    with pytest.raises(CorruptCheckpointError, match="share one hash value"):
        decode_object(packer.pack_map_pairs([(s, 0) for s in scalars]), where="sched")
    # real values that share a hash now and then still decode
    fine = {(-1,): "a", (-2,): "b", **{(i, "x"): i for i in range(4 * MAX_SAME_HASH)}, np.complex64(1j): 2}
    assert decode_object(encode_object(fine)) == fine
    tuples = {(i, -1) for i in range(200)} | {(-1,), (-2,)}
    assert decode_object(encode_object(tuples)) == tuples
