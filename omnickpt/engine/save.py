"""Save pipeline: snapshot (the only part training waits for) and persist (write, checksum,
fsync), then the coordinator's commit: the manifest, written last and atomically."""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:   # the engine takes the adapters' records but never imports the adapters layer
    from omnickpt.adapters.base import TensorShard
from omnickpt.format import (CHUNK_BYTES, CONTROL_DIR, ColumnTable, DATA_DIR, FORMAT_VERSION, FileEntry, Manifest, ObjectEntry, Sums, TensorEntry,
                             checksum, dtype_from_name)
from omnickpt.format.codec import encode_chunk
from omnickpt.engine.incremental import Base, WriteMeta, block_hashes, plan_pieces, rows_per_block
from omnickpt.lease import OWNER_RECORD
from omnickpt.steps import REFS_DIR, references_here
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import GlobalPlan, WriteItem
from omnickpt.planner.save_plan import ALIGN
from omnickpt.errors import PlanError
from omnickpt.engine.staging import checksums, copy_bytes, gc_paused, plain_bytes
from omnickpt.storage import Segment, Storage



def data_file_name(save_id: str, rank: int) -> str:
    return f"{DATA_DIR}/{save_id}-r{rank:05d}.bin"


def tensor_bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class RankResult:
    """What one rank reports to the coordinator after persisting."""
    rank: int
    file: str | None
    bytes: int
    checksums: list[list[int]]                  # per write item, in plan order: CRC32C per CHUNK_BYTES chunk
    objects: list[tuple[str, int, int, int, str]] = field(default_factory=list)  # key, off, n, crc, digest
    timings: dict = field(default_factory=dict)
    error: str | None = None
    error_class: str = "CheckpointError"       # so that every rank raises the class the failing rank did
    # A compressed save (codec set) lays its file out anew: each write's file offset and the stored
    # length of each of its chunks (checksums are then those of the stored bytes).
    codec: str | None = None
    offsets: list[int] | None = None
    stored: list[list[int]] | None = None
    # An incremental save (engine/incremental.py): per write its runs of rows as [first row, rows,
    # ref, offset] (ref -1: in this rank's file at offset; else at offset of refs[ref], a file of
    # an earlier checkpoint as [path, rank, bytes]) and its block hashes; checksums then hold the
    # CRCs of each run's bytes, run after run.
    # With quantize_optimizer=: [write index, scheme, largest error] of each write whose chunks
    # are quantized (a list: the record travels as JSON).
    quantized: list[list] | None = None
    pieces: list[list[list[int]]] | None = None
    refs: list[list] | None = None
    hashes: list[list[int]] | None = None


@dataclass
class Snapshot:
    """A rank's data ready to persist: segments of its file and the spans to checksum.

    A lazy snapshot still has copies to make (`finish()`, in the background job, before the
    persist), and one over the staging budget writes some tensors from their own memory; until
    both are done whatever would change those tensors waits: `release` (set by the caller) is
    called once, by `settle()`, with the error if the copy failed."""
    file_bytes: int
    segments: list[Segment]
    spans: list[memoryview]                     # one per write item
    objects: list[tuple[str, int, int, memoryview]]  # key, offset, nbytes, bytes
    staging: torch.Tensor | None = None
    cuda_event: object = None
    deferred: Callable[[], None] | None = None  # the lazy copies into staging
    references: bool = False                    # some tensors are written from their own memory
    release: Callable[[BaseException | None], None] | None = None
    blocking: bool = False                      # save() waits for `release` (its stall ends there)
    _finishing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _copy_error: BaseException | None = None

    def finish(self, timer: PhaseTimer) -> None:
        """Background, before persisting: make the deferred copies (once: a second caller waits for
        the first and sees its error); training may step again once they are done, unless tensors
        are still to be written from their own memory."""
        with self._finishing:
            deferred, self.deferred = self.deferred, None
            if deferred is not None:
                try:
                    with timer.phase("snapshot_lazy"):
                        deferred()
                except BaseException as e:
                    self._copy_error = e
                    self.settle(e)
                    raise
            if self._copy_error is not None:
                raise self._copy_error
            if not self.references:
                self.settle()

    def settle(self, error: BaseException | None = None) -> None:
        """Let training change the saved tensors again (once; after the write at the latest)."""
        release, self.release = self.release, None
        if release is not None:
            release(error)


