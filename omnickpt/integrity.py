"""Is a checkpoint complete, and are its bytes the bytes that were saved? `verify(path)`, importable as
`omnickpt.verify`; the command `omnickpt verify` prints its report (omnickpt/cli/verify.py).

Reads every data file once, sequentially, in large chunks, with several files (or parts of one
large file) checked in parallel threads: both the reads and CRC32C release the GIL. Nothing is
decoded, so verifying an untrusted checkpoint executes no code from it. Encoded chunks are not
decoded either, but their sizes are judged as a load judges them: verify reports a compressed
chunk whose zstd frame header declares a size other than the chunk's raw length (which a load
refuses before decompressing) and a quantized chunk of the wrong length.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from omnickpt.formats import read_manifest
from omnickpt.errors import CheckpointError
from omnickpt.format.objects import validate_object
from omnickpt.format import MANIFEST_NAME, Manifest, checksum, tiling_problem
from omnickpt.format.codec import CODECS, FRAME_HEADER_MAX, frame_problem, stored_problem
from omnickpt.storage import Storage, storage_for
from omnickpt.storage.linked import with_siblings

# One read request. Large enough to stream at disk speed, small enough that a few threads' buffers
# stay cheap.
CHUNK_BYTES = 16 << 20
# One task: a run of neighbouring spans of one file, at most this many bytes, so that one big file
# still spreads over the threads.
TASK_BYTES = 128 << 20
# Spans further apart than this start a new run: reading the gap would cost more than a new request.
MAX_GAP = 1 << 20


@dataclass(frozen=True)
class Span:
    """One checksummed byte range of a data file: a tensor box or an encoded object."""
    file: int
    offset: int
    nbytes: int
    checksum: int
    what: str       # "tensor 'model/weight' box offsets=[0, 0] lengths=[3, 4]" or "object 'rng'"
    frame: int = 0  # a zstd-compressed chunk's raw length, which its frame header must declare

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint; `where` is the file, `what` the tensor or object."""
    where: str
    what: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}: {self.message}" if self.what else f"{self.where}: {self.message}"


@dataclass
class VerifyReport:
    """What `verify` found: `problems` (empty when `ok`), `notes` on checks the format cannot support,
    and what was checked (counts, bytes read, seconds). `as_dict()` is the `verify --json` document."""
    path: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # checks this checkpoint's format cannot support
    files: int = 0
    tensors: int = 0
    boxes: int = 0
    objects: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "problems": [str(p) for p in self.problems], "notes": self.notes,
                "files": self.files, "tensors": self.tensors, "boxes": self.boxes, "objects": self.objects,
                "bytes_checked": self.bytes_checked, "seconds": self.seconds}


def spans_of(manifest: Manifest) -> list[Span]:
    """Every checksummed range the manifest references: each checksum chunk of each tensor box
    (the whole box in a version-1 checkpoint) and each object value."""
    spans = []
    for name, t in manifest.tensors.items():
        for b in t.boxes:
            if b.sums is None:   # a foreign format that stores no checksums (Hugging Face safetensors, DCP)
                continue
            what = f"tensor {name!r} box offsets={list(b.offsets)} lengths={list(b.lengths)}"
            grid = b.sums
            framed = grid.stored is not None and grid.codec in CODECS
            for i, crc in enumerate(grid.crcs):
                lo, hi = grid.file_chunk(i)   # a compressed chunk's CRC covers its stored bytes
                where = what if len(grid.crcs) == 1 else f"{what} bytes [{lo}, {hi})"
                raw = grid.chunk(i)[1] - grid.chunk(i)[0] if framed else 0
                spans.append(Span(b.file, lo, hi - lo, crc, where, raw if raw != hi - lo else 0))
    for key, entries in manifest.objects.items():
        for e in entries:
            if e.inline is None:
                spans.append(Span(e.file, e.offset, e.nbytes, e.checksum, f"object {key!r} (ranks {e.ranks})"))
    return spans


