"""The on-storage format: manifest schema, versioning, checksums, safe object encoding.

docs/format.md is the human-readable specification of what this package writes.
"""
from omnickpt.format.checksum import checksum
from omnickpt.format.manifest import (
    BoxColumns,
    CHUNK_BYTES,
    ColumnTable,
    CONTROL_DIR,
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ObjectEntry,
    SavedBox,
    Sums,
    TensorEntry,
    dtype_from_name,
    dtype_name,
    manifest_document,
    overlap_problem,
    tiling_problem,
)
from omnickpt.format.objects import ShardRef, decode_object, encode_object

__all__ = [
    "BoxColumns", "CHUNK_BYTES", "ColumnTable", "CONTROL_DIR", "DATA_DIR", "Sums", "overlap_problem", "tiling_problem", "FORMAT_NAME", "FORMAT_VERSION", "MAGIC", "MANIFEST_NAME", "FileEntry", "Manifest", "ObjectEntry",
    "SavedBox", "ShardRef", "TensorEntry", "checksum", "decode_object", "dtype_from_name", "dtype_name", "manifest_document",
    "encode_object",
]
