"""The manifest: the one global metadata record of a checkpoint, written last and atomically.

Version 3 (written by default) is a small JSON header (files, objects, layout and an index of
the tensors) followed by columnar little-endian integer arrays of the boxes, read with
numpy.frombuffer: a manifest of 10^6 boxes encodes and decodes in a fraction of a second, and a
reader that wants a few tensors (`Manifest.decode(..., names=)`) validates only their rows; each
tensor's box objects are made only when someone asks for them. Versions 1 and 2 were JSON and
still decode. No version executes code. `Manifest.decode` validates everything it reads:
a manifest is untrusted input, so every size, offset and box is checked before anything is
allocated from it, and the boxes of each tensor must tile it exactly (no hole, no overlap).

Version 2 checksums each box in chunks of `chunk_bytes` (`Sums`), so that a load that reads only
part of a box (any resharded load) can still verify every byte it uses. Version 1 held one CRC per
box; it is read as a one-chunk grid, so a partial read of a version-1 box reads the whole box.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import posixpath
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from omnickpt.format.checksum import checksum
from omnickpt.format.codec import STORED_CODECS, TENSOR_CODECS
from omnickpt.format.quant import QUANT_DTYPES

FORMAT_NAME = "omnickpt"
FORMAT_VERSION = 3
# The first bytes of a version-3 manifest; a JSON manifest (versions 1, 2) starts with '{'.
MAGIC = b"OMNICKPT"
_PRELUDE = struct.Struct("<8sIIQII")   # magic, version, header bytes, array bytes, crc32c, reserved
_ALIGN = 8
# Integer arrays may be stored as narrow unsigned integers or int64 (little-endian); nothing else.
_ARRAY_DTYPES = {"|u1", "<u2", "<u4", "<i8"}
_COLUMNS = ("offsets", "lengths", "file", "offset", "crcs")
# A compressed checkpoint adds one column: the stored (compressed) byte length of each chunk.
_STORED = "stored"
_HASHES = "hashes"   # an incremental save's block hashes (xxh3-64 of each block of rows), "<u8"
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"          # data files: data/<save_id>-r<rank>.bin
CONTROL_DIR = ".omnickpt"  # per-save records, commit status, the owner lease; not part of the checkpoint
# The checksum granularity of version 2. A partial read verifies whole chunks, so it reads at most
# one chunk too much at each end of a run; smaller chunks mean more CRCs in the manifest (one
# 4-byte value per MiB: ~4 MB of JSON for a 1 TB checkpoint).
CHUNK_BYTES = 1 << 20
# What a manifest may declare before anything is believed: larger values are damage, not data.
_MAX_DIMS = 64
_MAX_INT = 1 << 62
# Versions are small integers, one per incompatible change; anything larger is a damaged field.
_MAX_VERSION = 255

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


@dataclass(frozen=True)
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

    @functools.cached_property
    def _stored_ends(self) -> tuple[int, ...]:
        # Cumulative stored lengths, made once: a reader asks for many chunks of one box.
        return tuple(itertools.accumulate(self.stored))

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


@dataclass
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


@dataclass
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
        codecs = {s.codec for s in sums if s is not None}
        codec, itemsize, stored, dtype = None, 1, None, None
        if codecs and codecs != {None}:
            itemsizes, dtypes = {s.itemsize for s in sums}, {s.dtype for s in sums}
            if len(codecs) != 1 or len(itemsizes) != 1 or len(dtypes) != 1:
                return None
            codec, itemsize, dtype = codecs.pop(), itemsizes.pop(), dtypes.pop()
            stored = np.array([x for s in sums for x in s.stored], dtype=np.int64)
        if all(s is None for s in sums):
            chunk_bytes, counts, crcs = None, [0] * n, []
        elif any(s is None for s in sums) or (codec is not None and any(s.stored is None for s in sums)):
            return None
        else:
            if any((s.start, s.end) != (b.offset, b.offset + b.nbytes) for s, b in zip(sums, boxes)):
                return None
            sizes = {s.size for s in sums}
            chunk_bytes = sizes.pop() if len(sizes) == 1 else 0
            if not (chunk_bytes and all(len(s.crcs) == Sums.chunk_count(b.nbytes, chunk_bytes)
                                        for s, b in zip(sums, boxes))):
                # Version 1: one chunk per box, as large as the box.
                chunk_bytes = 0
                if any(len(s.crcs) != 1 or s.size != max(1, b.nbytes) for s, b in zip(sums, boxes)):
                    return None
            counts = [len(s.crcs) for s in sums]
            crcs = [c for s in sums for c in s.crcs]
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


@dataclass(frozen=True)
class ColumnTable:
    """The boxes of many tensors in shared columns, rows grouped by tensor: offsets and lengths are
    padded to the widest tensor. A save builds its manifest from one (engine/save.py) and hands each
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
        return TensorEntry(shape, dtype, load=_TableRows(self, a, b, len(shape), dtype_from_name(dtype).itemsize,
                                                         dtype, codec or self.codec))


