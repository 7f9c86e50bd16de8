"""Planning is pure: plans for many ranks are built here from plain records, with no processes."""
from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest

from omnickpt.errors import MismatchError, PlanError
from omnickpt.format import FileEntry, Manifest, SavedBox, TensorEntry
from omnickpt.layout import Box, flat_range_to_boxes
from omnickpt.planner import ShardRecord, WriteItem, build_global_plan, plan_reads, structure_digest
from omnickpt.planner import save_plan
from omnickpt.planner.save_plan import ALIGN, RecordBatch


def rec(name, shape, box: Box | None = None, dtype="float32", itemsize=4) -> ShardRecord:
    return ShardRecord(name, tuple(shape), dtype, itemsize, box or Box.full(shape))


def _written(plan) -> list[tuple[int, ShardRecord]]:
    """(rank, record) for every box the plan writes."""
    return [(r, plan.records[r][w.index]) for r, ws in enumerate(plan.writes) for w in ws]


def _check_file_layout(plan):
    for rank, ws in enumerate(plan.writes):
        end = 0
        for w in sorted(ws, key=lambda w: w.offset):
            assert w.offset % ALIGN == 0 and w.offset >= end, (rank, w)
            assert w.nbytes == plan.records[rank][w.index].nbytes
            end = w.offset + w.nbytes
        assert plan.tensor_bytes[rank] >= end


# ---------------------------------------------------------------------------------------- save plan
def test_replicas_are_written_exactly_once_and_shards_by_their_holder():
    world = 3
    records = []
    for r in range(world):
        shard = Box((2 * r, 0), (2, 4))
        records.append([rec("model/replicated", (5, 5)), rec("model/sharded", (6, 4), shard),
                        rec("model/bias", (7,))])
    plan = build_global_plan(records)
    written = _written(plan)
    names = sorted(rc.name for _, rc in written)
    assert names == ["model/bias", "model/replicated"] + ["model/sharded"] * world
    for rank, rc in written:
        if rc.name == "model/sharded":
            assert rc.box.offsets == (2 * rank, 0)        # nobody else holds that box
    _check_file_layout(plan)


def test_two_ranks_with_the_same_ten_tensors_write_balanced_bytes():
    rng = random.Random(5)
    for trial in range(50):
        sizes = [rng.randint(1, 4000) for _ in range(10)]
        same = [rec(f"t{i}", (n,)) for i, n in enumerate(sizes)]
        plan = build_global_plan([list(same), list(same)])
        per_rank = plan.bytes_per_rank()
        assert sum(per_rank) == sum(sizes) * 4                  # each tensor written once
        assert sorted(rc.name for _, rc in _written(plan)) == sorted(r.name for r in same)
        # within one tensor of each other (greedy largest-first onto the least-loaded rank)
        assert abs(per_rank[0] - per_rank[1]) <= max(sizes) * 4, (trial, sizes, per_rank)
        _check_file_layout(plan)


def test_equal_replicas_split_evenly_over_many_ranks():
    # 8 data-parallel ranks holding 64 equal tensors: 8 writes each, not everything on rank 0.
    world = 8
    records = [[rec(f"layer{i}.weight", (16, 16)) for i in range(64)] for _ in range(world)]
    plan = build_global_plan(records)
    assert [len(ws) for ws in plan.writes] == [8] * world
    assert len(set(plan.bytes_per_rank())) == 1


def test_thousands_of_ranks_plan_without_processes():
    # FSDP-like: a row-sharded weight over 4096 ranks and a replicated bias.
    world, rows = 4096, 8192
    records = [[rec("w", (rows, 4), Box((2 * r, 0), (2, 4))), rec("b", (4,))] for r in range(world)]
    plan = build_global_plan(records)
    written = _written(plan)
    assert len(written) == world + 1
    assert sum(rc.box.numel for _, rc in written if rc.name == "w") == rows * 4
    assert sum(1 for _, rc in written if rc.name == "b") == 1


def test_flat_ranges_of_an_fsdp1_style_flat_parameter_plan_as_boxes():
    # A flat parameter split unevenly over 3 ranks: each rank's range becomes boxes; together
    # they write every element once.
    shape = (5, 7, 3)
    total = math.prod(shape)
    cuts = [0, 31, 77, total]
    records = [[rec("flat", shape, b) for b in flat_range_to_boxes(shape, cuts[r], cuts[r + 1] - cuts[r])]
               for r in range(3)]
    plan = build_global_plan(records)
    count = np.zeros(shape, dtype=int)
    for _, rc in _written(plan):
        count[tuple(slice(o, o + n) for o, n in zip(rc.box.offsets, rc.box.lengths))] += 1
    assert (count == 1).all()