@dataclass
class StageLayout:
    """Where each write's bytes come from during the persist (a pure plan, `stage_layout`).

    `at[i]`: write i's offset in the staging buffer, or None where it is written from the tensor's
    own memory (over the staging budget). `later`: the writes copied in the background (lazy)
    rather than before save() returns. Without a budget, or within it, staging is laid out exactly
    like the file (`compact` False: one sequential write of the whole buffer)."""
    size: int
    file_bytes: int
    at: list[int | None]
    later: list[int]
    compact: bool
    blocking: bool      # a tensor training may change at any time is written from its own memory

    @property
    def references(self) -> bool:
        return any(a is None for a in self.at)


def stage_layout(shards: list[TensorShard], writes: list[WriteItem], tensor_region: int, blobs: dict[str, bytes],
                 *, stable: set[int] | frozenset = frozenset(), room: int | None = None) -> StageLayout:
    """Plan an async snapshot. `stable`: storages (data_ptr) only an optimizer step changes
    (omnickpt.fence.step_stable_storages): their writes are copied later, in the background.
    `room`: the most staging bytes to use (the budget). Over it, staging holds first what must be
    copied (tensors that are not plain host memory), then what training changes at any time
    (buffers, user tensors), then step-stable tensors; the rest is written from the tensors' own
    memory (objects are immutable bytes: always referenced then) while the fence holds."""
    file_bytes = _layout_objects(blobs, tensor_region)[1]

    def is_stable(w: WriteItem) -> bool:
        return bool(stable) and _storage_of(shards[w.index].local) in stable
    if room is None or file_bytes <= room:
        later = [i for i, w in enumerate(writes) if is_stable(w)]
        return StageLayout(file_bytes, file_bytes, [w.offset for w in writes], later, False, False)
    movable = [plain_bytes(shards[w.index].local) and shards[w.index].local.numel()
               * shards[w.index].local.element_size() == w.nbytes for w in writes]
    order = sorted(range(len(writes)), key=lambda i: (movable[i], is_stable(writes[i])))
    at: list[int | None] = [None] * len(writes)
    pos = 0
    for i in order:
        n = writes[i].nbytes
        if pos + n <= room:
            at[i] = pos
            pos = (pos + n + ALIGN - 1) // ALIGN * ALIGN
        elif not movable[i]:
            raise PlanError(f"tensor {shards[writes[i].index].name!r} ({n} bytes, on a GPU or not contiguous) "
                            f"does not fit in the staging budget ({room} bytes usable, {pos} taken by what must "
                            "be copied first); raise Checkpointer(staging_budget=...)")
    later = [i for i in range(len(writes)) if at[i] is not None and is_stable(writes[i])]
    blocking = any(at[i] is None and not is_stable(writes[i]) for i in range(len(writes)))
    return StageLayout(max(pos, 1), file_bytes, at, later, True, blocking)


def _storage_of(t: torch.Tensor) -> int:
    to_local = getattr(t, "to_local", None)
    t = to_local() if callable(to_local) else t
    return t.untyped_storage().data_ptr()


