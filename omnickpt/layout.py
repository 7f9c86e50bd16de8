"""Boxes: the regular (hyper-rectangular) parts of a global tensor that ranks hold.

A box is (offsets, lengths) in the coordinates of the global tensor. Everything about resharding
comes down to intersecting boxes and turning an intersection into byte runs of a row-major box.
Pure functions only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


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


class BoxIndex:
    """The boxes of one tensor, indexed so that the ones overlapping a query box are found without
    scanning them all: sorted by their start along the first dimension, a query looks only at the
    boxes that start less than the longest box's length before its own start, and intersects those
    with numpy, all dimensions at once. Boxes that cut a tensor into row slabs or a grid (any
    FSDP/TP layout) give each query only its neighbours.

    `offsets` and `lengths` are [n, ndim] integer arrays (box i is row i)."""

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray):
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.ndim = offsets.shape[1]
        if self.ndim == 0 or not len(offsets):
            self._order = np.arange(len(offsets))
            self._starts = np.zeros(len(offsets), dtype=np.int64)
            self._span = 0
        else:
            self._order = np.argsort(offsets[:, 0], kind="stable")
            self._starts = offsets[self._order, 0]
            self._span = int(lengths[:, 0].max())
        self._lo = offsets[self._order]
        self._hi = self._lo + lengths[self._order]

    @classmethod
    def of(cls, boxes: Sequence["Box"], ndim: int) -> "BoxIndex":
        n = len(boxes)
        offs = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(n, ndim)
        lens = np.array([b.lengths for b in boxes], dtype=np.int64).reshape(n, ndim)
        return cls(offs, lens)

    def overlapping(self, box: "Box") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(indices of the boxes sharing at least one element with `box`, ascending; the
        intersections' offsets [k, ndim]; their lengths [k, ndim])."""
        if self.ndim == 0:
            idx = np.arange(len(self._order)) if box.numel else np.zeros(0, dtype=np.int64)
            empty = np.zeros((len(idx), 0), dtype=np.int64)
            return idx, empty, empty
        q_lo = np.asarray(box.offsets, dtype=np.int64)
        q_hi = q_lo + np.asarray(box.lengths, dtype=np.int64)
        a = int(np.searchsorted(self._starts, q_lo[0] - self._span, side="right"))
        b = int(np.searchsorted(self._starts, q_hi[0], side="left"))
        lo = np.maximum(self._lo[a:b], q_lo)
        hi = np.minimum(self._hi[a:b], q_hi)
        keep = np.flatnonzero((hi > lo).all(axis=1))
        idx = self._order[a:b][keep]
        lo, hi = lo[keep], hi[keep]
        order = np.argsort(idx, kind="stable")
        return idx[order], lo[order], (hi - lo)[order]


def relative(inner: Box, outer: Box) -> Box:
    """`inner` expressed in the local coordinates of `outer` (which must contain it)."""
    return Box(tuple(i - o for i, o in zip(inner.offsets, outer.offsets)), inner.lengths)


def row_major_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def contiguous_start(inner: Box, outer: Box) -> int | None:
    """The row-major index, within `outer`, of the first element of `inner` (a non-empty box
    inside it, both in global coordinates) when `inner` is one contiguous run of the row-major
    `outer`; None when it is several runs."""
    lens, outer_lens = inner.lengths, outer.lengths
    k = len(outer_lens)
    while k > 0 and lens[k - 1] == outer_lens[k - 1]:
        k -= 1
    # Dims from k on are whole; dim k-1 is a stretch; every dim before it must be a single index.
    for d in range(k - 1):
        if lens[d] != 1:
            return None
    first, acc = 0, 1
    for d in range(len(outer_lens) - 1, -1, -1):
        first += (inner.offsets[d] - outer.offsets[d]) * acc
        acc *= outer_lens[d]
    return first


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