def test_conflicting_shapes_name_the_tensor_and_both_ranks():
    records = [[rec("model/w", (4, 4))], [rec("model/w", (4, 4))], [rec("model/w", (4, 5))]]
    with pytest.raises(PlanError) as info:
        build_global_plan(records)
    msg = str(info.value)
    assert "'model/w'" in msg and "rank 0" in msg and "rank 2" in msg and "[4, 5]" in msg


def test_conflicting_dtypes_and_boxes_outside_the_shape_are_plan_errors():
    with pytest.raises(PlanError, match=r"rank 0 .*float32.* rank 1 .*bfloat16"):
        build_global_plan([[rec("w", (4,))], [rec("w", (4,), dtype="bfloat16", itemsize=2)]])
    with pytest.raises(PlanError, match=r"'w': rank 1 holds box .* outside shape \[4\]"):
        build_global_plan([[rec("w", (4,), Box((0,), (2,)))], [rec("w", (4,), Box((2,), (3,)))]])


def _plan_arrays(plan):
    return [plan.write_start.tolist(), plan.write_index.tolist(), plan.write_offset.tolist(),
            plan.write_nbytes.tolist(), [plan.names[t] for t in plan.write_tensor], plan.tensor_bytes]


@pytest.mark.parametrize("world", [1, 2, 7, 64])
def test_the_uniform_and_the_general_planner_make_the_same_plan(world):
    # FSDP rows, column blocks (TP) and replicas of several sizes, as every rank reports them: the
    # array planner for that usual layout must decide exactly what the general one does.
    recs = []
    for r in range(world):
        rows = [rec(f"rows{i}", (world * 3, 5), Box((3 * r, 0), (3, 5))) for i in range(4)]
        cols = [rec("cols", (2, world * 2), Box((0, 2 * r), (2, 2)), dtype="bfloat16", itemsize=2)]
        reps = [rec(f"rep{i}", (1 + (i * 37) % 11,)) for i in range(9)] + [rec("step", ())]
        recs.append(rows + reps[:5] + cols + reps[5:])
    batches = [RecordBatch.from_records(r) for r in recs]
    table = save_plan._tensor_table(batches)
    fast = save_plan._plan_uniform(batches, *table)
    assert fast is not None
    slow = save_plan._plan_general(batches, *table)
    assert _plan_arrays(fast) == _plan_arrays(slow)
    assert _plan_arrays(build_global_plan(recs)) == _plan_arrays(fast)
    _check_file_layout(fast)


@pytest.mark.parametrize("groups", [2, 3])
def test_hsdp_plans_the_same_with_both_planners_and_bulk_balancing(groups, monkeypatch):
    # `groups` replica groups x 4 shards of 3 tensors, a full replica, in shuffled rank order:
    # the array planner, the general one and the bulk balancing by holder set agree.
    world, shards = 4 * groups, 4
    perm = random.Random(groups).sample(range(shards), shards)
    recs = [[rec(f"w{i}", (8, 4 + i), Box((2 * perm[r % shards], 0), (2, 4 + i))) for i in range(3)]
            + [rec("b", (5,))] for r in range(world)]
    batches = [RecordBatch.from_records(r) for r in recs]
    table = save_plan._tensor_table(batches)
    fast = save_plan._plan_uniform(batches, *table)
    slow = save_plan._plan_general(batches, *table)
    assert fast is not None and _plan_arrays(fast) == _plan_arrays(slow)
    monkeypatch.setattr(save_plan, "LOOP_LIMIT", 0)     # the bulk path for any number of boxes
    bulk = save_plan._plan_uniform(batches, *table)
    written = _written(bulk)
    assert sorted((rc.name, rc.box.offsets) for _, rc in written) == sorted(
        {(f"w{i}", (2 * s, 0)) for i in range(3) for s in range(shards)} | {("b", (0,))})
    per_rank = bulk.bytes_per_rank()
    assert max(per_rank) - min(per_rank) <= 2 * 2 * 6 * 4     # within a box or two of each other
    _check_file_layout(bulk)


