"""Derived tensor entries: slices, concatenations, stacks and pads of saved tensors, expressed as
boxes over the same stored bytes (the transforms' building blocks, omnickpt/transforms.py).

Every saved box is a row-major block: a range of its leading rows is a contiguous byte range (a
plain SavedBox at a byte offset), a selection along another dimension is a WindowBox the reader
turns into strided runs, concatenation is boxes at shifted offsets, and pad rows are zero-fill
boxes backed by no bytes. A derived box keeps the chunk checksums (Sums) of the stored box its
bytes lie in, so the reader verifies every byte it reads; `carry_quantized` follows the lossy
records the same way."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, SavedBox, TensorEntry, WindowBox, dtype_from_name
from omnickpt.layout import Box, intersect
from omnickpt.planner.load_plan import ZERO_FILL


def _itemsize(entry: TensorEntry) -> int:
    return dtype_from_name(entry.dtype).itemsize


def _stored(sb: SavedBox) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lengths of the stored block behind `sb`, where sb's first element lies in it)."""
    if isinstance(sb, WindowBox):
        return sb.base_lengths, sb.base_start
    return sb.lengths, (0,) * len(sb.lengths)


def _box(offsets, lengths, file, offset, base_lengths, base_start, itemsize, sums) -> SavedBox:
    """A plain SavedBox when the stored block is exactly the box, else a WindowBox."""
    offsets, lengths = tuple(offsets), tuple(lengths)
    base_lengths, base_start = tuple(base_lengths), tuple(base_start)
    nbytes = math.prod(base_lengths) * itemsize
    if base_lengths == lengths and not any(base_start):
        return SavedBox(offsets, lengths, file, offset, nbytes, sums)
    return WindowBox(offsets, lengths, file, offset, nbytes, sums, base_lengths, base_start)


def _zero_box(offsets, lengths, itemsize) -> SavedBox:
    return SavedBox(tuple(offsets), tuple(lengths), ZERO_FILL, 0, math.prod(lengths) * itemsize, None)


def _select(sb: SavedBox, sel: Box, itemsize: int) -> SavedBox | None:
    """The part of saved box `sb` inside `sel` (both in the tensor's coordinates), or None.

    Only the leading rows the part needs stay in its stored block (a contiguous byte range), so a
    selection of whole trailing extents is a plain SavedBox; a narrower one becomes a window.
    """
    if not sb.lengths:                       # 0-dim: nothing to select
        return sb
    region = intersect(Box(sb.offsets, sb.lengths), sel)
    if region is None or region.numel == 0:
        return None
    if sb.file == ZERO_FILL:
        return _zero_box(region.offsets, region.lengths, itemsize)
    if region == Box(sb.offsets, sb.lengths) and not isinstance(sb, WindowBox):
        return sb                            # the whole stored box: it keeps its checksum
    base, start = _stored(sb)
    start = [s + r - o for s, r, o in zip(start, region.offsets, sb.offsets)]
    row_bytes = math.prod(base[1:]) * itemsize
    offset = sb.offset + start[0] * row_bytes
    base = (region.lengths[0],) + tuple(base[1:])
    start[0] = 0
    # Its bytes lie inside sb's stored range: the reader verifies them against sb's chunk grid.
    return _box(region.offsets, region.lengths, sb.file, offset, base, start, itemsize, sb.sums)


def _shift(sb: SavedBox, dim: int, delta: int) -> SavedBox:
    offsets = list(sb.offsets)
    offsets[dim] += delta
    return dataclasses.replace(sb, offsets=tuple(offsets))


def narrow(entry: TensorEntry, dim: int, start: int, stop: int) -> TensorEntry:
    """entry[..., start:stop, ...] along `dim`, at coordinates starting from 0."""
    itemsize = _itemsize(entry)
    shape = list(entry.shape)
    sel = Box(tuple(start if d == dim else 0 for d in range(len(shape))),
              tuple(stop - start if d == dim else n for d, n in enumerate(shape)))
    boxes = [_shift(b, dim, -start) for sb in entry.boxes if (b := _select(sb, sel, itemsize)) is not None]
    shape[dim] = stop - start
    return TensorEntry(tuple(shape), entry.dtype, boxes)


def concat(entries: Sequence[TensorEntry], dim: int, what: str) -> TensorEntry:
    first = entries[0]
    for e in entries[1:]:
        if e.dtype != first.dtype or len(e.shape) != len(first.shape) or any(
                a != b for d, (a, b) in enumerate(zip(e.shape, first.shape)) if d != dim):
            raise MismatchError(f"{what}: cannot concatenate shapes {[list(x.shape) for x in entries]} "
                                f"(dtypes {[x.dtype for x in entries]}) along dim {dim}; all parts need one dtype "
                                "and equal sizes in the other dimensions", [what])
    boxes, at = [], 0
    for e in entries:
        boxes += [_shift(b, dim, at) for b in e.boxes]
        at += e.shape[dim]
    shape = list(first.shape)
    shape[dim] = at
    return TensorEntry(tuple(shape), first.dtype, boxes)


