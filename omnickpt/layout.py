"""Boxes: the regular (hyper-rectangular) parts of a global tensor that ranks hold.

A box is (offsets, lengths) in the coordinates of the global tensor. Everything about resharding
comes down to intersecting boxes and turning an intersection into byte runs of a row-major box.
Pure functions only.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


@dataclass(frozen=True, slots=True)   # slots: a resharded load makes one per read item, 10^5 and more
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


def spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + counts[i]) as one int64 index array, without a
    loop (the rows of many tensors in a manifest's columns, the chunks of many boxes)."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    if not total:
        return np.zeros(0, dtype=np.int64)
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts)


def present(indices: np.ndarray) -> np.ndarray:
    """The distinct values of non-negative integer indices (into a list of tensors, destinations,
    files), ascending: np.unique's result by one counting pass. np.unique hashes (numpy 2.3+) or
    sorts: 4-40 ms for the 24,000 destinations of a load that this does in a fraction of one."""
    if not len(indices):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.bincount(indices))


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


# ------------------------------------------------------------------------------ overlap and tiling
# Whether boxes share an element: what the manifest decoders refuse (boxes read from an untrusted
# manifest), the save planner refuses (hand-sharded specs) and the foreign readers refuse. A box is
# anything with `offsets` and `lengths` (Box, format's SavedBox); the bulk forms take [n, ndim]
# arrays. Everything here is bounded on hostile input: O(n log n), or refused past a bound.
def tiling_problem(shape: Sequence[int], boxes: Sequence) -> str | None:
    """None when the boxes cover every element of `shape` exactly once, else what is wrong."""
    problem = overlap_problem(shape, boxes)
    if problem:
        return problem
    total, held = math.prod(shape), sum(math.prod(b.lengths) for b in boxes)
    return f"its boxes hold {held} of its {total} elements" if held != total else None


def overlap_problem(shape: Sequence[int], boxes: Sequence) -> str | None:
    """None when no two boxes share an element, else which two do.

    Without overlaps, counting elements proves coverage. A few boxes are compared pair by pair;
    more go to `_array_overlap`, O(n log n) (its docstring says how, and what it refuses).
    """
    boxes = [b for b in boxes if math.prod(b.lengths)]
    if len(boxes) > 32:
        lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
        ln = np.array([b.lengths for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
        return _array_overlap(lo, ln)
    if len(boxes) > 1:
        ndim = len(shape)
        if not ndim:
            return "two boxes of a 0-d tensor overlap"
        dim = max(range(ndim), key=lambda d: len({b.offsets[d] for b in boxes}))
        boxes = sorted(boxes, key=lambda b: b.offsets[dim])
        starts = [b.offsets[dim] for b in boxes]
        for i, a in enumerate(boxes):
            stop = bisect.bisect_left(starts, a.offsets[dim] + a.lengths[dim], lo=i + 1)
            for b in boxes[i + 1:stop]:
                if all(bo < ao + al and ao < bo + bl
                       for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                    return (f"boxes {list(a.offsets)}+{list(a.lengths)} and {list(b.offsets)}+{list(b.lengths)} "
                            "overlap")
    return None


def overlap_problem_arrays(offsets: np.ndarray, lengths: np.ndarray, numel: np.ndarray | None = None) -> str | None:
    """overlap_problem for boxes given as [n, ndim] arrays (BoxColumns)."""
    if numel is None:
        numel = lengths.prod(axis=1) if lengths.shape[1] else np.ones(len(lengths), dtype=np.int64)
    keep = numel > 0
    lo, ln = offsets[keep], lengths[keep]
    if len(lo) <= 1:
        return None
    return _array_overlap(lo, ln)




# Up to this many boxes every pair is compared at once (one numpy operation beats the sorting).
_ALL_PAIRS = 48
# The sweep of three or more interleaved dimensions compares candidate pairs; past this many (or
# _PAIRS_PER_BOX per box) a manifest is refused rather than checked: see _array_overlap.
_MAX_PAIRS, _PAIRS_PER_BOX = 4_000_000, 64


def _array_overlap(lo: np.ndarray, ln: np.ndarray) -> str | None:
    """overlap_problem for non-empty boxes as [n, ndim] arrays, in O(n log n) for every layout but
    pathological ones of three or more interleaved dimensions (refused past a bound, never checked
    for longer: a manifest is untrusted, and every rank and reader decodes it).

    A dimension is a *grid* dimension when the boxes' intervals along it are pairwise equal or
    disjoint (every dimension of a TP x FSDP x EP layout, a dimension no box splits): two boxes
    then share an element there iff they have the same interval, so grouping the boxes by their
    intervals in all grid dimensions leaves only the other dimensions to test within each group:
    none (two boxes in one group overlap), one (sorted intervals must clear the previous end: the
    runs of rows of an incremental save), two (a plane sweep, `_plane_sweep`), or more (the
    candidate sweep, `_sweep_overlap`, whose work is the number of candidate pairs)."""
    n, nd = lo.shape
    if n <= 1:
        return None
    if not nd:
        return "two boxes of a 0-d tensor overlap"
    hi = lo + ln
    if n <= _ALL_PAIRS:
        hit = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(axis=2)
        pairs = np.argwhere(np.triu(hit, 1))
        return _pair(lo, ln, int(pairs[0, 0]), int(pairs[0, 1])) if len(pairs) else None
    grid = [d for d in range(nd) if _is_grid(lo[:, d], hi[:, d])]
    rest = [d for d in range(nd) if d not in grid]
    group = _groups(lo[:, grid]) if grid else np.zeros(n, dtype=np.int64)
    if len(rest) <= 1:
        d = rest[0] if rest else 0
        order = np.lexsort((lo[:, d], group))
        same = group[order[1:]] == group[order[:-1]]
        # no other dimension separates a group: its intervals along d, sorted by start, must each end
        # before the next starts (with none, any two boxes of a group are equal in every dimension)
        clash = same & (lo[order[1:], d] < hi[order[:-1], d]) if rest else same
        k = np.flatnonzero(clash)
        return _pair(lo, ln, int(order[k[0]]), int(order[k[0] + 1])) if len(k) else None
    if len(rest) == 2:
        b = _plane_sweep(lo[:, rest[0]], hi[:, rest[0]], lo[:, rest[1]], hi[:, rest[1]], group)
        if b is None:
            return None
        partner = np.flatnonzero(((lo < hi[b]) & (lo[b] < hi)).all(axis=1))
        return _pair(lo, ln, int(partner[partner != b][0]), b)
    return _sweep_overlap(lo, ln, hi, group, rest)


def _pair(lo: np.ndarray, ln: np.ndarray, a: int, b: int) -> str:
    return f"boxes {lo[a].tolist()}+{ln[a].tolist()} and {lo[b].tolist()}+{ln[b].tolist()} overlap"


def _is_grid(lo: np.ndarray, hi: np.ndarray) -> bool:
    """Whether the intervals [lo, hi) (non-empty) are pairwise equal or disjoint."""
    order = np.lexsort((hi, lo))
    slo, shi = lo[order], hi[order]
    distinct = (slo[1:] != slo[:-1]) | (shi[1:] != shi[:-1])
    # sorted by start, the distinct intervals are disjoint iff each starts at or after the end of the one before
    return not (distinct & (slo[1:] < shi[:-1])).any()


def _groups(keys: np.ndarray) -> np.ndarray:
    """A group number per row of `keys` [n, k], equal for equal rows."""
    order = np.lexsort(keys.T[::-1])
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (keys[order[1:]] != keys[order[:-1]]).any(axis=1)
    group = np.empty(len(keys), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return group


def _plane_sweep(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray, group: np.ndarray) -> int | None:
    """A box that shares an element with an earlier one within its group, as rectangles [x0, x1) x
    [y0, y1), or None: O(n log n) whatever the layout. A sweep along x keeps the boxes it is inside
    of; those are pairwise disjoint in y until a clash is found, so a box entering clashes iff some
    active box starts below its y-end and ends above its y-start: the largest y-end among active
    boxes ranked (by y-start) below its y-end, kept in a max segment tree."""
    n = len(x0)
    rank = np.empty(n, dtype=np.int64)
    by_y = np.argsort(y0, kind="stable")
    rank[by_y] = np.arange(n)
    below = np.searchsorted(y0[by_y], y1, side="left")   # boxes that start below each box's y-end
    # Leaving (at x1) sorts before entering (at x0) at one x, the intervals being half-open; a
    # group's events all come before the next group's, so the tree is empty when a group begins.
    entering = np.repeat([False, True], n)
    order = np.lexsort((entering, np.concatenate([x1, x0]), np.concatenate([group, group])))
    events, entering = np.concatenate([np.arange(n), np.arange(n)])[order], entering[order]
    # size > n: the prefix queries below then never need the root's left border (see the loop)
    size = 1 << n.bit_length()
    tree = [-1] * (2 * size)   # leaf size + rank: the y-end of that box while it is active
    rank_l, below_l, y0_l, y1_l = rank.tolist(), below.tolist(), y0.tolist(), y1.tolist()
    for b, enter in zip(events.tolist(), entering.tolist()):
        i = rank_l[b] + size
        if enter:
            # max over ranks [0, below[b]): from the right end up, taking each left sibling; the
            # left end stays the leftmost node of its level, which adds nothing
            best, r, lft = -1, below_l[b] + size, size
            while lft < r:
                if r & 1:
                    r -= 1
                    if tree[r] > best:
                        best = tree[r]
                lft >>= 1
                r >>= 1
            if best > y0_l[b]:
                return b
            v = y1_l[b]
            tree[i] = v
            i >>= 1
            while i and tree[i] < v:
                tree[i] = v
                i >>= 1
        else:
            tree[i] = -1
            i >>= 1
            while i:
                m = max(tree[2 * i], tree[2 * i + 1])
                if tree[i] == m:
                    break
                tree[i] = m
                i >>= 1
    return None


# Below this many boxes still to compare, the sweep takes each box against all its candidates at
# once rather than one shift at a time (a box spanning the others would otherwise cost a shift each).
_SWEEP_ONE_BY_ONE = 64


def _sweep_overlap(lo: np.ndarray, ln: np.ndarray, hi: np.ndarray, group: np.ndarray, dims: list[int]) -> str | None:
    """The test for three or more interleaved dimensions: sorted (within each group) by start along
    the dimension of `dims` with the fewest candidate pairs (the boxes after a box that start
    before it ends there), box i is compared with its candidates one shift at a time, shift k
    comparing every box i whose candidates reach that far with box i + k. The work is the number of
    candidate pairs, counted first: past max(_MAX_PAIRS, _PAIRS_PER_BOX * n) the boxes are refused."""
    n = len(lo)
    best = None
    for d in dims:
        order = np.lexsort((lo[:, d], group))
        starts = np.unique(lo[:, d])
        # one sortable key per box: (group, dense rank of its start); a box's candidates end at the
        # first box of its group whose start is at or past its end
        key = group[order] * (len(starts) + 1) + np.searchsorted(starts, lo[order, d])
        stop = np.searchsorted(key, group[order] * (len(starts) + 1) + np.searchsorted(starts, hi[order, d]))
        pairs = int((stop - np.arange(n) - 1).sum())
        if best is None or pairs < best[0]:
            best = (pairs, order, stop)
    pairs, order, stop = best
    if pairs > max(_MAX_PAIRS, _PAIRS_PER_BOX * n):
        return (f"its {n} boxes interleave in {len(dims)} dimensions so that proving them disjoint would take "
                f"{pairs} comparisons; no parallel layout writes such boxes, so they are refused unchecked")
    slo, shi = lo[order], hi[order]
    active = np.flatnonzero(stop > np.arange(n) + 1)
    first = None   # (i, j) in sorted positions
    k = 1
    while len(active):
        if len(active) < _SWEEP_ONE_BY_ONE:
            for i in active.tolist():
                j = np.arange(i + k, stop[i])
                hit = ((slo[j] < shi[i]) & (slo[i] < shi[j])).all(axis=1)
                if hit.any():
                    first = (i, int(j[np.argmax(hit)]))
                    break
            break
        j = active + k
        hit = ((slo[j] < shi[active]) & (slo[active] < shi[j])).all(axis=1)
        if hit.any():
            h = int(np.argmax(hit))
            first = (int(active[h]), int(j[h]))
            active = active[:h]   # only an earlier box can still give an earlier pair
        k += 1
        active = active[stop[active] > active + k]
    if first is None:
        return None
    return _pair(lo, ln, int(order[first[0]]), int(order[first[1]]))


def bulk_disjoint(o: np.ndarray, ln: np.ndarray, numel: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per tensor (rows [o, ln, numel] grouped by tensor, counts[t] each, one ndim): True when its
    boxes are proven disjoint in bulk, False when `overlap_problem_arrays` must decide. The usual
    layout (a save writes boxes sorted by offsets; FSDP/TP blocks differ along one dimension) is
    checked for all tensors at once: boxes that differ along one dimension only and are sorted
    along it are disjoint iff each starts at or after the end of the one before."""
    clear = counts <= 1
    nd = o.shape[1]
    if nd == 0 or clear.all():
        return clear
    seg_of = np.repeat(np.arange(len(counts)), counts)
    if not (numel > 0).all():   # empty boxes hold no element
        keep = numel > 0
        o, ln, seg_of = o[keep], ln[keep], seg_of[keep]
    ok = np.ones(len(counts), dtype=bool)
    if len(seg_of) > 1:
        same = seg_of[1:] == seg_of[:-1]
        # A dimension varies in a tensor iff two consecutive boxes of it differ there.
        step = ((o[1:] != o[:-1]) | (ln[1:] != ln[:-1])) & same[:, None]
        pair_seg = seg_of[1:]
        counts = np.bincount(pair_seg, minlength=len(counts))
        starts = np.cumsum(counts) - counts
        varying = np.zeros((len(counts), nd), dtype=bool)
        nonempty = counts > 0
        if nonempty.any():
            varying[nonempty] = np.logical_or.reduceat(step, starts[nonempty], axis=0)
        ok &= varying.sum(axis=1) <= 1
        d = np.argmax(varying, axis=1)[seg_of]
        if (d == d[0]).all():
            lo, hi = o[:, d[0]], o[:, d[0]] + ln[:, d[0]]
        else:
            idx = np.arange(len(o))
            lo, hi = o[idx, d], o[idx, d] + ln[idx, d]
        ok[pair_seg[same & (lo[1:] < hi[:-1])]] = False   # unsorted, or overlapping: the per-tensor test decides
    return clear | ok