def test_bulk_balancing_is_the_greedy_one_when_holder_sets_are_disjoint():
    rng = random.Random(7)
    world = 12
    recs = [[] for _ in range(world)]
    for i in range(300):   # boxes of random sizes, each held by one of 4 disjoint rank triples
        n = rng.randint(1, 50)
        for r in [(i % 4) + 4 * k for k in range(3)]:
            recs[r].append(rec(f"t{i}", (n,)))
    batches = [RecordBatch.from_records(r) for r in recs]
    table = save_plan._tensor_table(batches)
    one_by_one = save_plan._plan_general(batches, *table)
    save_plan.LOOP_LIMIT, saved = 0, save_plan.LOOP_LIMIT
    try:
        bulk = save_plan._plan_general(batches, *table)
    finally:
        save_plan.LOOP_LIMIT = saved
    assert _plan_arrays(bulk) == _plan_arrays(one_by_one)


def test_hsdp_replicas_of_shards_are_written_once_each_and_balanced():
    # 2 replica groups x 4 shards: each shard box is held by 2 ranks, written by one of them.
    world = 8
    recs = [[rec("w", (8, 4), Box((2 * (r % 4), 0), (2, 4))), rec("b", (4,))] for r in range(world)]
    plan = build_global_plan(recs)
    written = _written(plan)
    assert sorted(rc.box.offsets for _, rc in written if rc.name == "w") == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert sum(1 for _, rc in written if rc.name == "b") == 1
    assert max(len(ws) for ws in plan.writes) == 1   # 5 boxes over 8 ranks: nobody writes two
    _check_file_layout(plan)


def test_overlapping_boxes_are_refused_naming_the_tensor_and_ranks():
    # Two ranks claim rows 0..3 and 2..5 of one tensor: not replicas, and they share rows 2..3.
    recs = [[rec("w", (6, 2), Box((0, 0), (4, 2)))], [rec("w", (6, 2), Box((2, 0), (4, 2)))]]
    with pytest.raises(PlanError, match=r"'w'.*overlap.*ranks \[0, 1\]"):
        build_global_plan(recs)
    grid = [[rec("g", (4, 4), Box((0, 0), (2, 3)))], [rec("g", (4, 4), Box((1, 2), (2, 2)))],
            [rec("g", (4, 4), Box((2, 0), (2, 2)))]]
    with pytest.raises(PlanError, match=r"'g'.*overlap"):
        build_global_plan(grid)


def test_records_travel_as_compact_arrays_and_tables_once():
    world = 64
    recs = [[rec(f"model/layers.{i}.weight", (world * 4, 1024), Box((4 * r, 0), (4, 1024))) for i in range(500)]
            for r in range(world)]
    batches = [RecordBatch.from_records(r) for r in recs]
    full = len(pickle.dumps(batches[1]))
    lean = len(pickle.dumps(batches[1].without_table()))
    assert lean < 10 * 500 < full < len(pickle.dumps(recs[1]))   # a few bytes per record without the names
    assert batches[1].records() == recs[1]
    # Ranks that share rank 0's table leave it out; the coordinator plans the same.
    sent = [batches[0]] + [b.without_table() for b in batches[1:]]
    assert _plan_arrays(build_global_plan(sent)) == _plan_arrays(build_global_plan(batches))
    with pytest.raises(PlanError, match="without their tensor table"):
        build_global_plan([b.without_table() for b in batches])


def test_ranks_without_records_and_empty_boxes_plan_like_any_other():
    plan = build_global_plan([[rec("a", (3,))], []])
    assert plan.bytes_per_rank() == [12, 0] and list(plan.writes) == [[WriteItem(0, 0, 12)], []]
    # A tensor with no elements is still planned once (its manifest entry needs a record).
    plan = build_global_plan([[rec("z", (0, 4)), rec("s", ())], [rec("z", (0, 4)), rec("s", ())]])
    assert sorted((rc.name, rc.nbytes) for _, rc in _written(plan)) == [("s", 4), ("z", 0)]
    assert build_global_plan([[], []]).tensor_bytes == [0, 0]


