"""The records a checkpoint's manifest is made of, and nothing else: what a manifest says, not how it is
stored (docs/format.md; DCP's metadata.py plays this role there).

A manifest (`Manifest`, format/manifest.py) lists its data files (`FileEntry`), its tensors
(`TensorEntry`: a global shape and dtype, and the stored boxes in two views, `SavedBox` records
or `BoxColumns` arrays) and its objects (`ObjectEntry`). `Sums` is the CRC32C grid of a stored
box's bytes.

How a manifest is stored sits above these records: format/header.py (the fields every version
shares, validated as untrusted input), format/v3.py (the binary version 3, written by default,
with the header reader retention uses) and format/legacy.py (the JSON of versions 1 and 2).
`Manifest` itself lives on top of them, in format/manifest.py, so that its `encode` and `decode`
reach the codecs by an ordinary downward import.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

from omnickpt.errors import CorruptCheckpointError

FORMAT_NAME = "omnickpt"
FORMAT_VERSION = 3
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"          # data files: data/<save_id>-r<rank>.bin
CONTROL_DIR = ".omnickpt"  # per-save records, commit status, the owner lease; not part of the checkpoint
# The checksum granularity of version 2. A partial read verifies whole chunks, so it reads at most
# one chunk too much at each end of a run; smaller chunks mean more CRCs in the manifest (one
# 4-byte value per MiB: ~4 MB of JSON for a 1 TB checkpoint).
CHUNK_BYTES = 1 << 20

# Only these dtypes are accepted from a manifest: a name is never resolved with getattr on
# arbitrary input.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"dtype {dtype} is not supported by the omnickpt format")
    return name


def dtype_from_name(name: str, where: str = "manifest") -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where} names an unknown dtype {name!r}") from None


@dataclass(frozen=True, slots=True)
class Sums:
    """CRC32C of the consecutive `size`-byte chunks of file bytes [start, end) (the last chunk may be
    shorter). A stored box has the grid of its own bytes; a box derived from it by a transform
    keeps that grid, since its bytes lie inside the same stored range.

    In a compressed checkpoint [start, end) are the box's raw bytes as if stored at `start`
    (every byte range a reader plans with stays in these coordinates), while chunk i really lies
    at `file_chunk(i)`: the chunks stored back to back from `start`, `stored[i]` bytes each,
    compressed with `codec` (elements of `itemsize` bytes) unless `stored[i]` equals the chunk's
    raw length (then it is stored raw). The CRCs are those of the stored bytes."""
    start: int
    end: int
    size: int
    crcs: tuple[int, ...]
    stored: tuple[int, ...] | None = None
    codec: str | None = None
    itemsize: int = 1
    dtype: str | None = None    # the tensor's: a quantized chunk decodes into it
    # Cumulative stored lengths, made at the first use: a reader asks for many chunks of one box.
    # (A slot, not a cached_property: slots make the 10^5 Sums of a resharded load ~2x cheaper to build.)
    _ends: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def file_chunk(self, i: int) -> tuple[int, int]:
        """File bytes [a, b) where chunk i is stored (`chunk(i)` unless compressed)."""
        if self.stored is None:
            return self.chunk(i)
        ends = self._stored_ends
        return self.start + (ends[i - 1] if i else 0), self.start + ends[i]

    @property
    def file_end(self) -> int:
        """One past the last file byte of the stored box."""
        if self.stored is None:
            return self.end
        return self.start + (self._stored_ends[-1] if self.stored else 0)

    @property
    def _stored_ends(self) -> tuple[int, ...]:
        if self._ends is None:
            object.__setattr__(self, "_ends", tuple(itertools.accumulate(self.stored)))
        return self._ends

    @staticmethod
    def chunk_count(nbytes: int, size: int) -> int:
        return -(-nbytes // size) if nbytes else 0

    def covering(self, lo: int, hi: int) -> range:
        """Indices of the chunks that hold file bytes [lo, hi) (which must lie in [start, end))."""
        return range((lo - self.start) // self.size, -(-(hi - self.start) // self.size))

    def chunk(self, i: int) -> tuple[int, int]:
        """File bytes [a, b) of chunk i."""
        a = self.start + i * self.size
        return a, min(a + self.size, self.end)


@dataclass(slots=True)
class SavedBox:
    """One stored box of a tensor: where its row-major bytes lie and their checksums."""
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int          # index into Manifest.files
    offset: int        # byte offset in that file
    nbytes: int
    sums: Sums | None  # checksums of the stored bytes (None: nothing stored, see transforms' zero fill)

    @classmethod
    def stored(cls, offsets, lengths, file: int, offset: int, nbytes: int, crcs, chunk_bytes: int = CHUNK_BYTES):
        """A box as written by a save: its chunk grid starts at its own first byte."""
        return cls(tuple(offsets), tuple(lengths), file, offset, nbytes,
                   Sums(offset, offset + nbytes, chunk_bytes, tuple(crcs)))

    @property
    def checksum(self) -> int | None:
        """The CRC32C of the whole box when one chunk covers exactly its bytes, else None."""
        s = self.sums
        if s is not None and len(s.crcs) == 1 and (s.start, s.end) == (self.offset, self.offset + self.nbytes):
            return s.crcs[0]
        return None

    def encode(self) -> list:
        return [list(self.offsets), list(self.lengths), self.file, self.offset, self.nbytes, list(self.sums.crcs)]


@dataclass(slots=True)
class WindowBox(SavedBox):
    """A derived box (made by a transform) whose elements are a sub-box of a stored block.

    The stored block is row-major over `base_lengths` at bytes [offset, offset + nbytes) of the
    file; this box's element (0, ..., 0) lies at `base_start` inside it. A plain SavedBox is the
    case base_lengths == lengths, base_start == 0. Windows let a transform select along any
    dimension (not only contiguous leading rows); the reader turns them into strided runs.
    """
    base_lengths: tuple[int, ...] = ()
    base_start: tuple[int, ...] = ()


@dataclass(frozen=True)
class BoxColumns:
    """The stored boxes of one tensor as columns (numpy int64 unless said), row i being box i.

    Each box's chunk grid is that of its own bytes [offset[i], offset[i] + nbytes[i]):
    `chunk_bytes` > 0: pieces of that many bytes, the last one shorter (versions 2 and 3);
    0: one chunk covering the whole box (version 1); None: no checksums at all (a foreign format),
    crcs is then empty. Box i's CRCs are crcs[sums_start[i]:sums_start[i + 1]]; in a compressed
    checkpoint (`codec` set) `stored` holds each chunk's stored length, like crcs (see Sums).
    """
    offsets: np.ndarray      # [n, ndim]
    lengths: np.ndarray      # [n, ndim]
    file: np.ndarray         # [n] index into Manifest.files
    offset: np.ndarray       # [n] byte offset in that file
    nbytes: np.ndarray       # [n]
    sums_start: np.ndarray   # [n + 1]
    crcs: np.ndarray         # uint32 [total chunks]
    chunk_bytes: int | None = CHUNK_BYTES
    stored: np.ndarray | None = None   # int64 [total chunks], with codec
    codec: str | None = None
    itemsize: int = 1
    dtype: str | None = None

    def __len__(self) -> int:
        return len(self.file)

    def _compressed(self, a: int, b: int) -> dict:
        if self.codec is None:
            return {}
        return {"stored": tuple(self.stored[a:b].tolist()), "codec": self.codec, "itemsize": self.itemsize,
                "dtype": self.dtype}

    def sums(self, i: int) -> Sums | None:
        """Box i's checksum grid, as SavedBox.sums holds it."""
        if self.chunk_bytes is None:
            return None
        off, nb = int(self.offset[i]), int(self.nbytes[i])
        size = self.chunk_bytes or max(1, nb)
        a, b = int(self.sums_start[i]), int(self.sums_start[i + 1])
        return Sums(off, off + nb, size, tuple(self.crcs[a:b].tolist()), **self._compressed(a, b))

    def to_boxes(self) -> list[SavedBox]:
        """One SavedBox per row (what TensorEntry.boxes shows)."""
        n = len(self)
        if not n:
            return []
        offs = list(map(tuple, self.offsets.tolist()))
        lens = list(map(tuple, self.lengths.tolist()))
        file, offset, nbytes = self.file.tolist(), self.offset.tolist(), self.nbytes.tolist()
        if self.chunk_bytes is None:
            return [SavedBox(offs[i], lens[i], file[i], offset[i], nbytes[i], None) for i in range(n)]
        starts, crcs, cb = self.sums_start.tolist(), self.crcs.tolist(), self.chunk_bytes
        return [SavedBox(offs[i], lens[i], file[i], offset[i], nbytes[i],
                         Sums(offset[i], offset[i] + nbytes[i], cb or max(1, nbytes[i]),
                              tuple(crcs[starts[i]:starts[i + 1]]), **self._compressed(starts[i], starts[i + 1])))
                for i in range(n)]

    @staticmethod
    def from_boxes(boxes: list[SavedBox], ndim: int) -> "BoxColumns | None":
        """The columns of plain stored boxes; None when a box cannot be a row (a transform's
        WindowBox or a box that reads another box's chunk grid): such entries stay object-based."""
        n = len(boxes)
        sums = [b.sums for b in boxes]
        if any(type(b) is not SavedBox for b in boxes):
            return None
        shared = _shared_codec(sums)
        grid = None if shared is None else _shared_grid(sums, boxes, shared[0])
        if grid is None:
            return None
        (codec, itemsize, stored, dtype), (chunk_bytes, counts, crcs) = shared, grid
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        return BoxColumns(
            offsets=np.array([b.offsets for b in boxes], dtype=np.int64).reshape(n, ndim),
            lengths=np.array([b.lengths for b in boxes], dtype=np.int64).reshape(n, ndim),
            file=np.array([b.file for b in boxes], dtype=np.int64),
            offset=np.array([b.offset for b in boxes], dtype=np.int64),
            nbytes=np.array([b.nbytes for b in boxes], dtype=np.int64),
            sums_start=starts, crcs=np.array(crcs, dtype=np.uint32), chunk_bytes=chunk_bytes,
            stored=stored, codec=codec, itemsize=itemsize, dtype=dtype)


