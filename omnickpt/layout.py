"""Boxes: the regular (hyper-rectangular) parts of a global tensor that ranks hold.

A box is (offsets, lengths) in the coordinates of the global tensor. Everything about resharding
comes down to intersecting boxes and turning an intersection into byte runs of a row-major box.
Pure functions only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    def key(self) -> tuple:
        return (self.offsets, self.lengths)

    def within(self, shape: Sequence[int]) -> bool:
        return all(o >= 0 and l >= 0 and o + l <= s for o, l, s in zip(self.offsets, self.lengths, shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None when they do not overlap."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def relative(inner: Box, outer: Box) -> Box:
    """`inner` expressed in the local coordinates of `outer` (which must contain it)."""
    return Box(tuple(i - o for i, o in zip(inner.offsets, outer.offsets)), inner.lengths)


def row_major_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def element_runs(sub: Box, outer_lengths: Sequence[int]) -> tuple[int, int, Iterator[int]]:
    """Contiguous runs of `sub` (local coordinates) inside a row-major array of `outer_lengths`.

    Returns (run_elements, run_count, starts) where starts yields each run's first element index
    in the outer array, in the row-major order of `sub`. Trailing dimensions that `sub` covers fully
    merge into one run, so a slab of whole rows is a single run.
    """
    nd = len(outer_lengths)
    if nd == 0:
        return 1, 1, iter([0])
    # k: the first dimension from which `sub` spans whole rows of the outer array.
    k = nd
    while k > 0 and sub.lengths[k - 1] == outer_lengths[k - 1] and sub.offsets[k - 1] == 0:
        k -= 1
    if k == 0:
        return math.prod(outer_lengths), 1, iter([0])
    # dimension k-1 contributes a contiguous stretch; dims before it are iterated
    strides = row_major_strides(outer_lengths)
    run = sub.lengths[k - 1] * strides[k - 1]
    count = math.prod(sub.lengths[: k - 1])

    def starts() -> Iterator[int]:
        base = sum(o * s for o, s in zip(sub.offsets, strides))
        if k == 1:
            yield base
            return
        outer_dims = sub.lengths[: k - 1]
        outer_strides = strides[: k - 1]
        idx = [0] * (k - 1)
        for _ in range(count):
            yield base + sum(i * s for i, s in zip(idx, outer_strides))
            for d in range(k - 2, -1, -1):
                idx[d] += 1
                if idx[d] < outer_dims[d]:
                    break
                idx[d] = 0

    return run, count, starts()


def flat_range_to_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """Decompose the elements [start, start+length) of a row-major tensor into regular boxes.

    At most 2*ndim-1 boxes come out, with no communication; this is how a contiguous range of a
    flattened parameter (FSDP1 flat parameters, flattened optimizer buffers) becomes layout-free.
    Boxes are returned in row-major order, so their elements concatenated are the range.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if start < 0 or length < 0 or start + length > total:
        raise ValueError(f"range [{start}, {start + length}) outside a tensor of {total} elements")
    if length == 0:
        return []
    if len(shape) == 0:
        return [Box((), ())]
    return _decompose(shape, start, start + length)


def _decompose(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    # Recursive on the leading dimension: a partial leading row, whole rows, a partial trailing row.
    if len(shape) == 1:
        return [Box((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first_row, last_row = lo // inner, (hi - 1) // inner
    boxes: list[Box] = []

    def prefixed(row: int, sub: list[Box]) -> list[Box]:
        return [Box((row,) + b.offsets, (1,) + b.lengths) for b in sub]

    if first_row == last_row:
        return prefixed(first_row, _decompose(shape[1:], lo - first_row * inner, hi - first_row * inner))
    whole_start = first_row
    if lo % inner:
        boxes += prefixed(first_row, _decompose(shape[1:], lo - first_row * inner, inner))
        whole_start = first_row + 1
    whole_end = last_row + 1 if hi % inner == 0 else last_row
    if whole_end > whole_start:
        boxes.append(Box((whole_start,) + (0,) * (len(shape) - 1), (whole_end - whole_start,) + shape[1:]))
    if hi % inner:
        boxes += prefixed(last_row, _decompose(shape[1:], 0, hi - last_row * inner))
    return boxes