def test_structure_digest_changes_with_any_structural_change():
    base = [rec("w", (4, 4), Box((0, 0), (2, 4))), rec("b", (4,))]
    d = structure_digest(base)
    assert structure_digest(list(base)) == d                   # stable
    assert structure_digest([rec("w", (4, 4), Box((2, 0), (2, 4))), rec("b", (4,))]) != d   # box moved
    assert structure_digest([rec("w", (4, 4), Box((0, 0), (2, 4))), rec("b", (4,), dtype="float16",
                                                                           itemsize=2)]) != d
    assert structure_digest(base[::-1]) != d                   # order is the plan's index order
    # a box of a tensor that spans more than 255 elements narrows its arrays to wider integers: the
    # digest follows the values, not the integer width
    assert structure_digest([rec("w", (400, 4), Box((0, 0), (2, 4))), rec("b", (4,))]) != structure_digest(
        [rec("w", (400, 4), Box((300, 0), (2, 4))), rec("b", (4,))])


def test_a_batch_of_boxes_of_several_dimensions_keeps_every_record():
    # 0-d step counts, 1-d and 2-d boxes in one batch: padded to the widest, read back as they were,
    # and the same batch whether made from records or from the shards' columns
    recs = [rec("step", ()), rec("b", (300,), Box((256,), (44,))), rec("w", (4, 6), Box((2, 3), (2, 3)), "bfloat16", 2),
            rec("z", (0, 4))]
    batch = RecordBatch.from_records(recs)
    assert batch.records() == recs and batch.offsets.shape == (4, 2)
    assert batch.lengths[:2].tolist() == [[1, 1], [44, 1]]   # padded with length 1: a box's size is the product
    cols = RecordBatch.from_columns([r.name for r in recs], [list(r.shape) for r in recs], [r.dtype for r in recs],
                                    [r.itemsize for r in recs], [r.box for r in recs])
    assert cols.records() == recs and cols.structure_digest() == batch.structure_digest() == structure_digest(recs)
    assert RecordBatch.from_records([]).structure_digest() == structure_digest([])


# ---------------------------------------------------------------------------------------- load plan
def _manifest(shape, boxes: list[Box], name="w") -> Manifest:
    itemsize = 4
    saved, off = [], 0
    for b in boxes:
        saved.append(SavedBox.stored(b.offsets, b.lengths, 0, off, b.numel * itemsize, [0] * -(-b.numel * itemsize // (1 << 20))))
        off += b.numel * itemsize
    return Manifest("id", 1, [FileEntry("data/id-r00000.bin", 0, off)], {name: TensorEntry(tuple(shape), "float32", saved)},
                    {})


def test_plan_reads_covers_each_wanted_element_exactly_once():
    rng = random.Random(11)
    for trial in range(200):
        shape = (rng.randint(1, 9), rng.randint(1, 9))
        # saved as row slabs (2 ranks), wanted as column slabs (3 ranks): a real reshard
        cut = rng.randint(0, shape[0])
        saved = [b for b in (Box((0, 0), (cut, shape[1])), Box((cut, 0), (shape[0] - cut, shape[1]))) if b.numel]
        m = _manifest(shape, saved)
        cols = sorted(rng.sample(range(shape[1] + 1), 2))
        want = Box((0, cols[0]), (shape[0], cols[1] - cols[0]))
        items = plan_reads(m, [("w", want), ("w", Box.full(shape))])
        for dest, box in enumerate([want, Box.full(shape)]):
            count = np.zeros(shape, dtype=int)
            for it in items:
                if it.dest == dest:
                    assert it.region.within(shape)
                    count[tuple(slice(o, o + n) for o, n in zip(it.region.offsets, it.region.lengths))] += 1
            expect = np.zeros(shape, dtype=int)
            expect[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))] = 1
            assert np.array_equal(count, expect), (trial, shape, saved, box)


def test_plan_reads_marks_whole_box_reads():
    m = _manifest((4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))])
    items = plan_reads(m, [("w", Box.full((4, 4)))])
    assert [it.whole_box for it in items] == [True, True]
    items = plan_reads(m, [("w", Box((0, 0), (4, 2)))])
    assert [it.whole_box for it in items] == [False, False]


def test_plan_reads_gaps_raise_one_mismatch_listing_every_gap():
    # Saved boxes cover only rows 0-1 of w; "v" is not in the checkpoint at all.
    m = _manifest((4, 4), [Box((0, 0), (2, 4))])
    with pytest.raises(MismatchError) as info:
        plan_reads(m, [("w", Box((0, 0), (2, 4))), ("w", Box((1, 0), (2, 4))), ("v", Box.full((3,)))])
    diffs = info.value.differences
    assert len(diffs) == 2
    assert "w: the checkpoint holds only 4 of the 8 elements" in diffs[0] and "offsets=[1, 0]" in diffs[0]
    assert diffs[1] == "v: missing from the checkpoint"