def _layout_objects(blobs: dict[str, bytes], start: int) -> tuple[list[tuple[str, int, bytes]], int]:
    out, off = [], start
    for key, blob in blobs.items():
        out.append((key, off, blob))
        off = (off + len(blob) + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def snapshot(shards: list[TensorShard], writes: list[WriteItem], tensor_region: int, blobs: dict[str, bytes],
             staging: torch.Tensor | None, timer: PhaseTimer, *, cuda: bool = False,
             pack: Callable[[int], torch.Tensor] | None = None, layout: StageLayout | None = None) -> Snapshot:
    """With `staging`, copy into it (async save: training may go on right after) as `layout` says
    (stage_layout; default: everything now, laid out like the file); the writes it copies later
    are left to `Snapshot.finish()`. Without staging, reference the tensors' own memory (sync
    save: nothing changes until we return), except small tensors, which are packed into one buffer
    so the file is written in large pieces: `pack(nbytes)` gives that buffer (held as
    Snapshot.staging; fresh memory when None)."""
    placed, total = _layout_objects(blobs, tensor_region)
    with timer.phase("snapshot"):
        if staging is not None:
            if layout is None:
                layout = StageLayout(total, total, [w.offset for w in writes], [], False, False)
            later = set(layout.later)
            now = [i for i in range(len(writes)) if layout.at[i] is not None and i not in later]
            _copy_on_stream(staging, shards, writes, layout.at, now, cuda)
            event = torch.cuda.Event() if cuda else None
            if event is not None:
                event.record()   # the copies of now (the training stream waits for them already)
            whole = tensor_bytes_view(staging)
            spans: list[memoryview] = []
            if not layout.compact:
                for key, off, blob in placed:
                    whole[off:off + len(blob)] = blob   # one copy, straight into staging
                segments = [Segment(0, whole[:total])]
                spans = [whole[w.offset:w.offset + w.nbytes] for w in writes]
                objs = [(k, off, len(b), whole[off:off + len(b)]) for k, off, b in placed]
            else:
                segments, objs = [], []
                for w, a in zip(writes, layout.at):
                    mv = whole[a:a + w.nbytes] if a is not None else tensor_bytes_view(shards[w.index].local.detach())
                    spans.append(mv)
                    if w.nbytes:
                        segments.append(Segment(w.offset, mv))
                for key, off, blob in placed:
                    mv = memoryview(blob)
                    segments.append(Segment(off, mv))
                    objs.append((key, off, len(blob), mv))
            snap = Snapshot(total, segments, spans, objs, staging, event, references=layout.references)
            if later:
                start = torch.cuda.Event() if cuda else None
                if start is not None:
                    start.record()   # the values of the save call: what the training stream queued so far

                def deferred() -> None:
                    snap.cuda_event = _copy_on_stream(staging, shards, writes, layout.at, sorted(later), cuda,
                                                      after=start, wait_host=True)
                snap.deferred = deferred
            return snap
        segments, spans, packed = _reference(shards, writes, pack)
        objs = []
        for key, off, blob in placed:
            mv = memoryview(blob)
            segments.append(Segment(off, mv))
            objs.append((key, off, len(blob), mv))
        return Snapshot(total, segments, spans, objs, packed)


def _copy_on_stream(buf: torch.Tensor, shards: list[TensorShard], writes: list[WriteItem], at: list[int | None],
                    which: list[int], cuda: bool, *, after=None, wait_host: bool = False):
    """Copy writes `which` into `buf` at their staging offsets. On a GPU the copies run on a side
    stream: called from the training thread (after=None), the training stream then waits for them
    on the GPU, not the host; from the background (`after`: an event of the training stream at the
    save call) the host waits for them (`wait_host`), so that the fence opens only once they are
    done. Returns the copies' CUDA event (None on the CPU)."""
    stream = None
    if cuda:
        stream = torch.cuda.Stream()
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream())
    ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
    with ctx, torch.no_grad():
        _copy_into(buf, shards, [(writes[i], at[i]) for i in which])
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    if wait_host:
        event.synchronize()
    else:
        # Training kernels queued after this point wait for the copy on the GPU, not on the host.
        torch.cuda.current_stream().wait_stream(stream)
    return event


# A sync save packs tensors smaller than this into one buffer: a segment (and a write task) per
# small tensor costs far more than copying its bytes once.
PACK_BELOW = 256 << 10


def _copy_into(buf: torch.Tensor, shards: list[TensorShard], placed: list[tuple[WriteItem, int]]) -> None:
    """Copy each write's source to its staging offset in `buf`: raw bytes (one memmove) where the
    source is plain host memory of exactly the planned size, a torch copy otherwise (GPU sources
    run on the caller's stream, non-blocking)."""
    base, size = buf.data_ptr(), buf.numel()
    for w, at in placed:
        src = shards[w.index].local
        if (plain_bytes(src) and src.numel() * src.element_size() == w.nbytes
                and 0 <= at and at + w.nbytes <= size):
            if w.nbytes:
                copy_bytes(base + at, src.data_ptr(), w.nbytes)
            continue
        dst = buf[at:at + w.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src, non_blocking=src.is_cuda)


