"""The bulk (vectorised) paths against the one-item-at-a-time code they replace: box search
(BoxIndex, indexed plan_reads) on random box sets, and the engine's coalescing of reads and
copies at their edges."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from omnickpt.errors import MismatchError
from omnickpt.format import Manifest, SavedBox, TensorEntry
from omnickpt.format.manifest import FileEntry, Sums
from omnickpt.layout import Box, BoxIndex, flat_range_to_boxes, intersect
from omnickpt.planner import plan_reads
from omnickpt.planner.load_plan import _INDEX_FROM, ReadItem

CASES = 300


def _random_box(rng: random.Random, shape) -> Box:
    offs, lens = [], []
    for s in shape:
        o = rng.randint(0, s)
        offs.append(o)
        lens.append(rng.randint(0, s - o))
    return Box(tuple(offs), tuple(lens))


def _tiling(rng: random.Random, shape) -> list[Box]:
    """Boxes tiling `shape`: a random grid, some cells split further as flat ranges (the uneven
    boxes FSDP1-style flattening makes), in a shuffled order."""
    cuts = [sorted({0, s, *(rng.randint(0, s) for _ in range(rng.randint(0, 4)))}) for s in shape]
    boxes = [Box((), ())] if not shape else []
    def walk(d, offs, lens):
        if d == len(shape):
            boxes.append(Box(tuple(offs), tuple(lens)))
            return
        for a, b in zip(cuts[d], cuts[d][1:]):
            walk(d + 1, offs + [a], lens + [b - a])
    if shape:
        walk(0, [], [])
    out = []
    for b in boxes:
        if b.numel > 1 and rng.random() < 0.3:
            # Split the cell's elements [0, n) into flat ranges, then lift them to the cell.
            n = b.numel
            stops = sorted({0, n, rng.randint(1, n)})
            for lo, hi in zip(stops, stops[1:]):
                for sub in flat_range_to_boxes(b.lengths, lo, hi - lo):
                    out.append(Box(tuple(o + s for o, s in zip(b.offsets, sub.offsets)), sub.lengths))
        else:
            out.append(b)
    rng.shuffle(out)
    return out


def test_box_index_finds_exactly_the_scalar_intersections():
    rng = random.Random(11)
    for case in range(CASES):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 4)))
        boxes = _tiling(rng, shape) if rng.random() < 0.7 else [_random_box(rng, shape) for _ in range(rng.randint(0, 20))]
        index = BoxIndex.of(boxes, len(shape))
        for _ in range(5):
            q = _random_box(rng, shape)
            want = [(i, intersect(b, q)) for i, b in enumerate(boxes)]
            want = [(i, r) for i, r in want if r is not None and r.numel]
            idx, offs, lens = index.overlapping(q)
            got = [(i, Box(tuple(o), tuple(n))) for i, o, n in zip(idx.tolist(), offs.tolist(), lens.tolist())]
            assert got == want, (case, shape, boxes, q)


def _manifest(rng: random.Random, shape, boxes: list[Box]) -> Manifest:
    saved, off = [], 0
    for b in boxes:
        nb = b.numel * 4
        saved.append(SavedBox(b.offsets, b.lengths, 0, off, nb, Sums(off, off + nb, 1 << 20, (rng.getrandbits(32),))))
        off += nb
    return Manifest(save_id="s", world_size=1, files=[FileEntry("data/f.bin", 0, off)],
                    tensors={"t": TensorEntry(shape, "float32", saved)}, objects={})


def _scalar_plan(manifest: Manifest, wanted) -> list[ReadItem]:
    """What plan_reads returned before it was indexed: every saved box intersected in turn."""
    items = []
    for di, (name, box) in enumerate(wanted):
        for sb in manifest.tensors[name].boxes:
            r = intersect(Box(sb.offsets, sb.lengths), box)
            if r is not None and r.numel:
                items.append(ReadItem(name, di, sb, r))
    return items


def test_indexed_plan_reads_equals_the_scalar_plan():
    rng = random.Random(5)
    checked = 0
    for _ in range(CASES):
        shape = tuple(rng.randint(2, 12) for _ in range(rng.randint(1, 3)))
        boxes = _tiling(rng, shape)
        if len(boxes) < _INDEX_FROM:
            continue   # the scalar path: nothing new to compare
        m = _manifest(rng, shape, boxes)
        wanted = [("t", Box.full(shape))] + [("t", _random_box(rng, shape)) for _ in range(4)]
        wanted = [w for w in wanted if w[1].numel]
        assert plan_reads(m, wanted) == _scalar_plan(m, wanted)
        checked += 1
    assert checked > 30


def test_indexed_plan_reads_reports_a_hole():
    shape = (32, 4)
    boxes = [Box((r, 0), (1, 4)) for r in range(32) if r != 17]
    m = _manifest(random.Random(0), shape, boxes)
    with pytest.raises(Exception, match=r"holds only 124 of the 128 elements"):
        plan_reads(m, [("t", Box.full(shape))])


def test_box_index_on_a_large_grid():
    # 1000 x 1000 boxes of 1 x 1: a 3 x 3 query must come back with 9, in the tensor's box order.
    n = 1000
    offs = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
    index = BoxIndex(offs, np.ones_like(offs))
    idx, lo, ln = index.overlapping(Box((10, 20), (3, 3)))
    assert idx.tolist() == [r * n + c for r in range(10, 13) for c in range(20, 23)]
    assert (ln == 1).all() and lo.tolist()[0] == [10, 20]


def test_contiguous_start_agrees_with_element_runs():
    from omnickpt.layout import contiguous_start, element_runs
    rng = random.Random(3)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 4)))
        sub = _random_box(rng, shape)
        if not sub.numel:
            continue
        run, count, starts = element_runs(sub, shape)
        first = next(iter(starts))
        outer = Box(tuple(rng.randint(0, 3) for _ in shape), shape)   # anywhere in the global tensor
        inner = Box(tuple(o + s for o, s in zip(outer.offsets, sub.offsets)), sub.lengths)
        assert contiguous_start(inner, outer) == (first if count == 1 else None), (shape, sub)


def test_bulk_copy_and_checksums_match_per_item():
    from omnickpt.engine.staging import checksums
    from omnickpt.format import checksum
    from concurrent.futures import ThreadPoolExecutor
    rng = random.Random(1)
    data = bytes(rng.getrandbits(8) for _ in range(1 << 16)) * 200   # 13 MB: past the parallel threshold
    mv = memoryview(data)
    cuts = sorted({0, len(data), *(rng.randint(0, len(data)) for _ in range(3000))})
    spans = [mv[a:b] for a, b in zip(cuts, cuts[1:])]
    with ThreadPoolExecutor(4) as ex:
        assert checksums(spans, ex) == [checksum(s) for s in spans]
    assert checksums(spans[:3], None) == [checksum(s) for s in spans[:3]]


def test_sync_save_packs_small_tensors_with_zero_gaps(tmp_path):
    """Small tensors of a sync save are packed into one buffer per run; the alignment gaps
    between them must be zeros (as when each was written alone), a large tensor in between is
    written from its own memory, and everything loads back bitwise."""
    import omnickpt
    from omnickpt.storage import storage_for
    gen = torch.Generator().manual_seed(0)
    spec = lambda t: omnickpt.ShardSpec(t, (0,) * t.dim(), t.shape)  # noqa: E731  (tensors, not objects)
    state = {f"s{i}": spec(torch.randn(1 + i % 5, generator=gen)) for i in range(40)}     # 4..20 bytes each
    state["big"] = spec(torch.randn(300_000, generator=gen))                               # 1.2 MB: not packed
    state.update({f"t{i}": spec(torch.randn(3, 7, generator=gen).to(torch.float64)) for i in range(40)})
    with omnickpt.Checkpointer() as ckpt:
        # An async save first leaves non-zero bytes in the pool buffers that the sync save packs into.
        for _ in range(2):
            ckpt.save(str(tmp_path / "a"), {"x": torch.randn(100_000, generator=gen) + 3}, async_save=True).wait()
        ckpt.save(str(tmp_path / "c"), state)
        (data,) = (tmp_path / "c" / "data").iterdir()
        raw = data.read_bytes()
        m = omnickpt.read_manifest(storage_for(str(tmp_path / "c")))
        used = np.zeros(len(raw), dtype=bool)
        for e in m.tensors.values():
            for b in e.boxes:
                used[b.offset:b.offset + b.nbytes] = True
        for es in m.objects.values():
            for e in es:
                used[e.offset:e.offset + e.nbytes] = True
        assert not np.frombuffer(raw, dtype=np.uint8)[~used].any()
        back = {k: spec(torch.zeros_like(v.local)) for k, v in state.items()}
        ckpt.load(str(tmp_path / "c"), back)
    assert all(torch.equal(back[k].local, v.local) for k, v in state.items())


def _columns_manifest(rng: random.Random, tensors: dict) -> Manifest:
    """A manifest of several tensors ({name: (shape, boxes)}), encoded and decoded: its entries hold
    columns only, as a load sees them."""
    entries, off = {}, 0
    for name, (shape, boxes) in tensors.items():
        saved = []
        for b in boxes:
            nb = b.numel * 4
            saved.append(SavedBox.stored(b.offsets, b.lengths, 0, off, nb, [rng.getrandbits(32)] if nb else []))
            off += nb
        entries[name] = TensorEntry(shape, "float32", saved)
    data = Manifest("s", 1, [FileEntry("data/f.bin", 0, off)], entries, {}).encode()
    return Manifest.decode(data)


def test_bulk_plan_reads_of_many_small_tensors_equals_the_scalar_plan():
    # Hundreds of tensors of few boxes each (0-d to 3-d, empty boxes among them), several wanted
    # boxes per tensor in a shuffled order: the one-pass numpy plan gives the scalar plan's items.
    rng = random.Random(21)
    for case in range(20):
        tensors = {}
        for t in range(rng.randint(1, 200)):
            shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
            boxes = _tiling(rng, shape)
            if len(boxes) >= _INDEX_FROM:
                boxes = [Box.full(shape)]
            tensors[f"t{t}"] = (shape, boxes)
        wanted = [(n, Box.full(s)) for n, (s, _) in tensors.items()]
        wanted += [(n, q) for n, (s, _) in tensors.items() for q in [_random_box(rng, s)] if q.numel]
        rng.shuffle(wanted)
        data = _columns_manifest(rng, tensors).encode()
        got = plan_reads(Manifest.decode(data), wanted)
        assert got == _scalar_plan(Manifest.decode(data), wanted), case


def _random_small_tensors(rng: random.Random, count: int) -> dict:
    tensors = {}
    for t in range(count):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
        boxes = _tiling(rng, shape)
        tensors[f"t{t}"] = (shape, boxes if len(boxes) < _INDEX_FROM else [Box.full(shape)])
    return tensors


def test_joined_columns_of_a_decoded_manifest_equal_its_entries_concatenated():
    # The join reads many tensors' rows straight from the decoded arrays; it must give exactly
    # each entry's own columns one after the other, CRC positions shifted into the joined CRCs.
    from omnickpt.format.records import joined_columns
    rng = random.Random(8)
    tensors = _random_small_tensors(rng, 120)
    data = _columns_manifest(rng, tensors).encode()
    for nd in (0, 1, 2, 3):
        names = [n for n, (s, _) in tensors.items() if len(s) == nd]
        rng.shuffle(names)
        if not names:
            continue
        lazy, eager = Manifest.decode(data), Manifest.decode(data)
        assert all(lazy.tensors[n].pending is not None for n in names)
        joined = joined_columns([lazy.tensors[n] for n in names])
        cols = [eager.tensors[n].columns for n in names]
        for field in ("file", "offset", "nbytes", "crcs"):
            assert getattr(joined, field).tolist() == np.concatenate([getattr(c, field) for c in cols]).tolist()
        assert joined.offsets.tolist() == np.concatenate([c.offsets for c in cols]).tolist()
        assert joined.lengths.tolist() == np.concatenate([c.lengths for c in cols]).tolist()
        boxes = [b for n in names for b in eager.tensors[n].boxes]
        assert [joined.sums(i) for i in range(len(boxes))] == [b.sums for b in boxes]
        # entries whose columns were made already join the slow way, with the same result
        mixed = joined_columns([eager.tensors[n] for n in names])
        assert [mixed.sums(i) for i in range(len(boxes))] == [b.sums for b in boxes]


def test_bulk_plan_reads_of_partly_decoded_entries_equals_the_scalar_plan():
    # A manifest some of whose entries were listed (boxes) or made into columns before the plan:
    # those are planned by other paths than the ones joined from the arrays; all agree.
    rng = random.Random(13)
    for case in range(10):
        tensors = _random_small_tensors(rng, rng.randint(2, 150))
        wanted = [(n, Box.full(s)) for n, (s, _) in tensors.items()]
        wanted += [(n, q) for n, (s, _) in tensors.items() for q in [_random_box(rng, s)] if q.numel]
        rng.shuffle(wanted)
        data = _columns_manifest(rng, tensors).encode()
        m = Manifest.decode(data)
        for name, entry in m.tensors.items():
            touch = rng.random()
            if touch < 0.3:
                entry.columns
            elif touch < 0.5:
                entry.boxes
        assert plan_reads(m, wanted) == _scalar_plan(Manifest.decode(data), wanted), case


def test_plan_reads_lists_every_gap_in_wanted_order_whatever_the_path():
    rng = random.Random(2)
    rows = [Box((r, 0), (1, 4)) for r in range(32) if r != 17]            # indexed: 31 boxes
    small = [Box((0, 0), (2, 3))]                                           # bulk: rows 2..3 missing
    m = _columns_manifest(rng, {"big": ((32, 4), rows), "small": ((4, 3), small)})
    wanted = [("small", Box.full((4, 3))), ("gone", Box((0,), (1,))), ("big", Box.full((32, 4))),
              ("small", Box((0, 0), (2, 3)))]
    with pytest.raises(MismatchError) as e:
        plan_reads(m, wanted)
    gaps = e.value.differences
    assert [g.split(":")[0] for g in gaps] == ["small", "gone", "big"]
    assert "holds only 6 of the 12 elements" in gaps[0] and "holds only 124 of the 128 elements" in gaps[2]


def test_overlap_sweep_finds_exactly_the_overlapping_layouts():
    # Layouts where several dimensions vary (grids, random boxes) go through the numpy sweep: it
    # must refuse exactly the box sets in which some pair shares an element, naming such a pair.
    from omnickpt.format.manifest import overlap_problem_arrays
    rng = random.Random(8)
    refused = 0
    for case in range(CASES):
        shape = tuple(rng.randint(1, 10) for _ in range(rng.randint(1, 3)))
        boxes = _tiling(rng, shape) if rng.random() < 0.6 else [_random_box(rng, shape) for _ in range(rng.randint(2, 90))]
        if rng.random() < 0.5 and boxes:
            boxes.append(_random_box(rng, shape))
        boxes = [b for b in boxes if b.numel]
        if len(boxes) < 2:
            continue
        clash = any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])
        lo = np.array([b.offsets for b in boxes], dtype=np.int64)
        ln = np.array([b.lengths for b in boxes], dtype=np.int64)
        problem = overlap_problem_arrays(lo, ln)
        assert (problem is not None) == clash, (case, shape, boxes)
        if problem:
            refused += 1
            a, b = (Box(*(tuple(int(x) for x in half.strip("[] ").split(",")) for half in part.split("+")))
                    for part in problem.removeprefix("boxes ").removesuffix(" overlap").split(" and "))
            assert a in boxes and b in boxes and intersect(a, b) is not None
    assert refused > 30


def test_overlap_sweep_on_a_large_grid_with_one_moved_box():
    from omnickpt.format.manifest import overlap_problem_arrays
    g = 300   # 90 000 boxes of 2 x 2
    offs = (np.stack(np.meshgrid(np.arange(g), np.arange(g), indexing="ij"), -1).reshape(-1, 2) * 2).astype(np.int64)
    lens = np.full_like(offs, 2)
    assert overlap_problem_arrays(offs, lens) is None
    offs[g * g // 2, 1] += 1
    assert "overlap" in overlap_problem_arrays(offs, lens)


def _random_items(rng: random.Random, count: int):
    """(read item, itemsize) of random small boxes (0-d to 3-d) with random checksum grids, some
    compressed, some without checksums."""
    items = []
    for i in range(count):
        nd = rng.randint(0, 3)
        lens = tuple(rng.randint(1, 5) for _ in range(nd))
        offs = tuple(rng.randint(0, 7) for _ in range(nd))
        region = _random_box(rng, lens)
        region = Box(tuple(o + r for o, r in zip(offs, region.offsets)), region.lengths)
        if not region.numel:
            region = Box(offs, lens)
        itemsize = rng.choice([1, 2, 4, 8])
        off = rng.randint(0, 1 << 20)
        nbytes = math.prod(lens) * itemsize
        size = rng.choice([4, 16, 64, 1 << 22])
        crcs = tuple(rng.getrandbits(32) for _ in range(max(1, -(-nbytes // size))))
        kind = rng.random()
        sums = (None if kind < 0.15 else
                Sums(off, off + nbytes, size, crcs, stored=tuple(min(size, 3) for _ in crcs)) if kind < 0.3 else
                Sums(off, off + nbytes, size, crcs))
        sb = SavedBox(offs, lens, rng.randint(0, 3), off, nbytes, sums)
        items.append((ReadItem(f"t{i}", i, sb, region), itemsize))
    return items


def test_chunks_to_check_in_bulk_lists_each_used_chunk_once_in_first_use_order():
    from omnickpt.engine.load import _chunks_to_check, _Extent, _need
    rng = random.Random(6)
    for case in range(30):
        pairs = _random_items(rng, rng.randint(1, 300))
        # several items of one box: chunks shared by needs must be listed once
        pairs += [(ReadItem(it.name, len(pairs) + k, it.saved, it.region), s) for k, (it, s) in enumerate(pairs[:20])]
        items = [p[0] for p in pairs]
        needs = [_need(i, it, p[1], True, {}) for i, (it, p) in enumerate(zip(items, pairs))]
        rng.shuffle(needs)
        expect, seen = [], set()
        for n in needs:
            sums = items[n.index].saved.sums
            if sums is None:
                continue
            for c in range((n.lo - sums.start) // sums.size, -(-(n.hi - sums.start) // sums.size)):
                a = sums.start + c * sums.size
                b = min(a + sums.size, sums.end)
                if (a, b) not in seen:
                    seen.add((a, b))
                    expect.append((a, b, sums.crcs[c], n.index))
        firsts, ends, crcs, users = _chunks_to_check(_Extent(0, 0, 0, needs), items)
        assert list(zip(firsts, ends, crcs, [n.index for n in users])) == expect, case


@pytest.mark.parametrize("dest_kind", ["contiguous", "column slice", "transposed"])
def test_many_small_boxes_load_into_strided_destinations(tmp_path, dest_kind):
    # Thousands of small boxes of a finely sharded tensor, each one run in the file and many in
    # its destination, are installed together by index: into a plain tensor, a column slice of a
    # wider one and a transposed view, every element lands where it belongs and nothing else moves.
    import omnickpt
    from omnickpt import ShardSpec
    shape, br, bc = (96, 40), 3, 2
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * 0.25
    state = {f"b{r}.{c}": ShardSpec(full[r:r + br, c:c + bc].clone(), (r, c), shape, name="w")
             for r in range(0, shape[0], br) for c in range(0, shape[1], bc)}
    omnickpt.save(str(tmp_path / "ck"), state)
    if dest_kind == "contiguous":
        host = torch.full(shape, -1.0)
        dest = host
    elif dest_kind == "column slice":
        host = torch.full((shape[0], shape[1] + 7), -1.0)
        dest = host[:, 3:3 + shape[1]]
    else:
        host = torch.full((shape[1], shape[0]), -1.0)
        dest = host.t()
    rows = slice(5, 77)   # a part of the tensor: boxes cut at both ends are read in part
    target = dest[rows]
    with omnickpt.Checkpointer() as ck:
        ck.load(str(tmp_path / "ck"), {"w": ShardSpec(target, (rows.start, 0), shape, name="w")})
    assert torch.equal(target, full[rows])
    untouched = torch.ones_like(host, dtype=torch.bool)
    if dest_kind == "transposed":
        untouched.t()[rows] = False
    elif dest_kind == "column slice":
        untouched[rows, 3:3 + shape[1]] = False
    else:
        untouched[rows] = False
    assert (host[untouched] == -1.0).all()


def _land(path, wanted, dests, records: bool):
    """Plan and land `wanted` into `dests` through the engine: as the plan's columns, or
    (`records`) as one ReadItem per item."""
    from omnickpt.engine.load import land_tensors
    from omnickpt.formats import read_manifest
    from omnickpt.monitor import PhaseTimer
    from omnickpt.storage import storage_for
    storage = storage_for(str(path))
    manifest = read_manifest(storage)
    plan = plan_reads(manifest, wanted)
    assert plan.columns is not None and not plan.objects
    items = list(plan) if records else plan
    land_tensors(storage, manifest, items, [b for _, b in wanted], dests, None, verify=True,
                 timer=PhaseTimer()).install()


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64]


def _dest_for(rng: random.Random, box: Box, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination for `box`, the tensor holding it): plain, inside a wider one, or transposed."""
    kind = rng.choice(["plain", "wider", "transposed"]) if len(box.lengths) >= 2 else "plain"
    if kind == "plain":
        t = torch.full(box.lengths, -7, dtype=dtype)
        return t, t
    if kind == "wider":
        host = torch.full(box.lengths[:-1] + (box.lengths[-1] + 3,), -7, dtype=dtype)
        return host[..., 2:2 + box.lengths[-1]], host
    host = torch.full(box.lengths[:-2] + (box.lengths[-1], box.lengths[-2]), -7, dtype=dtype)
    return host.transpose(-1, -2), host


