"""Parallel reads: only the byte ranges needed, straight into the destination where possible."""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Sequence

import torch

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import Manifest, checksum, decode_object
from omnickpt.layout import Box, element_runs, relative
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import ReadItem
from omnickpt.planner.load_plan import ZERO_FILL, ForwardPlan, item_key, stored_region
from omnickpt.storage import Storage

# Runs closer than this are read in one request (the gap goes to a scratch buffer): fewer
# syscalls / HTTP requests for a little extra data.
COALESCE_GAP = 256 << 10
# Largest merged request: big enough to amortise a round trip, small enough to spread a large
# file over several reader threads.
MAX_REQUEST = 64 << 20


def _view_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def _dest_view(item: ReadItem, dest_box: Box, dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the destination region of `item`, a contiguous tensor to fill: the region itself when it
    is contiguous, else a temporary to copy from)."""
    rel_dest = relative(item.region, dest_box)
    view = dest[tuple(slice(o, o + l) for o, l in zip(rel_dest.offsets, rel_dest.lengths))] if dest.dim() else dest
    compact = view if view.is_contiguous() else torch.empty(item.region.lengths, dtype=dest.dtype)
    return view, compact


@dataclass
class _Prepared:
    """One read item ready to be filled: where its bytes go and the byte runs that fill them."""
    item: ReadItem
    view: torch.Tensor
    compact: torch.Tensor
    out: memoryview
    runs: list[tuple[int, memoryview]]      # (file offset, piece of `out`), in file order


def _prepare(manifest: Manifest, item: ReadItem, dest_box: Box, dest: torch.Tensor) -> _Prepared:
    sb = item.saved
    view, compact = _dest_view(item, dest_box, dest)
    if sb.file == ZERO_FILL:
        # A region no stored bytes back (pad rows added by a transform): it loads as zeros.
        with torch.no_grad():
            compact.zero_()
        return _Prepared(item, view, compact, memoryview(b""), [])
    out = _view_bytes(compact)
    itemsize = dest.element_size()
    # The stored block may be larger than the saved box when a transform made it a window.
    rel_saved, stored_lengths = stored_region(item)
    run_elems, _, starts = element_runs(rel_saved, stored_lengths)
    run_bytes = run_elems * itemsize
    runs, pos = [], 0
    for s in starts:
        runs.append((sb.offset + s * itemsize, out[pos:pos + run_bytes]))
        pos += run_bytes
    return _Prepared(item, view, compact, out, runs)


def _requests(manifest: Manifest, prepared: Sequence[_Prepared]) -> list[tuple[str, int, list[memoryview], list[ReadItem]]]:
    """Merge the runs of all items into few large requests per file: runs closer than
    COALESCE_GAP join one request (the gap is read into scratch), up to MAX_REQUEST bytes. On
    object stores a request is an HTTP round trip, so one GET per tensor would dominate a load."""
    by_file: dict[int, list[tuple[int, memoryview, ReadItem]]] = {}
    for p in prepared:
        for off, buf in p.runs:
            by_file.setdefault(p.item.saved.file, []).append((off, buf, p.item))
    out = []
    for fi, runs in by_file.items():
        path = manifest.files[fi].path
        runs.sort(key=lambda r: r[0])
        cur: list = []
        start = end = 0
        scratch = None
        for off, buf, item in runs:
            gap = off - end
            if cur and 0 <= gap <= COALESCE_GAP and off + len(buf) - start <= MAX_REQUEST:
                if gap:
                    if scratch is None:
                        scratch = memoryview(bytearray(COALESCE_GAP))
                    cur[2].append(scratch[:gap])
            else:
                if cur:
                    out.append(cur)
                cur, start, scratch = [path, off, [], []], off, None
            cur[2].append(buf)
            if not cur[3] or cur[3][-1] is not item:
                cur[3].append(item)
            end = off + len(buf)
        if cur:
            out.append(cur)
    return [tuple(r) for r in out]


def _fetch(storage: Storage, path: str, off: int, bufs: list[memoryview], items: list[ReadItem]) -> None:
    try:
        storage.read_into(path, off, bufs)
    except CorruptCheckpointError as e:
        names = sorted({f"{it.name!r} box offsets={list(it.saved.offsets)} lengths={list(it.saved.lengths)}"
                        for it in items})
        raise CorruptCheckpointError(f"{e} (reading tensor {', '.join(names[:3])}"
                                     f"{' ...' if len(names) > 3 else ''})") from None


def _finish(storage: Storage, manifest: Manifest, p: _Prepared, verify: bool) -> int:
    item, sb = p.item, p.item.saved
    if verify and item.whole_box and sb.checksum is not None and sb.file != ZERO_FILL \
            and checksum(p.out) != sb.checksum:
        raise CorruptCheckpointError(
            f"checksum mismatch in {storage.describe(manifest.files[sb.file].path)} for tensor {item.name!r} box "
            f"offsets={list(sb.offsets)} lengths={list(sb.lengths)}: the data file is corrupt; restore it "
            "or load an earlier checkpoint")
    if p.compact is not p.view:
        with torch.no_grad():
            p.view.copy_(p.compact)
    return len(p.out)


def read_tensors(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], dest_boxes: Sequence[Box],
                 dests: Sequence[torch.Tensor], executor: Executor | None, *, verify: bool,
                 timer: PhaseTimer) -> list[torch.Tensor]:
    """Read every item into its destination; returns each item's filled contiguous bytes (the
    destination region itself, or the temporary it was copied from) for forwarding to peers."""
    with timer.phase("read"):
        prepared = [_prepare(manifest, it, dest_boxes[it.dest], dests[it.dest]) for it in items]
        requests = _requests(manifest, prepared)
        if executor is None or len(requests) <= 1:
            for r in requests:
                _fetch(storage, *r)
            n = sum(_finish(storage, manifest, p, verify) for p in prepared)
        else:
            for f in [executor.submit(_fetch, storage, *r) for r in requests]:
                f.result()
            n = sum(f.result() for f in [executor.submit(_finish, storage, manifest, p, verify) for p in prepared])
    timer.count("read", n)
    return [p.compact for p in prepared]


def forward_replicas(items: Sequence[ReadItem], compacts: dict[int, torch.Tensor], plan: "ForwardPlan",
                     dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor], rank: int, group,
                     timer: PhaseTimer) -> None:
    """Zero-redundancy load, second half: readers send what they read to the other ranks that
    want the same bytes; those receive straight into their destination where it is contiguous.

    All ranks walk the shared keys in the same order, so the point-to-point pairs always match.
    """
    import torch.distributed as dist
    by_key = {item_key(it): i for i, it in enumerate(items)}
    with timer.phase("forward"):
        ops, pending = [], []
        for key, reader, others in plan:
            i = by_key.get(key)
            if i is None:
                continue
            if reader == rank:
                for o in others:
                    ops.append(dist.P2POp(dist.isend, compacts[i], dist.get_global_rank(group, o), group))
            elif rank in others:
                it = items[i]
                view, compact = _dest_view(it, dest_boxes[it.dest], dests[it.dest])
                ops.append(dist.P2POp(dist.irecv, compact, dist.get_global_rank(group, reader), group))
                if compact is not view:
                    pending.append((view, compact))
                timer.count("received", compact.numel() * compact.element_size())
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        with torch.no_grad():
            for view, compact in pending:
                view.copy_(compact)


def read_objects(storage: Storage, manifest: Manifest, keys: Sequence[str], rank: int, *, allow_pickle: bool,
                 timer: PhaseTimer, all_ranks: Sequence[str] = ()) -> dict:
    """Decode objects: for each key in `keys` the value saved by this rank (or the lowest rank's);
    for each key in `all_ranks` a dict {saving rank: value} with every rank's value (for state that
    is redistributed across ranks on load, like dataloader positions)."""
    out: dict = {}
    with timer.phase("objects"):
        for key in keys:
            if key in manifest.objects:
                out[key] = _read_object(storage, manifest, key, manifest.object_for_rank(key, rank), allow_pickle, timer)
        for key in all_ranks:
            if key in manifest.objects:
                by_rank = {}
                for e in manifest.objects[key]:
                    value = _read_object(storage, manifest, key, e, allow_pickle, timer)
                    by_rank.update({r: value for r in e.ranks})
                out[key] = dict(sorted(by_rank.items()))
    return out


def _read_object(storage, manifest, key, e, allow_pickle, timer):
    buf = bytearray(e.nbytes)
    path = manifest.files[e.file].path
    try:
        storage.read_into(path, e.offset, [memoryview(buf)])
    except CorruptCheckpointError as err:
        raise CorruptCheckpointError(f"{err} (reading object {key!r})") from None
    if checksum(buf) != e.checksum:
        raise CorruptCheckpointError(
            f"checksum mismatch in {storage.describe(path)} for object {key!r}: the data file is corrupt")
    timer.count("read", e.nbytes)
    return decode_object(bytes(buf), allow_pickle=allow_pickle, where=key)


def check_file_sizes(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], object_ranges) -> None:
    """Fail before anything is read (and so before any parameter is overwritten) when a data file
    is missing or shorter than the bytes this rank needs; the error names what lies past the end.

    `object_ranges` holds (object key, ObjectEntry) pairs. One size query per file.
    """
    needs: dict[int, list[tuple[int, str]]] = {}
    for it in items:
        if it.saved.file >= 0:
            needs.setdefault(it.saved.file, []).append(
                (it.saved.offset + it.saved.nbytes,
                 f"tensor {it.name!r} box offsets={list(it.saved.offsets)} lengths={list(it.saved.lengths)}"))
    for key, e in object_ranges:
        needs.setdefault(e.file, []).append((e.offset + e.nbytes, f"object {key!r}"))
    for fi, ends in needs.items():
        path = manifest.files[fi].path
        size = storage.size(path)
        beyond = [what for end, what in ends if end > size]
        if beyond:
            raise CorruptCheckpointError(
                f"data file {storage.describe(path)} is truncated: it has {size} bytes but the manifest needs "
                f"{max(end for end, _ in ends)}; past its end: {', '.join(beyond[:5])}"
                + (f" and {len(beyond) - 5} more" if len(beyond) > 5 else "")
                + ". Restore the file or load an earlier checkpoint")
