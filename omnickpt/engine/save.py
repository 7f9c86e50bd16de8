"""Save pipeline: snapshot (the only part training waits for) and persist (write, checksum,
fsync), then the coordinator's commit: the manifest, written last and atomically."""
from __future__ import annotations

import hashlib
import itertools
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:   # the engine takes the adapters' records but never imports the adapters layer
    from omnickpt.adapters.base import TensorShard
from omnickpt.format import (CHUNK_BYTES, CONTROL_DIR, ColumnTable, DATA_DIR, FORMAT_VERSION, FileEntry, Manifest, ObjectEntry, Sums, TensorEntry,
                             checksum)
from omnickpt.lease import OWNER_RECORD
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import GlobalPlan, WriteItem
from omnickpt.planner.save_plan import ALIGN
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


@dataclass
class Snapshot:
    """A rank's data ready to persist: segments of its file and the spans to checksum."""
    file_bytes: int
    segments: list[Segment]
    spans: list[memoryview]                     # one per write item
    objects: list[tuple[str, int, int, memoryview]]  # key, offset, nbytes, bytes
    staging: torch.Tensor | None = None
    cuda_event: object = None


def _layout_objects(blobs: dict[str, bytes], start: int) -> tuple[list[tuple[str, int, bytes]], int]:
    out, off = [], start
    for key, blob in blobs.items():
        out.append((key, off, blob))
        off = (off + len(blob) + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def snapshot(shards: list[TensorShard], writes: list[WriteItem], tensor_region: int, blobs: dict[str, bytes],
             staging: torch.Tensor | None, timer: PhaseTimer, *, cuda: bool = False,
             pack: Callable[[int], torch.Tensor] | None = None) -> Snapshot:
    """With `staging`, copy everything into it (async save: training may go on right after);
    without, reference the tensors' own memory (sync save: nothing changes until we return),
    except small tensors, which are packed into one buffer so the file is written in large pieces:
    `pack(nbytes)` gives that buffer (held as Snapshot.staging; fresh memory when None)."""
    placed, total = _layout_objects(blobs, tensor_region)
    with timer.phase("snapshot"):
        if staging is not None:
            buf = staging[:total]
            event = None
            stream = None
            if cuda:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
            ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
            with ctx, torch.no_grad():
                _copy_into(buf, shards, writes)
            if stream is not None:
                # Training kernels queued after this point wait for the copy on the GPU, not on the host.
                event = torch.cuda.Event()
                event.record(stream)
                torch.cuda.current_stream().wait_stream(stream)
            whole = tensor_bytes_view(buf)
            for key, off, blob in placed:
                whole[off:off + len(blob)] = blob   # one copy, straight into staging
            spans = [whole[w.offset:w.offset + w.nbytes] for w in writes]
            objs = [(k, off, len(b), whole[off:off + len(b)]) for k, off, b in placed]
            return Snapshot(total, [Segment(0, whole)], spans, objs, staging, event)
        segments, spans, packed = _reference(shards, writes, pack)
        objs = []
        for key, off, blob in placed:
            mv = memoryview(blob)
            segments.append(Segment(off, mv))
            objs.append((key, off, len(blob), mv))
        return Snapshot(total, segments, spans, objs, packed)


# A sync save packs tensors smaller than this into one buffer: a segment (and a write task) per
# small tensor costs far more than copying its bytes once.
PACK_BELOW = 256 << 10


def _copy_into(buf: torch.Tensor, shards: list[TensorShard], writes: list[WriteItem]) -> None:
    """Copy each write's source to its offset in `buf`: raw bytes (one memmove) where the source
    is plain host memory of exactly the planned size, a torch copy otherwise (GPU sources run on
    the caller's stream, non-blocking)."""
    base, size = buf.data_ptr(), buf.numel()
    for w in writes:
        src = shards[w.index].local
        if (plain_bytes(src) and src.numel() * src.element_size() == w.nbytes
                and 0 <= w.offset and w.offset + w.nbytes <= size):
            if w.nbytes:
                copy_bytes(base + w.offset, src.data_ptr(), w.nbytes)
            continue
        dst = buf[w.offset:w.offset + w.nbytes].view(src.dtype).view(src.shape)
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


@gc_paused()
def persist(storage: Storage, snap: Snapshot, rank: int, save_id: str, executor: Executor | None, *,
            durable: bool, timer: PhaseTimer) -> RankResult:
    """Write this rank's data file and checksum what it wrote."""
    if snap.cuda_event is not None:
        snap.cuda_event.synchronize()
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
        t0 = time.perf_counter()
        phases = storage.write_file(rel, snap.file_bytes, snap.segments, executor, durable=durable) or {}
        elapsed = time.perf_counter() - t0
        timer.add("write", elapsed - sum(phases.values()), start=t0)
        at = t0 + elapsed - sum(phases.values())
        for name, secs in phases.items():   # sub-phases (fsync) end the write
            timer.add(name, secs, start=at)
            at += secs
        timer.count("written", snap.file_bytes)
    return RankResult(rank, rel, snap.file_bytes, sums, objs)


def build_manifest(plan: GlobalPlan, results: list[RankResult], *, save_id: str, layout: dict,
                   tool_version: str) -> Manifest:
    files: list[FileEntry] = []
    file_index: dict[int, int] = {}
    for r in results:
        if r.file is not None:
            file_index[r.rank] = len(files)
            files.append(FileEntry(r.file, r.rank, r.bytes))
    # The boxes go from the plan's write rows into shared columns, sorted by tensor then offsets,
    # with no object per box: at 8192 ranks the plan holds millions of them.
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
    nbytes = plan.write_nbytes[rows]
    keep = nbytes > 0   # a tensor with no elements: its entry (shape, dtype) is the whole record
    if (n_crcs[keep] != -(-nbytes[keep] // CHUNK_BYTES)).any() or n_crcs[~keep].any():
        raise RuntimeError("a rank reported a checksum count that does not match its writes' chunk grid")
    crc0 = np.concatenate(([0], np.cumsum(n_crcs)))[:-1]
    rows, crc0, n_crcs = rows[keep], crc0[keep], n_crcs[keep]
    tid = plan.write_tensor[rows]
    offs = plan.write_offsets[rows]
    order = np.lexsort(tuple(offs[:, d] for d in range(offs.shape[1] - 1, -1, -1)) + (tid,))
    rows, crc0, n_crcs, tid = rows[order], crc0[order], n_crcs[order], tid[order]
    sums_start = np.concatenate(([0], np.cumsum(n_crcs)))
    crc_rows = np.arange(int(sums_start[-1]), dtype=np.int64) + np.repeat(crc0 - sums_start[:-1], n_crcs)
    rank_of = np.repeat(np.arange(len(plan.write_start) - 1), np.diff(plan.write_start))[rows]
    table = ColumnTable(offsets=plan.write_offsets[rows].astype(np.int64),
                        lengths=plan.write_lengths[rows].astype(np.int64), file=file_of[rank_of],
                        offset=plan.write_offset[rows], nbytes=plan.write_nbytes[rows], sums_start=sums_start,
                        crcs=crcs[crc_rows], chunk_bytes=CHUNK_BYTES)
    bounds = np.searchsorted(tid, np.arange(len(plan.names) + 1))
    # Every tensor any rank holds gets an entry, even if all its boxes are empty.
    tensors: dict[str, TensorEntry] = {
        name: table.entry(plan.shapes[t], plan.dtypes[t], int(bounds[t]), int(bounds[t + 1]))
        for t, name in enumerate(plan.names)}
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
    return Manifest(save_id=save_id, world_size=len(results), files=files, tensors=tensors, objects=objects,
                    layout=layout, tool_version=tool_version, created=time.time(), version=FORMAT_VERSION,
                    chunk_bytes=CHUNK_BYTES)


def collect_garbage(storage: Storage, manifest: Manifest) -> None:
    """After a commit: remove data and control files of earlier or interrupted saves here."""
    keep = {f.path for f in manifest.files}
    for rel in storage.list(DATA_DIR):
        if rel not in keep:
            storage.delete(rel)
    for name in storage.children(CONTROL_DIR):
        if name != manifest.save_id and f"{CONTROL_DIR}/{name}" != OWNER_RECORD:   # the lease is the job's
            storage.delete_tree(f"{CONTROL_DIR}/{name}")




def staging_size(tensor_region: int, blobs: dict[str, bytes]) -> int:
    """Bytes of staging memory a snapshot of this plan and these objects needs."""
    return _layout_objects(blobs, tensor_region)[1]