def _reference(shards: list[TensorShard], writes: list[WriteItem], pack: Callable[[int], torch.Tensor] | None
               ) -> tuple[list[Segment], list[memoryview], torch.Tensor | None]:
    """(segments of the file, one span per write, the packing buffer) for a sync save: large
    tensors are referenced where they lie; runs of small ones (in file order) are copied into one
    buffer, each run a segment whose alignment gaps are zeroed (as when written one by one)."""
    spans: list[memoryview | None] = [None] * len(writes)
    segments: list[Segment] = []
    small: list[int] = []
    for i, w in enumerate(writes):
        src = shards[w.index].local
        if w.nbytes < PACK_BELOW and plain_bytes(src) and src.numel() * src.element_size() == w.nbytes:
            small.append(i)
            continue
        src = src.detach()
        if src.is_cuda or not src.is_contiguous():
            src = src.cpu().contiguous()
        mv = tensor_bytes_view(src)
        segments.append(Segment(w.offset, mv))
        spans[i] = mv
    if small:
        small.sort(key=lambda i: writes[i].offset)
        runs: list[list[int]] = [[small[0]]]
        for i in small[1:]:
            prev = writes[runs[-1][-1]]
            # One run while only alignment padding separates them (a large tensor between two
            # small ones ends the run: it is written from its own memory).
            if writes[i].offset - (prev.offset + prev.nbytes) < ALIGN:
                runs[-1].append(i)
            else:
                runs.append([i])
        extent = [(writes[r[0]].offset, writes[r[-1]].offset + writes[r[-1]].nbytes) for r in runs]
        size = sum(b - a for a, b in extent)
        # A reused buffer's pages are faulted in already: fresh memory costs a page fault per 4 KiB.
        scratch = pack(size) if pack is not None else torch.empty(max(1, size), dtype=torch.uint8)
        whole, base, pos = tensor_bytes_view(scratch), scratch.data_ptr(), 0
        for run, (a, b) in zip(runs, extent):
            end = a   # file offset up to which the run's bytes are filled
            for i in run:
                w = writes[i]
                if w.offset > end:
                    whole[pos + end - a:pos + w.offset - a] = bytes(w.offset - end)
                if w.nbytes:
                    copy_bytes(base + pos + w.offset - a, shards[w.index].local.data_ptr(), w.nbytes)
                spans[i] = whole[pos + w.offset - a:pos + w.offset - a + w.nbytes]
                end = w.offset + w.nbytes
            segments.append(Segment(a, whole[pos:pos + b - a]))
            pos += b - a
        return segments, spans, scratch
    return segments, spans, None


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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
    tasks = [(span[i:i + CHUNK_BYTES], codec, size, dtype) for span, codec, size, dtype
             in zip(snap.spans, codecs, itemsizes, dtypes) for i in range(0, len(span), CHUNK_BYTES)]
    if executor is None or len(tasks) <= 1:
        flat = [encode_chunk(*t) for t in tasks]
    else:
        flat = list(executor.map(lambda t: encode_chunk(*t), tasks))
    per_write, errors, pos = [], [], 0
    for span in snap.spans:
        n = Sums.chunk_count(len(span), CHUNK_BYTES)
        per_write.append([c for c, _ in flat[pos:pos + n]])
        errors.append(max((e for _, e in flat[pos:pos + n]), default=0.0))
        pos += n
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
    buf = np.zeros(max(1, pos), dtype=np.uint8)
    whole = memoryview(buf)
    chunks = []
    for w, pieces in enumerate(per_write):
        at, views = offsets[w], []
        for c in pieces:
            whole[at:at + len(c)] = c
            views.append(whole[at:at + len(c)])
            at += len(c)
        chunks.append(views)
    objects = [(key, off, n, _put(whole, off, mv)) for key, off, n, mv in objects]
    return pos, [Segment(0, whole[:pos])], offsets, chunks, objects, errors


def _put(whole: memoryview, off: int, data: memoryview) -> memoryview:
    whole[off:off + len(data)] = data
    return whole[off:off + len(data)]


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


@gc_paused()
def persist(storage: Storage, snap: Snapshot, rank: int, save_id: str, executor: Executor | None, *,
            durable: bool, timer: PhaseTimer, encoding: Encoding = Encoding(),
            incremental: Incremental | None = None) -> RankResult:
    """Write this rank's data file and checksum what it wrote. With `encoding.compression`, each
    CHUNK_BYTES chunk of each write is compressed on its own and the file laid out anew
    (RankResult.offsets, .stored); the checksums are those of the stored bytes. With
    `incremental`, only the blocks that changed since its base are written (RankResult.pieces)."""
    compression, itemsizes, codecs, dtypes = encoding.compression, encoding.itemsizes, encoding.codecs, encoding.dtypes
    if snap.cuda_event is not None:
        snap.cuda_event.synchronize()
    if incremental is not None:
        return _persist_incremental(storage, snap, rank, save_id, executor, durable, timer, incremental)
    if compression is not None:
        per_write = [c or compression for c in codecs] if codecs else [compression] * len(snap.spans)
        with timer.phase("compress"):
            file_bytes, segments, offsets, chunks, objects, errors = _compressed_layout(
                snap, per_write, itemsizes, dtypes or [""] * len(snap.spans), executor)
        rel = data_file_name(save_id, rank) if snap.file_bytes else None
        with timer.phase("checksum"):
            flat = checksums([c for cs in chunks for c in cs], executor)
            sums, pos = [], 0
            for cs in chunks:
                sums.append(flat[pos:pos + len(cs)])
                pos += len(cs)
            objs = [(k, off, n, checksum(mv), hashlib.blake2b(mv, digest_size=16).hexdigest())
                    for k, off, n, mv in objects]
        if rel is not None:
            _write(storage, rel, file_bytes, segments, executor, durable, timer)
        return RankResult(rank, rel, file_bytes if rel is not None else 0, sums, objs, codec=compression,
                          offsets=offsets, stored=[[len(c) for c in cs] for cs in chunks],
                          quantized=[[i, c, errors[i]] for i, c in enumerate(codecs)
                                     if c is not None and c != compression])
    rel = data_file_name(save_id, rank) if snap.file_bytes else None
    with timer.phase("checksum"):
        # One CRC per chunk so that a partial (resharded) read can verify what it reads; the
        # chunks of all items are one flat list of tasks, so large boxes spread over the threads.
        pieces = [span[i:i + CHUNK_BYTES] for span in snap.spans for i in range(0, len(span), CHUNK_BYTES)]
        flat = checksums(pieces, executor)
        sums, pos = [], 0
        for span in snap.spans:
            n = Sums.chunk_count(len(span), CHUNK_BYTES)
            sums.append(flat[pos:pos + n])
            pos += n
        objs = [(k, off, n, checksum(mv), hashlib.blake2b(mv, digest_size=16).hexdigest())
                for k, off, n, mv in snap.objects]
    if rel is not None:
        _write(storage, rel, snap.file_bytes, snap.segments, executor, durable, timer)
    return RankResult(rank, rel, snap.file_bytes, sums, objs)


