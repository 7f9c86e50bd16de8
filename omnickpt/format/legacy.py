"""Versions 1 and 2 of the manifest: one JSON document holding every box as a record (docs/format.md,
"version 2"). Both still load; version 2 is still written where a JSON form is asked for
(`Manifest(version=2).encode()`, `manifest_document`: tools and tests that edit a manifest by
hand). Version 1 held one CRC per box, read as a one-chunk grid (`Sums`), so a partial read of a
version-1 box reads the whole box.

Decoding validates as format/header.py says; here, each box: inside its tensor's shape, inside its
data file, with the checksums its bytes need, and no two boxes of a tensor sharing an element.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format.header import (check_version, chunk_bytes_field, decode_files, decode_manifest_fields,
                                    encode_header, int_field, ints_field, stored_columns)
from omnickpt.format.records import FileEntry, SavedBox, Sums, TensorEntry, dtype_from_name
from omnickpt.layout import overlap_problem

if TYPE_CHECKING:   # Manifest sits above the codecs (format/manifest.py), which hands its class to them
    from omnickpt.format.manifest import Manifest


# ------------------------------------------------------------------------------------ reading
def decode_document(doc: dict, where: str, wanted: set | None, make: Callable[..., Manifest]) -> Manifest:
    """The manifest of a version-1 or version-2 JSON document, built by `make` (the Manifest class);
    with `wanted`, only those tensors."""
    version = check_version(doc, where, binary=False)
    chunk_bytes = chunk_bytes_field(doc, version)
    files = decode_files(doc, where, version)
    ctx = _Context(where, files, chunk_bytes, version)
    tensors = {name: _tensor(t, name, ctx) for name, t in doc["tensors"].items()
               if wanted is None or name in wanted}
    return decode_manifest_fields(doc, where, version, chunk_bytes, files, tensors, make)


@dataclass(frozen=True)
class _Context:
    """What every box of a document is checked against."""
    where: str
    files: list[FileEntry]
    chunk_bytes: int
    version: int


def _tensor(t: dict, name: str, ctx: _Context) -> TensorEntry:
    where = ctx.where
    shape = ints_field(t["shape"], f"tensor {name!r} shape")
    if any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a negative dimension in shape {list(shape)}")
    dtype = t["dtype"]
    itemsize = dtype_from_name(dtype, f"{where}: tensor {name!r}").itemsize
    boxes = [_box(raw, name, shape, itemsize, ctx) for raw in t["boxes"]]
    # Holes are allowed here (a node of the memory tier stores only its own ranks' boxes; the
    # load planner checks that every wanted element is held), overlaps never: with them,
    # counting elements could not see a hole.
    problem = overlap_problem(shape, boxes)
    if problem:
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: {problem}; the manifest is damaged")
    return TensorEntry(shape, dtype, boxes)


def _box(raw: list, name: str, shape: tuple[int, ...], itemsize: int, ctx: _Context) -> SavedBox:
    where, files = ctx.where, ctx.files
    offs, lens, fi, off, nb, ck = raw
    box = SavedBox(ints_field(offs, "box offsets"), ints_field(lens, "box lengths"), int_field(fi, "box file"),
                   int_field(off, "box offset"), int_field(nb, "box bytes"), None)
    if (len(box.offsets) != len(shape) or len(box.lengths) != len(shape)
            or any(o < 0 or l < 0 or o + l > s for o, l, s in zip(box.offsets, box.lengths, shape))):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a box {offs}+{lens} outside its shape "
                                     f"{list(shape)}")
    if (box.nbytes != math.prod(box.lengths) * itemsize or not 0 <= box.file < len(files) or box.offset < 0
            or box.offset + box.nbytes > files[box.file].bytes):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has an inconsistent box record {raw}")
    box.sums = _sums(ck, box, ctx.chunk_bytes, ctx.version, f"{where}: tensor {name!r} box {offs}+{lens}")
    return box


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


# ------------------------------------------------------------------------------------ writing
def encode(m: Manifest) -> bytes:
    """`m` as a version-2 JSON document. ValueError for what version 2 cannot say: an incremental
    or compressed checkpoint, boxes that are not stored ones (format/header.py's stored_columns)."""
    if m.block_bytes or any(f.path.startswith("../") for f in m.files):
        raise ValueError("an incremental checkpoint has no version-2 (JSON) form; encode it as version 3")
    if m.compression:
        raise ValueError(f"a compressed checkpoint ({m.compression}) has no version-2 (JSON) form; "
                         "encode it as version 3")
    doc = encode_header(m)
    doc["tensors"] = {}
    for name, t in m.tensors.items():
        stored_columns(m, name, t)
        doc["tensors"][name] = {"shape": list(t.shape), "dtype": t.dtype, "boxes": [b.encode() for b in t.boxes]}
    return json.dumps(doc, separators=(",", ":")).encode()
