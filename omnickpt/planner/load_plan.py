"""Load planning: intersect the boxes a rank wants with the boxes the checkpoint holds."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, SavedBox, Sums, WindowBox
from omnickpt.format.records import joined_columns
from omnickpt.layout import Box, BoxIndex, intersect, present

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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, eq=False)
class ReadColumns:
    """Read items as columns, row i being one item: what a load of 10^5 boxes plans, reads and
    installs without a ReadItem, SavedBox, Sums and Box per item (~2 us each to build). Only plain
    stored boxes with their own checksum grid (uncompressed) are rows. Rows of fewer dimensions
    than `offsets.shape[1]` are padded in front with offset 0, length 1 (the row-major arithmetic
    of the real dimensions is unchanged); `ndim` keeps the real count."""
    names: list[str]             # tensor names; `tensor` indexes them
    tensor: np.ndarray           # [n]
    dest: np.ndarray             # [n] index into the wanted list
    file: np.ndarray             # [n] the saved box: data file, first byte, bytes
    offset: np.ndarray
    nbytes: np.ndarray
    saved_offsets: np.ndarray    # [n, D] the saved box
    saved_lengths: np.ndarray    # [n, D]
    offsets: np.ndarray          # [n, D] the region read (global coordinates)
    lengths: np.ndarray          # [n, D]
    ndim: np.ndarray             # [n]
    chunk: np.ndarray            # [n] checksum chunk bytes; the grid starts at the saved box's first byte
    crc_lo: np.ndarray           # [n] the box's CRCs are crcs[crc_lo:crc_hi]
    crc_hi: np.ndarray
    crcs: np.ndarray             # uint32

    def __len__(self) -> int:
        return len(self.dest)

    def take(self, rows: np.ndarray) -> "ReadColumns":
        return ReadColumns(self.names, *(getattr(self, f)[rows] for f in _ROW_FIELDS), self.crcs)

    def item(self, r: int) -> ReadItem:
        """Row r as a ReadItem."""
        k = self.offsets.shape[1] - int(self.ndim[r])
        a, b = int(self.offset[r]), int(self.nbytes[r])
        saved = SavedBox(tuple(self.saved_offsets[r, k:].tolist()), tuple(self.saved_lengths[r, k:].tolist()),
                         int(self.file[r]), a, b,
                         Sums(a, a + b, int(self.chunk[r]), tuple(self.crcs[self.crc_lo[r]:self.crc_hi[r]].tolist())))
        return ReadItem(self.names[int(self.tensor[r])], int(self.dest[r]), saved,
                        Box(tuple(self.offsets[r, k:].tolist()), tuple(self.lengths[r, k:].tolist())))

    def keys(self) -> list[tuple]:
        """item_key of every row, without its record."""
        n, width = len(self), self.offsets.shape[1]
        offs: list = [None] * n
        lens: list = [None] * n
        for nd in np.unique(self.ndim).tolist():
            rows = np.flatnonzero(self.ndim == nd)
            at = rows.tolist()
            for r, o, m in zip(at, self.offsets[rows, width - nd:].tolist(), self.lengths[rows, width - nd:].tolist()):
                offs[r], lens[r] = tuple(o), tuple(m)
        names = self.names
        return [(names[t], f, a, o, m) for t, f, a, o, m in
                zip(self.tensor.tolist(), self.file.tolist(), self.offset.tolist(), offs, lens)]

    def items(self) -> list[ReadItem]:
        """Every row as a ReadItem (equal to what the record-based planner makes)."""
        if not len(self):
            return []
        lists = [getattr(self, f).tolist() for f in _ROW_FIELDS]
        tensor, dest, file, offset, nbytes, so, sl, ro, rl, nd, chunk, c0, c1 = lists
        crcs, names = self.crcs.tolist(), self.names
        out = []
        for i in range(len(dest)):
            k = len(so[i]) - nd[i]
            a, b = offset[i], nbytes[i]
            saved = SavedBox(tuple(so[i][k:]), tuple(sl[i][k:]), file[i], a, b,
                             Sums(a, a + b, chunk[i], tuple(crcs[c0[i]:c1[i]])))
            out.append(ReadItem(names[tensor[i]], dest[i], saved, Box(tuple(ro[i][k:]), tuple(rl[i][k:]))))
        return out

    def item_nbytes(self) -> np.ndarray:
        """ReadItem.nbytes of every row."""
        return self.lengths.prod(axis=1) * (self.nbytes // np.maximum(self.saved_lengths.prod(axis=1), 1))


_ROW_FIELDS = ("tensor", "dest", "file", "offset", "nbytes", "saved_offsets", "saved_lengths", "offsets", "lengths",
               "ndim", "chunk", "crc_lo", "crc_hi")


def _columnar(cols) -> bool:
    """Whether the overlaps of stored boxes `cols` (BoxColumns or None) stay columns: checksummed
    (a foreign format's boxes have none) and uncompressed (a compressed box's grid lies elsewhere)."""
    return cols is not None and cols.chunk_bytes is not None and cols.codec is None


class _Pieces:
    """The columnar read items of one plan_reads call, gathered per stored-box table."""

    def __init__(self):
        self.parts: list[tuple] = []
        self.names: list[str] = []
        self.crcs: dict[int, tuple] = {}   # id(BoxColumns) -> (base, its crcs, it)
        self.ncrcs = 0

    def add(self, names, dest: np.ndarray, cols, rows: np.ndarray, offs: np.ndarray, lens: np.ndarray,
            tensor: np.ndarray | None = None) -> None:
        """Items reading rows `rows` of `cols` over regions (offs, lens): one tensor's (`names` a
        string) or several (`names` a list, `tensor` indexing it)."""
        first = len(self.names)
        if isinstance(names, str):
            self.names.append(names)
            tensor = np.full(len(rows), first, dtype=np.int64)
        else:
            self.names.extend(names)
            tensor = tensor + first
        held = self.crcs.get(id(cols))
        if held is None:
            held = self.crcs[id(cols)] = (self.ncrcs, cols.crcs, cols)   # cols kept: its id stays unique
            self.ncrcs += len(cols.crcs)
        base = held[0]
        nbytes = cols.nbytes[rows]
        chunk = np.full(len(rows), cols.chunk_bytes, dtype=np.int64) if cols.chunk_bytes else np.maximum(nbytes, 1)
        self.parts.append((tensor, dest, cols.file[rows], cols.offset[rows], nbytes, cols.offsets[rows],
                           cols.lengths[rows], offs, lens, chunk, base + cols.sums_start[rows],
                           base + cols.sums_start[rows + 1]))

    def columns(self) -> ReadColumns | None:
        if not self.parts:
            return None
        width = max(p[5].shape[1] for p in self.parts)

        def cat(k: int, pad: int | None = None) -> np.ndarray:
            arrays = [p[k] for p in self.parts]
            if pad is not None:
                arrays = [a if a.shape[1] == width else
                          np.concatenate([np.full((len(a), width - a.shape[1]), pad, dtype=np.int64), a], axis=1)
                          for a in arrays]
            return np.concatenate(arrays).astype(np.int64, copy=False)

        ndim = np.concatenate([np.full(len(p[0]), p[5].shape[1], dtype=np.int64) for p in self.parts])
        crcs = np.concatenate([c for _, c, _ in self.crcs.values()]).astype(np.uint32, copy=False)
        return ReadColumns(self.names, cat(0), cat(1), cat(2), cat(3), cat(4), cat(5, 0), cat(6, 1), cat(7, 0),
                           cat(8, 1), ndim, cat(9), cat(10), cat(11), crcs)


class ReadPlan(Sequence):
    """What plan_reads returns: a sequence of ReadItems (per wanted box, in the order of the
    tensor's saved boxes), held as records (`objects`) and columns (`columns`, or None); the
    records of column rows are made only when a caller indexes or iterates the plan. The engine
    reads and installs `columns` as arrays (engine.load.land_tensors)."""

    def __init__(self, objects: list[ReadItem], columns: ReadColumns | None = None):
        self.objects = objects
        self.columns = columns if columns is not None and len(columns) else None
        self._items: list[ReadItem] | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.objects) + (len(self.columns) if self.columns is not None else 0)

    @property
    def order(self) -> np.ndarray:
        """Position in the sequence -> index into objects + rows of columns (objects first)."""
        if self._order is None:
            dests = np.fromiter((it.dest for it in self.objects), dtype=np.int64, count=len(self.objects))
            if self.columns is not None:
                dests = np.concatenate([dests, self.columns.dest])
            # Each wanted box's items all come from one of the two: a stable sort by wanted box
            # keeps each one's own order.
            self._order = np.argsort(dests, kind="stable")
        return self._order

    def _all(self) -> list[ReadItem]:
        if self._items is None:
            if self.columns is None:
                self._items = self.objects
            else:
                merged = self.objects + self.columns.items()
                self._items = [merged[i] for i in self.order.tolist()]
        return self._items

    def __getitem__(self, i):
        if self._items is not None or not isinstance(i, int):
            return self._all()[i]
        # One record, made alone: forwarding asks for a few items of a plan of 10^5.
        src = int(self.order[i])
        n = len(self.objects)
        return self.objects[src] if src < n else self.columns.item(src - n)

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other) -> bool:
        if isinstance(other, (ReadPlan, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"ReadPlan({len(self.objects)} records, {0 if self.columns is None else len(self.columns)} rows)"

    def take(self, positions: Sequence[int]) -> "ReadPlan":
        """The items at `positions` (ascending), as a plan: columns stay columns."""
        src = self.order[np.asarray(positions, dtype=np.int64)]
        n = len(self.objects)
        objects = [self.objects[i] for i in src[src < n].tolist()]
        rows = src[src >= n] - n
        return ReadPlan(objects, self.columns.take(rows) if self.columns is not None and len(rows) else None)

    def wants(self) -> list[tuple[ItemKey, int]]:
        """(item_key, nbytes) of every item, in order, without making records of the rows."""
        keyed = [(item_key(it), it.nbytes) for it in self.objects]
        if self.columns is not None:
            keyed += list(zip(self.columns.keys(), self.columns.item_nbytes().tolist()))
            keyed = [keyed[i] for i in self.order.tolist()]
        return keyed

    def names(self) -> set[str]:
        out = {it.name for it in self.objects}
        if self.columns is not None:
            out.update(self.columns.names[i] for i in present(self.columns.tensor).tolist())
        return out

    def digest(self) -> str:
        """What the plan reads and where it lands it, as a hex digest: equal on two ranks when
        their plans are (the columns hashed as arrays: 10^5 rows in milliseconds)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr([(item_key(it), it.nbytes, it.dest) for it in self.objects]).encode())
        c = self.columns
        if c is not None:
            h.update(repr(c.names).encode())
            for f in _ROW_FIELDS:
                h.update(np.ascontiguousarray(getattr(c, f)).tobytes())
        return h.hexdigest()

    def bytes_per_file(self) -> dict[int, int]:
        """{data file: bytes the items read from it} (zero-fill items left out)."""
        read: dict[int, int] = {}
        for it in self.objects:
            if it.saved.file >= 0:
                read[it.saved.file] = read.get(it.saved.file, 0) + it.nbytes
        c = self.columns
        if c is not None:
            files, at = np.unique(c.file, return_inverse=True)
            sums = np.bincount(at, weights=c.item_nbytes(), minlength=len(files))
            for f, b in zip(files.tolist(), sums.tolist()):
                read[f] = read.get(f, 0) + int(b)
        return read


