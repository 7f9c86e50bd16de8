"""Version 3 of the manifest, written by default (docs/format.md, "version 3"): a 32-byte prelude,
a small JSON header (the fields of format/header.py, plus an index of the tensors and a description
of the arrays), then columnar little-endian integer arrays of the boxes, read with
numpy.frombuffer. A manifest of 10^6 boxes encodes and decodes in a fraction of a second, and a
reader that wants a few tensors (`decode(..., wanted=)`) validates only their rows; each tensor's
box columns are made only when someone asks for them.

`decode` validates everything it reads: a manifest is untrusted input, so every size, offset and
box is checked before anything is allocated from it, and no two boxes of a tensor may share an
element (omnickpt/layout.py's overlap check). `read_header` reads the prelude and the header
alone, with two ranged reads, for what needs only header fields (retention, omnickpt/steps.py).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format.checksum import checksum
from omnickpt.format.codec import TENSOR_CODECS
from omnickpt.format.header import (MAX_DIMS, MAX_INT, MAX_VERSION, check_stored, check_version, chunk_bytes_field,
                                    corrupt, decode_files, decode_manifest_fields, dumps_json, encode_header, int_field,
                                    ints_field, json_document, refuse_constant, stored_columns)
from omnickpt.format.quant import QUANT_DTYPES
from omnickpt.format.records import FORMAT_VERSION, BoxColumns, TableSpan, TensorEntry, dtype_from_name, table_span
from omnickpt.layout import bulk_disjoint, overlap_problem_arrays, spans

if TYPE_CHECKING:   # Manifest sits above the codecs (format/manifest.py), which hands its class to them
    from omnickpt.format.manifest import Manifest

# The first bytes of a version-3 manifest; a JSON manifest (versions 1, 2) starts with '{'.
MAGIC = b"OMNICKPT"
PRELUDE = struct.Struct("<8sIIQII")   # magic, version, header bytes, array bytes, crc32c, reserved
_ALIGN = 8
# Integer arrays may be stored as narrow unsigned integers or int64 (little-endian); nothing else.
_ARRAY_DTYPES = {"|u1", "<u2", "<u4", "<i8"}
_COLUMNS = ("offsets", "lengths", "file", "offset", "crcs")
# A compressed checkpoint adds one column: the stored (compressed) byte length of each chunk.
_STORED = "stored"
_HASHES = "hashes"   # an incremental save's block hashes (xxh3-64 of each block of rows), "<u8"


class Prelude(NamedTuple):
    version: int
    header_bytes: int
    array_bytes: int
    crc: int   # CRC32C of every byte after the prelude


def prelude(raw) -> Prelude:
    """The fields of the first PRELUDE.size bytes of a version-3 manifest (the magic not checked)."""
    _, version, head_len, arrays_len, crc, _ = PRELUDE.unpack_from(raw)
    return Prelude(version, head_len, arrays_len, crc)


def _columns_of(m: Manifest) -> tuple[str, ...]:
    """The arrays a manifest of these features stores, in order."""
    return _COLUMNS + ((_STORED,) if m.compression else ()) + ((_HASHES,) if m.block_bytes else ())


# ------------------------------------------------------------------------------------ writing
def encode(m: Manifest) -> bytes:
    """`m` as a version-3 manifest: prelude, header JSON, then one array per column, rows grouped
    by tensor in index order. ValueError for boxes that are not stored ones (a derived manifest)."""
    header = encode_header(m)
    names = _columns_of(m)
    span = None if m.block_bytes else table_span(list(m.tensors.values()))
    if span is not None:
        index, arrays = _span_index(m, span)
    else:
        index, cols = {}, {k: [] for k in names}
        for name, t in m.tensors.items():
            index[name] = _index_record(m, name, t, cols)
        arrays = {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in cols.items()}
    header["tensors"] = index
    header["arrays"], blobs, pos = _pack_arrays(names, arrays)
    head = dumps_json(header)
    head += b" " * (-(len(head) + PRELUDE.size) % _ALIGN)   # arrays start aligned
    body = b"".join([head] + blobs)
    return PRELUDE.pack(MAGIC, m.version, len(head), pos, checksum(body), 0) + body


def _index_record(m: Manifest, name: str, t: TensorEntry, cols: dict[str, list]) -> dict:
    """Tensor `name`'s record of the header's index; its rows appended to `cols`."""
    c = stored_columns(m, name, t)
    record = _record(m, name, t, len(c), len(c.crcs))
    if m.block_bytes:
        h = np.asarray(m.hashes.get(name, np.zeros(0, dtype=np.uint64)), dtype=np.uint64)
        record["blocks"] = int(h.size)
        cols[_HASHES].append(h)
    cols["offsets"].append(c.offsets.reshape(-1))
    cols["lengths"].append(c.lengths.reshape(-1))
    cols["file"].append(c.file)
    cols["offset"].append(c.offset)
    cols["crcs"].append(c.crcs)
    if m.compression and c.stored is not None:
        cols[_STORED].append(c.stored)
    return record


def _record(m: Manifest, name: str, t: TensorEntry, boxes: int, chunks: int) -> dict:
    record = {"shape": list(t.shape), "dtype": t.dtype, "boxes": boxes, "chunks": chunks}
    q = m.quantized.get(name)
    if q is not None:
        record["codec"] = q["scheme"]
        record["max_error"] = float(q["max_error"])
    return record


def _span_index(m: Manifest, span: TableSpan) -> tuple[dict, dict[str, np.ndarray]]:
    """The index and the arrays of a manifest whose tensors are one span of a save's table, in
    bulk: what _index_record gives tensor by tensor, without a BoxColumns per tensor."""
    t = span.table
    rows = span.a + span.starts
    boxes = np.diff(span.starts).tolist()
    chunks = np.diff(t.sums_start[rows]).tolist()
    index = {}
    for i, (name, e) in enumerate(m.tensors.items()):
        check_stored(m, name, boxes[i], t.chunk_bytes, span.codecs[i])
        index[name] = _record(m, name, e, boxes[i], chunks[i])
    c0, c1 = span.chunks()
    arrays = {"offsets": span.flat(t.offsets), "lengths": span.flat(t.lengths), "file": t.file[span.a:span.b],
              "offset": t.offset[span.a:span.b], "crcs": t.crcs[c0:c1]}
    if m.compression:
        arrays[_STORED] = t.stored[c0:c1] if t.stored is not None else np.zeros(0, dtype=np.int64)
    return index, arrays


def _pack_arrays(names: tuple[str, ...], cols: dict[str, np.ndarray]) -> tuple[dict, list[bytes], int]:
    """(the header's description of the arrays, their bytes with padding, their total length)."""
    arrays, blobs, pos = {}, [], 0
    for k in names:
        a = cols[k]
        a = a.astype("<u4") if k == "crcs" else a.astype("<u8") if k == _HASHES else _narrow_array(a)
        arrays[k] = {"dtype": a.dtype.str, "count": int(a.size), "offset": pos}
        blob = a.tobytes()
        blobs.append(blob)
        pad = -len(blob) % _ALIGN
        if pad:
            blobs.append(bytes(pad))
        pos += len(blob) + pad
    return arrays, blobs, pos


def _narrow_array(a: np.ndarray) -> np.ndarray:
    """Non-negative integers in the narrowest stored dtype that holds them."""
    top = int(a.max()) if a.size else 0
    for dt in ("<u1", "<u2", "<u4"):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype("<i8")


# ------------------------------------------------------------------------------------ reading
def decode(data: memoryview, where: str, wanted: set | None, make: Callable[..., Manifest]) -> Manifest:
    """The manifest of a version-3 manifest's bytes, built by `make` (the Manifest class); with
    `wanted`, only those tensors are decoded and validated (the others are absent from `tensors`),
    at a cost in proportion to their boxes."""
    p = _checked_prelude(data, where)
    doc = json_document(data[PRELUDE.size:PRELUDE.size + p.header_bytes], where)
    version = check_version(doc, where, binary=True)
    chunk_bytes = chunk_bytes_field(doc, version)
    files = decode_files(doc, where, version)
    m = decode_manifest_fields(doc, where, version, chunk_bytes, files, {}, make)
    if m.version != p.version:
        raise corrupt(where, f"the header says version {m.version}, the prelude {p.version}")
    raw = _arrays(doc, data, p, _columns_of(m), where)
    index = doc["tensors"]
    if not isinstance(index, dict):
        raise corrupt(where, "field 'tensors' is not an object")
    _index_tensors(m, index, raw, where, wanted)
    if m.block_bytes:
        _index_hashes(m, index, raw[_HASHES], where, wanted)
    return m


def _checked_prelude(data: memoryview, where: str) -> Prelude:
    """The prelude, once the bytes it describes are all there and match its checksum."""
    if len(data) < PRELUDE.size:
        raise corrupt(where, f"{len(data)} bytes is too short for a version-3 manifest (truncated)")
    p = prelude(data)
    if p.version > FORMAT_VERSION:
        raise _newer(data, where, p)
    if p.version < 3:
        raise corrupt(where, f"its binary prelude says format version {p.version}, which has no binary form")
    if PRELUDE.size + p.header_bytes + p.array_bytes != len(data):
        raise corrupt(where, f"the prelude declares {PRELUDE.size + p.header_bytes + p.array_bytes} bytes but the "
                      f"file has {len(data)} (truncated or extended)")
    if checksum(data[PRELUDE.size:]) != p.crc:
        raise corrupt(where, "its checksum does not match its bytes")
    return p


def _arrays(doc: dict, data: memoryview, p: Prelude, names: tuple[str, ...], where: str) -> dict[str, np.ndarray]:
    """The arrays `names` as the header describes them: views of `data`, each checked to lie
    inside the array bytes and to have a dtype its column may have."""
    specs = doc["arrays"]
    if not isinstance(specs, dict):
        raise corrupt(where, "field 'arrays' is not an object")
    base, raw = PRELUDE.size + p.header_bytes, {}
    for k in names:
        spec = specs.get(k)
        if not isinstance(spec, dict) or (spec.get("dtype") != "<u8" if k == _HASHES else (
                spec.get("dtype") not in _ARRAY_DTYPES or (k == "crcs" and spec["dtype"] != "<u4"))):
            raise corrupt(where, f"array {k!r} has no valid description ({spec!r:.80})")
        dt = np.dtype(spec["dtype"])
        count, off = int_field(spec["count"], f"array {k} count"), int_field(spec["offset"], f"array {k} offset")
        if count < 0 or off < 0 or off % dt.itemsize or off + count * dt.itemsize > p.array_bytes:
            raise corrupt(where, f"array {k!r} ({count} x {dt.str} at {off}) lies outside the {p.array_bytes} "
                          "bytes of arrays")
        raw[k] = np.frombuffer(data, dtype=dt, count=count, offset=base + off)
    return raw


def _newer(data: memoryview, where: str, p: Prelude) -> CorruptCheckpointError:
    """The error for a prelude declaring a version newer than this reader's. The version field lies
    outside the manifest's checksum, so a flipped bit there would read as a newer format: it is
    believed (and the user told to upgrade) only when the checksummed header says the same."""
    version, head_len = p.version, p.header_bytes
    header = None
    if (version <= MAX_VERSION and PRELUDE.size + head_len + p.array_bytes == len(data)
            and checksum(data[PRELUDE.size:]) == p.crc):
        try:
            header = json.loads(bytes(data[PRELUDE.size:PRELUDE.size + head_len]), parse_constant=refuse_constant)
        except (ValueError, RecursionError):
            pass
    said = header.get("version") if isinstance(header, dict) else None
    if said == version and type(said) is int:
        return CorruptCheckpointError(f"{where}: format version {version} is newer than this omnickpt reads "
                                      f"({FORMAT_VERSION}); upgrade omnickpt")
    if type(said) is int:
        return corrupt(where, f"its prelude says format version {version} but its checksummed header says {said}: "
                       "the version field is damaged")
    return corrupt(where, f"its prelude says format version {version}, and the rest of it cannot be read to confirm "
                   f"that (this omnickpt reads versions 1..{FORMAT_VERSION}; a version field outside its checksum "
                   "was most likely damaged)")


def _index_hashes(m: Manifest, index: dict, hashes: np.ndarray, where: str, wanted: set | None) -> None:
    """Each wanted tensor's block hashes, a view of the column. Only their total is checked here:
    a hash only ever decides whether a later save rewrites a block, and a block it wrongly
    reuses is caught by the CRCs that later save computes from its own bytes."""
    counts = [int_field(t.get("blocks", 0), f"tensor {name!r} blocks") for name, t in index.items()]
    if any(c < 0 for c in counts) or sum(counts) != len(hashes):
        raise corrupt(where, f"array 'hashes' holds {len(hashes)} values but the tensor index needs {sum(counts)}")
    pos = 0
    for name, c in zip(index, counts):
        if wanted is None or name in wanted:
            m.hashes[name] = hashes[pos:pos + c]
        pos += c




@dataclass
class _Index:
    """The header's tensor index, checked and laid out: tensor i's rows are [row0[i], row0[i + 1])
    of the box columns, its offsets and lengths elements [elem0[i], elem0[i + 1]), its chunks
    [crc0[i], crc0[i + 1])."""
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    itemsizes: list[int]
    codecs: list[str | None]   # each tensor's own codec (quantized), else None
    nbox: np.ndarray
    nchunk: np.ndarray
    ndim: np.ndarray
    row0: np.ndarray
    elem0: np.ndarray
    crc0: np.ndarray


def _index_tensors(m: Manifest, index: dict, raw: dict, where: str, wanted: set | None) -> None:
    """Validate the tensor index against the arrays, then the rows of the wanted tensors, in bulk."""
    idx = _read_index(m, index, where, wanted)
    for k, total in (("file", idx.row0[-1]), ("offset", idx.row0[-1]), ("offsets", idx.elem0[-1]),
                     ("lengths", idx.elem0[-1]), ("crcs", idx.crc0[-1])) + (
                         ((_STORED, idx.crc0[-1]),) if m.compression else ()):
        if len(raw[k]) != total:
            raise corrupt(where, f"array {k!r} holds {len(raw[k])} values but the tensor index needs {total}")
    sel = [i for i, name in enumerate(idx.names) if wanted is None or name in wanted]
    store = _Rows(raw, m.chunk_bytes, m.compression)
    if sel:
        _validate_rows(m, store, idx, sel, where)
    # Plain lists: indexing a numpy array per tensor makes a numpy scalar each time (10^4 tensors).
    row0, elem0, crc0 = idx.row0.tolist(), idx.elem0.tolist(), idx.crc0.tolist()
    names, shapes, dtypes, itemsizes, codecs = idx.names, idx.shapes, idx.dtypes, idx.itemsizes, idx.codecs
    m.tensors = {names[i]: TensorEntry(shapes[i], dtypes[i], load=_Slice(
        store, row0[i], row0[i + 1], elem0[i], len(shapes[i]), crc0[i], itemsizes[i], dtypes[i], codecs[i]))
        for i in sel}


def _read_index(m: Manifest, index: dict, where: str, wanted: set | None) -> _Index:
    """Every tensor's index record checked (shape, dtype, counts, codec); the quantized ones among
    the wanted noted in m.quantized."""
    names, shapes, dtypes, itemsizes, nbox, nchunk, codecs = [], [], [], [], [], [], []
    checked: dict[tuple, tuple] = {}   # see _checked_record
    for name, t in index.items():
        shape, itemsize, n, k = _checked_record(name, t, where, checked)
        codec = _tensor_codec(m, name, t, where)
        if codec is not None and (wanted is None or name in wanted):
            m.quantized[name] = {"scheme": codec, "max_error": float(t["max_error"])}
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
    return _Index(names, shapes, dtypes, itemsizes, codecs, nbox_a, nchunk_a, ndim,
                  row0=np.concatenate(([0], np.cumsum(nbox_a))),
                  elem0=np.concatenate(([0], np.cumsum(nbox_a * ndim))),
                  crc0=np.concatenate(([0], np.cumsum(nchunk_a))))


def _checked_record(name: str, t, where: str, checked: dict) -> tuple[tuple[int, ...], int, int, int]:
    """_tensor_record, with each (dtype, shape) checked once: 10^4 tensors of an MoE model share a
    few. `checked` maps (dtype, shape) to (shape, itemsize); only shapes of plain ints are keys, so
    that a shape [1.0, 2] or [True, 2] is never taken for a checked [1, 2]."""
    raw, dtype = (t.get("shape"), t.get("dtype")) if type(t) is dict else (None, None)
    key = None
    if type(raw) is list and type(dtype) is str and len(raw) <= MAX_DIMS and all(type(x) is int for x in raw):
        key = (dtype, tuple(raw))
    hit = checked.get(key) if key is not None else None
    if hit is None:
        shape, itemsize, n, k = _tensor_record(name, t, where)
        if key is not None:
            checked[key] = (shape, itemsize)
        return shape, itemsize, n, k
    n, k = t["boxes"], t["chunks"]
    # Sound counts pass without a call or a message built per field (10^4 records).
    if not (type(n) is int and type(k) is int and 0 <= n <= MAX_INT and 0 <= k <= MAX_INT):
        n, k = int_field(n, f"tensor {name!r} boxes"), int_field(k, f"tensor {name!r} chunks")
        if n < 0 or k < 0:
            raise corrupt(where, f"tensor {name!r} declares {n} boxes and {k} chunks")
    return hit[0], hit[1], n, k


def _tensor_record(name: str, t, where: str) -> tuple[tuple[int, ...], int, int, int]:
    """(shape, itemsize, boxes, chunks) of one index record."""
    if not isinstance(t, dict):
        raise corrupt(where, f"tensor {name!r} has no valid index record")
    shape = ints_field(t["shape"], f"tensor {name!r} shape")
    if any(x < 0 for x in shape) or math.prod(shape) > MAX_INT:
        raise corrupt(where, f"tensor {name!r} has an impossible shape {list(shape)}")
    itemsize = dtype_from_name(t["dtype"], f"{where}: tensor {name!r}").itemsize
    if math.prod(shape) * itemsize > MAX_INT:   # then no byte count below can overflow int64
        raise corrupt(where, f"tensor {name!r} has an impossible shape {list(shape)}")
    n, k = int_field(t["boxes"], f"tensor {name!r} boxes"), int_field(t["chunks"], f"tensor {name!r} chunks")
    if n < 0 or k < 0:
        raise corrupt(where, f"tensor {name!r} declares {n} boxes and {k} chunks")
    return shape, itemsize, n, k


def _tensor_codec(m: Manifest, name: str, t: dict, where: str) -> str | None:
    """A quantized tensor's own codec (format/quant.py), checked with its max_error; else None."""
    codec = t.get("codec")
    if codec is None:
        return None
    if codec not in TENSOR_CODECS or not m.compression or t["dtype"] not in QUANT_DTYPES:
        raise corrupt(where, f"tensor {name!r} is stored with codec {codec!r:.40}, which this omnickpt "
                      "does not know for its dtype or without a chunked layout (upgrade omnickpt?)")
    error = t.get("max_error")
    if type(error) not in (int, float) or not 0 <= error < math.inf:
        raise corrupt(where, f"tensor {name!r} is quantized but records no valid max_error")
    return codec



def _validate_rows(m: Manifest, store: "_Rows", idx: _Index, sel: list[int], where: str) -> None:
    """Check the rows of the selected tensors, tensors of one rank (ndim) at a time, so that each
    check is one operation on [rows, ndim] arrays; note each row's byte size in `store`."""
    sel = np.array(sel, dtype=np.int64)
    fbytes = np.array([f.bytes for f in m.files] + [0], dtype=np.int64)
    for nd in np.unique(idx.ndim[sel]).tolist():
        group = _Group(idx, sel[idx.ndim[sel] == nd], nd)
        if not group.total:
            continue
        offs = store.raw["offsets"][group.elems].astype(np.int64).reshape(group.total, nd)
        lens = store.raw["lengths"][group.elems].astype(np.int64).reshape(group.total, nd)
        _check_inside_shapes(group, offs, lens, where)
        numel = lens.prod(axis=1) if nd else np.ones(group.total, dtype=np.int64)
        nbytes = numel * np.repeat(np.array(idx.itemsizes, dtype=np.int64)[group.ts], group.n_t)
        _check_chunk_counts(group, nbytes, m.chunk_bytes, where)
        span = nbytes if store.codec is None else _checked_storedspans(group, store, m.chunk_bytes, nbytes, where)
        _check_inside_files(group, store, span, fbytes, len(m.files), where)
        store.nbytes[group.rows] = nbytes
        _check_disjoint(group, offs, lens, numel, where)


class _Group:
    """The selected tensors of one rank: which they are (ts: indices into the index), how many
    rows each has (n_t), and where their rows and offsets/lengths elements lie in the columns
    (one slice when contiguous, as in a whole manifest of 2-D tensors; else gathered)."""

    def __init__(self, idx: _Index, ts: np.ndarray, nd: int):
        self.idx, self.ts, self.nd = idx, ts, nd
        self.n_t = idx.nbox[ts]
        self.total = int(self.n_t.sum())
        self.first = np.concatenate(([0], np.cumsum(self.n_t)))   # each tensor's first row in the group
        r0, e0 = idx.row0, idx.elem0
        if self.total and int(r0[ts[-1]] + self.n_t[-1] - r0[ts[0]]) == self.total:
            self.rows = slice(int(r0[ts[0]]), int(r0[ts[0]]) + self.total)
            self.elems = slice(int(e0[ts[0]]), int(e0[ts[0]]) + self.total * nd)
        else:
            self.rows = spans(r0[ts], self.n_t)
            self.elems = spans(e0[ts], self.n_t * nd)

    def name_of_row(self, i: int) -> str:
        """The name of the tensor that row i of the group belongs to."""
        return self.idx.names[int(np.repeat(self.ts, self.n_t)[i])]


def _check_inside_shapes(g: _Group, offs: np.ndarray, lens: np.ndarray, where: str) -> None:
    shapes = g.idx.shapes
    bound = np.repeat(np.array([shapes[t] for t in g.ts.tolist()], dtype=np.int64).reshape(len(g.ts), g.nd),
                      g.n_t, axis=0)
    # Written so that no sum can overflow int64, whatever a hostile file holds.
    bad = ((offs < 0) | (lens < 0) | (lens > bound) | (offs > bound - lens)).any(axis=1)
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        t = int(np.repeat(g.ts, g.n_t)[i])
        raise corrupt(where, f"tensor {g.idx.names[t]!r} has a box outside its shape {list(shapes[t])}")


def _check_chunk_counts(g: _Group, nbytes: np.ndarray, chunk_bytes: int, where: str) -> None:
    """Each tensor declares as many chunk checksums as its boxes' bytes make chunks."""
    chunks = np.concatenate(([0], np.cumsum(-(-nbytes // chunk_bytes))))
    per_t = chunks[g.first[1:]] - chunks[g.first[:-1]]
    nchunk = g.idx.nchunk[g.ts]
    if (per_t != nchunk).any():
        j = int(np.nonzero(per_t != nchunk)[0][0])
        raise corrupt(where, f"tensor {g.idx.names[g.ts[j]]!r} declares {int(nchunk[j])} chunk checksums but its "
                      f"boxes hold {int(per_t[j])} chunks of {chunk_bytes} bytes")


def _checked_storedspans(g: _Group, store: "_Rows", chunk_bytes: int, nbytes: np.ndarray, where: str) -> np.ndarray:
    """The file bytes each box's stored (compressed) chunks occupy."""
    span, bad_box = _storedspans(store, chunk_bytes, g.idx.crc0[g.ts], g.idx.nchunk[g.ts], nbytes)
    if bad_box is not None:
        raise corrupt(where, f"tensor {g.name_of_row(bad_box)!r} has a stored chunk length outside 1..its raw length")
    return span


def _check_inside_files(g: _Group, store: "_Rows", span: np.ndarray, fbytes: np.ndarray, nfiles: int,
                        where: str) -> None:
    file = store.raw["file"][g.rows].astype(np.int64)
    offset = store.raw["offset"][g.rows].astype(np.int64)
    bad = (file < 0) | (file >= nfiles) | (offset < 0)
    bad |= offset > fbytes[np.where(bad, nfiles, file)] - span
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise corrupt(where, f"tensor {g.name_of_row(i)!r} has a box in file {int(file[i])} at bytes "
                      f"{int(offset[i])}+{int(span[i])}, outside the {nfiles} data files it lists")


def _check_disjoint(g: _Group, offs: np.ndarray, lens: np.ndarray, numel: np.ndarray, where: str) -> None:
    """No two boxes of a tensor may share an element (then counting elements proves coverage): the
    usual layouts are proven disjoint for all tensors at once, the others one tensor at a time."""
    clear = bulk_disjoint(offs, lens, numel, g.n_t)
    for j in np.nonzero(~clear)[0].tolist():
        a, b = int(g.first[j]), int(g.first[j + 1])
        problem = overlap_problem_arrays(offs[a:b], lens[a:b], numel[a:b])
        if problem:
            raise corrupt(where, f"tensor {g.idx.names[g.ts[j]]!r}: {problem}")


def _storedspans(store, chunk_bytes: int, crc0, nchunk, nbytes) -> tuple[np.ndarray, int | None]:
    """(the file bytes each box's stored chunks occupy, the first box with an impossible stored
    length or None), for the rows of tensors whose chunks start at crc0 and number nchunk, box raw
    sizes nbytes. A chunk is stored in 1..its raw length bytes (equal: stored raw)."""
    idx = spans(crc0, nchunk)
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
            return self.whole(name, dtype)[lo:hi]
        return self.raw[name][lo:hi].astype(dtype)

    def whole(self, name: str, dtype=np.int64) -> np.ndarray:
        """Array `name` widened to `dtype`, once."""
        wide = self._wide.get(name)
        if wide is None:
            wide = self._wide[name] = self.raw[name].astype(dtype)
        return wide


@dataclass(slots=True)
class _Slice:
    """One tensor's rows of a _Rows: made into BoxColumns on first use (slots, and not frozen,
    whose __init__ sets each field through object.__setattr__: one per tensor of a decoded
    manifest, 10^4 and more). Never changed after it is made."""
    store: _Rows
    row0: int
    row1: int
    elem0: int
    ndim: int
    crc0: int
    itemsize: int
    dtype: str | None = None
    codec: str | None = None    # this tensor's own (quantized), else the manifest's

    def __len__(self) -> int:
        return self.row1 - self.row0

    @property
    def chunk_bytes(self) -> int:
        return self.store.chunk_bytes

    @property
    def group(self) -> tuple:
        """Slices with equal groups are joined in one pass (join)."""
        codec = self.codec or self.store.codec
        # A compressed box's grid names its dtype: such slices join with their own dtype only.
        return (id(self.store), self.ndim, codec) + ((self.itemsize, self.dtype) if codec else ())

    @staticmethod
    def join(slices: "list[_Slice]") -> BoxColumns:
        """The rows of many slices of one group, concatenated in their order, as one BoxColumns
        (sums_start into the concatenated CRCs): what calling each and concatenating gives, in a
        few numpy passes however many tensors there are (a load of 10^4 small tensors)."""
        first = slices[0]
        store, nd, codec = first.store, first.ndim, first.codec or first.store.codec
        row0 = np.fromiter((s.row0 for s in slices), dtype=np.int64, count=len(slices))
        counts = np.fromiter((s.row1 for s in slices), dtype=np.int64, count=len(slices)) - row0
        rows = spans(row0, counts)
        nbytes = store.nbytes[rows]
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(-(-nbytes // store.chunk_bytes), out=starts[1:])
        ends = np.cumsum(counts)
        chunks = starts[ends] - starts[ends - counts]   # each slice's CRC count
        crc0 = np.fromiter((s.crc0 for s in slices), dtype=np.int64, count=len(slices))
        at = spans(crc0, chunks)
        elem0 = np.fromiter((s.elem0 for s in slices), dtype=np.int64, count=len(slices))
        elems = spans(elem0, counts * nd)
        whole = store.whole
        return BoxColumns(
            offsets=whole("offsets")[elems].reshape(len(rows), nd),
            lengths=whole("lengths")[elems].reshape(len(rows), nd),
            file=whole("file")[rows], offset=whole("offset")[rows], nbytes=nbytes, sums_start=starts,
            crcs=whole("crcs", np.uint32)[at], chunk_bytes=store.chunk_bytes,
            stored=None if codec is None else whole(_STORED)[at],
            codec=codec, itemsize=first.itemsize, dtype=first.dtype)

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




# ------------------------------------------------------------------------------------ the header alone
def read_header(storage, rel: str, where: str | None = None,
                advice: str = "restore the manifest, or load an earlier checkpoint") -> dict | None:
    """The JSON header of the manifest at `rel` in `storage` (a Storage), read with two ranged
    reads (the prelude, then the header) so that what needs only header fields, such as the files
    a checkpoint takes from its neighbours (retention, omnickpt/steps.py), never fetches the tensor
    arrays. None when the manifest is JSON (versions 1 and 2: no header apart from the document).

    The header is not checked against the manifest's checksum (which covers the arrays too) and is
    not validated past being a JSON object: the caller checks the fields it reads. A manifest that
    is empty, neither binary nor JSON, of a version this omnickpt does not read, or whose header
    runs past its end or is not a JSON object is a CorruptCheckpointError "<where>: <what>;
    <advice>" (`where` defaults to the manifest's description by the storage). A missing manifest
    is whatever the storage raises for a missing file (FileNotFoundError)."""
    where = storage.describe(rel) if where is None else where

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {what}; {advice}")
    size = storage.size(rel)
    if size == 0:
        raise bad("its manifest is empty")
    first = bytearray(min(size, PRELUDE.size))
    storage.read_into(rel, 0, [memoryview(first)])
    if first[:1] == b"{":
        return None
    if len(first) < PRELUDE.size or bytes(first[:len(MAGIC)]) != MAGIC:
        raise bad(f"its manifest starts with {bytes(first[:len(MAGIC)])!r}, neither a version-3 prelude nor JSON")
    p = prelude(first)
    if p.version < 3 or p.version > FORMAT_VERSION:
        # a newer format may say what its header says in a way this code does not know
        raise bad(f"its manifest is of format version {p.version}; this omnickpt reads 3..{FORMAT_VERSION}")
    if PRELUDE.size + p.header_bytes > size:
        raise bad(f"its manifest's header ({p.header_bytes} bytes) runs past its {size} bytes (truncated)")
    head = bytearray(p.header_bytes)
    storage.read_into(rel, PRELUDE.size, [memoryview(head)])
    try:
        doc = json.loads(head.decode("utf-8"), parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"its manifest's header is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise bad(f"its manifest's header is unreadable (a JSON {type(doc).__name__}, not an object)")
    return doc
