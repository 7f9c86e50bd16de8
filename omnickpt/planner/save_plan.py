"""Save planning: every rank's local records -> who writes which box where.

Identical boxes held by several ranks (DDP, replicated DTensors, HSDP replicas) are replicas:
exactly one holder writes each (planner/replicas.py finds them), chosen to even out the bytes
each rank writes. Each rank writes one data file; boxes are laid out back to back, aligned.

The coordinator plans for every rank of the job (8192 ranks x 500 tensors is 4 million records),
so records travel and are planned as arrays: one `RecordBatch` per rank (a table of its tensors
and one row per box), deduplicated, balanced and laid out with numpy. Only the replicated boxes
are balanced one at a time (greedy LPT is sequential), and there are few of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import numpy as np
# np.unique imports numpy.ma on its first call (~20 ms): here, at import, not in the first save's stall.
import numpy.ma  # noqa: F401

from omnickpt.errors import PlanError
from omnickpt.layout import Box, spans
from omnickpt.planner.replicas import group_replicas, stable_order

ALIGN = 64


@dataclass(frozen=True)
class ShardRecord:
    """Rank-local claim: 'I hold `box` of global tensor `name`'."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    box: Box

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize


@dataclass(frozen=True)
class WriteItem:
    """Write local shard number `index` at byte `offset` of this rank's data file."""
    index: int
    offset: int
    nbytes: int


def _narrow(a: np.ndarray) -> np.ndarray:
    """The smallest unsigned dtype that holds `a` (non-negative): what travels in a gather."""
    if not a.size:
        return a.astype(np.uint8)
    return a.astype(np.min_scalar_type(int(a.max())), copy=False)


