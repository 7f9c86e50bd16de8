"""The writers of a rank's data file: plain, compressed and incremental. Each lays the file out
from a snapshot (`RankFile`: its segments, the bytes to checksum, its own RankResult fields);
persist (engine/persist.py) picks one and runs the tail they share: chunk, checksum, write.

A writer only decides where bytes go; it neither checksums nor writes, so a new way of storing
data is one function here and one line in persist."""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from omnickpt.engine.incremental import Base, WriteMeta, block_hashes, plan_pieces
from omnickpt.format import CHUNK_BYTES, Sums
from omnickpt.format.codec import encode_chunk
from omnickpt.monitor import PhaseTimer
from omnickpt.planner.save_plan import ALIGN
from omnickpt.storage import Segment

if TYPE_CHECKING:   # persist hands writers the snapshot; engine/save.py defines it
    from omnickpt.engine.save import Snapshot


@dataclass(frozen=True)
class Incremental:
    """An incremental save as one rank runs it: its writes' boxes, the base to compare against
    (None: a full save that stores block hashes, the first of a chain) and the block grid."""
    metas: list[WriteMeta]
    base: Base | None
    block_bytes: int


@dataclass(frozen=True)
class Encoding:
    """How persist encodes a rank's writes. `compression`: a codec of format/codec.py (None: the
    writes' bytes as they are); `itemsizes`: the element size of each write's tensor; `codecs`: per
    write a codec other than `compression` or None (quantize_optimizer=); `dtypes`: the writes'
    tensors' dtypes."""
    compression: str | None = None
    itemsizes: Sequence[int] = ()
    codecs: Sequence[str | None] = ()
    dtypes: Sequence[str] = ()


@dataclass
class RankFile:
    """A rank's data file as a writer lays it out, for the persist tail.

    `views`: the bytes to checksum, every write's in plan order, that the tail cuts into
    CHUNK_BYTES chunks (`chunked`: they are chunks already, a compressed file's stored chunks);
    `counts`: how many chunks each write has. `written`: whether there is a file to write at all.
    `fields`: the writer's own RankResult fields. `referenced`: bytes an incremental save left in
    its base's files (None for the other writers)."""
    file_bytes: int
    segments: list[Segment]
    views: list[memoryview]
    counts: list[int]
    objects: list[tuple[str, int, int, memoryview]]   # key, offset, nbytes, bytes
    written: bool
    chunked: bool = False
    fields: dict = field(default_factory=dict)
    referenced: int | None = None


# ---------------------------------------------------------------------- plain
def plain_file(snap: Snapshot) -> RankFile:
    """The file exactly as the plan and the snapshot laid it out."""
    counts = [Sums.chunk_count(len(span), CHUNK_BYTES) for span in snap.spans]
    return RankFile(snap.file_bytes, snap.segments, snap.spans, counts, snap.objects, bool(snap.file_bytes))


# ---------------------------------------------------------------------- compressed
def compressed_file(snap: Snapshot, encoding: Encoding, executor: Executor | None, timer: PhaseTimer) -> RankFile:
    """Each CHUNK_BYTES chunk of each write compressed on its own (write i with its codec of
    quantize_optimizer=, else `encoding.compression`) and the file laid out anew (RankResult
    .offsets, .stored); the checksums are then those of the stored bytes."""
    compression, codecs = encoding.compression, encoding.codecs
    per_write = [c or compression for c in codecs] if codecs else [compression] * len(snap.spans)
    with timer.phase("compress"):
        file_bytes, segments, offsets, chunks, objects, errors = _compressed_layout(
            snap, per_write, encoding.itemsizes, encoding.dtypes or [""] * len(snap.spans), executor)
    fields = {"codec": compression, "offsets": offsets, "stored": [[len(c) for c in cs] for cs in chunks],
              "quantized": [[i, c, errors[i]] for i, c in enumerate(codecs) if c is not None and c != compression]}
    return RankFile(file_bytes, segments, [c for cs in chunks for c in cs], [len(cs) for cs in chunks], objects,
                    bool(snap.file_bytes), chunked=True, fields=fields)