def test_column_loads_equal_record_loads_on_random_layouts(tmp_path):
    # A load planned as columns (no ReadItem per item: the byte ranges, landing extents, chunk
    # checks and installs computed with numpy) installs exactly what the record way installs, for
    # tensors of 0-3 dimensions and 1-8 byte elements cut into random boxes (many boxes: the
    # indexed planner; few: the bulk one), wanted in random boxes, into plain, sliced and transposed
    # destinations; nothing outside a destination's region moves.
    import omnickpt
    from omnickpt import ShardSpec
    rng = random.Random(17)
    for case in range(10):
        state, full = {}, {}
        for i in range(rng.randint(1, 5)):
            ndim = rng.randint(0, 3)
            shape = tuple(rng.randint(1, 24 if ndim <= 2 else 7) for _ in range(ndim))
            dtype = rng.choice(_DTYPES)
            values = torch.randint(-100, 100, shape, generator=torch.Generator().manual_seed(case * 10 + i))
            full[f"t{i}"] = values.to(dtype)
            for k, b in enumerate(_tiling(rng, shape)):
                local = full[f"t{i}"][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))].clone()
                state[f"t{i}.{k}"] = ShardSpec(local, b.offsets, shape, name=f"t{i}")
        path = tmp_path / f"ck{case}"
        omnickpt.save(str(path), state)
        wanted = []
        for name, t in full.items():
            for _ in range(rng.randint(1, 3)):
                b = _random_box(rng, t.shape)
                if b.numel:
                    wanted.append((name, b))
        if not wanted:
            continue
        out = {}
        for records in (False, True):
            made = [_dest_for(random.Random(case), b, full[n].dtype) for n, b in wanted]
            _land(path, wanted, [d for d, _ in made], records)
            out[records] = made
            for (name, b), (d, host) in zip(wanted, made):
                expect = full[name][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))]
                assert torch.equal(d, expect), (case, name, b, records)
                assert (host == -7).sum() == host.numel() - d.numel() + (d == -7).sum(), (case, name, b)
        for (c, hc), (r, hr) in zip(out[False], out[True]):
            assert torch.equal(hc, hr)