_GATHER_RUNS = 64   # written runs of an incremental save above which they are gathered into one buffer


def _persist_incremental(storage: Storage, snap: Snapshot, rank: int, save_id: str, executor: Executor | None,
                         durable: bool, timer: PhaseTimer, inc: Incremental) -> RankResult:
    """Hash each write's blocks, keep the runs that changed since the base in this rank's file (laid
    out anew: runs back to back, 64-byte aligned, then the objects), reference the others."""
    if len(inc.metas) != len(snap.spans):
        raise ValueError(f"an incremental save needs one box per write ({len(snap.spans)}), got {len(inc.metas)}")
    with timer.phase("hash"):
        tasks = list(zip(snap.spans, inc.metas))
        hashes = (list(executor.map(lambda t: block_hashes(t[0], t[1].lengths, t[1].itemsize, inc.block_bytes),
                                    tasks)) if executor is not None and len(tasks) > 1 else
                  [block_hashes(sp, m.lengths, m.itemsize, inc.block_bytes) for sp, m in tasks])
        runs = [plan_pieces(m, h, inc.base, inc.block_bytes) for m, h in zip(inc.metas, hashes)]
        # The base files this rank would reference must still be there (after the reference records
        # the coordinator holds on their folders, so nothing removes them once checked).
        if inc.base is not None and inc.base.drop_unreadable({r[2] for rs in runs for r in rs if r[2] is not None}):
            runs = [plan_pieces(m, h, inc.base, inc.block_bytes) for m, h in zip(inc.metas, hashes)]
    segments, pieces, views, refs, pos = [], [], [], {}, 0
    referenced = 0
    for span, meta, write_runs in zip(snap.spans, inc.metas, runs):
        rows_total = meta.lengths[0] if meta.lengths else 1
        row_bytes = len(span) // rows_total if rows_total else 0
        mine = []
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
        pieces.append(mine)
    if len(segments) > _GATHER_RUNS:
        # Scattered changes make many small runs: one write of them gathered beats a syscall each.
        whole = memoryview(np.zeros(pos, dtype=np.uint8))
        for at, data in segments:
            whole[at:at + len(data)] = data
        segments = [Segment(0, whole)]
    objects = []
    for key, _, n, mv in snap.objects:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        segments.append(Segment(pos, mv))
        objects.append((key, pos, n, mv))
        pos += n
    rel = data_file_name(save_id, rank) if pos else None
    with timer.phase("checksum"):
        # The CRCs of referenced runs too, of this save's bytes: see engine/incremental.py.
        chunks = [v[i:i + CHUNK_BYTES] for v in views for i in range(0, len(v), CHUNK_BYTES)]
        flat = checksums(chunks, executor)
        sums, at, v = [], 0, 0
        for mine in pieces:
            n = sum(Sums.chunk_count(len(views[v + k]), CHUNK_BYTES) for k in range(len(mine)))
            v += len(mine)
            sums.append(flat[at:at + n])
            at += n
        objs = [(k, off, n, checksum(mv), hashlib.blake2b(mv, digest_size=16).hexdigest()) for k, off, n, mv in objects]
    if rel is not None:
        _write(storage, rel, pos, segments, executor, durable, timer)
    timer.count("referenced", referenced)
    base = inc.base
    ref_files = [[base.file_path(i), base.manifest.files[i].rank, base.manifest.files[i].bytes]
                 for i, _ in sorted(refs.items(), key=lambda kv: kv[1])] if base is not None else []
    return RankResult(rank, rel, pos if rel is not None else 0, sums, objs, pieces=pieces, refs=ref_files,
                      hashes=[h.tolist() for h in hashes])


