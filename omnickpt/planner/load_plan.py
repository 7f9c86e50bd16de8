"""Load planning: intersect the boxes a rank wants with the boxes the checkpoint holds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, SavedBox, Sums, WindowBox
from omnickpt.format.records import joined_columns
from omnickpt.layout import Box, BoxIndex, intersect

# SavedBox.file of a box that is not stored at all: its elements load as zeros. Only transforms
# make such boxes (the pad rows of a padded vocabulary, omnickpt/transforms.py); a manifest read
# from storage never holds one (Manifest.decode rejects a negative file index).
ZERO_FILL = -1


def stored_region(item: "ReadItem") -> tuple[Box, tuple[int, ...]]:
    """(item.region in the local coordinates of the stored block it reads from, that block's lengths)."""
    sb = item.saved
    rel = tuple(r - o for r, o in zip(item.region.offsets, sb.offsets))
    if isinstance(sb, WindowBox):
        return Box(tuple(r + s for r, s in zip(rel, sb.base_start)), item.region.lengths), sb.base_lengths
    return Box(rel, item.region.lengths), sb.lengths


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy the part `region` (global coordinates) of saved box `saved` into wanted box `dest`."""
    name: str
    dest: int            # index into the wanted list
    saved: SavedBox
    region: Box

    @property
    def nbytes(self) -> int:
        stored = self.saved.base_lengths if isinstance(self.saved, WindowBox) else self.saved.lengths
        return self.region.numel * (self.saved.nbytes // max(1, _numel(stored)))

    @property
    def whole_box(self) -> bool:
        return self.region.lengths == self.saved.lengths


def _numel(lengths) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n


# From this many stored boxes on, a tensor is searched through an index (BoxIndex); tensors with
# fewer are intersected all together, in bulk (_plan_small).
_INDEX_FROM = 16


def plan_reads(manifest: Manifest, wanted: list[tuple[str, Box]]) -> list[ReadItem]:
    """Every (saved box, wanted box) overlap, checking that each wanted box is fully covered.

    Items come per wanted box, in the order of the tensor's saved boxes. A tensor with many boxes
    is searched through an index (`BoxIndex`, built once per call), so a wanted box costs its
    overlaps, not the tensor's box count; tensors with few boxes (10^4 small tensors of an MoE
    model) are intersected with numpy all at once. Only the saved boxes a wanted box overlaps
    become SavedBox records."""
    per_box: list[list[ReadItem]] = [[] for _ in wanted]
    gaps: list[tuple[int, str]] = []
    indexes: dict[str, BoxIndex] = {}
    small: dict[tuple, list] = {}   # (ndim, chunk_bytes) -> [(wanted index, name, box, columns)]
    for di, (name, box) in enumerate(wanted):
        entry = manifest.tensors.get(name)
        if entry is None:
            gaps.append((di, f"{name}: missing from the checkpoint"))
            continue
        covered = 0
        if entry.box_count < _INDEX_FROM:
            key = _small_key(entry)
            if key is not None:
                small.setdefault(key, []).append((di, name, box, entry))
                continue
            for sb in entry.boxes:
                region = intersect(Box(sb.offsets, sb.lengths), box)
                if region is not None and region.numel:
                    per_box[di].append(ReadItem(name, di, sb, region))
                    covered += region.numel
        else:
            index = indexes.get(name)
            if index is None:
                index = indexes[name] = _index(entry)
            found, offs, lens = index.overlapping(box)
            if len(found):
                covered = int(lens.prod(axis=1).sum())
                saved = _saved_boxes(entry, found)
                per_box[di] = [ReadItem(name, di, sb, Box(tuple(o), tuple(n)))
                               for sb, o, n in zip(saved, offs.tolist(), lens.tolist())]
        if covered < box.numel:
            gaps.append((di, _gap(name, covered, box)))
    for (ndim, chunk_bytes, _), group in small.items():
        _plan_small(group, ndim, chunk_bytes, per_box, gaps)
    if gaps:
        lines = [g for _, g in sorted(gaps, key=lambda g: g[0])]
        raise MismatchError("the checkpoint does not cover every element this rank needs:\n  " + "\n  ".join(lines),
                            lines)
    return [it for items in per_box for it in items]


def _gap(name: str, covered: int, box: Box) -> str:
    return (f"{name}: the checkpoint holds only {covered} of the {box.numel} elements of box "
            f"offsets={list(box.offsets)} lengths={list(box.lengths)}")


def _small_key(entry) -> tuple | None:
    """The bulk group of an entry with few stored boxes: (ndim, chunk size, the manifest arrays
    its rows are joined from, or None); None when the entry holds SavedBox records already
    (foreign formats, transforms, listed before): intersecting those one by one costs less."""
    pending = getattr(entry, "pending", None)
    if pending is not None:
        return len(entry.shape), pending.chunk_bytes, pending.group
    if getattr(entry, "holds_boxes", True):
        return None
    cols = entry.columns
    return None if cols is None else (len(entry.shape), cols.chunk_bytes, None)


def _plan_small(group: list, ndim: int, chunk_bytes: int | None, per_box: list[list[ReadItem]],
                gaps: list[tuple[int, str]]) -> None:
    """The reads of wanted boxes of tensors with few stored boxes, all of one ndim and checksum
    kind: their boxes joined (straight from the manifest's arrays where it was decoded), every
    (stored box, wanted box of its tensor) pair intersected in one numpy pass, records made for
    the overlaps only (one per tensor with a 1:1 layout)."""
    cols = joined_columns([g[3] for g in group])
    counts = np.fromiter((g[3].box_count for g in group), dtype=np.int64, count=len(group))
    owner = np.repeat(np.arange(len(group)), counts)
    lo, n = _small_overlaps(group, cols, owner, ndim)
    hit = np.flatnonzero((n > 0).all(axis=1))
    numel = n[hit].prod(axis=1)
    covered = np.zeros(len(group), dtype=np.int64)
    np.add.at(covered, owner[hit], numel)
    for k in np.flatnonzero(covered < np.array([g[2].numel for g in group], dtype=np.int64)).tolist():
        gaps.append((group[k][0], _gap(group[k][1], int(covered[k]), group[k][2])))
    if not len(hit):
        return
    who = owner[hit]
    file, offset, nbytes = cols.file[hit].tolist(), cols.offset[hit].tolist(), cols.nbytes[hit].tolist()
    sums = _small_sums(cols, hit, offset, nbytes, chunk_bytes)
    saved_offs = map(tuple, cols.offsets[hit].tolist())
    saved_lens = map(tuple, cols.lengths[hit].tolist())
    regions = zip(map(tuple, lo[hit].tolist()), map(tuple, n[hit].tolist()))
    for k, so, sl, f, a, b, sm, (ro, rl) in zip(who.tolist(), saved_offs, saved_lens, file, offset, nbytes, sums,
                                                 regions):
        di, name = group[k][0], group[k][1]
        per_box[di].append(ReadItem(name, di, SavedBox(so, sl, f, a, b, sm), Box(ro, rl)))


def _small_overlaps(group: list, cols, owner: np.ndarray, ndim: int):
    """(lo, n): each joined stored box's overlap with its entry's wanted box, as offsets `lo` and
    lengths `n` (a length <= 0 where they do not overlap)."""
    q_lo = np.array([g[2].offsets for g in group], dtype=np.int64).reshape(len(group), ndim)
    q_hi = q_lo + np.array([g[2].lengths for g in group], dtype=np.int64).reshape(len(group), ndim)
    lo = np.maximum(cols.offsets, q_lo[owner])
    n = np.minimum(cols.offsets + cols.lengths, q_hi[owner]) - lo
    return lo, n


def _small_sums(cols, hit: np.ndarray, offset: list[int], nbytes: list[int],
                chunk_bytes: int | None) -> list[Sums | None]:
    """The checksums of the overlapped joined boxes `hit`, or Nones when the group has none."""
    if chunk_bytes is None:
        return [None] * len(hit)
    s0, s1 = cols.sums_start[hit].tolist(), cols.sums_start[hit + 1].tolist()
    crcs = cols.crcs.tolist()
    return [Sums(a, a + b, chunk_bytes or max(1, b), tuple(crcs[i:j]))
            for a, b, i, j in zip(offset, nbytes, s0, s1)]


def _index(entry) -> BoxIndex:
    cols = getattr(entry, "columns", None)   # None for transforms' derived boxes: those are indexed from the box list
    if cols is not None:
        return BoxIndex(cols.offsets, cols.lengths)
    return BoxIndex.of(entry.boxes, len(entry.shape))


def _saved_boxes(entry, rows: np.ndarray) -> list[SavedBox]:
    """The SavedBoxes of rows `rows` of `entry`, equal to entry.boxes[i], but made from its columns
    for those rows only: a tensor of 10^4 boxes of which a rank reads ten costs ten records."""
    cols = getattr(entry, "columns", None)
    if cols is None:
        boxes = entry.boxes
        return [boxes[i] for i in rows.tolist()]
    offs = map(tuple, cols.offsets[rows].tolist())
    lens = map(tuple, cols.lengths[rows].tolist())
    file, offset, nbytes = cols.file[rows].tolist(), cols.offset[rows].tolist(), cols.nbytes[rows].tolist()
    if cols.chunk_bytes is None:
        return [SavedBox(o, n, f, a, b, None) for o, n, f, a, b in zip(offs, lens, file, offset, nbytes)]
    cb = cols.chunk_bytes
    s0, s1 = cols.sums_start[rows].tolist(), cols.sums_start[rows + 1].tolist()
    # rows ascend, so their CRCs lie in one stretch: one conversion, then list slices
    base = s0[0]
    crcs = cols.crcs[base:s1[-1]].tolist()
    return [SavedBox(o, n, f, a, b, Sums(a, a + b, cb or max(1, b), tuple(crcs[i - base:j - base])))
            for o, n, f, a, b, i, j in zip(offs, lens, file, offset, nbytes, s0, s1)]


ItemKey = tuple   # (tensor name, file, byte offset of the saved box, region offsets, region lengths)
ForwardPlan = list[tuple[ItemKey, int, list[int]]]   # (key, reader rank, ranks it forwards to)


def item_key(item: ReadItem) -> ItemKey:
    """Identifies the exact bytes a read item needs: equal keys on two ranks mean the same bytes.

    The tensor name is part of the key: after transforms two tensors can read the same stored
    bytes at equal region coordinates (a tied alias, two windows of one fused box, two zero-fill
    pads), and one rank must never see two of its items under one key.
    """
    return (item.name, item.saved.file, item.saved.offset, item.region.offsets, item.region.lengths)


def assign_readers(wants: list[list[tuple[ItemKey, int]]]) -> ForwardPlan:
    """Zero-redundancy loading: for bytes several ranks want, one of them reads and forwards.

    `wants[r]` lists (key, nbytes) of rank r's reads. Largest first, each shared key goes to the
    wanting rank that has the fewest bytes to read so far. Keys wanted by one rank stay with it
    and are not listed. Every rank computes the same plan from the same input.
    """
    holders: dict[ItemKey, list[int]] = {}
    size: dict[ItemKey, int] = {}
    load = [0] * len(wants)
    for rank, ws in enumerate(wants):
        for key, nbytes in ws:
            if key[1] == ZERO_FILL:
                continue   # zeros are cheaper to make than to receive: every rank fills its own
            holders.setdefault(key, []).append(rank)
            size[key] = nbytes
    for key, hs in holders.items():
        if len(hs) == 1:
            load[hs[0]] += size[key]
    plan: ForwardPlan = []
    for key in sorted((k for k, hs in holders.items() if len(hs) > 1), key=lambda k: (-size[k], k)):
        hs = holders[key]
        reader = min(hs, key=lambda r: (load[r], r))
        load[reader] += size[key]
        plan.append((key, reader, [r for r in hs if r != reader]))
    return plan
