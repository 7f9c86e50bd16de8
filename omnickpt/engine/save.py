"""Save pipeline: snapshot (the only part training waits for) and persist (engine/persist.py:
a writer of engine/writers.py, then checksum, write, fsync), then the coordinator's commit: the
manifest (engine/manifest.py), written last and atomically, and the garbage collection after it.

This module holds the snapshot side; the names of the others are re-exported here, where the
save job (omnickpt/saving.py) and the memory tier import them."""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:   # the engine takes the adapters' records but never imports the adapters layer
    from omnickpt.adapters.base import TensorShard
from omnickpt.engine.manifest import build_manifest  # noqa: F401
from omnickpt.engine.persist import RankResult, data_file_name, persist  # noqa: F401
from omnickpt.engine.staging import copy_bytes, plain_bytes
from omnickpt.engine.writers import Encoding, Incremental  # noqa: F401
from omnickpt.errors import PlanError
from omnickpt.format import CONTROL_DIR, DATA_DIR, Manifest
from omnickpt.lease import OWNER_RECORD
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import WriteItem
from omnickpt.planner.save_plan import ALIGN
from omnickpt.steps import REFS_DIR, references_here
from omnickpt.storage import Segment, Storage


def tensor_bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class Snapshot:
    """A rank's data ready to persist: segments of its file and the spans to checksum.

    A lazy snapshot still has copies to make (`finish()`, in the background job, before the
    persist), and one over the staging budget writes some tensors from their own memory; until
    both are done whatever would change those tensors waits: `release` (set by the caller) is
    called once, by `settle()`, with the error if the copy failed."""
    file_bytes: int
    segments: list[Segment]
    # one per write item; or what makes them, called on first use (`spans`), off the stall path
    _spans: list[memoryview] | Callable[[], list[memoryview]]
    objects: list[tuple[str, int, int, memoryview]]  # key, offset, nbytes, bytes
    staging: torch.Tensor | None = None
    cuda_event: object = None
    deferred: Callable[[], None] | None = None  # the lazy copies into staging
    references: bool = False                    # some tensors are written from their own memory
    release: Callable[[BaseException | None], None] | None = None
    blocking: bool = False                      # save() waits for `release` (its stall ends there)
    _finishing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _copy_error: BaseException | None = None

    @property
    def spans(self) -> list[memoryview]:
        """The bytes of each write item, to checksum and write."""
        if callable(self._spans):
            self._spans = self._spans()
        return self._spans

    def cancel(self) -> None:
        """The save failed before its lazy copies ran (its persist never called finish()): none may
        run once its staging is given back, where a later save or load may already be writing. A
        copy under way is waited for (finish() holds the lock while it copies)."""
        with self._finishing:
            self.deferred = None

    def drop(self) -> None:
        """After the persist, the staging given back: forget every view of it."""
        self.staging, self.segments, self._spans, self.objects = None, [], [], []

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
    # copies(): {id(which): (shards, writes, which, _CopyPlan)}, the plans made for this layout
    _copies: dict = field(default_factory=dict, repr=False, compare=False)
    _gaps: list | None = field(default=None, repr=False, compare=False)   # gaps(), once per layout

    @property
    def references(self) -> bool:
        return any(a is None for a in self.at)

    @functools.cached_property
    def now(self) -> list[int]:
        """The writes copied before save() returns: staged, and not left for later. Worked out once
        per layout (a save whose layout is reused does not walk its writes again)."""
        later = set(self.later)
        return [i for i, a in enumerate(self.at) if a is not None and i not in later]

    def gaps(self, writes: list[WriteItem], tensor_region: int) -> list[tuple[int, int]]:
        """[start, end) of the bytes of the tensor region of a file laid out like staging that no
        write covers (alignment padding), worked out once per layout: they depend on the writes
        alone (the objects after them may move from one save to the next: their region is zeroed
        by each save). A reused buffer holds whatever its last use left there (an earlier save's or
        a load's bytes); zeroed, every staged file is the bytes of its own state alone, as a file
        written from the tensors is (its gaps are holes)."""
        if self._gaps is None:
            gaps, pos = [], 0
            for a, b in sorted((w.offset, w.offset + w.nbytes) for w in writes if w.nbytes):
                if a > pos:
                    gaps.append((pos, a))
                pos = max(pos, b)
            if tensor_region > pos:
                gaps.append((pos, tensor_region))
            self._gaps = gaps
        return self._gaps

    def copies(self, shards: list[TensorShard], writes: list[WriteItem], which: list[int]) -> _CopyPlan:
        """How the copies of writes `which` run (_copy_plan), worked out once per layout for the
        same shard and write lists: a reused layout's saves copy 6,000 step counts without sorting
        them out again."""
        hit = self._copies.get(id(which))
        if hit is not None and hit[0] is shards and hit[1] is writes and hit[2] is which:
            return hit[3]
        plan = _copy_plan(shards, [(writes[i], self.at[i]) for i in which])
        self._copies[id(which)] = (shards, writes, which, plan)
        return plan


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
    return _over_budget(shards, writes, file_bytes, room, is_stable)