def _compressed_layout(snap: Snapshot, codecs: Sequence[str], itemsizes: Sequence[int], dtypes: Sequence[str],
                       executor: Executor | None) -> tuple[int, list[Segment], list[int], list[list[memoryview]], list,
                                                           list[float]]:
    """Encode every write's chunks on their own (write i with codecs[i]) and lay the file out anew:
    each write at a 64-byte aligned offset, its stored chunks back to back, then the objects (not
    encoded). Returns (file bytes, segments, per write its offset, per write its stored chunks
    (views of the file buffer), objects as (key, offset, nbytes, bytes), per write the largest
    error of a lossy codec)."""
    if not (len(itemsizes) == len(codecs) == len(dtypes) == len(snap.spans)):
        raise ValueError(f"compression needs one codec, element size and dtype per write ({len(snap.spans)})")
    per_write, errors = _encode_chunks(snap.spans, codecs, itemsizes, dtypes, executor)
    offsets, pos = [0] * len(snap.spans), 0
    # Writes keep their plan order in the file.
    for w in range(len(snap.spans)):
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        offsets[w] = pos
        pos += sum(len(c) for c in per_write[w])
    objects = []
    for key, _, n, mv in snap.objects:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        objects.append((key, pos, n, mv))
        pos += n
    whole = memoryview(np.zeros(max(1, pos), dtype=np.uint8))
    chunks = [_put_chunks(whole, offsets[w], pieces) for w, pieces in enumerate(per_write)]
    objects = [(key, off, n, _put(whole, off, mv)) for key, off, n, mv in objects]
    return pos, [Segment(0, whole[:pos])], offsets, chunks, objects, errors


def _encode_chunks(spans: list[memoryview], codecs: Sequence[str], itemsizes: Sequence[int], dtypes: Sequence[str],
                   executor: Executor | None) -> tuple[list[list[memoryview]], list[float]]:
    """Per write its stored chunks and the largest error of a lossy codec; every chunk of every
    write is one task, so large writes spread over the threads."""
    tasks = [(span[i:i + CHUNK_BYTES], codec, size, dtype) for span, codec, size, dtype
             in zip(spans, codecs, itemsizes, dtypes) for i in range(0, len(span), CHUNK_BYTES)]
    if executor is None or len(tasks) <= 1:
        flat = [encode_chunk(*t) for t in tasks]
    else:
        flat = list(executor.map(lambda t: encode_chunk(*t), tasks))
    per_write, errors, pos = [], [], 0
    for span in spans:
        n = Sums.chunk_count(len(span), CHUNK_BYTES)
        per_write.append([c for c, _ in flat[pos:pos + n]])
        errors.append(max((e for _, e in flat[pos:pos + n]), default=0.0))
        pos += n
    return per_write, errors


def _put_chunks(whole: memoryview, at: int, pieces: list[memoryview]) -> list[memoryview]:
    """Copy one write's stored chunks back to back from `at`; their views in the file buffer."""
    views = []
    for c in pieces:
        whole[at:at + len(c)] = c
        views.append(whole[at:at + len(c)])
        at += len(c)
    return views


def _put(whole: memoryview, off: int, data: memoryview) -> memoryview:
    whole[off:off + len(data)] = data
    return whole[off:off + len(data)]


# ---------------------------------------------------------------------- incremental
_GATHER_RUNS = 64   # written runs of an incremental save above which they are gathered into one buffer