def _shared_codec(sums: list[Sums | None]) -> tuple | None:
    """(codec, itemsize, stored lengths, dtype) of boxes' checksum grids when the boxes share one
    codec (codec None: raw bytes), None when they do not (then they cannot be rows of one table)."""
    codecs = {s.codec for s in sums if s is not None}
    if not codecs or codecs == {None}:
        return None, 1, None, None
    itemsizes, dtypes = {s.itemsize for s in sums}, {s.dtype for s in sums}
    if len(codecs) != 1 or len(itemsizes) != 1 or len(dtypes) != 1:
        return None
    codec, itemsize, dtype = codecs.pop(), itemsizes.pop(), dtypes.pop()
    return codec, itemsize, np.array([x for s in sums for x in s.stored], dtype=np.int64), dtype


def _shared_grid(sums: list[Sums | None], boxes: list[SavedBox], codec: str | None) -> tuple | None:
    """(chunk_bytes, CRCs per box, all CRCs) when every box's grid is that of its own bytes in one
    chunk size (chunk_bytes None: no box has checksums; 0: each box one chunk, version 1), None
    when the grids cannot share a column (some boxes without sums, another box's grid)."""
    if all(s is None for s in sums):
        return None, [0] * len(boxes), []
    if not _own_grids(sums, boxes, codec):
        return None
    chunk_bytes = _grid_size(sums, boxes)
    if chunk_bytes is None:
        return None
    return chunk_bytes, [len(s.crcs) for s in sums], [c for s in sums for c in s.crcs]


