"""Boxes: intersect, relative, element_runs and flat_range_to_boxes against brute-force numpy.

Each property is checked on many random cases: with hypothesis when it is installed, otherwise on
seeded random draws (reproducible: a failure prints the seed's case).
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from omnickpt.layout import Box, element_runs, flat_range_to_boxes, intersect, relative, row_major_strides

CASES = 1500


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + l) for o, l in zip(box.offsets, box.lengths))


def _shape(rng: random.Random, max_ndim: int = 4, max_len: int = 6) -> tuple[int, ...]:
    return tuple(rng.randint(1, max_len) for _ in range(rng.randint(0, max_ndim)))


def _box(rng: random.Random, shape, allow_empty: bool = True) -> Box:
    offs, lens = [], []
    for s in shape:
        o = rng.randint(0, s if allow_empty else s - 1)
        lens.append(rng.randint(0 if allow_empty else 1, s - o))
        offs.append(o)
    return Box(tuple(offs), tuple(lens))


def _mask(shape, box: Box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[_slices(box)] = True
    return m


def test_box_rejects_offsets_and_lengths_of_different_rank():
    with pytest.raises(ValueError, match="differ in rank"):
        Box((0, 0), (1,))


def test_box_within_and_numel():
    assert Box((1, 2), (3, 4)).numel == 12
    assert Box((), ()).numel == 1          # a scalar is one element
    assert Box((1, 2), (3, 4)).within((4, 6))
    assert not Box((1, 2), (3, 5)).within((4, 6))
    assert not Box((-1, 0), (1, 1)).within((4, 6))


def test_intersect_matches_numpy_masks():
    rng = random.Random(1234)
    for case in range(CASES):
        shape = _shape(rng)
        a, b = _box(rng, shape), _box(rng, shape)
        expected = _mask(shape, a) & _mask(shape, b)
        got = intersect(a, b)
        if not expected.any():
            # an empty intersection is None (a scalar's boxes always overlap: ndim 0 never gets here)
            assert got is None or got.numel == 0, (case, shape, a, b, got)
            continue
        assert got is not None, (case, shape, a, b)
        assert np.array_equal(_mask(shape, got), expected), (case, shape, a, b, got)
        assert intersect(b, a) == got          # symmetric


def test_relative_addresses_the_same_elements_inside_the_outer_box():
    rng = random.Random(99)
    for case in range(CASES):
        shape = _shape(rng)
        glob = np.arange(math.prod(shape)).reshape(shape)
        outer = _box(rng, shape, allow_empty=False)
        inner = _box(rng, outer.lengths)                     # local to outer ...
        inner = Box(tuple(o + i for o, i in zip(outer.offsets, inner.offsets)), inner.lengths)  # ... made global
        local = glob[_slices(outer)]
        rel = relative(inner, outer)
        assert np.array_equal(local[_slices(rel)], glob[_slices(inner)]), (case, shape, outer, inner)


def test_element_runs_cover_the_sub_box_in_row_major_order_with_fewest_runs():
    rng = random.Random(7)
    for case in range(CASES):
        outer = _shape(rng)
        sub = _box(rng, outer)
        flat = np.arange(math.prod(outer))
        arr = flat.reshape(outer)
        run, count, starts = element_runs(sub, outer)
        starts = list(starts)
        assert len(starts) == count, (case, outer, sub)
        got = np.concatenate([flat[s:s + run] for s in starts]) if starts else np.empty(0, dtype=flat.dtype)
        want = arr[_slices(sub)].ravel()
        if sub.numel == 0:
            assert got.size == 0, (case, outer, sub)
            continue
        assert np.array_equal(got, want), (case, outer, sub, run, starts)
        # Fewest runs: one per break in the (increasing) flat indices of the sub-box.
        breaks = int(np.count_nonzero(np.diff(want) != 1))
        assert count == breaks + 1, (case, outer, sub, run, count)


def test_element_runs_merge_whole_rows_into_one_run():
    # Rows 1..2 of a (4, 5) array are one run of 10 elements starting at element 5.
    run, count, starts = element_runs(Box((1, 0), (2, 5)), (4, 5))
    assert (run, count, list(starts)) == (10, 1, [5])
    run, count, starts = element_runs(Box((), ()), ())
    assert (run, count, list(starts)) == (1, 1, [0])


def test_row_major_strides():
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides(()) == ()


def test_flat_range_to_boxes_exact_cover_in_order_and_at_most_2n_minus_1_boxes():
    rng = random.Random(2024)
    for case in range(CASES * 2):
        shape = _shape(rng, max_ndim=5, max_len=5)
        total = math.prod(shape)
        start = rng.randint(0, total)
        length = rng.randint(0, total - start)
        boxes = flat_range_to_boxes(shape, start, length)
        arr = np.arange(total).reshape(shape)
        if length == 0:
            assert boxes == []
            continue
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (case, shape, start, length, boxes)
        assert all(b.within(shape) and b.numel > 0 for b in boxes), (case, shape, start, length, boxes)
        got = np.concatenate([arr[_slices(b)].ravel() for b in boxes])
        assert np.array_equal(got, np.arange(start, start + length)), (case, shape, start, length, boxes)


def test_flat_range_to_boxes_worst_case_uses_all_2n_minus_1_boxes():
    # A range starting one element into the tensor and ending one element before its end needs a
    # partial box per dimension on each side plus the whole middle.
    shape = (3, 3, 3)
    boxes = flat_range_to_boxes(shape, 1, 25)
    assert len(boxes) == 5
    assert sum(b.numel for b in boxes) == 25


def test_flat_range_to_boxes_rejects_ranges_outside_the_tensor():
    with pytest.raises(ValueError, match="outside a tensor of 6 elements"):
        flat_range_to_boxes((2, 3), 4, 3)
    with pytest.raises(ValueError):
        flat_range_to_boxes((2, 3), -1, 2)
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]


# ------------------------------------------------------------------------------ overlap and tiling
def _brute_overlap(boxes: list[Box]) -> bool:
    return any(intersect(a, b) is not None and a.numel and b.numel
               for i, a in enumerate(boxes) for b in boxes[i + 1:])


@pytest.mark.parametrize("count", [3, 40, 200])   # pair by pair, all pairs at once, and the sweeps
def test_overlap_problem_agrees_with_brute_force(count):
    from omnickpt.layout import overlap_problem, overlap_problem_arrays, tiling_problem
    for case in range(60):
        rng = random.Random(case * 1000 + count)
        shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 4)))
        boxes = [_box(rng, shape) for _ in range(rng.randint(0, count))]
        if rng.random() < 0.5:   # a disjoint tiling (rows), optionally with one box doubled
            boxes = [Box((i,) + (0,) * (len(shape) - 1), (1,) + shape[1:]) for i in range(shape[0])]
            if rng.random() < 0.5:
                boxes.append(boxes[rng.randrange(len(boxes))])
        want = _brute_overlap(boxes)
        got = overlap_problem(shape, boxes)
        assert (got is not None) == want, (case, shape, boxes, got)
        n = len(boxes)
        lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(n, len(shape))
        ln = np.array([b.lengths for b in boxes], dtype=np.int64).reshape(n, len(shape))
        assert (overlap_problem_arrays(lo, ln) is not None) == want, (case, shape, boxes)
        held = sum(b.numel for b in boxes)
        assert (tiling_problem(shape, boxes) is None) == (not want and held == math.prod(shape))


def test_bulk_disjoint_never_clears_an_overlap():
    from omnickpt.layout import bulk_disjoint
    rows = [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]        # sorted slabs: proven disjoint in bulk
    cols = [Box((0, 2), (4, 2)), Box((0, 0), (4, 2))]        # disjoint but unsorted: left to the exact test
    clash = [Box((0, 0), (3, 4)), Box((2, 0), (2, 4))]       # overlapping: never cleared
    boxes = rows + cols + clash
    lo = np.array([b.offsets for b in boxes], dtype=np.int64)
    ln = np.array([b.lengths for b in boxes], dtype=np.int64)
    clear = bulk_disjoint(lo, ln, ln.prod(axis=1), np.array([2, 2, 2]))
    assert clear.tolist() == [True, False, False]


def test_layout_stays_a_leaf():
    # layout is pure geometry: the format, the planner and the readers import it, never the reverse
    import ast
    import omnickpt.layout as layout
    tree = ast.parse(open(layout.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.startswith("omnickpt") for m in imported), imported


def test_present_gives_np_unique_of_indices():
    from omnickpt.layout import present
    rng = np.random.default_rng(3)
    for n, top in ((0, 1), (1, 1), (50, 7), (24000, 24000), (1000, 10 ** 6)):
        a = rng.integers(0, top, size=n, dtype=np.int64)
        assert present(a).tolist() == np.unique(a).tolist()