# From this many stored boxes on, a tensor is searched through an index (BoxIndex); tensors with
# fewer are intersected all together, in bulk (_plan_small).
_INDEX_FROM = 16


def plan_reads(manifest: Manifest, wanted: list[tuple[str, Box]]) -> "ReadPlan":
    """Every (saved box, wanted box) overlap, checking that each wanted box is fully covered.

    Items come per wanted box, in the order of the tensor's saved boxes. A tensor with many boxes
    is searched through an index (`BoxIndex`, built once per call), so a wanted box costs its
    overlaps, not the tensor's box count; tensors with few boxes (10^4 small tensors of an MoE
    model) are intersected with numpy all at once. Overlaps with stored boxes that have columns
    (a decoded omnickpt manifest, uncompressed, checksummed) stay columns (`ReadColumns`): no
    record is built per item unless a caller asks for one."""
    per_box: list[list[ReadItem]] = [[] for _ in wanted]
    gaps: list[tuple[int, str]] = []
    indexes: dict[str, BoxIndex] = {}
    small: dict[tuple, list] = {}   # (ndim, chunk_bytes) -> [(wanted index, name, box, columns)]
    pieces = _Pieces()
    for di, (name, box) in enumerate(wanted):
        entry = manifest.tensors.get(name)
        if entry is None:
            gaps.append((di, f"{name}: missing from the checkpoint"))
            continue
        covered = 0
        pending = entry.pending   # undecoded rows (a decoded manifest's entries): grouped without decoding
        if pending is not None and len(pending) < _INDEX_FROM:
            small.setdefault((len(entry.shape), pending.chunk_bytes, pending.group), []).append((di, name, box, entry))
            continue
        if entry.box_count < _INDEX_FROM:
            key = _small_key(entry)
            if key is not None:
                small.setdefault(key, []).append((di, name, box, entry))
                continue
            for sb in entry.boxes:
                region = intersect(Box(sb.offsets, sb.lengths), box)
                if region is not None and region.numel:
                    per_box[di].append(ReadItem(name, di, sb, region))
                    covered += region.numel
        else:
            index = indexes.get(name)
            if index is None:
                index = indexes[name] = _index(entry)
            found, offs, lens = index.overlapping(box)
            if len(found):
                covered = int(lens.prod(axis=1).sum())
                cols = getattr(entry, "columns", None)
                if _columnar(cols):
                    pieces.add(name, np.full(len(found), di, dtype=np.int64), cols, found, offs, lens)
                else:
                    saved = _saved_boxes(entry, found)
                    per_box[di] = [ReadItem(name, di, sb, Box(tuple(o), tuple(n)))
                                   for sb, o, n in zip(saved, offs.tolist(), lens.tolist())]
        if covered < box.numel:
            gaps.append((di, _gap(name, covered, box)))
    for (ndim, chunk_bytes, _), group in small.items():
        _plan_small(group, ndim, chunk_bytes, per_box, gaps, pieces)
    if gaps:
        lines = [g for _, g in sorted(gaps, key=lambda g: g[0])]
        raise MismatchError("the checkpoint does not cover every element this rank needs:\n  " + "\n  ".join(lines),
                            lines)
    return ReadPlan([it for items in per_box for it in items], pieces.columns())