def _own_grids(sums: list[Sums | None], boxes: list[SavedBox], codec: str | None) -> bool:
    """Whether every box has the checksums of its own bytes (and, compressed, their stored lengths)."""
    if any(s is None for s in sums) or (codec is not None and any(s.stored is None for s in sums)):
        return False
    return all((s.start, s.end) == (b.offset, b.offset + b.nbytes) for s, b in zip(sums, boxes))


def _grid_size(sums: list[Sums], boxes: list[SavedBox]) -> int | None:
    """The chunk size every box's grid has; 0 when each box is one chunk (version 1); else None."""
    sizes = {s.size for s in sums}
    chunk_bytes = sizes.pop() if len(sizes) == 1 else 0
    if chunk_bytes and all(len(s.crcs) == Sums.chunk_count(b.nbytes, chunk_bytes) for s, b in zip(sums, boxes)):
        return chunk_bytes
    # Version 1: one chunk per box, as large as the box.
    if any(len(s.crcs) != 1 or s.size != max(1, b.nbytes) for s, b in zip(sums, boxes)):
        return None
    return 0


@dataclass(frozen=True)
class ColumnTable:
    """The boxes of many tensors in shared columns, rows grouped by tensor: offsets and lengths are
    padded to the widest tensor. A save builds its manifest from one (engine/manifest.py) and hands each
    tensor rows [a, b) as a TensorEntry that slices its columns on first use."""
    offsets: np.ndarray      # [N, D]
    lengths: np.ndarray      # [N, D]
    file: np.ndarray         # [N]
    offset: np.ndarray       # [N]
    nbytes: np.ndarray       # [N]
    sums_start: np.ndarray   # [N + 1] into crcs
    crcs: np.ndarray         # uint32
    chunk_bytes: int | None = CHUNK_BYTES
    stored: np.ndarray | None = None   # like crcs: each chunk's stored length (a compressed save)
    codec: str | None = None

    def entry(self, shape: tuple[int, ...], dtype: str, a: int, b: int, codec: str | None = None) -> "TensorEntry":
        """Rows [a, b) as a tensor's entry; `codec`: this tensor's, where it is not the table's (a
        quantized optimizer moment in a checkpoint whose other tensors are stored otherwise)."""
        return self.entries([""], [shape], [dtype], [a, b], {"": codec} if codec else {})[""]

    def entries(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str],
                bounds: Sequence[int], codecs: Mapping[str, str]) -> "dict[str, TensorEntry]":
        """name -> entry() of rows [bounds[i], bounds[i + 1]) for every tensor i: a save's manifest
        makes one per tensor (10^4 and more), so the itemsize is looked up once per dtype."""
        itemsize = {d: dtype_from_name(d).itemsize for d in set(dtypes)}
        rows = _TableRows
        return {name: TensorEntry(shape, dtype, load=rows(self, a, b, len(shape), itemsize[dtype], dtype,
                                                          codecs.get(name) or self.codec))
                for name, shape, dtype, a, b in zip(names, shapes, dtypes, bounds[:-1], bounds[1:])}