def _over_budget(shards: list[TensorShard], writes: list[WriteItem], file_bytes: int, room: int,
                 is_stable: Callable[[WriteItem], bool]) -> StageLayout:
    """stage_layout when the file does not fit in `room`: staging compact, filled in the order of
    its docstring."""
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
            return _stage(shards, writes, tensor_region, placed, total, staging, cuda, layout)
        segments, spans, packed = _reference(shards, writes, pack)
        objs = _objects_as_they_are(placed, segments)
        return Snapshot(total, segments, spans, objs, packed)


def _stage(shards: list[TensorShard], writes: list[WriteItem], tensor_region: int,
           placed: list[tuple[str, int, bytes]], total: int,
           staging: torch.Tensor, cuda: bool, layout: StageLayout) -> Snapshot:
    """The async snapshot: copy now what `layout` does not leave for later, then describe the file
    from staging (laid out like the file, or compact with the rest from the tensors' own memory)."""
    _copy_on_stream(staging, shards, layout.copies(shards, writes, layout.now), cuda)
    event = torch.cuda.Event() if cuda else None
    if event is not None:
        event.record()   # the copies of now (the training stream waits for them already)
    whole = tensor_bytes_view(staging)
    # the padding between writes (a compact staging holds none): zeroed now, or with the lazy copies,
    # off the stall path (6,000 gaps: 1.5 ms); the objects' region, a few bytes, now, before they land
    zero = None if layout.compact else (lambda: _zero(whole, layout.gaps(writes, tensor_region)))
    if not layout.compact:
        if not layout.later:
            zero()
        _zero(whole, [(tensor_region, total)] if total > tensor_region else [])
        for key, off, blob in placed:
            whole[off:off + len(blob)] = blob   # one copy, straight into staging
        segments = [Segment(0, whole[:total])]
        # a view per write (10^4 of an MoE state) is made by the background job that needs them
        spans = functools.partial(_spans_of, whole, writes)
        objs = [(k, off, len(b), whole[off:off + len(b)]) for k, off, b in placed]
    else:
        segments, spans = _compact_segments(whole, shards, writes, layout.at)
        objs = _objects_as_they_are(placed, segments)
    snap = Snapshot(total, segments, spans, objs, staging, event, references=layout.references)
    if layout.later:
        snap.deferred = _deferred_copy(snap, staging, shards, layout.copies(shards, writes, layout.later), cuda, zero)
    return snap


def _zero(whole: memoryview, gaps: list[tuple[int, int]]) -> None:
    """Zero the staging bytes of `gaps` (StageLayout.gaps)."""
    if gaps:
        zeros = memoryview(bytes(max(b - a for a, b in gaps)))
        for a, b in gaps:
            whole[a:b] = zeros[:b - a]


def _spans_of(whole: memoryview, writes: list[WriteItem]) -> list[memoryview]:
    return [whole[w.offset:w.offset + w.nbytes] for w in writes]


def _compact_segments(whole: memoryview, shards: list[TensorShard], writes: list[WriteItem], at: list[int | None]
                      ) -> tuple[list[Segment], list[memoryview]]:
    """(segments, spans) of the writes of a compact staging: each from its staging offset, or from
    its tensor's own memory where it has none."""
    segments, spans = [], []
    for w, a in zip(writes, at):
        mv = whole[a:a + w.nbytes] if a is not None else tensor_bytes_view(shards[w.index].local.detach())
        spans.append(mv)
        if w.nbytes:
            segments.append(Segment(w.offset, mv))
    return segments, spans


def _objects_as_they_are(placed: list[tuple[str, int, bytes]], segments: list[Segment]
                         ) -> list[tuple[str, int, int, memoryview]]:
    """The objects written from their own bytes (immutable: no copy needed); appends their segments."""
    objs = []
    for key, off, blob in placed:
        mv = memoryview(blob)
        segments.append(Segment(off, mv))
        objs.append((key, off, len(blob), mv))
    return objs


def _deferred_copy(snap: Snapshot, staging: torch.Tensor, shards: list[TensorShard], copies: _CopyPlan,
                   cuda: bool, zero: Callable[[], None] | None = None) -> Callable[[], None]:
    """The lazy copies, for Snapshot.finish() to run in the background (after `zero`: the padding
    between the writes)."""
    start = torch.cuda.Event() if cuda else None
    if start is not None:
        start.record()   # the values of the save call: what the training stream queued so far

    def deferred() -> None:
        if zero is not None:
            zero()
        snap.cuda_event = _copy_on_stream(staging, shards, copies, cuda, after=start, wait_host=True)
    return deferred