@dataclass(frozen=True)
class _TableRows:
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
        return len(self._boxes) if self._boxes is not None else len(self.columns)

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


@dataclass
class Manifest:
    save_id: str
    world_size: int
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    objects: dict[str, list[ObjectEntry]]
    layout: dict[str, Any] = field(default_factory=dict)
    tool_version: str = ""
    created: float = 0.0
    version: int = FORMAT_VERSION
    chunk_bytes: int = CHUNK_BYTES
    # The codec of every stored chunk (format/codec.py), None for raw bytes; version 3 only.
    compression: str | None = None
    # Incremental saves (engine/incremental.py), version 3 only: the block grid (bytes of rows per
    # block) the content hashes are taken on, each tensor's block hashes (uint64, box after box),
    # the sibling checkpoint the save compared against and how many incremental saves since the
    # last full one. None: no hashes (an ordinary save).
    block_bytes: int | None = None
    hashes: dict[str, np.ndarray] = field(default_factory=dict)
    # Lossy quantization (save(quantize_optimizer=), format/quant.py), version 3 only: per tensor
    # stored quantized, {"scheme": "int8" | "fp8", "max_error": the largest |x - x'| measured}.
    quantized: dict[str, dict] = field(default_factory=dict)
    base: str | None = None
    chain: int = 0
    # True once a transform has rewritten it (omnickpt/transforms.py); never stored.
    derived: bool = False

    def object_for_rank(self, key: str, rank: int) -> ObjectEntry:
        """The value saved by `rank`, or else by the lowest saving rank (scale-up)."""
        entries = self.objects[key]
        for e in entries:
            if rank in e.ranks:
                return e
        return min(entries, key=lambda e: min(e.ranks))

    # -- encoding ---------------------------------------------------------------------------
    def encode(self) -> bytes:
        """The stored manifest: version 3 (binary, docs/format.md) unless `version` asks for the JSON
        of version 2. Every box must carry its own chunk grid (start = its offset, end = its end,
        size = chunk_bytes): derived manifests (transforms) are never stored."""
        if self.version <= 2:
            return self._encode_json()
        return _encode_v3(self)

    def _header(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "tool_version": self.tool_version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "layout": self.layout,
            "checksum": "crc32c",
            "chunk_bytes": self.chunk_bytes,
            "files": [_file_record(f) for f in self.files],
            "objects": {k: [e.encode() for e in v] for k, v in self.objects.items()},
        } | ({"compression": self.compression} if self.compression else {}) | (
            {"incremental": {"block_bytes": self.block_bytes, "base": self.base, "chain": self.chain}}
            if self.block_bytes else {})

    def _stored_columns(self, name: str, t: "TensorEntry") -> BoxColumns:
        c = t.columns
        if c is None or (len(c) and c.chunk_bytes != self.chunk_bytes):
            raise ValueError(f"tensor {name!r}: its boxes have no checksum grid of their own bytes in chunks of "
                             f"{self.chunk_bytes}; only stored boxes can be encoded")
        if len(c) and c.codec != self.compression and c.codec != self.quantized.get(name, {}).get("scheme"):
            raise ValueError(f"tensor {name!r}: its boxes are stored with compression {c.codec!r}, the manifest "
                             f"says {self.compression!r}")
        return c

    def _encode_json(self) -> bytes:
        if self.block_bytes or any(f.path.startswith("../") for f in self.files):
            raise ValueError("an incremental checkpoint has no version-2 (JSON) form; encode it as version 3")
        if self.compression:
            raise ValueError(f"a compressed checkpoint ({self.compression}) has no version-2 (JSON) form; "
                             "encode it as version 3")
        doc = self._header()
        doc["tensors"] = {}
        for name, t in self.tensors.items():
            self._stored_columns(name, t)
            doc["tensors"][name] = {"shape": list(t.shape), "dtype": t.dtype, "boxes": [b.encode() for b in t.boxes]}
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes, where: str = "manifest", names=None) -> "Manifest":
        """A manifest from its stored bytes (any version), validated as untrusted input: damage is a
        CorruptCheckpointError naming `where` and the field. With `names`, only those tensors are
        decoded and validated (the others are absent from `tensors`); a version-3 manifest then
        costs in proportion to their boxes."""
        wanted = None if names is None else set(names)
        if bytes(data[:len(MAGIC)]) == MAGIC:
            try:
                return _decode_v3(memoryview(data), where, wanted)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as e:
                raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); the manifest "
                                             "is damaged: restore it or load an earlier checkpoint") from None
        doc = _json_doc(data, where)
        try:
            m = _decode(doc, where, wanted)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); the manifest is "
                                         "damaged: restore it or load an earlier checkpoint") from None
        return m


def manifest_document(data: bytes, where: str = "manifest") -> dict:
    """A stored manifest (any version) as the JSON document of version 2, for tools and tests
    that read or edit a manifest by hand: a document written back as JSON still loads."""
    m = Manifest.decode(data, where)
    m.version = 2
    return json.loads(m._encode_json())