class _TableRows(NamedTuple):
    """Rows [a, b) of a ColumnTable: one tensor's entry, made into its BoxColumns on first use.
    A tuple: a save makes one per tensor, at a quarter of a frozen dataclass's cost (0.27 us, not 1.07)."""
    table: ColumnTable
    a: int
    b: int
    ndim: int
    itemsize: int
    dtype: str | None = None
    codec: str | None = None

    def __call__(self) -> BoxColumns:
        t, a, b = self.table, self.a, self.b
        s0, s1 = int(t.sums_start[a]), int(t.sums_start[b])
        return BoxColumns(offsets=np.ascontiguousarray(t.offsets[a:b, :self.ndim]),
                          lengths=np.ascontiguousarray(t.lengths[a:b, :self.ndim]),
                          file=t.file[a:b], offset=t.offset[a:b], nbytes=t.nbytes[a:b],
                          sums_start=t.sums_start[a:b + 1] - s0, crcs=t.crcs[s0:s1], chunk_bytes=t.chunk_bytes,
                          stored=None if t.stored is None else t.stored[s0:s1], codec=self.codec,
                          itemsize=self.itemsize, dtype=self.dtype)


class TensorEntry:
    """A global tensor of the manifest: shape, dtype and its stored boxes, in two views.

    `columns` (BoxColumns) is what bulk code uses; `boxes` (a list of SavedBox) what per-box code
    uses. An entry decoded from a manifest or built by a save holds columns and makes the box list
    on first access; an entry built from a box list makes columns on first access (None when a box
    cannot be a row: transforms' derived boxes). Edit `boxes` only while building an entry, before
    anyone reads `columns` (a change of its length is noticed, an in-place edit is not).
    """
    __slots__ = ("shape", "dtype", "_boxes", "_columns", "_load")

    def __init__(self, shape: tuple[int, ...], dtype: str, boxes: list[SavedBox] | None = None, *,
                 columns: BoxColumns | None = None, load=None):
        self.shape = shape
        self.dtype = dtype
        self._boxes = boxes if boxes is not None or columns is not None or load is not None else []
        self._columns = columns
        self._load = load   # makes the columns on first use (a lazily decoded manifest)

    @property
    def columns(self) -> BoxColumns | None:
        if self._load is not None:
            self._columns, self._load = self._load(), None
        if self._boxes is not None and (self._columns is None or len(self._columns) != len(self._boxes)):
            self._columns = BoxColumns.from_boxes(self._boxes, len(self.shape))
        return self._columns

    @property
    def boxes(self) -> list[SavedBox]:
        if self._boxes is None:
            self._boxes = self.columns.to_boxes()
        return self._boxes

    @boxes.setter
    def boxes(self, boxes: list[SavedBox]) -> None:
        self._boxes, self._columns, self._load = boxes, None, None

    @property
    def holds_boxes(self) -> bool:
        """Whether the entry holds its boxes as SavedBox records already (made from a list: foreign
        formats, transforms; or listed before), rather than only as columns."""
        return self._boxes is not None

    @property
    def box_count(self) -> int:
        if self._boxes is not None:
            return len(self._boxes)
        if self._load is not None and hasattr(self._load, "join"):
            return len(self._load)   # without decoding the rows
        return len(self.columns)

    @property
    def table_rows(self) -> "_TableRows | None":
        """Its rows of a save's ColumnTable while nobody has asked for its boxes or columns (a
        manifest a save just built), else None: see table_span."""
        load = self._load
        return load if type(load) is _TableRows and self._boxes is None else None

    @property
    def pending(self):
        """The undecoded rows of a lazily decoded entry that can be joined with others' in bulk
        (see joined_columns), else None."""
        load = self._load
        return load if load is not None and self._boxes is None and hasattr(load, "join") else None

    @property
    def nbytes(self) -> int:
        if self._boxes is None:
            return int(self.columns.nbytes.sum())
        return sum(b.nbytes for b in self._boxes)

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (tuple(self.shape), self.dtype, self.boxes) == (tuple(other.shape), other.dtype, other.boxes)

    def __repr__(self) -> str:
        return f"TensorEntry(shape={tuple(self.shape)}, dtype={self.dtype!r}, boxes={self.box_count})"