def _gap(name: str, covered: int, box: Box) -> str:
    return (f"{name}: the checkpoint holds only {covered} of the {box.numel} elements of box "
            f"offsets={list(box.offsets)} lengths={list(box.lengths)}")


def _small_key(entry) -> tuple | None:
    """The bulk group of an entry with few stored boxes whose rows are decoded already (plan_reads
    groups undecoded ones itself): (ndim, chunk size, None); None when the entry holds SavedBox
    records already (foreign formats, transforms, listed before): intersecting those one by one
    costs less."""
    if getattr(entry, "holds_boxes", True):
        return None
    cols = entry.columns
    return None if cols is None else (len(entry.shape), cols.chunk_bytes, None)


def _plan_small(group: list, ndim: int, chunk_bytes: int | None, per_box: list[list[ReadItem]],
                gaps: list[tuple[int, str]], pieces: "_Pieces") -> None:
    """The reads of wanted boxes of tensors with few stored boxes, all of one ndim and checksum
    kind: their boxes joined (straight from the manifest's arrays where it was decoded), every
    (stored box, wanted box of its tensor) pair intersected in one numpy pass, records made for
    the overlaps only (one per tensor with a 1:1 layout)."""
    cols = joined_columns([g[3] for g in group])
    counts = np.fromiter((g[3].box_count for g in group), dtype=np.int64, count=len(group))
    owner = np.repeat(np.arange(len(group)), counts)
    lo, n = _small_overlaps(group, cols, owner, ndim)
    hit = np.flatnonzero((n > 0).all(axis=1))
    numel = n[hit].prod(axis=1)
    covered = np.zeros(len(group), dtype=np.int64)
    np.add.at(covered, owner[hit], numel)
    for k in np.flatnonzero(covered < np.array([g[2].numel for g in group], dtype=np.int64)).tolist():
        gaps.append((group[k][0], _gap(group[k][1], int(covered[k]), group[k][2])))
    if not len(hit):
        return
    who = owner[hit]
    if _columnar(cols):
        dest = np.array([g[0] for g in group], dtype=np.int64)[who]
        names = [g[1] for g in group]
        pieces.add(names, dest, cols, hit, lo[hit], n[hit], tensor=who)
        return
    file, offset, nbytes = cols.file[hit].tolist(), cols.offset[hit].tolist(), cols.nbytes[hit].tolist()
    sums = _small_sums(cols, hit, offset, nbytes, chunk_bytes)
    saved_offs = map(tuple, cols.offsets[hit].tolist())
    saved_lens = map(tuple, cols.lengths[hit].tolist())
    regions = zip(map(tuple, lo[hit].tolist()), map(tuple, n[hit].tolist()))
    for k, so, sl, f, a, b, sm, (ro, rl) in zip(who.tolist(), saved_offs, saved_lens, file, offset, nbytes, sums,
                                                 regions):
        di, name = group[k][0], group[k][1]
        per_box[di].append(ReadItem(name, di, SavedBox(so, sl, f, a, b, sm), Box(ro, rl)))