def _copy_on_stream(buf: torch.Tensor, shards: list[TensorShard], copies: _CopyPlan, cuda: bool, *, after=None,
                    wait_host: bool = False):
    """Make `copies` into `buf` (their staging offsets). On a GPU the copies run on a side
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
        _copy_into(buf, shards, copies)
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


# Host scalars of these dtypes are copied into staging together (_copy_scalars); others one by one.
_SCALAR_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                            torch.int32, torch.int64, torch.uint8, torch.bool})


@dataclass
class _CopyPlan:
    """How `_copy_into` copies writes into staging (a pure plan of `_copy_plan`): host scalars (an
    optimizer's step counts) by dtype, each group as its sources and their element offsets in a flat
    byte buffer; every other write one by one."""
    scalars: list[tuple[torch.dtype, list[torch.Tensor], torch.Tensor, list[tuple[WriteItem, int]]]]
    rest: list[tuple[WriteItem, int]]
    scalar_end: int      # the staging bytes the scalar groups reach

    def __len__(self) -> int:
        return len(self.rest) + sum(len(g[3]) for g in self.scalars)


def _copy_plan(shards: list[TensorShard], placed: list[tuple[WriteItem, int]]) -> _CopyPlan:
    """Sort writes (each with its staging offset) into host scalars that can be stored together
    (0-d CPU tensors of a plain dtype, at an offset their dtype can be viewed at) and the rest."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int], list[tuple[WriteItem, int]]]] = {}
    rest, end = [], 0
    for w, at in placed:
        src = shards[w.index].local
        if src.dim() == 0 and src.is_cpu and src.dtype in _SCALAR_DTYPES and w.nbytes == src.itemsize \
                and at % w.nbytes == 0 and 0 <= at:
            group = groups.get(src.dtype)
            if group is None:
                group = groups[src.dtype] = ([], [], [])
            group[0].append(src)
            group[1].append(at // w.nbytes)
            group[2].append((w, at))
            end = max(end, at + w.nbytes)
        else:
            rest.append((w, at))
    scalars = [(dtype, srcs, torch.tensor(where, dtype=torch.int64), items)
               for dtype, (srcs, where, items) in groups.items()]
    return _CopyPlan(scalars, rest, end)


def _copy_into(buf: torch.Tensor, shards: list[TensorShard], plan: _CopyPlan) -> None:
    """Copy each write of `plan` from its source to its staging offset in `buf`: host scalars all
    at once per dtype, raw bytes (one memmove) where the source is plain host memory of exactly the
    planned size, a torch copy otherwise (GPU sources run on the caller's stream, non-blocking)."""
    base, size = buf.data_ptr(), buf.numel()
    # a flat byte buffer whose start lies on 8 bytes can be viewed as any scalar dtype
    batch = buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous() and buf.storage_offset() % 8 == 0 \
        and base % 8 == 0 and plan.scalar_end <= size
    rest = plan.rest
    for dtype, srcs, where, items in plan.scalars:
        if batch:
            _copy_scalars(buf, dtype, srcs, where)
        else:
            rest = rest + items
    for w, at in rest:
        src = shards[w.index].local
        if (plain_bytes(src) and src.numel() * src.element_size() == w.nbytes
                and 0 <= at and at + w.nbytes <= size):
            if w.nbytes:
                copy_bytes(base + at, src.data_ptr(), w.nbytes)
            continue
        dst = buf[at:at + w.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src, non_blocking=src.is_cuda)


def _copy_scalars(buf: torch.Tensor, dtype: torch.dtype, srcs: list[torch.Tensor], where: torch.Tensor) -> None:
    """0-d host tensors `srcs` into `buf` (bytes) at element offsets `where` of `dtype`: one stack
    and one indexed store instead of a memmove call each (6,000 step counts of an MoE model's Adam:
    23 ms on the stall path, 7 ms this way)."""
    n = buf.numel() // dtype.itemsize
    view = buf[:n * dtype.itemsize].view(dtype)
    view[where] = torch.stack(srcs)


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
        return segments, spans, _pack_runs(shards, writes, _small_runs(writes, small), pack, spans, segments)
    return segments, spans, None


def _small_runs(writes: list[WriteItem], small: list[int]) -> list[list[int]]:
    """The small writes in file order, cut into runs that only alignment padding separates (a large
    tensor between two small ones ends the run: it is written from its own memory)."""
    small.sort(key=lambda i: writes[i].offset)
    runs: list[list[int]] = [[small[0]]]
    for i in small[1:]:
        prev = writes[runs[-1][-1]]
        if writes[i].offset - (prev.offset + prev.nbytes) < ALIGN:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _pack_runs(shards: list[TensorShard], writes: list[WriteItem], runs: list[list[int]],
               pack: Callable[[int], torch.Tensor] | None, spans: list, segments: list[Segment]) -> torch.Tensor:
    """Copy each run of small writes into one buffer (returned), a segment per run; fills their spans."""
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
    return scratch


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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