def verify(path: str, *, workers: int | None = None, chunk_bytes: int = CHUNK_BYTES,
           task_bytes: int = TASK_BYTES) -> VerifyReport:
    """Check the checkpoint at `path`: manifest, data files, every checksum.

    `workers` reader threads (default: 2 per core, at most 8) each check runs of up to
    `task_bytes`, reading `chunk_bytes` per request.

    Raises NotCommittedError when `path` holds no committed checkpoint, CorruptCheckpointError or
    UnsafeCheckpointError when its manifest cannot be trusted; everything else wrong is listed in
    the report's `problems`, one per file/tensor.
    """
    t0 = time.perf_counter()
    storage = storage_for(path)
    manifest = read_manifest(storage)
    storage = with_siblings(storage, path, manifest.files)   # an incremental checkpoint's referenced files
    report = VerifyReport(storage.describe(), files=len(manifest.files), tensors=len(manifest.tensors),
                          boxes=sum(len(t.boxes) for t in manifest.tensors.values()),
                          objects=sum(len(v) for v in manifest.objects.values()))
    report.notes += _notes(manifest)
    report.problems += _coverage_problems(manifest, storage)
    report.problems += _encoding_problems(manifest, storage)
    by_file: dict[int, list[Span]] = {}
    for s in spans_of(manifest):
        by_file.setdefault(s.file, []).append(s)
    tasks: list[tuple[str, list[Span]]] = []
    for fi, entry in enumerate(manifest.files):
        found, readable = _readable_spans(storage, entry, by_file.get(fi, []))
        report.problems += found
        tasks += [(entry.path, run) for run in _runs(readable, task_bytes)]
    for found, nbytes in _check_runs(storage, tasks, workers or min(8, 2 * (os.cpu_count() or 1)), chunk_bytes):
        report.problems += found
        report.bytes_checked += nbytes
    report.problems += _object_problems(manifest, storage, report.problems)
    report.seconds = time.perf_counter() - t0
    return report


def _notes(manifest: Manifest) -> list[str]:
    """What this checkpoint's format or options leave unchecked, or checked differently."""
    notes = []
    if manifest.version < 2:
        notes.append(
            f"format version {manifest.version}: one checksum per box, not per chunk, so a load that reads part of a "
            "box (any resharded load) must read the whole box to verify it; saving the state again writes "
            "version 2")
    notes += _encoding_notes(manifest)
    elsewhere = sorted({f.path.split("/")[1] for f in manifest.files if f.path.startswith("../")})
    if manifest.block_bytes:
        notes.append(f"incremental checkpoint (chain {manifest.chain}, base {manifest.base}): "
                     + (f"unchanged blocks are read from {', '.join(elsewhere)}" if elsewhere
                        else "every block is stored here"))
    unchecked = sum(b.sums is None for t in manifest.tensors.values() for b in t.boxes)
    if unchecked:
        notes.append(
            f"{unchecked} box(es) have no checksums (a {manifest.layout.get('format', 'foreign')} checkpoint: its "
            "format stores none): only the structure and the file sizes were checked, not the bytes")
    return notes


def _encoding_notes(manifest: Manifest) -> list[str]:
    """What the chunks really are: quantized (lossy) tensors by scheme, and lossless compression when there is
    any. Codec "none" is the chunked layout with every chunk stored raw (what a save with quantize_optimizer=
    and no compression writes): no compression to speak of."""
    notes = []
    quantized = manifest.quantized or {}
    if quantized:
        schemes = ", ".join(sorted({str(r.get("scheme")) for r in quantized.values()}))
        worst = max(float(r.get("max_error", 0.0)) for r in quantized.values())
        first = next(iter(quantized))
        # save(quantize_optimizer=) quantizes only an optimizer's moments, named "<key>/state/<param>/<moment>"
        what = "optimizer moment tensor(s)" if all("/state/" in n for n in quantized) else "tensor(s)"
        notes.append(f"{len(quantized)} {what} stored quantized ({schemes}; lossy, largest recorded error "
                     f"{worst:.3g}), e.g. {first!r}: each chunk's checksum covers its stored (quantized) bytes, "
                     "checked without dequantizing; the other tensors are stored "
                     + (f"compressed with {manifest.compression}" if manifest.compression not in (None, "none")
                        else "raw (no compression)"))
    elif manifest.compression and manifest.compression != "none":
        notes.append(f"tensor data compressed with {manifest.compression}: each chunk's checksum covers its "
                     "stored (compressed) bytes, checked without decompressing")
    return notes