def _small_overlaps(group: list, cols, owner: np.ndarray, ndim: int):
    """(lo, n): each joined stored box's overlap with its entry's wanted box, as offsets `lo` and
    lengths `n` (a length <= 0 where they do not overlap)."""
    q_lo = np.array([g[2].offsets for g in group], dtype=np.int64).reshape(len(group), ndim)
    q_hi = q_lo + np.array([g[2].lengths for g in group], dtype=np.int64).reshape(len(group), ndim)
    lo = np.maximum(cols.offsets, q_lo[owner])
    n = np.minimum(cols.offsets + cols.lengths, q_hi[owner]) - lo
    return lo, n


def _small_sums(cols, hit: np.ndarray, offset: list[int], nbytes: list[int],
                chunk_bytes: int | None) -> list[Sums | None]:
    """The checksums of the overlapped joined boxes `hit`, or Nones when the group has none."""
    if chunk_bytes is None:
        return [None] * len(hit)
    s0, s1 = cols.sums_start[hit].tolist(), cols.sums_start[hit + 1].tolist()
    crcs = cols.crcs.tolist()
    return [Sums(a, a + b, chunk_bytes or max(1, b), tuple(crcs[i:j]))
            for a, b, i, j in zip(offset, nbytes, s0, s1)]


def _index(entry) -> BoxIndex:
    cols = getattr(entry, "columns", None)   # None for transforms' derived boxes: those are indexed from the box list
    if cols is not None:
        return BoxIndex(cols.offsets, cols.lengths)
    return BoxIndex.of(entry.boxes, len(entry.shape))