def _write(storage: Storage, rel: str, file_bytes: int, segments: list[Segment], executor: Executor | None,
           durable: bool, timer: PhaseTimer) -> None:
    t0 = time.perf_counter()
    phases = storage.write_file(rel, file_bytes, segments, executor, durable=durable) or {}
    elapsed = time.perf_counter() - t0
    timer.add("write", elapsed - sum(phases.values()), start=t0)
    at = t0 + elapsed - sum(phases.values())
    for name, secs in phases.items():   # sub-phases (fsync) end the write
        timer.add(name, secs, start=at)
        at += secs
    timer.count("written", file_bytes)


def build_manifest(plan: GlobalPlan, results: list[RankResult], *, save_id: str, layout: dict,
                   tool_version: str, incremental: dict | None = None) -> Manifest:
    """The manifest of a save from the plan and every rank's result. `incremental`: the header
    fields of an incremental save ({"block_bytes", "base", "chain"}); its results carry pieces."""
    files: list[FileEntry] = []
    file_index: dict[int, int] = {}
    for r in results:
        if r.file is not None:
            file_index[r.rank] = len(files)
            files.append(FileEntry(r.file, r.rank, r.bytes))
    codecs = {r.codec for r in results if r.file is not None}
    if len(codecs) > 1:
        raise RuntimeError(f"ranks saved with different compression: {sorted(map(str, codecs))}")
    codec = codecs.pop() if codecs else None
    if incremental is not None:
        boxes = _piece_boxes(plan, results, file_index, files, incremental["block_bytes"])
    else:
        boxes = _write_boxes(plan, results, file_index, codec)
    tid, offs, lens, file, file_offset, nbytes, n_crcs, crcs, stored, n_hash, hashes = boxes
    keep = nbytes > 0   # a tensor with no elements: its entry (shape, dtype) is the whole record
    if (n_crcs[keep] != -(-nbytes[keep] // CHUNK_BYTES)).any() or n_crcs[~keep].any():
        raise RuntimeError("a rank reported a checksum count that does not match its writes' chunk grid")
    crc0 = np.concatenate(([0], np.cumsum(n_crcs)))[:-1]
    h0 = np.concatenate(([0], np.cumsum(n_hash)))[:-1]
    sel = np.nonzero(keep)[0]
    order = sel[np.lexsort(tuple(offs[sel, d] for d in range(offs.shape[1] - 1, -1, -1)) + (tid[sel],))]
    crc_rows = _regroup(crc0[order], n_crcs[order])
    tid = tid[order]
    table = ColumnTable(offsets=offs[order].astype(np.int64), lengths=lens[order].astype(np.int64),
                        file=file[order], offset=file_offset[order], nbytes=nbytes[order],
                        sums_start=np.concatenate(([0], np.cumsum(n_crcs[order]))), crcs=crcs[crc_rows],
                        chunk_bytes=CHUNK_BYTES, stored=None if stored is None else stored[crc_rows], codec=codec)
    bounds = np.searchsorted(tid, np.arange(len(plan.names) + 1))
    # Every tensor any rank holds gets an entry, even if all its boxes are empty.
    quantized = _quantized_tensors(plan, results)
    tensors: dict[str, TensorEntry] = {
        name: table.entry(plan.shapes[t], plan.dtypes[t], int(bounds[t]), int(bounds[t + 1]),
                          quantized.get(name, {}).get("scheme"))
        for t, name in enumerate(plan.names)}
    block_hashes = {}
    if incremental is not None:
        h_sorted = hashes[_regroup(h0[order], n_hash[order])]
        hb = np.concatenate(([0], np.cumsum(n_hash[order])))
        block_hashes = {name: h_sorted[hb[bounds[t]]:hb[bounds[t + 1]]] for t, name in enumerate(plan.names)}
    objects: dict[str, list[ObjectEntry]] = {}
    by_content: dict[tuple[str, str], ObjectEntry] = {}
    for r in results:
        for key, off, n, ck, digest in r.objects:
            seen = by_content.get((key, digest))
            if seen is not None:
                seen.ranks.append(r.rank)
                continue
            e = ObjectEntry([r.rank], file_index[r.rank], off, n, ck)
            by_content[(key, digest)] = e
            objects.setdefault(key, []).append(e)
    inc = incremental or {}
    return Manifest(save_id=save_id, world_size=len(results), files=files, tensors=tensors, objects=objects,
                    layout=layout, tool_version=tool_version, created=time.time(), version=FORMAT_VERSION,
                    chunk_bytes=CHUNK_BYTES, compression=codec, block_bytes=inc.get("block_bytes"),
                    hashes=block_hashes, base=inc.get("base"), chain=inc.get("chain", 0), quantized=quantized)


def _quantized_tensors(plan: GlobalPlan, results: list[RankResult]) -> dict[str, dict]:
    """Per quantized tensor: its scheme and the largest error any rank's chunks of it made. Every
    box of a tensor must be stored alike (the manifest holds one codec per tensor)."""
    out: dict[str, dict] = {}
    of_tensor: dict[int, set] = {}
    for r in results:
        a = int(plan.write_start[r.rank])
        marked = {int(i): (c, float(e)) for i, c, e in r.quantized or ()}
        for j in range(int(plan.write_start[r.rank + 1]) - a):
            t = int(plan.write_tensor[a + j])
            scheme, error = marked.get(j, (None, 0.0))
            of_tensor.setdefault(t, set()).add(scheme)
            if scheme is not None:
                name = plan.names[t]
                seen = out.setdefault(name, {"scheme": scheme, "max_error": 0.0})
                seen["max_error"] = max(seen["max_error"], error)
    mixed = [plan.names[t] for t, schemes in of_tensor.items() if len(schemes) > 1]
    if mixed:
        raise RuntimeError(f"ranks stored boxes of {mixed[0]!r} with different codecs: {sorted(map(str, of_tensor[plan.names.index(mixed[0])]))}")
    return out


def _regroup(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Indices of the runs [starts[i], starts[i] + counts[i]) one after the other."""
    bounds = np.concatenate(([0], np.cumsum(counts)))
    return np.arange(int(bounds[-1]), dtype=np.int64) + np.repeat(starts - bounds[:-1], counts)


def _write_boxes(plan: GlobalPlan, results: list[RankResult], file_index: dict[int, int], codec: str | None):
    """One box per write of the plan, in result order, as columns (no object per box: at 8192
    ranks the plan holds millions of them)."""
    ranks = np.array([r.rank for r in results], dtype=np.int64)
    file_of = np.full(len(plan.write_start) - 1, -1, dtype=np.int64)
    file_of[[r.rank for r in results if r.file is not None]] = [file_index[r.rank] for r in results if r.file is not None]
    counts = []
    for r in results:
        a, b = int(plan.write_start[r.rank]), int(plan.write_start[r.rank + 1])
        if b - a != len(r.checksums):
            raise RuntimeError(f"rank {r.rank} reported {len(r.checksums)} checksums for {b - a} writes")
        counts.append(np.fromiter(map(len, r.checksums), dtype=np.int64, count=b - a))
    # Rows in result order (each rank's writes in plan order), as the checksums come.
    rows = np.concatenate([np.arange(plan.write_start[k], plan.write_start[k + 1]) for k in ranks.tolist()]
                          + [np.zeros(0, dtype=np.int64)])
    n_crcs = np.concatenate(counts + [np.zeros(0, dtype=np.int64)])
    crcs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(r.checksums) for r in results),
                       dtype=np.uint32, count=int(n_crcs.sum()))
    stored, file_offset = None, plan.write_offset[rows]
    if codec is not None:
        # A compressed file is laid out by its rank (chunks shrink), so offsets come from the results.
        stored = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(r.stored or ()) for r in results),
                             dtype=np.int64, count=int(n_crcs.sum()))
        file_offset = np.concatenate([np.asarray(r.offsets if r.offsets is not None else [], dtype=np.int64)
                                      for r in results] + [np.zeros(0, dtype=np.int64)])
        if len(file_offset) != len(rows):
            raise RuntimeError("a rank of a compressed save reported no file offset for some of its writes")
    rank_of = np.repeat(np.arange(len(plan.write_start) - 1), np.diff(plan.write_start))[rows]
    none = np.zeros(len(rows), dtype=np.int64)
    return (plan.write_tensor[rows], plan.write_offsets[rows], plan.write_lengths[rows], file_of[rank_of],
            np.asarray(file_offset, dtype=np.int64), plan.write_nbytes[rows].astype(np.int64), n_crcs, crcs, stored,
            none, np.zeros(0, dtype=np.uint64))


def _piece_boxes(plan: GlobalPlan, results: list[RankResult], file_index: dict[int, int], files: list[FileEntry],
                 block_bytes: int):
    """An incremental save's boxes: each write becomes its runs of rows (engine/incremental.py),
    stored in its rank's file or in a file of an earlier checkpoint (added to `files` once)."""
    ref_of: dict[str, int] = {}
    tid, offs, lens, file, offset, nbytes, n_crcs, n_hash = [], [], [], [], [], [], [], []
    crcs: list[int] = []
    hashes: list[int] = []
    for r in results:
        a, b = int(plan.write_start[r.rank]), int(plan.write_start[r.rank + 1])
        if r.pieces is None or len(r.pieces) != b - a or len(r.checksums) != b - a or len(r.hashes or ()) != b - a:
            raise RuntimeError(f"rank {r.rank} reported no runs, checksums or hashes for some of its {b - a} writes")
        refs = []
        for path, rank, size in r.refs or ():
            if path not in ref_of:
                ref_of[path] = len(files)
                files.append(FileEntry(path, int(rank), int(size)))
            refs.append(ref_of[path])
        own = file_index.get(r.rank, -1)
        ref_files = np.array(refs + [own], dtype=np.int64)   # ref -1 (this rank's file) picks `own`
        for j in range(b - a):
            row = a + j
            t = int(plan.write_tensor[row])
            nd = len(plan.shapes[t])
            o0, l0 = plan.write_offsets[row].astype(np.int64), plan.write_lengths[row].astype(np.int64)
            item = dtype_from_name(plan.dtypes[t]).itemsize
            row_bytes = (int(np.prod(l0[1:nd])) if nd else 1) * item
            rpb = rows_per_block(tuple(l0[:nd].tolist()), item, block_bytes)
            # The runs of one write as columns: no Python per run (a scattered update makes 10^4-10^5).
            p = np.asarray(r.pieces[j], dtype=np.int64).reshape(-1, 4)
            first, rows = p[:, 0], p[:, 1]
            o, ln = np.repeat(o0[None, :], len(p), axis=0), np.repeat(l0[None, :], len(p), axis=0)
            if nd:
                o[:, 0] += first
                ln[:, 0] = rows
            n = rows * row_bytes
            k = -(-n // CHUNK_BYTES)
            if int(k.sum()) != len(r.checksums[j]):
                raise RuntimeError(f"rank {r.rank} reported {len(r.checksums[j])} checksums for runs of "
                                   f"{int(k.sum())} chunks")
            # Runs start on the block grid and cover the write in order: their hashes, one after the
            # other, are the write's.
            h = np.where(n > 0, -(-rows // rpb), 0) if nd else np.where(n > 0, 1, 0)
            if int(h.sum()) != len(r.hashes[j]):
                raise RuntimeError(f"rank {r.rank} reported {len(r.hashes[j])} block hashes for runs of "
                                   f"{int(h.sum())} blocks")
            tid.append(np.full(len(p), t, dtype=np.int64))
            offs.append(o)
            lens.append(ln)
            file.append(ref_files[p[:, 2]])
            offset.append(p[:, 3])
            nbytes.append(n)
            n_crcs.append(k)
            crcs.extend(r.checksums[j])
            n_hash.append(h)
            hashes.extend(r.hashes[j])
    width = plan.write_offsets.shape[1] if plan.write_offsets.ndim == 2 else 0
    i64, none = np.int64, np.zeros(0, dtype=np.int64)
    cat = lambda parts: np.concatenate(parts + [none])   # noqa: E731
    return (cat(tid), np.concatenate(offs + [np.zeros((0, width), dtype=i64)]).astype(i64),
            np.concatenate(lens + [np.zeros((0, width), dtype=i64)]).astype(i64), cat(file), cat(offset),
            cat(nbytes), cat(n_crcs), np.array(crcs, dtype=np.uint32), None, cat(n_hash),
            np.array(hashes, dtype=np.uint64))


def collect_garbage(storage: Storage, manifest: Manifest) -> None:
    """After a commit: remove data and control files of earlier or interrupted saves here, but no
    data file that a committed checkpoint next to this one references (one that took this folder as
    its base), and none at all while a save in flight holds a reference record here (the rule of
    omnickpt/steps.py). The neighbours' manifests are read only when there is something to remove."""
    own = f"../{str(storage.root).rstrip('/').rpartition('/')[2]}/"
    # A reference to this very folder through its parent (written by an earlier version) is a file of its own.
    keep = {f.path[len(own):] if f.path.startswith(own) else f.path for f in manifest.files}
    old = [rel for rel in storage.list(DATA_DIR) if rel not in keep]
    used = references_here(storage) if old else set()
    for rel in old:
        if used is not None and rel not in used:
            storage.delete(rel)
    for name in storage.children(CONTROL_DIR):
        rel = f"{CONTROL_DIR}/{name}"
        # the lease is the job's; reference records are other saves' (steps.live_references expires them)
        if name != manifest.save_id and rel != OWNER_RECORD and rel != REFS_DIR:
            storage.delete_tree(rel)




def staging_size(tensor_region: int, blobs: dict[str, bytes]) -> int:
    """Bytes of staging memory a snapshot of this plan and these objects needs."""
    return _layout_objects(blobs, tensor_region)[1]