def _readable_spans(storage: Storage, entry, spans: list[Span]) -> tuple[list[Problem], list[Span]]:
    """(problems, the spans there are bytes for, by offset) of one data file: missing, shorter than
    the manifest records, or ending before a span does."""
    where = storage.describe(entry.path)
    mine = sorted(spans, key=lambda s: (s.offset, s.nbytes))
    if not storage.exists(entry.path):
        names = sorted({s.what for s in mine})
        return [Problem(where, "", f"data file missing (written by rank {entry.rank}; it holds "
                                   f"{len(mine)} box(es)/object(s): {_first(names)})")], []
    size = storage.size(entry.path)
    problems = []
    if size < entry.bytes:
        problems.append(Problem(where, "", f"truncated: {size} bytes, the manifest records {entry.bytes}"))
    problems += [Problem(where, s.what, f"truncated: needs bytes [{s.offset}, {s.end}), the file has {size}")
                 for s in mine if s.end > size]
    return problems, [s for s in mine if s.end <= size]


def _check_runs(storage: Storage, tasks: list[tuple[str, list[Span]]], workers: int,
                chunk_bytes: int) -> list[tuple[list[Problem], int]]:
    """`_check_run` of every task, in `workers` threads when there is more than one task."""
    if len(tasks) <= 1 or workers <= 1:
        return [_check_run(storage, rel, run, chunk_bytes) for rel, run in tasks]
    with ThreadPoolExecutor(workers, thread_name_prefix="omnickpt-verify") as pool:
        return list(pool.map(lambda t: _check_run(storage, *t, chunk_bytes), tasks))


def _object_problems(manifest: Manifest, storage: Storage, found: list[Problem]) -> list[Problem]:
    """Decode every object whose bytes are intact, without unpickling anything: bytes that match
    their checksum but were not written by omnickpt (or by a newer one) would fail the load."""
    damaged = {p.what for p in found} | {p.where for p in found if not p.what}
    out = []
    for key, entries in manifest.objects.items():
        for e in entries:
            what = f"object {key!r} (ranks {e.ranks})"
            path = manifest.files[e.file].path if e.inline is None else MANIFEST_NAME
            if what in damaged or storage.describe(path) in damaged:
                continue
            try:
                if e.inline is not None:
                    validate_object(e.inline, where=key)
                    continue
                buf = bytearray(e.nbytes)
                storage.read_into(path, e.offset, [memoryview(buf)])
                validate_object(bytes(buf), where=key)
            except CheckpointError as err:
                out.append(Problem(storage.describe(path), what, str(err)))
    return out