def _saved_boxes(entry, rows: np.ndarray) -> list[SavedBox]:
    """The SavedBoxes of rows `rows` of `entry`, equal to entry.boxes[i], but made from its columns
    for those rows only: a tensor of 10^4 boxes of which a rank reads ten costs ten records."""
    cols = getattr(entry, "columns", None)
    if cols is None:
        boxes = entry.boxes
        return [boxes[i] for i in rows.tolist()]
    offs = map(tuple, cols.offsets[rows].tolist())
    lens = map(tuple, cols.lengths[rows].tolist())
    file, offset, nbytes = cols.file[rows].tolist(), cols.offset[rows].tolist(), cols.nbytes[rows].tolist()
    if cols.chunk_bytes is None:
        return [SavedBox(o, n, f, a, b, None) for o, n, f, a, b in zip(offs, lens, file, offset, nbytes)]
    cb = cols.chunk_bytes
    s0, s1 = cols.sums_start[rows].tolist(), cols.sums_start[rows + 1].tolist()
    # rows ascend, so their CRCs lie in one stretch: one conversion, then list slices
    base = s0[0]
    crcs = cols.crcs[base:s1[-1]].tolist()
    return [SavedBox(o, n, f, a, b, Sums(a, a + b, cb or max(1, b), tuple(crcs[i - base:j - base])))
            for o, n, f, a, b, i, j in zip(offs, lens, file, offset, nbytes, s0, s1)]


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