def test_a_corrupt_chunk_in_a_column_load_names_its_box_and_installs_nothing(tmp_path):
    # 400 boxes of one tensor, loaded as columns: a flipped byte in one box's bytes fails the load
    # with the file, the byte range, the tensor and that box, and leaves every destination as it was.
    import omnickpt
    from omnickpt import ShardSpec
    from omnickpt.errors import CorruptCheckpointError
    from omnickpt.formats import read_manifest
    from omnickpt.storage import storage_for
    shape = (80, 40)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    state = {f"b{r}.{c}": ShardSpec(full[r:r + 4, c:c + 2].clone(), (r, c), shape, name="w")
             for r in range(0, 80, 4) for c in range(0, 40, 2)}
    path = tmp_path / "ck"
    omnickpt.save(str(path), state)
    manifest = read_manifest(storage_for(str(path)))
    victim = manifest.tensors["w"].boxes[123]
    data = path / manifest.files[victim.file].path
    raw = bytearray(data.read_bytes())
    raw[victim.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    a, b = torch.full((40, 40), -1.0), torch.full((40, 40), -1.0)
    wanted = [("w", Box((0, 0), (40, 40))), ("w", Box((40, 0), (40, 40)))]
    with pytest.raises(CorruptCheckpointError) as err:
        _land(path, wanted, [a, b], records=False)
    msg = str(err.value)
    assert "checksum mismatch" in msg and manifest.files[victim.file].path in msg
    assert f"tensor 'w' box offsets={list(victim.offsets)} lengths={list(victim.lengths)}" in msg
    assert f"[{victim.offset}, {victim.offset + victim.nbytes})" in msg
    assert (a == -1).all() and (b == -1).all()


@pytest.mark.parametrize("dest_kind", ["plain", "offset by 2", "offset by 4", "transposed"])
def test_column_installs_by_run_and_by_index_put_every_element_in_place(tmp_path, dest_kind):
    # The column way's two bulk installs. By run: boxes back to back in the file go into separate
    # destinations (and two of them into one, where they follow each other there too: one memmove).
    # By index: a grid of 4x4 boxes moves in units of the largest run every box start allows (4
    # elements in a plain destination, 2 in one shifted by 2 elements, single elements transposed).
    import omnickpt
    from omnickpt import ShardSpec
    flat = torch.arange(64, dtype=torch.float32)   # boxes of 64 bytes: back to back in the file
    grid_shape = (32, 24)
    grid = torch.arange(math.prod(grid_shape), dtype=torch.float32).reshape(grid_shape) + 0.5
    state = {f"v{k}": ShardSpec(flat[k * 16:(k + 1) * 16].clone(), (k * 16,), (64,), name="v") for k in range(4)}
    state.update({f"g{r}.{c}": ShardSpec(grid[r:r + 4, c:c + 4].clone(), (r, c), grid_shape, name="g")
                  for r in range(0, 32, 4) for c in range(0, 24, 4)})
    omnickpt.save(str(tmp_path / "ck"), state)
    vs = [torch.full((16,), -1.0), torch.full((32,), -1.0), torch.full((16,), -1.0)]
    shift = {"plain": 0, "offset by 2": 2, "offset by 4": 4, "transposed": 0}[dest_kind]
    if dest_kind == "transposed":
        host = torch.full((grid_shape[1], grid_shape[0]), -1.0)
        g = host.t()
    else:
        host = torch.full((grid_shape[0] * (grid_shape[1] + 4) + shift,), -1.0)
        g = host[shift:].view(grid_shape[0], grid_shape[1] + 4)[:, :grid_shape[1]]
    for records in (False, True):
        for t in vs + [host]:
            t.fill_(-1.0)
        wanted = [("v", Box((0,), (16,))), ("v", Box((16,), (32,))), ("v", Box((48,), (16,))),
                  ("g", Box.full(grid_shape))]
        _land(tmp_path / "ck", wanted, vs + [g], records)
        assert torch.equal(vs[0], flat[:16]) and torch.equal(vs[1], flat[16:48]) and torch.equal(vs[2], flat[48:])
        assert torch.equal(g, grid), records
        assert (host == -1.0).sum() == host.numel() - grid.numel()
    # Rows of one dimension beside an empty box of the grid (uneven shards leave a rank nothing
    # of a tensor): a destination of more dimensions than any row.
    v = torch.full((64,), -1.0)
    _land(tmp_path / "ck", [("g", Box((0, 0), (0, 24))), ("v", Box.full((64,)))], [torch.empty(0, 24), v], False)
    assert torch.equal(v, flat)


def test_a_large_install_spread_over_threads_puts_every_byte_in_place(tmp_path):
    # Runs of more than _PARALLEL_BYTES are copied in pieces of _COPY_PIECE on the I/O threads: runs
    # of odd lengths (not whole pieces) into tensors side by side in one file all land exactly.
    import omnickpt
    from omnickpt.engine.load import _COPY_PIECE, _PARALLEL_BYTES
    gen = torch.Generator().manual_seed(3)
    sizes = [_COPY_PIECE // 4 * 2 + 3, _PARALLEL_BYTES // 4 + 17, 5]
    state = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    omnickpt.save(str(tmp_path / "ck"), state)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with omnickpt.Checkpointer() as ck:
        ck.load(str(tmp_path / "ck"), dest)
    for k in state:
        assert torch.equal(dest[k], state[k]), k


def test_ranks_reading_shared_files_begin_at_different_requests(tmp_path):
    # Ranks that read the same files through the page cache (DDP replicas) begin their reads at
    # rank / ranks of their request list and go round: the device reads each part once and the
    # parts in parallel, where in one order every rank waits for the same pages. Four regions far
    # apart in the file (one request each), begun at 0.5: the third and fourth are read first.
    import omnickpt
    from omnickpt.engine.load import land_tensors
    from omnickpt.formats import read_manifest
    from omnickpt.monitor import PhaseTimer
    from omnickpt.storage.local import LocalStorage

    class Recording(LocalStorage):
        read_direct = None   # read through the cache, as a shared file is

        def __init__(self, root):
            super().__init__(root)
            self.offsets = []

        def read_into(self, rel, offset, buffers):
            self.offsets.append(offset)
            super().read_into(rel, offset, buffers)

    from omnickpt import ShardSpec
    state = {f"t{i}": torch.full((300 << 8,), float(i)) for i in range(8)}   # 300 KiB each
    omnickpt.save(str(tmp_path / "ck"), {k: ShardSpec(v, (0,), v.shape, name=k) for k, v in state.items()})
    wanted = [(f"t{i}", Box.full((300 << 8,))) for i in (0, 2, 4, 6)]
    for start_at, first in ((0.0, "t0"), (0.5, "t4"), (0.75, "t6")):
        storage = Recording(str(tmp_path / "ck"))
        manifest = read_manifest(storage)
        dests = [torch.zeros(300 << 8) for _ in wanted]
        land_tensors(storage, manifest, plan_reads(manifest, wanted), [b for _, b in wanted], dests, None,
                     verify=True, timer=PhaseTimer(), start_at=start_at).install()
        starts = {manifest.tensors[n].boxes[0].offset: n for n, _ in wanted}
        order = [starts[o] for o in storage.offsets if o in starts]
        assert order[0] == first and sorted(order) == ["t0", "t2", "t4", "t6"], (start_at, order)
        assert all(torch.equal(d, state[n]) for d, (n, _) in zip(dests, wanted))


def test_a_read_plan_digest_tells_equal_plans_from_different_ones():
    # Replicas compare digests (loading.replica_part): equal plans, planned twice, give one digest;
    # a plan wanting one box more, or another box, or the same boxes in another order gives another.
    rng = random.Random(5)
    tensors = _random_small_tensors(rng, 60)
    data = _columns_manifest(rng, tensors).encode()
    wanted = [(n, Box.full(s)) for n, (s, _) in tensors.items()]

    def digest(w):
        plan = plan_reads(Manifest.decode(data), w)
        assert plan.columns is not None   # the columns are hashed, not only the records
        return plan.digest()
    assert digest(wanted) == digest(list(wanted))
    name, shape = next((n, s) for n, (s, _) in tensors.items() if math.prod(s) > 1)
    part = Box((0,) * len(shape), (1,) * len(shape))
    assert len({digest(wanted), digest(wanted + [(name, part)]), digest(wanted[::-1]),
                digest([(n, part if n == name else b) for n, b in wanted])}) == 4
