"""Load planning: intersect the boxes a rank wants with the boxes the checkpoint holds."""
from __future__ import annotations

from dataclasses import dataclass

from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, SavedBox, WindowBox
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


@dataclass(frozen=True)
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


# Up to this many stored boxes, a tensor's boxes are intersected one by one: building an index
# costs more than it saves.
_INDEX_FROM = 16


def plan_reads(manifest: Manifest, wanted: list[tuple[str, Box]]) -> list[ReadItem]:
    """Every (saved box, wanted box) overlap, checking that each wanted box is fully covered.

    Items come per wanted box, in the order of the tensor's saved boxes. A tensor with many boxes
    is searched through an index (`BoxIndex`, built once per call), so a wanted box costs its
    overlaps, not the tensor's box count."""
    items: list[ReadItem] = []
    gaps: list[str] = []
    indexes: dict[str, BoxIndex] = {}
    for di, (name, box) in enumerate(wanted):
        entry = manifest.tensors.get(name)
        if entry is None:
            gaps.append(f"{name}: missing from the checkpoint")
            continue
        covered = 0
        boxes = entry.boxes
        if len(boxes) < _INDEX_FROM:
            for sb in boxes:
                region = intersect(Box(sb.offsets, sb.lengths), box)
                if region is not None and region.numel:
                    items.append(ReadItem(name, di, sb, region))
                    covered += region.numel
        else:
            index = indexes.get(name)
            if index is None:
                index = indexes[name] = _index(entry)
            found, offs, lens = index.overlapping(box)
            covered = int(lens.prod(axis=1).sum()) if len(found) else 0
            items += [ReadItem(name, di, boxes[i], Box(tuple(o), tuple(n)))
                      for i, o, n in zip(found.tolist(), offs.tolist(), lens.tolist())]
        if covered < box.numel:
            gaps.append(f"{name}: the checkpoint holds only {covered} of the {box.numel} elements of box "
                        f"offsets={list(box.offsets)} lengths={list(box.lengths)}")
    if gaps:
        raise MismatchError("the checkpoint does not cover every element this rank needs:\n  " + "\n  ".join(gaps), gaps)
    return items


def _index(entry) -> BoxIndex:
    cols = getattr(entry, "columns", None)   # None for transforms' derived boxes: those are indexed from the box list
    if cols is not None:
        return BoxIndex(cols.offsets, cols.lengths)
    return BoxIndex.of(entry.boxes, len(entry.shape))


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
