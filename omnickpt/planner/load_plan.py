"""Load planning: intersect the boxes a rank wants with the boxes the checkpoint holds."""
from __future__ import annotations

from dataclasses import dataclass

from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, SavedBox
from omnickpt.layout import Box, intersect


@dataclass(frozen=True)
class ReadItem:
    """Copy the part `region` (global coordinates) of saved box `saved` into wanted box `dest`."""
    name: str
    dest: int            # index into the wanted list
    saved: SavedBox
    region: Box

    @property
    def whole_box(self) -> bool:
        return self.region.lengths == self.saved.lengths


def plan_reads(manifest: Manifest, wanted: list[tuple[str, Box]]) -> list[ReadItem]:
    """Every (saved box, wanted box) overlap, checking that each wanted box is fully covered."""
    items: list[ReadItem] = []
    gaps: list[str] = []
    for di, (name, box) in enumerate(wanted):
        entry = manifest.tensors[name]
        covered = 0
        for sb in entry.boxes:
            region = intersect(Box(sb.offsets, sb.lengths), box)
            if region is not None and region.numel:
                items.append(ReadItem(name, di, sb, region))
                covered += region.numel
        if covered < box.numel:
            gaps.append(f"{name}: the checkpoint holds only {covered} of the {box.numel} elements of box "
                        f"offsets={list(box.offsets)} lengths={list(box.lengths)}")
    if gaps:
        raise MismatchError("the checkpoint does not cover every element this rank needs:\n  " + "\n  ".join(gaps), gaps)
    return items