def _json_doc(data, where: str) -> dict:
    try:
        doc = json.loads(bytes(data), parse_constant=_refuse_constant)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a manifest; the manifest is damaged") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the manifest is damaged") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (a JSON {type(doc).__name__}, "
                                     "not an object); the manifest is damaged")
    return doc


def _narrow_array(a: np.ndarray) -> np.ndarray:
    """Non-negative integers in the narrowest stored dtype that holds them."""
    top = int(a.max()) if a.size else 0
    for dt in ("<u1", "<u2", "<u4"):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype("<i8")


def _encode_v3(m: Manifest) -> bytes:
    """Header JSON, then one array per column, rows grouped by tensor in index order."""
    header = m._header()
    names = _COLUMNS + ((_STORED,) if m.compression else ()) + ((_HASHES,) if m.block_bytes else ())
    index, cols = {}, {k: [] for k in names}
    for name, t in m.tensors.items():
        c = m._stored_columns(name, t)
        index[name] = {"shape": list(t.shape), "dtype": t.dtype, "boxes": len(c), "chunks": len(c.crcs)}
        if name in m.quantized:
            index[name]["codec"] = m.quantized[name]["scheme"]
            index[name]["max_error"] = float(m.quantized[name]["max_error"])
        if m.block_bytes:
            h = np.asarray(m.hashes.get(name, np.zeros(0, dtype=np.uint64)), dtype=np.uint64)
            index[name]["blocks"] = int(h.size)
            cols[_HASHES].append(h)
        cols["offsets"].append(c.offsets.reshape(-1))
        cols["lengths"].append(c.lengths.reshape(-1))
        cols["file"].append(c.file)
        cols["offset"].append(c.offset)
        cols["crcs"].append(c.crcs)
        if m.compression and c.stored is not None:
            cols[_STORED].append(c.stored)
    header["tensors"] = index
    arrays, blobs, pos = {}, [], 0
    for k in names:
        a = np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=np.int64)
        a = a.astype("<u4") if k == "crcs" else a.astype("<u8") if k == _HASHES else _narrow_array(a)
        arrays[k] = {"dtype": a.dtype.str, "count": int(a.size), "offset": pos}
        blob = a.tobytes()
        blobs.append(blob)
        pad = -len(blob) % _ALIGN
        if pad:
            blobs.append(bytes(pad))
        pos += len(blob) + pad
    header["arrays"] = arrays
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + _PRELUDE.size) % _ALIGN)   # arrays start aligned
    body = b"".join([head] + blobs)
    return _PRELUDE.pack(MAGIC, m.version, len(head), pos, checksum(body), 0) + body


def _corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the manifest is damaged: restore it or load an earlier checkpoint")


def _decode_v3(data: memoryview, where: str, wanted: set | None) -> Manifest:
    if len(data) < _PRELUDE.size:
        raise _corrupt(where, f"{len(data)} bytes is too short for a version-3 manifest (truncated)")
    _, version, head_len, arrays_len, crc, _ = _PRELUDE.unpack_from(data)
    if version > FORMAT_VERSION:
        raise _newer(data, where, version, head_len, arrays_len, crc)
    if version < 3:
        raise _corrupt(where, f"its binary prelude says format version {version}, which has no binary form")
    if _PRELUDE.size + head_len + arrays_len != len(data):
        raise _corrupt(where, f"the prelude declares {_PRELUDE.size + head_len + arrays_len} bytes but the file has "
                       f"{len(data)} (truncated or extended)")
    if checksum(data[_PRELUDE.size:]) != crc:
        raise _corrupt(where, "its checksum does not match its bytes")
    doc = _json_doc(data[_PRELUDE.size:_PRELUDE.size + head_len], where)
    base = _PRELUDE.size + head_len
    m = _decode(doc, where, wanted, tensors_from=None)
    if m.version != version:
        raise _corrupt(where, f"the header says version {m.version}, the prelude {version}")
    raw = {}
    specs = doc["arrays"]
    if not isinstance(specs, dict):
        raise _corrupt(where, "field 'arrays' is not an object")
    for k in _COLUMNS + ((_STORED,) if m.compression else ()) + ((_HASHES,) if m.block_bytes else ()):
        spec = specs.get(k)
        if not isinstance(spec, dict) or (spec.get("dtype") != "<u8" if k == _HASHES else (
                spec.get("dtype") not in _ARRAY_DTYPES or (k == "crcs" and spec["dtype"] != "<u4"))):
            raise _corrupt(where, f"array {k!r} has no valid description ({spec!r:.80})")
        dt = np.dtype(spec["dtype"])
        count, off = _int(spec["count"], f"array {k} count"), _int(spec["offset"], f"array {k} offset")
        if count < 0 or off < 0 or off % dt.itemsize or off + count * dt.itemsize > arrays_len:
            raise _corrupt(where, f"array {k!r} ({count} x {dt.str} at {off}) lies outside the {arrays_len} bytes "
                           "of arrays")
        raw[k] = np.frombuffer(data, dtype=dt, count=count, offset=base + off)
    index = doc["tensors"]
    if not isinstance(index, dict):
        raise _corrupt(where, "field 'tensors' is not an object")
    _index_tensors(m, index, raw, where, wanted)
    if m.block_bytes:
        _index_hashes(m, index, raw[_HASHES], where, wanted)
    return m