def take_rows(entry: TensorEntry, ranges: Iterable[tuple[int, int]], what: str) -> TensorEntry:
    """The rows [start, stop) of each range, back to back along dim 0."""
    return concat([narrow(entry, 0, a, b) for a, b in ranges], 0, what)


def indexed(entry: TensorEntry, i: int) -> TensorEntry:
    """entry[i] (dim 0 dropped). `_select` leaves a box exactly the rows it needs of its stored
    block (here one), so the leading dimension can be dropped from the box and the block alike."""
    part = narrow(entry, 0, i, i + 1)
    boxes = []
    for sb in part.boxes:
        if isinstance(sb, WindowBox):
            boxes.append(dataclasses.replace(sb, offsets=sb.offsets[1:], lengths=sb.lengths[1:],
                                             base_lengths=sb.base_lengths[1:], base_start=sb.base_start[1:]))
        else:
            boxes.append(dataclasses.replace(sb, offsets=sb.offsets[1:], lengths=sb.lengths[1:]))
    return TensorEntry(entry.shape[1:], entry.dtype, boxes)


def stack(entries: Sequence[TensorEntry], what: str) -> TensorEntry:
    """Stack along a new leading dimension."""
    first = entries[0]
    boxes = []
    for i, e in enumerate(entries):
        if e.shape != first.shape or e.dtype != first.dtype:
            raise MismatchError(f"{what}: cannot stack shapes {[list(x.shape) for x in entries]} (dtypes "
                                f"{[x.dtype for x in entries]}); every part needs one shape and dtype", [what])
        for sb in e.boxes:
            if isinstance(sb, WindowBox):
                boxes.append(dataclasses.replace(sb, offsets=(i,) + sb.offsets, lengths=(1,) + sb.lengths,
                                                 base_lengths=(1,) + sb.base_lengths, base_start=(0,) + sb.base_start))
            else:
                boxes.append(dataclasses.replace(sb, offsets=(i,) + sb.offsets, lengths=(1,) + sb.lengths))
    return TensorEntry((len(entries),) + first.shape, first.dtype, boxes)


def resize_rows(entry: TensorEntry, rows: int) -> TensorEntry:
    """Truncate to `rows` rows, or pad with zero rows up to it."""
    have = entry.shape[0]
    if rows <= have:
        return narrow(entry, 0, 0, rows)
    pad = (rows - have,) + entry.shape[1:]
    zero = _zero_box((have,) + (0,) * (len(pad) - 1), pad, _itemsize(entry)) if math.prod(pad) else None
    return TensorEntry((rows,) + entry.shape[1:], entry.dtype, list(entry.boxes) + ([zero] if zero else []))


def carry_quantized(source: Manifest, tensors: Mapping[str, TensorEntry]) -> dict[str, dict]:
    """The lossy records (Manifest.quantized) of the rewritten `tensors`: a tensor whose bytes come
    from tensors `source` holds quantized is lossy under its new name, with the largest error of
    those (a fused tensor's error is its worst part's); a dropped tensor's record goes with it."""
    if not source.quantized:
        return {}
    # Records are found by the stored boxes behind a tensor, not by its name: a transform may
    # rename, fuse, split or pad, but a derived box keeps the chunk grid (Sums) of the stored box
    # its bytes lie in, and a stored box's grid starts at its own first byte, so (file, grid start)
    # names that stored box. Byte ranges would not: in a compressed file a box's raw range overlaps
    # the boxes stored after it.
    owner: dict[tuple[int, int], str] = {}
    whole: dict[int, str] = {}   # id of a quantized entry -> its name: kept, renamed or aliased as it is
    for name in source.quantized:
        entry = source.tensors.get(name)
        if entry is None:
            continue
        whole[id(entry)] = name
        if entry.holds_boxes:
            owner.update(((b.file, b.sums.start), name) for b in entry.boxes if b.sums is not None)
        else:
            cols = entry.columns
            owner.update(((f, o), name) for f, o in zip(cols.file.tolist(), cols.offset.tolist()))
    untouched = {id(e) for e in source.tensors.values()}
    out: dict[str, dict] = {}
    for name, entry in tensors.items():
        if id(entry) in whole:
            parts = {whole[id(entry)]}
        elif id(entry) in untouched:
            continue   # a source tensor the source holds exactly
        else:
            parts = {owner[k] for b in entry.boxes if b.sums is not None and (k := (b.file, b.sums.start)) in owner}
        if parts:
            # one save quantizes with one scheme; the worst part's names the record all the same
            worst = max(parts, key=lambda n: float(source.quantized[n]["max_error"]))
            out[name] = {"scheme": source.quantized[worst]["scheme"],
                         "max_error": float(source.quantized[worst]["max_error"])}
    return out