@dataclass(frozen=True)
class TableSpan:
    """Consecutive rows [a, b) of one ColumnTable that hold the boxes of some entries, in their
    order: `starts[i]:starts[i + 1]` (relative to a) are entry i's rows, `ndims[i]` its rank."""
    table: ColumnTable
    a: int
    b: int
    starts: np.ndarray   # [n + 1] int64, relative to a
    ndims: np.ndarray    # [n] int64
    codecs: list         # [n] each entry's codec (its own, or the table's)

    def flat(self, column: np.ndarray) -> np.ndarray:
        """Offsets or lengths ([N, D] padded) of the span's rows, each row cut to its entry's rank
        and all concatenated: what the entries' own columns reshaped to 1-D and joined would be."""
        rows = column[self.a:self.b]
        ranks = np.repeat(self.ndims, np.diff(self.starts))
        return rows[np.arange(rows.shape[1]) < ranks[:, None]]

    def chunks(self) -> tuple[int, int]:
        """[first, end) of the span's checksums in the table's crcs (and stored lengths)."""
        s = self.table.sums_start
        return int(s[self.a]), int(s[self.b])


def table_span(entries: "list[TensorEntry]") -> TableSpan | None:
    """When every entry still holds only its rows of one ColumnTable, the rows of each following
    the rows of the one before, those rows as one span: a save's manifest is then encoded straight
    from the table's columns instead of a BoxColumns per tensor (24,000 tensors took 0.3 s that
    way). None otherwise (an edited, decoded or derived entry): then per entry."""
    rows = [e.table_rows for e in entries]
    if not rows or any(r is None for r in rows):
        return None
    table = rows[0].table
    if any(r.table is not table for r in rows):
        return None
    n = len(rows)
    a = np.fromiter((r.a for r in rows), dtype=np.int64, count=n)
    b = np.fromiter((r.b for r in rows), dtype=np.int64, count=n)
    if (a[1:] != b[:-1]).any() or (b < a).any():
        return None
    starts = np.concatenate((a[:1], b)) - a[0]
    return TableSpan(table, int(a[0]), int(b[-1]), starts,
                     np.fromiter((r.ndim for r in rows), dtype=np.int64, count=n), [r.codec for r in rows])