@dataclass(frozen=True, eq=False)
class RecordBatch:
    """One rank's ShardRecords as arrays: what a rank sends to the coordinator to plan a save.

    Row i is the rank's record i: box `offsets[i]`+`lengths[i]` of tensor `names[tensor[i]]`.
    Boxes of lower-dimensional tensors are padded (offset 0, length 1) to the widest tensor of
    the rank. `table_digest` names the tensor table (names, shapes, dtypes), so the coordinator
    checks each distinct table once, and ranks whose table a lower rank sends leave it out (table
    fields None): under FSDP every rank holds the same tensors, and their names are most of the bytes.
    """
    names: tuple[str, ...] | None
    shapes: tuple[tuple[int, ...], ...] | None
    dtypes: tuple[str, ...] | None
    itemsizes: tuple[int, ...] | None
    tensor: np.ndarray    # [n]
    offsets: np.ndarray   # [n, ndim]
    lengths: np.ndarray   # [n, ndim]
    table_digest: bytes

    def __len__(self) -> int:
        return len(self.tensor)

    @staticmethod
    def from_records(records: list[ShardRecord]) -> "RecordBatch":
        """Never raises: every rank must reach the gather; the coordinator's plan judges the records
        (a rank holding one name with two shapes gets two table rows, refused there)."""
        return RecordBatch.from_columns([r.name for r in records], [r.shape for r in records],
                                        [r.dtype for r in records], [r.itemsize for r in records],
                                        [r.box for r in records])

    @staticmethod
    def from_columns(names: list[str], shapes: list, dtypes: list[str], itemsizes: list[int], boxes: list[Box]
                     ) -> "RecordBatch":
        """The batch of records given column by column (record i: box `boxes[i]` of tensor
        `names[i]` of `shapes[i]` and `dtypes[i]`): what a save's collect builds straight from its
        shards, with no ShardRecord per shard. Never raises, as from_records."""
        index: dict[tuple, int] = {}
        t_names, t_shapes, t_dtypes, t_itemsizes = [], [], [], []
        ids = []
        for name, shape, dtype, itemsize in zip(names, shapes, dtypes, itemsizes):
            shape = tuple(shape)
            key = (name, shape, dtype)
            t = index.get(key)
            if t is None:
                t = index[key] = len(t_names)
                t_names.append(name)
                t_shapes.append(shape)
                t_dtypes.append(dtype)
                t_itemsizes.append(itemsize)
            ids.append(t)
        n, ndim = len(ids), max((len(s) for s in t_shapes), default=0)
        # one array from padded tuples, not a numpy assignment per row (~1 us each: 10^3-10^4 rows
        # are on a first save's stall)
        offs = [b.offsets for b in boxes]
        lens = [b.lengths for b in boxes]
        if any(len(o) != ndim for o in offs):
            offs = [tuple(o) + (0,) * (ndim - len(o)) for o in offs]
            lens = [tuple(x) + (1,) * (ndim - len(x)) for x in lens]
        offsets = np.array(offs, dtype=np.int64).reshape(n, ndim)
        lengths = np.array(lens, dtype=np.int64).reshape(n, ndim)
        if n and min(offsets.min(), lengths.min()) >= 0:   # negative values keep int64 (refused by the plan)
            offsets, lengths = _narrow(offsets), _narrow(lengths)
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((t_names, t_shapes, t_dtypes, t_itemsizes)).encode())
        return RecordBatch(tuple(t_names), tuple(t_shapes), tuple(t_dtypes), tuple(t_itemsizes),
                           _narrow(np.array(ids, dtype=np.int64)), offsets, lengths, h.digest())

    def structure_digest(self) -> str:
        """A digest that changes whenever the records change (tensor, shape, dtype, box, order):
        `structure_digest` of the same records, computed from the arrays (stable across
        processes). Needs the batch's tensor table."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.table_digest)
        for a in (self.tensor, self.offsets, self.lengths):
            # widened: the narrowed dtypes depend on the largest value, the digest should not
            h.update(repr(a.shape).encode())
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()

    def wire_bytes(self) -> int:
        """About how many bytes the batch takes on the wire (its arrays and its tensor table)."""
        table = 0 if self.names is None else sum(map(len, self.names)) + 48 * len(self.names)
        return self.tensor.nbytes + self.offsets.nbytes + self.lengths.nbytes + table

    def without_table(self) -> "RecordBatch":
        """This batch less its tensor table, for a rank whose table a lower rank sends (same digest)."""
        return dataclasses.replace(self, names=None, shapes=None, dtypes=None, itemsizes=None)

    def with_table(self, other: "RecordBatch") -> "RecordBatch":
        return dataclasses.replace(self, names=other.names, shapes=other.shapes, dtypes=other.dtypes,
                                   itemsizes=other.itemsizes)

    def records(self) -> list[ShardRecord]:
        """The rank's records as objects (tests, and code that wants one record at a time)."""
        out = []
        for t, offs, lens in zip(self.tensor.tolist(), self.offsets.tolist(), self.lengths.tolist()):
            k = len(self.shapes[t])
            out.append(ShardRecord(self.names[t], self.shapes[t], self.dtypes[t], self.itemsizes[t],
                                   Box(tuple(offs[:k]), tuple(lens[:k]))))
        return out


class _PerRank:
    """A read-only per-rank list whose items are made on first access (one rank needs only its own)."""

    def __init__(self, n: int, make):
        self._items: list = [None] * n
        self._make = make

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, rank: int):
        item = self._items[rank]
        if item is None:
            item = self._items[rank] = self._make(rank)
        return item

    def __iter__(self):
        return (self[r] for r in range(len(self)))


