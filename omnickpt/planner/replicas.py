"""Replicas: which of the planner's rows (one per box a rank holds) hold the same box of a
tensor, found in bulk with numpy; two different boxes of a tensor that share an element are
refused here, naming the tensor, the boxes and the ranks that hold them (docs/design.md: a box
is held by one rank or by equal replicas)."""
from __future__ import annotations

import numpy as np

from omnickpt.errors import PlanError
from omnickpt.layout import Box, overlap_problem


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """A stable argsort of non-negative integers below `bound`: LSD radix over 16-bit digits, which
    numpy sorts by counting (far faster than a comparison sort of 4 million int64)."""
    order = np.arange(len(keys))
    for shift in range(0, max(1, int(bound - 1).bit_length()), 16):
        digit = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
    return order


def group_replicas(tid, offs, lens, rank, names, shapes, ntensors) -> np.ndarray:
    """A group id per row: rows with equal boxes of one tensor (replicas) share it. Refuses two
    different boxes of a tensor that share an element.

    Rows are ordered by tensor (a counting sort); per tensor, the dimensions along which its boxes
    differ decide the method: none (every holder has the same box: DDP), one (row or column
    blocks: intervals along that dimension, sorted, compared with their neighbour), or more (2-D
    sharding: exact keys sorted, then the general overlap test on the distinct boxes)."""
    n, ndim = offs.shape
    group = np.zeros(n, dtype=np.int64)
    if not n:
        return group
    order = stable_order(tid, ntensors)
    st = tid[order]
    seg = np.concatenate(([0], np.nonzero(st[1:] != st[:-1])[0] + 1))
    seg_tid = st[seg]
    first = np.empty(ntensors, dtype=np.int64)
    first[seg_tid] = order[seg]
    if ndim:
        differs = (offs[order] != offs[first[st]]) | (lens[order] != lens[first[st]])
        varying = np.logical_or.reduceat(differs, seg, axis=0)          # [segments, ndim]
    else:
        varying = np.zeros((len(seg), 0), dtype=bool)
    nvary = varying.sum(axis=1)
    seg_end = np.append(seg[1:], n)
    # Sort key inside each tensor: the start along its varying dimension (0 where none varies).
    vdim = np.argmax(varying, axis=1) if ndim else np.zeros(len(seg), dtype=np.int64)
    row_seg = np.repeat(np.arange(len(seg)), seg_end - seg)
    if ndim:
        d = vdim[row_seg]
        start = offs[order, d]
        length = lens[order, d]
    else:
        start = length = np.zeros(n, dtype=np.int64)
    one = nvary[row_seg] == 1
    # Order the one-dimension tensors by start where their rows are not already so (FSDP rows come
    # sorted by rank); ties by length keep equal boxes adjacent.
    unsorted = np.zeros(len(seg), dtype=bool)
    if n > 1:
        dec = (start[1:] < start[:-1]) | ((start[1:] == start[:-1]) & (length[1:] < length[:-1]))
        dec &= (row_seg[1:] == row_seg[:-1])
        np.logical_or.at(unsorted, row_seg[1:][dec], True)
    redo = one & unsorted[row_seg]
    if redo.any():
        idx = np.nonzero(redo)[0]
        sub = idx[np.lexsort((length[idx], start[idx], row_seg[idx]))]
        order[idx], start[idx], length[idx] = order[sub], start[sub], length[sub]
    # New group where the tensor changes or (one varying dimension) the interval changes.
    new = np.ones(n, dtype=bool)
    if n > 1:
        same_seg = row_seg[1:] == row_seg[:-1]
        new[1:] = ~same_seg | (one[1:] & ((start[1:] != start[:-1]) | (length[1:] != length[:-1])))
        numel = lens[order].prod(axis=1) if ndim else np.ones(n, dtype=np.int64)
        # Overlap of neighbouring distinct intervals, ignoring empty boxes (they hold no element).
        prev_end = start[:-1] + length[:-1]
        clash = same_seg & one[1:] & new[1:] & (start[1:] < prev_end) & (numel[1:] > 0) & (numel[:-1] > 0)
        if clash.any():
            _refuse(int(np.nonzero(clash)[0][0]), order, tid, offs, lens, rank, names, shapes)
    for s in np.nonzero(nvary > 1)[0]:
        a, b = int(seg[s]), int(seg_end[s])
        new[a:b] = _group_general(order[a:b], tid, offs, lens, rank, names, shapes, order, a)
    group[order] = np.cumsum(new) - 1
    return group


def _group_general(rows, tid, offs, lens, rank, names, shapes, order, a) -> np.ndarray:
    """Rows of one tensor whose boxes differ along several dimensions: sort them by exact box,
    mark where a new box starts (reordering `order[a:]` in place), and test the distinct boxes."""
    keys = np.concatenate([offs[rows], lens[rows]], axis=1)
    sub = np.lexsort(keys.T[::-1])
    rows = rows[sub]
    order[a:a + len(rows)] = rows
    keys = keys[sub]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    t = int(tid[rows[0]])
    k = len(shapes[t])
    distinct = rows[new]
    boxes = [Box(tuple(o[:k]), tuple(l[:k])) for o, l in zip(offs[distinct].tolist(), lens[distinct].tolist())]
    problem = overlap_problem(shapes[t], boxes)
    if problem:
        ranks = sorted(set(rank[rows].tolist()))
        raise PlanError(f"tensor {names[t]!r}: {problem} (held by ranks {_ranks(ranks)}); every element of a tensor must "
                        "be held by one box, or by equal boxes (replicas): check the ShardSpec offsets")
    return new


def _refuse(i: int, order, tid, offs, lens, rank, names, shapes):
    a, b = order[i], order[i + 1]
    t = int(tid[a])
    k = len(shapes[t])
    box = [f"{list(offs[r, :k].tolist())}+{list(lens[r, :k].tolist())}" for r in (a, b)]
    raise PlanError(f"tensor {names[t]!r}: boxes {box[0]} and {box[1]} overlap (held by ranks {_ranks([rank[a], rank[b]])}); "
                    "every element of a tensor must be held by one box, or by equal boxes (replicas): "
                    "check the ShardSpec offsets")


def _ranks(ranks) -> str:
    ranks = sorted(int(r) for r in ranks)
    return str(ranks) if len(ranks) <= 16 else f"{str(ranks[:16])[:-1]}, ... ({len(ranks)} ranks)]"