def joined_columns(entries: "list[TensorEntry]") -> BoxColumns:
    """The stored boxes of `entries` (one ndim and chunk size, none built from a box list)
    concatenated as one BoxColumns in their order, sums_start into the concatenated CRCs. Entries
    of a decoded manifest are joined straight from its arrays, without a BoxColumns per tensor."""
    loads = [e.pending for e in entries]
    if all(x is not None for x in loads) and len({x.group for x in loads}) == 1:
        return type(loads[0]).join(loads)
    cols = [e.columns for e in entries]
    counts = np.fromiter((len(c.crcs) for c in cols), dtype=np.int64, count=len(cols))
    base = np.concatenate(([0], np.cumsum(counts)[:-1]))
    starts = np.concatenate([c.sums_start[:-1] + b for c, b in zip(cols, base.tolist())] + [[int(counts.sum())]])
    first = cols[0]
    return BoxColumns(
        offsets=np.concatenate([c.offsets for c in cols]), lengths=np.concatenate([c.lengths for c in cols]),
        file=np.concatenate([c.file for c in cols]), offset=np.concatenate([c.offset for c in cols]),
        nbytes=np.concatenate([c.nbytes for c in cols]), sums_start=starts.astype(np.int64),
        crcs=np.concatenate([c.crcs for c in cols]), chunk_bytes=first.chunk_bytes,
        stored=None if first.stored is None else np.concatenate([c.stored for c in cols]),
        codec=first.codec, itemsize=first.itemsize, dtype=first.dtype)


@dataclass
class ObjectEntry:
    """A safely encoded non-tensor value; `ranks` lists every saving rank whose value it is.

    `inline` holds the encoded value itself when it is not in a data file: a reader of a foreign
    format (omnickpt/formats/) decodes that format's small values once, safely, and re-encodes
    them our way. Such entries have file == -1 and are never stored in an omnickpt manifest."""
    ranks: list[int]
    file: int
    offset: int
    nbytes: int
    checksum: int
    inline: bytes | None = None

    def encode(self) -> dict:
        return {"ranks": self.ranks, "file": self.file, "offset": self.offset,
                "nbytes": self.nbytes, "checksum": self.checksum}


@dataclass
class FileEntry:
    path: str   # relative to the checkpoint directory, '/'-separated
    rank: int   # the rank that wrote it
    bytes: int