@dataclass
class GlobalPlan:
    """The coordinator's decision: rank r writes its records `write_index[a:b]` (a, b =
    write_start[r], write_start[r + 1]) at `write_offset[a:b]` of its file, in file order.

    The write rows also carry each written box (tensor id into `names`, offsets, lengths padded
    as in RecordBatch), so the manifest is built from the plan without a record per box.
    `writes[r]` (WriteItems) and `records[r]` (ShardRecords) give one rank's part as objects,
    made on first access."""
    batches: list[RecordBatch]
    names: list[str]                        # global tensor table, by tensor id
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    write_start: np.ndarray                 # [world + 1]
    write_index: np.ndarray                 # [W] local record index on its rank
    write_offset: np.ndarray                # [W] byte offset in the rank's file
    write_nbytes: np.ndarray                # [W]
    write_tensor: np.ndarray                # [W] tensor id
    write_offsets: np.ndarray               # [W, ndim] box offsets (padded; any integer dtype)
    write_lengths: np.ndarray               # [W, ndim] box lengths (padded; any integer dtype)
    tensor_bytes: list[int]                 # per rank: size of the tensor region of its file
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.writes = _PerRank(len(self.batches), self._writes_of)
        self.records = _PerRank(len(self.batches), lambda r: self.batches[r].records())

    def write_arrays(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(local index, file offset, nbytes) of rank `rank`'s writes: its part of the plan."""
        a, b = int(self.write_start[rank]), int(self.write_start[rank + 1])
        return self.write_index[a:b], self.write_offset[a:b], self.write_nbytes[a:b]

    def _writes_of(self, rank: int) -> list[WriteItem]:
        return write_items(*self.write_arrays(rank))

    def bytes_per_rank(self) -> list[int]:
        total = np.concatenate(([0], np.cumsum(self.write_nbytes)))
        return (total[self.write_start[1:]] - total[self.write_start[:-1]]).tolist()


def write_items(index, offset, nbytes) -> list[WriteItem]:
    return [WriteItem(i, o, n) for i, o, n in zip(np.asarray(index).tolist(), np.asarray(offset).tolist(),
                                                  np.asarray(nbytes).tolist())]


def structure_digest(records: list[ShardRecord]) -> str:
    """A digest that changes whenever the structure of a rank's state changes (stable across
    processes, unlike hash()): RecordBatch.structure_digest of the records' batch."""
    return RecordBatch.from_records(records).structure_digest()


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_global_plan(records: list) -> GlobalPlan:
    """Deduplicate replicas, balance the writing by bytes, and lay out each rank's file.

    `records[r]` is rank r's RecordBatch (or its list of ShardRecords). Raises PlanError when
    ranks disagree on a tensor's shape or dtype, a box lies outside its tensor, or two different
    boxes of a tensor share an element."""
    batches = [b if isinstance(b, RecordBatch) else RecordBatch.from_records(b) for b in records]
    tables = {b.table_digest: b for b in batches if b.names is not None}
    for r, b in enumerate(batches):
        if b.names is None:
            if b.table_digest not in tables:
                raise PlanError(f"rank {r} sent its records without their tensor table, and no rank sent that "
                                "table; every rank of the save must send the same records it digested")
            batches[r] = b.with_table(tables[b.table_digest])
    table = _tensor_table(batches)
    return _plan_uniform(batches, *table) or _plan_general(batches, *table)


def _plan_general(batches, names, shapes, dtypes, itemsizes, owner, index) -> GlobalPlan:
    """Any records: one row per record of every rank, grouped by tensor with a counting sort."""
    world = len(batches)
    ntensors = len(names)
    ndim = max((len(s) for s in shapes), default=0)
    counts = np.array([len(b) for b in batches], dtype=np.int64)
    n = int(counts.sum())
    rank = np.repeat(np.arange(world, dtype=np.int64), counts)
    tid = np.empty(n, dtype=np.int64)
    offs = np.zeros((n, ndim), dtype=np.int64)
    lens = np.ones((n, ndim), dtype=np.int64)
    maps = {}
    pos = 0
    for b in batches:
        m = maps.get(b.table_digest)
        if m is None:
            m = maps[b.table_digest] = np.array([index[x] for x in b.names], dtype=np.int64)
        k = len(b)
        if k:
            tid[pos:pos + k] = m[b.tensor]
            offs[pos:pos + k, :b.offsets.shape[1]] = b.offsets
            lens[pos:pos + k, :b.lengths.shape[1]] = b.lengths
        pos += k
    shape_mat = np.ones((ntensors, ndim), dtype=np.int64)
    for t, s in enumerate(shapes):
        shape_mat[t, :len(s)] = s
    outside = ((offs < 0) | (lens < 0) | (offs + lens > shape_mat[tid])).any(axis=1) if ndim else np.zeros(n, dtype=bool)
    if outside.any():
        i = int(np.nonzero(outside)[0][0])
        k = len(shapes[tid[i]])
        raise PlanError(f"tensor {names[tid[i]]!r}: rank {rank[i]} holds box "
                        f"{Box(tuple(offs[i, :k].tolist()), tuple(lens[i, :k].tolist()))} outside shape "
                        f"{list(shapes[tid[i]])}")
    nbytes = lens.prod(axis=1) * np.array(itemsizes, dtype=np.int64)[tid] if n else np.zeros(0, dtype=np.int64)

    group = group_replicas(tid, offs, lens, rank, names, shapes, ntensors)
    chosen = _choose_writers(group, rank, nbytes, world)

    rows = np.nonzero(chosen)[0]   # already in (rank, local index) order: the file order
    w_rank = rank[rows]
    w_nbytes = nbytes[rows]
    write_start = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(np.bincount(w_rank, minlength=world), out=write_start[1:])
    # Every item starts aligned, so each one's offset is the sum of the aligned sizes before it.
    ends = np.cumsum(_align(w_nbytes))
    first = np.concatenate(([0], ends))[write_start[:-1]]
    w_offset = ends - _align(w_nbytes) - np.repeat(first, np.diff(write_start))
    sizes = np.concatenate(([0], ends))[write_start[1:]] - first
    starts = np.concatenate(([0], np.cumsum(counts)))
    return GlobalPlan(batches=batches, names=names, shapes=shapes, dtypes=dtypes, write_start=write_start,
                      write_index=rows - starts[w_rank], write_offset=w_offset, write_nbytes=w_nbytes,
                      write_tensor=tid[rows], write_offsets=offs[rows], write_lengths=lens[rows],
                      tensor_bytes=sizes.tolist(), extra={"owner": owner})


def _plan_uniform(batches, names, shapes, dtypes, itemsizes, owner, index) -> GlobalPlan | None:
    """The usual job, planned as [ranks, records] arrays with no sort: every rank holds one box of
    each of the same tensors (FSDP, TP, DDP), each box either the same on every rank (a replica)
    or one of disjoint intervals along one dimension in rank order. None when the records are not
    of that kind (the general planner takes them, and reports any error)."""
    stacked = _uniform_stack(batches, index)
    if stacked is None:
        return None
    slot_tid, O, L = stacked
    extent = _uniform_extent(O, L, slot_tid, shapes)
    if extent is None:
        return None
    numel, varying = extent
    grouping = _uniform_groups(O, L, numel, varying)
    if grouping is None:
        return None
    nbytes = numel * np.array(itemsizes, dtype=np.int64)[slot_tid]
    chosen = _uniform_writers(nbytes, *grouping)
    world, m, ndim = O.shape
    aligned = np.where(chosen, _align(nbytes), 0)
    offset = np.cumsum(aligned, axis=1) - aligned
    flat = np.nonzero(chosen.ravel())[0]
    w_rank, w_slot = np.divmod(flat, m)
    write_start = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(chosen.sum(axis=1), out=write_start[1:])
    return GlobalPlan(batches=batches, names=names, shapes=shapes, dtypes=dtypes, write_start=write_start,
                      write_index=w_slot, write_offset=offset.ravel()[flat], write_nbytes=nbytes.ravel()[flat],
                      write_tensor=slot_tid[w_slot], write_offsets=O.reshape(-1, ndim)[flat],
                      write_lengths=L.reshape(-1, ndim)[flat],
                      tensor_bytes=aligned.sum(axis=1).tolist(), extra={"owner": owner})


def _uniform_stack(batches, index):
    """(slot_tid, O, L): each slot's global tensor id and the ranks' offsets and lengths as
    [world, m, ndim] arrays (the narrow dtypes sent), or None when the ranks do not hold one box of
    each of the same tensors in the same order, or a box has a negative offset or length."""
    if not _same_slots(batches):
        return None
    first = batches[0]
    slot_tid = np.array([index[x] for x in first.names], dtype=np.int64)[first.tensor]
    O = np.stack([b.offsets for b in batches])
    L = np.stack([b.lengths for b in batches])
    if O.dtype.kind == "i" and (O < 0).any() or L.dtype.kind == "i" and (L < 0).any():
        return None
    return slot_tid, O, L


def _same_slots(batches) -> bool:
    """Every rank sent the same tensors in the same order, one box of each, with the same number of dimensions."""
    first = batches[0]
    m = len(first)
    if not m or any(b.table_digest != first.table_digest or len(b) != m or b.offsets.shape != first.offsets.shape
                    for b in batches):
        return False
    if len(first.tensor) != len(np.unique(first.tensor)):
        return False   # several boxes of a tensor on a rank (flat ranges): the general planner
    tensor_bytes = first.tensor.tobytes()
    return all(b.tensor.tobytes() == tensor_bytes for b in batches)


def _uniform_extent(O, L, slot_tid, shapes):
    """(numel [world, m], varying [m, ndim]: the dimensions along which a slot's boxes differ
    between ranks), or None when a box lies outside its tensor or varies along more than one
    dimension (the general planner reports or handles those)."""
    world, m, ndim = O.shape
    shape = np.ones((m, ndim), dtype=np.int64)
    for j, t in enumerate(slot_tid.tolist()):
        shape[j, :len(shapes[t])] = shapes[t]
    numel = np.ones((world, m), dtype=np.int64)
    varying = np.zeros((m, ndim), dtype=bool)
    for d in range(ndim):
        o, ln = O[:, :, d], L[:, :, d]
        if (np.add(o, ln, dtype=np.int64) > shape[:, d]).any():
            return None
        numel *= ln
        varying[:, d] = (o != o[0]).any(axis=0) | (ln != ln[0]).any(axis=0)
    if (varying.sum(axis=1) > 1).any():
        return None
    return numel, varying


def _uniform_groups(O, L, numel, varying):
    """(groups, groups_of, own), or None for overlapping boxes or empty replicated intervals.

    Group ids as the general planner numbers them (tensor by tensor, boxes by start): a slot
    whose box is the same everywhere is one group; a slot of intervals is one group per
    distinct interval, found by sorting the ranks' starts (already sorted under FSDP).
    groups[j] counts slot j's groups, groups_of maps a slot of replicated intervals to the group
    index of each rank's box, own marks slots where every rank's box is its own (FSDP rows)."""
    world, m, _ = O.shape
    groups = np.ones(m, dtype=np.int64)
    groups_of = {}
    own = np.zeros(m, dtype=bool)
    one = np.nonzero(varying.sum(axis=1) == 1)[0]
    if not len(one) or world == 1:
        return groups, groups_of, own
    d = np.argmax(varying[one], axis=1)
    starts = O[:, one, d]
    lens = L[:, one, d]
    ranked = (starts[1:] > starts[:-1]).all(axis=0)
    if (ranked & ~(starts[1:] >= np.add(starts[:-1], lens[:-1], dtype=np.int64)).all(axis=0)).any():
        return None   # overlapping boxes: the general planner says which
    own[one[ranked]] = True
    groups[one[ranked]] = world
    cols = np.nonzero(~ranked)[0]
    if len(cols):
        if (numel[:, one[cols]] == 0).any():
            return None   # empty boxes among replicated intervals: the general planner groups them
        counted = _interval_groups(starts[:, cols].astype(np.int64), lens[:, cols].astype(np.int64))
        if counted is None:
            return None
        index, cum = counted
        for k, j in enumerate(one[cols].tolist()):
            groups_of[j] = index[:, k]
            groups[j] = int(cum[-1, k]) + 1
    return groups, groups_of, own


def _interval_groups(st, ln):
    """Per column of [world, cols] interval starts and lengths that some ranks share: (index, cum),
    each rank's group index within its column and the running count of distinct intervals in
    sorted order; None when two different intervals overlap."""
    order = np.argsort(st, axis=0, kind="stable")
    st, ln = np.take_along_axis(st, order, axis=0), np.take_along_axis(ln, order, axis=0)
    new = (st[1:] != st[:-1]) | (ln[1:] != ln[:-1])
    if (new & (st[1:] < st[:-1] + ln[:-1])).any():
        return None
    cum = np.vstack([np.zeros((1, st.shape[1]), dtype=np.int64), np.cumsum(new, axis=0)])
    index = np.empty_like(cum)
    np.put_along_axis(index, order, cum, axis=0)
    return index, cum


def _uniform_writers(nbytes, groups, groups_of, own) -> np.ndarray:
    """[world, m] bool: which rank writes each slot. Every rank writes its own boxes; the replicated
    ones are balanced on top, their group ids numbered as the general planner numbers them (tensor
    by tensor, boxes by start), so both break ties alike."""
    world, m = nbytes.shape
    base = np.concatenate(([0], np.cumsum(groups)[:-1]))
    chosen = np.zeros((world, m), dtype=bool)
    chosen[:, own] = True
    shared = np.nonzero(~own)[0]
    if len(shared):
        load = (nbytes * chosen).sum(axis=1)
        count = chosen.sum(axis=1).astype(np.int64)
        group = np.empty((world, len(shared)), dtype=np.int64)
        for k, j in enumerate(shared.tolist()):
            group[:, k] = base[j] + (groups_of[j] if j in groups_of else 0)
        rank = np.repeat(np.arange(world, dtype=np.int64), len(shared))
        picked = _choose_writers(group.ravel(), rank, nbytes[:, shared].ravel(), world, load, count)
        chosen[:, shared] = picked.reshape(world, len(shared))
    return chosen


def _tensor_table(batches: list[RecordBatch]):
    """The global tensor table, checking that ranks agree on each tensor's shape and dtype."""
    index: dict[str, int] = {}
    names, shapes, dtypes, itemsizes, owner = [], [], [], [], []
    seen = set()
    for rank, b in enumerate(batches):
        if b.table_digest in seen:
            continue
        seen.add(b.table_digest)
        for name, shape, dtype, itemsize in zip(b.names, b.shapes, b.dtypes, b.itemsizes):
            t = index.get(name)
            if t is None:
                index[name] = len(names)
                names.append(name)
                shapes.append(shape)
                dtypes.append(dtype)
                itemsizes.append(itemsize)
                owner.append(rank)
            elif (shapes[t], dtypes[t]) != (shape, dtype):
                raise PlanError(
                    f"tensor {name!r}: rank {owner[t]} has shape {list(shapes[t])} {dtypes[t]} but rank {rank} "
                    f"has shape {list(shape)} {dtype}; all ranks must agree on a tensor's global shape and dtype")
    return names, shapes, dtypes, itemsizes, owner, index


# Up to this many replicated boxes are balanced one by one; more (HSDP at thousands of ranks:
# millions of boxes held by 2 ranks each) by holder set, in bulk.
LOOP_LIMIT = 20_000


def _choose_writers(group, rank, nbytes, world, load0=None, count0=None) -> np.ndarray:
    """A mask of the rows that write: one holder per group. A box only one rank holds is that
    rank's (most boxes under FSDP/TP); replicated boxes go largest first onto the least-loaded
    holder (greedy LPT keeps per-rank bytes within one box), ties by fewest boxes, then lowest rank."""
    n = len(group)
    chosen = np.zeros(n, dtype=bool)
    if not n:
        return chosen
    size = np.bincount(group)
    single = size[group] == 1
    chosen[single] = True
    # Bytes and boxes each rank writes already (`load0`, `count0`: decided by the caller).
    load = np.bincount(rank[single], weights=nbytes[single], minlength=world).astype(np.int64)
    count = np.bincount(rank[single], minlength=world).astype(np.int64)
    if load0 is not None:
        load += load0
        count += count0
    multi = np.nonzero(~single)[0]
    if not len(multi):
        return chosen
    # Rows of each replicated group together, groups largest first (then by tensor and box, so the
    # plan does not depend on the order ranks reported in).
    # Rows by group, holders by rank (counting sorts), then groups by decreasing size (stable:
    # equal sizes keep group order).
    if (np.diff(rank[multi]) < 0).any():
        multi = multi[np.argsort(rank[multi], kind="stable")]
    multi = multi[stable_order(group[multi], int(group.max()) + 1)]
    g = group[multi]
    starts = np.concatenate(([0], np.nonzero(g[1:] != g[:-1])[0] + 1))
    h = np.diff(np.append(starts, len(multi)))
    gorder = np.argsort(-nbytes[multi[starts]], kind="stable")
    multi = multi[spans(starts[gorder], h[gorder])]
    bounds = np.concatenate(([0], np.cumsum(h[gorder])))
    holders_all = rank[multi]
    if len(bounds) - 1 > LOOP_LIMIT:
        picks = _lpt_by_holder_sets(bounds, holders_all, nbytes[multi[bounds[:-1]]], load, count, world)
        chosen[multi[bounds[:-1] + picks]] = True
        return chosen
    sizes = nbytes[multi[bounds[:-1]]].tolist()
    if h.max() <= 8:
        # Few holders per box (DDP and HSDP replicas): on Python ints, not numpy scalars (a save's
        # first plan, on the stall: 2 ranks x 400 replicated boxes planned in 1.42 -> 0.85 ms). The
        # same rule as below.
        loads, counts, hold, b = load.tolist(), count.tolist(), holders_all.tolist(), bounds.tolist()
        picks = []
        for j in range(len(b) - 1):
            best = lo = b[j]
            r = hold[lo]
            key = (loads[r], counts[r], r)
            for i in range(lo + 1, b[j + 1]):
                q = hold[i]
                k = (loads[q], counts[q], q)
                if k < key:
                    best, r, key = i, q, k
            loads[r] += sizes[j]
            counts[r] += 1
            picks.append(best)
        chosen[multi[picks]] = True
        return chosen
    for j, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        hs = holders_all[lo:hi]
        if hi - lo <= 8:
            hl = hs.tolist()
            pick = min(range(len(hl)), key=lambda i: (load[hl[i]], count[hl[i]], hl[i]))
        else:
            pick = int(np.lexsort((hs, count[hs], load[hs]))[0])
        r = hs[pick]
        load[r] += sizes[j]
        count[r] += 1
        chosen[multi[lo + pick]] = True
    return chosen


def _lpt_by_holder_sets(bounds, holders, sizes, load, count, world) -> np.ndarray:
    """Greedy LPT for many replicated boxes, in bulk: for each group (rows bounds[g]:bounds[g+1]
    of `holders`, sorted largest first) the index of its writer among its holders.

    Boxes with the same holder set form a class. Classes whose holder sets share no rank do not
    affect each other's loads, so the k-th box of every such class is placed at once (round k);
    with disjoint classes (HSDP: the replica groups of each shard) this is exactly the one-by-one
    greedy. Classes that share ranks (full replicas besides HSDP shards) go to separate layers,
    placed one layer after the other, the layer with the largest box first: greedy per layer."""
    ngroups = len(bounds) - 1
    h = np.diff(bounds)
    picks = np.zeros(ngroups, dtype=np.int64)
    classes = []   # (group indices in LPT order, holder matrix [h] of the class)
    for hv in np.unique(h).tolist():
        gs = np.nonzero(h == hv)[0]
        mat = holders[bounds[gs][:, None] + np.arange(hv)]           # [groups, h], ranks ascending
        if hv * max(1, int(world - 1).bit_length()) <= 62:
            key = np.zeros(len(gs), dtype=np.int64)
            for c in range(hv):
                key = key * world + mat[:, c]
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        else:
            _, first, inverse = np.unique(mat, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(inverse, kind="stable")                    # keeps LPT order inside a class
        cuts = np.concatenate(([0], np.cumsum(np.bincount(inverse))))
        for c in range(len(first)):
            classes.append((gs[order[cuts[c]:cuts[c + 1]]], mat[first[c]]))
    # Layers of rank-disjoint classes, largest holder sets first.
    classes.sort(key=lambda c: -len(c[1]))
    layers: list[list[int]] = []
    used: list[np.ndarray] = []
    for ci, (_, hs) in enumerate(classes):
        for li, occ in enumerate(used):
            if not occ[hs].any():
                layers[li].append(ci)
                occ[hs] = True
                break
        else:
            occ = np.zeros(world, dtype=bool)
            occ[hs] = True
            used.append(occ)
            layers.append([ci])
    layers.sort(key=lambda cs: -max(int(sizes[classes[ci][0][0]]) for ci in cs))
    for layer in layers:
        by_h: dict[int, list[int]] = {}
        for ci in layer:
            by_h.setdefault(len(classes[ci][1]), []).append(ci)
        for hv, cis in by_h.items():
            H = np.stack([classes[ci][1] for ci in cis])              # [C, h]
            members = [classes[ci][0] for ci in cis]
            depth = np.array([len(m) for m in members])
            table = np.full((len(cis), int(depth.max())), -1, dtype=np.int64)
            for i, m in enumerate(members):
                table[i, :len(m)] = m
            for k in range(table.shape[1]):
                live = np.nonzero(depth > k)[0]
                g = table[live, k]
                hs = H[live]
                ld = load[hs]
                cand = ld == ld.min(axis=1, keepdims=True)
                ct = np.where(cand, count[hs], np.iinfo(np.int64).max)
                cand &= ct == ct.min(axis=1, keepdims=True)
                pick = np.argmax(cand, axis=1)                        # the lowest rank among the tied
                r = hs[np.arange(len(live)), pick]
                load[r] += sizes[g]
                count[r] += 1
                picks[g] = pick
    return picks
