"""The on-storage format: manifest schema, versioning, checksums, safe object encoding.

docs/format.md is the human-readable specification of what this package writes. records.py holds
the records a manifest is made of; v3.py (binary, written by default) and legacy.py (JSON, versions
1 and 2) their encodings, over header.py (the fields every version shares); manifest.py, on top,
defines `Manifest` and picks the codec its bytes take.
The geometry of boxes (overlap, tiling) lives in omnickpt/layout.py.
"""
from omnickpt.format.checksum import checksum
from omnickpt.format.manifest import Manifest, manifest_document
from omnickpt.format.objects import ShardRef, decode_object, encode_object
from omnickpt.format.records import (
    CHUNK_BYTES,
    CONTROL_DIR,
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    BoxColumns,
    ColumnTable,
    FileEntry,
    ObjectEntry,
    SavedBox,
    Sums,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from omnickpt.format.v3 import MAGIC, read_header
from omnickpt.layout import overlap_problem, tiling_problem

__all__ = [
    "BoxColumns", "CHUNK_BYTES", "CONTROL_DIR", "ColumnTable", "DATA_DIR", "FORMAT_NAME", "FORMAT_VERSION", "FileEntry",
    "MAGIC", "MANIFEST_NAME", "Manifest", "ObjectEntry", "SavedBox", "ShardRef", "Sums", "TensorEntry", "checksum",
    "decode_object", "dtype_from_name", "dtype_name", "encode_object", "manifest_document", "overlap_problem",
    "read_header", "tiling_problem",
]