def _newer(data: memoryview, where: str, version: int, head_len: int, arrays_len: int,
           crc: int) -> CorruptCheckpointError:
    """The error for a prelude declaring a version newer than this reader's. The version field lies
    outside the manifest's checksum, so a flipped bit there would read as a newer format: it is
    believed (and the user told to upgrade) only when the checksummed header says the same."""
    header = None
    if (version <= _MAX_VERSION and _PRELUDE.size + head_len + arrays_len == len(data)
            and checksum(data[_PRELUDE.size:]) == crc):
        try:
            header = json.loads(bytes(data[_PRELUDE.size:_PRELUDE.size + head_len]), parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            pass
    said = header.get("version") if isinstance(header, dict) else None
    if said == version and type(said) is int:
        return CorruptCheckpointError(f"{where}: format version {version} is newer than this omnickpt reads "
                                      f"({FORMAT_VERSION}); upgrade omnickpt")
    if type(said) is int:
        return _corrupt(where, f"its prelude says format version {version} but its checksummed header says {said}: "
                        "the version field is damaged")
    return _corrupt(where, f"its prelude says format version {version}, and the rest of it cannot be read to confirm "
                    f"that (this omnickpt reads versions 1..{FORMAT_VERSION}; a version field outside its checksum "
                    "was most likely damaged)")


def _index_hashes(m: Manifest, index: dict, hashes: np.ndarray, where: str, wanted: set | None) -> None:
    """Each wanted tensor's block hashes, a view of the column. Only their total is checked here:
    a hash only ever decides whether a later save rewrites a block, and a block it wrongly
    reuses is caught by the CRCs that later save computes from its own bytes."""
    counts = [_int(t.get("blocks", 0), f"tensor {name!r} blocks") for name, t in index.items()]
    if any(c < 0 for c in counts) or sum(counts) != len(hashes):
        raise _corrupt(where, f"array 'hashes' holds {len(hashes)} values but the tensor index needs {sum(counts)}")
    pos = 0
    for name, c in zip(index, counts):
        if wanted is None or name in wanted:
            m.hashes[name] = hashes[pos:pos + c]
        pos += c


def _index_tensors(m: Manifest, index: dict, raw: dict, where: str, wanted: set | None) -> None:
    """Validate the tensor index against the arrays, then the rows of the wanted tensors, in bulk."""
    names, shapes, dtypes, itemsizes, nbox, nchunk, codecs = [], [], [], [], [], [], []
    for name, t in index.items():
        if not isinstance(t, dict):
            raise _corrupt(where, f"tensor {name!r} has no valid index record")
        shape = _ints(t["shape"], f"tensor {name!r} shape")
        if any(x < 0 for x in shape) or math.prod(shape) > _MAX_INT:
            raise _corrupt(where, f"tensor {name!r} has an impossible shape {list(shape)}")
        itemsize = dtype_from_name(t["dtype"], f"{where}: tensor {name!r}").itemsize
        if math.prod(shape) * itemsize > _MAX_INT:   # then no byte count below can overflow int64
            raise _corrupt(where, f"tensor {name!r} has an impossible shape {list(shape)}")
        n, k = _int(t["boxes"], f"tensor {name!r} boxes"), _int(t["chunks"], f"tensor {name!r} chunks")
        if n < 0 or k < 0:
            raise _corrupt(where, f"tensor {name!r} declares {n} boxes and {k} chunks")
        codec = t.get("codec")
        if codec is not None:
            if codec not in TENSOR_CODECS or not m.compression or t["dtype"] not in QUANT_DTYPES:
                raise _corrupt(where, f"tensor {name!r} is stored with codec {codec!r:.40}, which this omnickpt "
                               "does not know for its dtype or without a chunked layout (upgrade omnickpt?)")
            error = t.get("max_error")
            if type(error) not in (int, float) or not 0 <= error < math.inf:
                raise _corrupt(where, f"tensor {name!r} is quantized but records no valid max_error")
            if wanted is None or name in wanted:
                m.quantized[name] = {"scheme": codec, "max_error": float(error)}
        codecs.append(codec)
        names.append(name)
        shapes.append(shape)
        dtypes.append(t["dtype"])
        itemsizes.append(itemsize)
        nbox.append(n)
        nchunk.append(k)
    ndim = np.array([len(s) for s in shapes], dtype=np.int64)
    nbox_a = np.array(nbox, dtype=np.int64)
    nchunk_a = np.array(nchunk, dtype=np.int64)
    row0 = np.concatenate(([0], np.cumsum(nbox_a)))
    elem0 = np.concatenate(([0], np.cumsum(nbox_a * ndim)))
    crc0 = np.concatenate(([0], np.cumsum(nchunk_a)))
    for k, total in (("file", row0[-1]), ("offset", row0[-1]), ("offsets", elem0[-1]), ("lengths", elem0[-1]),
                     ("crcs", crc0[-1])) + (((_STORED, crc0[-1]),) if m.compression else ()):
        if len(raw[k]) != total:
            raise _corrupt(where, f"array {k!r} holds {len(raw[k])} values but the tensor index needs {total}")
    sel = [i for i, name in enumerate(names) if wanted is None or name in wanted]
    store = _Rows(raw, m.chunk_bytes, m.compression)
    if sel:
        _validate_rows(m, store, sel, names, shapes, itemsizes, nbox_a, nchunk_a, ndim, row0, elem0, crc0, where)
    m.tensors = {}
    for i in sel:
        m.tensors[names[i]] = TensorEntry(shapes[i], dtypes[i], load=_Slice(
            store, int(row0[i]), int(row0[i + 1]), int(elem0[i]), len(shapes[i]), int(crc0[i]), itemsizes[i],
            dtypes[i], codecs[i]))


def _spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + counts[i]) as one index array, without a loop."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - counts), counts)