def incremental_file(snap: Snapshot, inc: Incremental, executor: Executor | None, timer: PhaseTimer) -> RankFile:
    """Hash each write's blocks, keep the runs that changed since the base in this rank's file (laid
    out anew: runs back to back, 64-byte aligned, then the objects), reference the others
    (RankResult.pieces, .refs, .hashes). The checksums are those of every run, referenced ones
    too, of this save's bytes (see engine/incremental.py)."""
    if len(inc.metas) != len(snap.spans):
        raise ValueError(f"an incremental save needs one box per write ({len(snap.spans)}), got {len(inc.metas)}")
    with timer.phase("hash"):
        hashes, runs = _hash_and_compare(snap.spans, inc, executor)
    segments, pieces, views, counts, refs, pos, referenced = _lay_out_runs(snap.spans, inc.metas, runs)
    if len(segments) > _GATHER_RUNS:
        # Scattered changes make many small runs: one write of them gathered beats a syscall each.
        segments = [Segment(0, _gather(segments, pos))]
    objects = []
    for key, _, n, mv in snap.objects:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        segments.append(Segment(pos, mv))
        objects.append((key, pos, n, mv))
        pos += n
    base = inc.base
    ref_files = [[base.file_path(i), base.manifest.files[i].rank, base.manifest.files[i].bytes]
                 for i, _ in sorted(refs.items(), key=lambda kv: kv[1])] if base is not None else []
    fields = {"pieces": pieces, "refs": ref_files, "hashes": [h.tolist() for h in hashes]}
    return RankFile(pos, segments, views, counts, objects, bool(pos), fields=fields, referenced=referenced)


def _hash_and_compare(spans: list[memoryview], inc: Incremental, executor: Executor | None
                      ) -> tuple[list[np.ndarray], list[list]]:
    """Each write's block hashes and its runs of rows as plan_pieces gives them."""
    tasks = list(zip(spans, inc.metas))
    hashes = (list(executor.map(lambda t: block_hashes(t[0], t[1].lengths, t[1].itemsize, inc.block_bytes),
                                tasks)) if executor is not None and len(tasks) > 1 else
              [block_hashes(sp, m.lengths, m.itemsize, inc.block_bytes) for sp, m in tasks])
    runs = [plan_pieces(m, h, inc.base, inc.block_bytes) for m, h in zip(inc.metas, hashes)]
    # The base files this rank would reference must still be there (after the reference records
    # the coordinator holds on their folders, so nothing removes them once checked).
    if inc.base is not None and inc.base.drop_unreadable({r[2] for rs in runs for r in rs if r[2] is not None}):
        runs = [plan_pieces(m, h, inc.base, inc.block_bytes) for m, h in zip(inc.metas, hashes)]
    return hashes, runs


def _lay_out_runs(spans: list[memoryview], metas: list[WriteMeta], runs: list[list]):
    """Place the runs this rank writes back to back (64-byte aligned) and number the base files the
    others lie in. Returns (segments, per write its runs as [first row, rows, ref, offset], every
    run's view in order, per write the chunks of its runs, base file -> ref, file bytes so far,
    bytes referenced)."""
    segments, pieces, views, counts, refs, pos = [], [], [], [], {}, 0
    referenced = 0
    for span, meta, write_runs in zip(spans, metas, runs):
        rows_total = meta.lengths[0] if meta.lengths else 1
        row_bytes = len(span) // rows_total if rows_total else 0
        mine, n = [], 0
        for row, rows, ref, off in write_runs:
            view = span[row * row_bytes:(row + rows) * row_bytes]
            if ref is None:
                pos = (pos + ALIGN - 1) // ALIGN * ALIGN
                if len(view):
                    segments.append(Segment(pos, view))
                mine.append([row, rows, -1, pos])
                pos += len(view)
            else:
                mine.append([row, rows, refs.setdefault(ref, len(refs)), off])
                referenced += len(view)
            views.append(view)
            n += Sums.chunk_count(len(view), CHUNK_BYTES)
        pieces.append(mine)
        counts.append(n)
    return segments, pieces, views, counts, refs, pos, referenced


def _gather(segments: list[Segment], size: int) -> memoryview:
    whole = memoryview(np.zeros(size, dtype=np.uint8))
    for at, data in segments:
        whole[at:at + len(data)] = data
    return whole