def _first(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _coverage_problems(manifest: Manifest, storage: Storage) -> list[Problem]:
    # Every element held exactly once: a hole means some rank's part never made it into the
    # manifest (decoding already refused overlaps, which could hide a hole from the count).
    out = []
    where = storage.describe(MANIFEST_NAME)
    for name, t in manifest.tensors.items():
        problem = tiling_problem(t.shape, t.boxes)
        if problem:
            out.append(Problem(where, f"tensor {name!r}", problem))
    return out


def _encoding_problems(manifest: Manifest, storage: Storage) -> list[Problem]:
    """Encoded chunks whose stored length their codec cannot produce (a quantized chunk's payload
    has one exact size; a checkpoint of codec "none" stores every chunk raw): a load refuses them."""
    out = []
    for name, t in manifest.tensors.items():
        cols = t.columns
        if cols is not None and cols.stored is None:
            continue    # no chunk is encoded
        for b in t.boxes:
            grid = b.sums
            if grid is None or grid.stored is None:
                continue
            for i in range(len(grid.crcs)):
                lo, hi = grid.file_chunk(i)
                ra, rb = grid.chunk(i)
                problem = stored_problem(hi - lo, rb - ra, grid.codec, grid.itemsize)
                if problem:
                    out.append(Problem(storage.describe(manifest.files[b.file].path),
                                       f"tensor {name!r} box offsets={list(b.offsets)} lengths={list(b.lengths)} "
                                       f"bytes [{lo}, {hi})", f"{problem}; the checkpoint is damaged"))
    return out


def _runs(spans: list[Span], task_bytes: int) -> list[list[Span]]:
    """Split offset-sorted spans into runs read as one stretch: close together, bounded in size."""
    runs: list[list[Span]] = []
    cur: list[Span] = []
    lo = end = 0
    for s in spans:
        if cur and (s.offset - end > MAX_GAP or max(end, s.end) - lo > task_bytes):
            runs.append(cur)
            cur = []
        if not cur:
            lo, end = s.offset, s.end
        cur.append(s)
        end = max(end, s.end)
    if cur:
        runs.append(cur)
    return runs


def _check_run(storage: Storage, rel: str, spans: list[Span], chunk_bytes: int) -> tuple[list[Problem], int]:
    """Read [first offset, last end) of `rel` chunk by chunk, feeding each span its bytes."""
    lo, hi = spans[0].offset, max(s.end for s in spans)
    buf = memoryview(bytearray(max(1, min(chunk_bytes, hi - lo))))
    crcs = [0] * len(spans)
    heads = {i: bytearray() for i, s in enumerate(spans) if s.frame}   # the frame headers to judge
    first = 0            # spans before this one are complete
    pos = lo
    where = storage.describe(rel)
    while pos < hi:
        n = min(len(buf), hi - pos)
        try:
            storage.read_into(rel, pos, [buf[:n]])
        except CheckpointError as e:   # shrank or vanished since we looked at its size
            return (_mismatches(where, spans[:first], crcs, heads)
                    + [Problem(where, s.what, f"unreadable: {e}") for s in spans[first:]]), pos - lo
        i = first
        while i < len(spans) and spans[i].offset < pos + n:
            a, b = max(spans[i].offset, pos), min(spans[i].end, pos + n)
            if b > a:
                crcs[i] = checksum(buf[a - pos:b - pos], crcs[i])
                head = heads.get(i)
                if head is not None and len(head) < FRAME_HEADER_MAX:
                    head += buf[a - pos:min(b, spans[i].offset + FRAME_HEADER_MAX) - pos]
            i += 1
        while first < len(spans) and spans[first].end <= pos + n:
            first += 1
        pos += n
    return _mismatches(where, spans, crcs, heads), hi - lo


def _mismatches(where: str, spans: list[Span], crcs: list[int], heads: dict[int, bytearray]) -> list[Problem]:
    out = []
    for i, (s, c) in enumerate(zip(spans, crcs)):
        if c != s.checksum:
            out.append(Problem(where, s.what, f"checksum mismatch (manifest {s.checksum:#010x}, data {c:#010x}): "
                               "the data file is corrupt; restore it or use an earlier checkpoint"))
        elif s.frame:
            # Intact bytes that are not the frame the manifest describes: written so on purpose, or by
            # a broken writer. A load refuses the chunk before decompressing it; say so here too.
            problem = frame_problem(heads[i], s.frame)
            if problem:
                out.append(Problem(where, s.what, f"{problem}; the checkpoint is damaged: restore the data file "
                                   "or use an earlier checkpoint"))
    return out


__all__ = ["CHUNK_BYTES", "Problem", "Span", "VerifyReport", "spans_of", "verify"]