def _validate_rows(m, store, sel, names, shapes, itemsizes, nbox, nchunk, ndim, row0, elem0, crc0, where) -> None:
    """Check the rows of the selected tensors, tensors of one rank (ndim) at a time, so that each
    check is one operation on [rows, ndim] arrays."""
    sel = np.array(sel, dtype=np.int64)
    fbytes = np.array([f.bytes for f in m.files] + [0], dtype=np.int64)
    for nd in np.unique(ndim[sel]).tolist():
        ts = sel[ndim[sel] == nd]
        n_t = nbox[ts]
        total = int(n_t.sum())
        if not total:
            continue
        # The rows of these tensors: one slice when they are contiguous (a whole manifest of 2-D
        # tensors), else gathered.
        if int(row0[ts[-1]] + n_t[-1] - row0[ts[0]]) == total:
            rows = slice(int(row0[ts[0]]), int(row0[ts[0]]) + total)
            elems = slice(int(elem0[ts[0]]), int(elem0[ts[0]]) + total * nd)
        else:
            rows = _spans(row0[ts], n_t)
            elems = _spans(elem0[ts], n_t * nd)
        offs = store.raw["offsets"][elems].astype(np.int64).reshape(total, nd)
        lens = store.raw["lengths"][elems].astype(np.int64).reshape(total, nd)
        bound = np.repeat(np.array([shapes[t] for t in ts.tolist()], dtype=np.int64).reshape(len(ts), nd), n_t, axis=0)
        # Written so that no sum can overflow int64, whatever a hostile file holds.
        bad = ((offs < 0) | (lens < 0) | (lens > bound) | (offs > bound - lens)).any(axis=1)
        if bad.any():
            t = int(np.repeat(ts, n_t)[np.nonzero(bad)[0][0]])
            raise _corrupt(where, f"tensor {names[t]!r} has a box outside its shape {list(shapes[t])}")
        numel = lens.prod(axis=1) if nd else np.ones(total, dtype=np.int64)
        nbytes = numel * np.repeat(np.array(itemsizes, dtype=np.int64)[ts], n_t)
        file = store.raw["file"][rows].astype(np.int64)
        offset = store.raw["offset"][rows].astype(np.int64)
        chunks = np.concatenate(([0], np.cumsum(-(-nbytes // m.chunk_bytes))))
        first = np.concatenate(([0], np.cumsum(n_t)))
        per_t = chunks[first[1:]] - chunks[first[:-1]]
        if (per_t != nchunk[ts]).any():
            j = int(np.nonzero(per_t != nchunk[ts])[0][0])
            raise _corrupt(where, f"tensor {names[ts[j]]!r} declares {int(nchunk[ts[j]])} chunk checksums but its "
                           f"boxes hold {int(per_t[j])} chunks of {m.chunk_bytes} bytes")
        span = nbytes
        if store.codec is not None:
            span, bad_box = _stored_spans(store, m.chunk_bytes, crc0[ts], nchunk[ts], nbytes)
            if bad_box is not None:
                t = int(np.repeat(ts, n_t)[bad_box])
                raise _corrupt(where, f"tensor {names[t]!r} has a stored chunk length outside 1..its raw length")
        bad = (file < 0) | (file >= len(m.files)) | (offset < 0)
        bad |= offset > fbytes[np.where(bad, len(m.files), file)] - span
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            t = int(np.repeat(ts, n_t)[i])
            raise _corrupt(where, f"tensor {names[t]!r} has a box in file {int(file[i])} at bytes "
                           f"{int(offset[i])}+{int(span[i])}, outside the {len(m.files)} data files it lists")
        store.nbytes[rows] = nbytes
        # No two boxes of a tensor may share an element (then counting elements proves coverage).
        clear = _rows_clear(offs, lens, numel, n_t)
        for j in np.nonzero(~clear)[0].tolist():
            a, b = int(first[j]), int(first[j + 1])
            problem = overlap_problem_arrays(offs[a:b], lens[a:b], numel[a:b])
            if problem:
                raise _corrupt(where, f"tensor {names[ts[j]]!r}: {problem}")


def _rows_clear(o, ln, numel, n_t) -> np.ndarray:
    """Per tensor (rows grouped by tensor, n_t each, one ndim): True when its boxes are proven
    disjoint in bulk. The usual layout (a save writes boxes sorted by offsets; FSDP/TP blocks
    differ along one dimension) is checked for all tensors at once; the others (False) get the
    per-tensor test."""
    clear = n_t <= 1
    nd = o.shape[1]
    if nd == 0 or clear.all():
        return clear
    seg_of = np.repeat(np.arange(len(n_t)), n_t)
    if not (numel > 0).all():   # empty boxes hold no element
        keep = numel > 0
        o, ln, seg_of = o[keep], ln[keep], seg_of[keep]
    ok = np.ones(len(n_t), dtype=bool)
    if len(seg_of) > 1:
        same = seg_of[1:] == seg_of[:-1]
        # A dimension varies in a tensor iff two consecutive boxes of it differ there.
        step = ((o[1:] != o[:-1]) | (ln[1:] != ln[:-1])) & same[:, None]
        pair_seg = seg_of[1:]
        counts = np.bincount(pair_seg, minlength=len(n_t))
        starts = np.cumsum(counts) - counts
        varying = np.zeros((len(n_t), nd), dtype=bool)
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


def _stored_spans(store, chunk_bytes: int, crc0, nchunk, nbytes) -> tuple[np.ndarray, int | None]:
    """(the file bytes each box's stored chunks occupy, the first box with an impossible stored
    length or None), for the rows of tensors whose chunks start at crc0 and number nchunk, box raw
    sizes nbytes. A chunk is stored in 1..its raw length bytes (equal: stored raw)."""
    idx = _spans(crc0, nchunk)
    stored = store.raw[_STORED][idx].astype(np.int64)
    per_box = -(-nbytes // chunk_bytes)
    # The raw length of each chunk: chunk_bytes, except the last of each box.
    raw_len = np.full(len(stored), chunk_bytes, dtype=np.int64)
    ends = np.cumsum(per_box)
    last = ends[per_box > 0] - 1
    raw_len[last] = nbytes[per_box > 0] - (per_box[per_box > 0] - 1) * chunk_bytes
    box_of = np.repeat(np.arange(len(nbytes)), per_box)
    bad = (stored < 1) | (stored > raw_len)
    if bad.any():
        return nbytes, int(box_of[np.nonzero(bad)[0][0]])
    return np.bincount(box_of, weights=stored, minlength=len(nbytes)).astype(np.int64), None


class _Rows:
    """The arrays of a version-3 manifest (views of its bytes) and the byte sizes of validated rows."""

    def __init__(self, raw: dict, chunk_bytes: int, codec: str | None = None):
        self.raw = raw
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.nbytes = np.zeros(len(raw["file"]), dtype=np.int64)
        self._slices = 0
        self._wide: dict[str, np.ndarray] = {}

    def column(self, name: str, lo: int, hi: int, dtype=np.int64) -> np.ndarray:
        """Elements [lo, hi) of array `name` as `dtype`. The arrays are stored narrow; widening one
        tensor's slice costs a few numpy calls, so once many tensors are asked for (a load of 10^4
        small tensors) each whole array is widened once and sliced from then on."""
        self._slices += 1
        if self._slices > 256 * 7:     # ~7 columns per tensor: after 256 tensors
            wide = self._wide.get(name)
            if wide is None:
                wide = self._wide[name] = self.raw[name].astype(dtype)
            return wide[lo:hi]
        return self.raw[name][lo:hi].astype(dtype)


@dataclass(frozen=True)
class _Slice:
    """One tensor's rows of a _Rows: made into BoxColumns on first use."""
    store: _Rows
    row0: int
    row1: int
    elem0: int
    ndim: int
    crc0: int
    itemsize: int
    dtype: str | None = None
    codec: str | None = None    # this tensor's own (quantized), else the manifest's

    def __call__(self) -> BoxColumns:
        n = self.row1 - self.row0
        e1 = self.elem0 + n * self.ndim
        nbytes = self.store.nbytes[self.row0:self.row1].copy()
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(-(-nbytes // self.store.chunk_bytes), out=starts[1:])
        codec = self.codec or self.store.codec
        col, c1 = self.store.column, self.crc0 + int(starts[-1])
        return BoxColumns(
            offsets=col("offsets", self.elem0, e1).reshape(n, self.ndim),
            lengths=col("lengths", self.elem0, e1).reshape(n, self.ndim),
            file=col("file", self.row0, self.row1),
            offset=col("offset", self.row0, self.row1),
            nbytes=nbytes, sums_start=starts,
            crcs=col("crcs", self.crc0, c1, np.uint32),
            chunk_bytes=self.store.chunk_bytes,
            stored=None if codec is None else col(_STORED, self.crc0, c1),
            codec=codec, itemsize=self.itemsize, dtype=self.dtype)


def _refuse_constant(name: str):
    # NaN and Infinity are not JSON; a manifest holding them was not written by omnickpt.
    raise ValueError(f"non-JSON number {name}")


def _int(v: Any, what: str) -> int:
    """A manifest integer: a JSON integer (not a bool, not a float) in a sane range."""
    if type(v) is not int or not -_MAX_INT <= v <= _MAX_INT:
        raise ValueError(f"{what} must be an integer, got {v!r:.40}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > _MAX_DIMS:
        raise ValueError(f"{what} must be a list of at most {_MAX_DIMS} integers, got {v!r:.60}")
    return tuple(_int(x, what) for x in v)


def safe_relative_path(path: str, where: str) -> str:
    """Reject any stored path that could point outside the checkpoint directory."""
    if not isinstance(path, str) or not path or "\\" in path or "\x00" in path:
        raise UnsafeCheckpointError(f"{where}: invalid data file path {path!r}")
    norm = posixpath.normpath(path)
    # ".." as a whole component only: "..data/x" is a legal name inside the checkpoint.
    if path.startswith("/") or norm == ".." or norm.startswith("../") or norm != path or ":" in path.split("/")[0]:
        raise UnsafeCheckpointError(
            f"{where}: data file path {path!r} escapes the checkpoint directory; refusing to load "
            "(a manifest may only name files inside its own checkpoint)")
    return path


def _decode(doc: dict, where: str, wanted: set | None = None, tensors_from: str | None = "json") -> Manifest:
    """The manifest of a JSON document (versions 1, 2) or of a version-3 header (`tensors_from`
    None: the tensors come from the arrays, see _decode_v3)."""
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (format={doc.get('format')!r})")
    version = _int(doc["version"], "version")
    if not 1 <= version <= _MAX_VERSION:
        # JSON carries no checksum: a version no omnickpt could have reached is damage, not a newer format
        raise CorruptCheckpointError(f"{where}: format version {version} does not exist; the manifest is damaged")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version} is newer than this omnickpt reads ({FORMAT_VERSION}); "
            "upgrade omnickpt")
    if (tensors_from is None) != (version >= 3):
        raise CorruptCheckpointError(f"{where}: a version-{version} manifest must be "
                                     f"{'binary' if version >= 3 else 'JSON'}; the manifest is damaged")
    chunk_bytes = _int(doc["chunk_bytes"], "chunk_bytes") if version >= 2 else 0
    if version >= 2 and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    files = [FileEntry(_file_path(f, where, version), _int(f["rank"], "file rank"), _int(f["bytes"], "file bytes"))
             for f in doc["files"]]
    for f in files:
        if f.rank < 0 or f.bytes < 0:
            raise CorruptCheckpointError(f"{where}: data file {f.path!r} has an inconsistent record "
                                         f"(rank {f.rank}, {f.bytes} bytes)")
    tensors: dict[str, TensorEntry] = {}
    for name, t in (doc["tensors"].items() if tensors_from else ()):
        if wanted is not None and name not in wanted:
            continue
        shape = _ints(t["shape"], f"tensor {name!r} shape")
        if any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has a negative dimension in shape {list(shape)}")
        dtype = t["dtype"]
        itemsize = dtype_from_name(dtype, f"{where}: tensor {name!r}").itemsize
        boxes = []
        for raw in t["boxes"]:
            offs, lens, fi, off, nb, ck = raw
            box = SavedBox(_ints(offs, "box offsets"), _ints(lens, "box lengths"), _int(fi, "box file"),
                           _int(off, "box offset"), _int(nb, "box bytes"), None)
            if (len(box.offsets) != len(shape) or len(box.lengths) != len(shape)
                    or any(o < 0 or l < 0 or o + l > s for o, l, s in zip(box.offsets, box.lengths, shape))):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has a box {offs}+{lens} outside its shape {list(shape)}")
            if (box.nbytes != math.prod(box.lengths) * itemsize or not 0 <= box.file < len(files) or box.offset < 0
                    or box.offset + box.nbytes > files[box.file].bytes):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has an inconsistent box record {raw}")
            box.sums = _sums(ck, box, chunk_bytes, version, f"{where}: tensor {name!r} box {offs}+{lens}")
            boxes.append(box)
        # Holes are allowed here (a node of the memory tier stores only its own ranks' boxes; the
        # load planner checks that every wanted element is held), overlaps never: with them,
        # counting elements could not see a hole.
        problem = overlap_problem(shape, boxes)
        if problem:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: {problem}; the manifest is damaged")
        tensors[name] = TensorEntry(shape, dtype, boxes)
    objects: dict[str, list[ObjectEntry]] = {}
    for key, entries in doc["objects"].items():
        objects[key] = []
        for e in entries:
            oe = ObjectEntry(list(_ints(e["ranks"], "object ranks")), _int(e["file"], "object file"),
                             _int(e["offset"], "object offset"), _int(e["nbytes"], "object bytes"),
                             _int(e["checksum"], "object checksum"))
            if (not 0 <= oe.file < len(files) or not oe.ranks or oe.offset < 0 or oe.nbytes < 0
                    or oe.offset + oe.nbytes > files[oe.file].bytes or any(r < 0 for r in oe.ranks)):
                raise CorruptCheckpointError(f"{where}: object {key!r} has an inconsistent record {e}")
            objects[key].append(oe)
    world_size = _int(doc["world_size"], "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    created = doc.get("created", 0.0)
    # finite: JSON's 1e400 parses as inf, which no clock writes and no date can show
    if type(created) not in (int, float) or not math.isfinite(created):
        raise ValueError(f"created must be a finite number, got {created!r:.40}")
    block_bytes, base, chain = _incremental(doc, where, version)
    compression = doc.get("compression") if version >= 3 else None
    if compression is not None and compression not in STORED_CODECS:
        raise CorruptCheckpointError(f"{where}: unknown compression {compression!r:.40} (this omnickpt knows "
                                     f"{', '.join(STORED_CODECS)}): upgrade omnickpt, or the manifest is damaged")
    return Manifest(
        save_id=str(doc["save_id"]), world_size=world_size, files=files, tensors=tensors,
        objects=objects, layout=dict(doc.get("layout") or {}), tool_version=str(doc.get("tool_version", "")),
        created=float(created), version=version, chunk_bytes=chunk_bytes or CHUNK_BYTES, compression=compression,
        block_bytes=block_bytes, base=base, chain=chain)


def _incremental(doc: dict, where: str, version: int) -> tuple[int | None, str | None, int]:
    inc = doc.get("incremental") if version >= 3 else None
    if inc is None:
        return None, None, 0
    if not isinstance(inc, dict):
        raise _corrupt(where, "field 'incremental' is not an object")
    block_bytes, chain = _int(inc.get("block_bytes"), "incremental block_bytes"), _int(inc.get("chain", 0), "chain")
    base = inc.get("base")
    if block_bytes < 1 or chain < 0 or not (base is None or isinstance(base, str)):
        raise _corrupt(where, f"field 'incremental' is inconsistent ({inc!r:.80})")
    return block_bytes, base, chain


def sibling_name(name: Any, where: str) -> str:
    """A checkpoint folder next to this one, named by an incremental checkpoint's file record:
    one path component, nothing that could lead elsewhere."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\:\x00")):
        raise UnsafeCheckpointError(f"{where}: data file base {name!r:.80} is not the name of a checkpoint folder "
                                    "next to this one; refusing to load")
    return name


def _file_path(record: dict, where: str, version: int) -> str:
    """The in-memory path of a file record: a file of a sibling checkpoint (an incremental save's
    reference, version 3) is "../<sibling>/<path inside it>"."""
    path = safe_relative_path(record["path"], where)
    if version >= 3 and "base" in record:
        return f"../{sibling_name(record['base'], where)}/{path}"
    return path


def _file_record(f: "FileEntry") -> dict:
    if f.path.startswith("../"):
        name, _, rest = f.path[3:].partition("/")
        return {"path": rest, "rank": f.rank, "bytes": f.bytes, "base": name}
    return {"path": f.path, "rank": f.rank, "bytes": f.bytes}


def _sums(raw: Any, box: SavedBox, chunk_bytes: int, version: int, what: str) -> Sums:
    """The checksum grid of a stored box: version 1 stored one CRC, version 2 one per chunk."""
    if version == 1:
        return Sums(box.offset, box.offset + box.nbytes, max(1, box.nbytes), (_crc(raw, what),))
    if not isinstance(raw, list) or len(raw) != Sums.chunk_count(box.nbytes, chunk_bytes):
        raise CorruptCheckpointError(f"{what}: expected {Sums.chunk_count(box.nbytes, chunk_bytes)} chunk checksums "
                                     f"for {box.nbytes} bytes, found {raw!r:.60}; the manifest is damaged")
    return Sums(box.offset, box.offset + box.nbytes, chunk_bytes, tuple(_crc(c, what) for c in raw))


def _crc(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v < 1 << 32:
        raise CorruptCheckpointError(f"{what}: checksum {v!r:.40} is not a CRC32C value; the manifest is damaged")
    return v


def tiling_problem(shape: tuple[int, ...], boxes: list[SavedBox]) -> str | None:
    """None when the boxes cover every element of `shape` exactly once, else what is wrong."""
    problem = overlap_problem(shape, boxes)
    if problem:
        return problem
    total, held = math.prod(shape), sum(math.prod(b.lengths) for b in boxes)
    return f"its boxes hold {held} of its {total} elements" if held != total else None


def overlap_problem(shape: tuple[int, ...], boxes: list[SavedBox]) -> str | None:
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
