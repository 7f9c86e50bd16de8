"""Parallel reads: only the byte ranges needed, straight into the destination where possible."""
from __future__ import annotations

from concurrent.futures import Executor
from typing import Sequence

import torch

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import Manifest, checksum, decode_object
from omnickpt.layout import Box, element_runs, relative
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import ReadItem
from omnickpt.storage import Storage

# Runs closer than this are read in one request (the gap goes to a scratch buffer): fewer
# syscalls / HTTP requests for a little extra data.
COALESCE_GAP = 256 << 10


def _view_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def _read_one(storage: Storage, manifest: Manifest, item: ReadItem, dest_box: Box, dest: torch.Tensor,
              verify: bool) -> int:
    sb = item.saved
    saved_box = Box(sb.offsets, sb.lengths)
    rel_saved = relative(item.region, saved_box)
    rel_dest = relative(item.region, dest_box)
    view = dest[tuple(slice(o, o + l) for o, l in zip(rel_dest.offsets, rel_dest.lengths))] if dest.dim() else dest
    direct = view.is_contiguous()
    compact = view if direct else torch.empty(item.region.lengths, dtype=dest.dtype)
    out = _view_bytes(compact)
    itemsize = dest.element_size()
    run_elems, _, starts = element_runs(rel_saved, sb.lengths)
    run_bytes = run_elems * itemsize
    path = manifest.files[sb.file].path
    # Group runs into requests; each request fills consecutive pieces of `out`.
    requests: list[tuple[int, list[memoryview]]] = []
    scratch = None
    pos = 0
    cur_start = cur_end = None
    pieces: list[memoryview] = []
    for s in starts:
        b = sb.offset + s * itemsize
        if cur_end is not None and 0 <= b - cur_end <= COALESCE_GAP:
            if b > cur_end:
                if scratch is None or len(scratch) < b - cur_end:
                    scratch = memoryview(bytearray(COALESCE_GAP))
                pieces.append(scratch[: b - cur_end])
        else:
            if pieces:
                requests.append((cur_start, pieces))
            pieces, cur_start = [], b
        pieces.append(out[pos:pos + run_bytes])
        pos += run_bytes
        cur_end = b + run_bytes
    if pieces:
        requests.append((cur_start, pieces))
    for off, bufs in requests:
        storage.read_into(path, off, bufs)
    if verify and item.whole_box and checksum(out) != sb.checksum:
        raise CorruptCheckpointError(
            f"checksum mismatch in {storage.describe(path)} for tensor {item.name!r} box "
            f"offsets={list(sb.offsets)} lengths={list(sb.lengths)}: the data file is corrupt; restore it "
            "or load an earlier checkpoint")
    if not direct:
        with torch.no_grad():
            view.copy_(compact)
    return len(out)


def read_tensors(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], dest_boxes: Sequence[Box],
                 dests: Sequence[torch.Tensor], executor: Executor | None, *, verify: bool, timer: PhaseTimer) -> None:
    with timer.phase("read"):
        if executor is None or len(items) <= 1:
            n = sum(_read_one(storage, manifest, it, dest_boxes[it.dest], dests[it.dest], verify) for it in items)
        else:
            futs = [executor.submit(_read_one, storage, manifest, it, dest_boxes[it.dest], dests[it.dest], verify)
                    for it in items]
            n = sum(f.result() for f in futs)
    timer.count("read", n)


def read_objects(storage: Storage, manifest: Manifest, keys: Sequence[str], rank: int, *, allow_pickle: bool,
                 timer: PhaseTimer) -> dict:
    out = {}
    with timer.phase("objects"):
        for key in keys:
            if key not in manifest.objects:
                continue
            e = manifest.object_for_rank(key, rank)
            buf = bytearray(e.nbytes)
            path = manifest.files[e.file].path
            storage.read_into(path, e.offset, [memoryview(buf)])
            if checksum(buf) != e.checksum:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {storage.describe(path)} for object {key!r}: the data file is corrupt")
            out[key] = decode_object(bytes(buf), allow_pickle=allow_pickle, where=key)
            timer.count("read", e.nbytes)
    return out
