"""The manifest's front door: which codec a stored manifest's bytes take, and the names this module
has always exported, now defined where each idea lives (issue 18):

- format/records.py: the records (Manifest, TensorEntry, SavedBox, WindowBox, Sums, BoxColumns,
  ColumnTable, FileEntry, ObjectEntry), the dtype names, the format's constants;
- format/header.py: the fields every version shares, read as untrusted input and written back;
- format/v3.py: the binary version 3 (written by default), and `read_header`, which reads only a
  manifest's prelude and header (retention, omnickpt/steps.py);
- format/legacy.py: the JSON of versions 1 and 2 (version 2 still written on request);
- omnickpt/layout.py: whether boxes overlap or tile a shape (overlap_problem, tiling_problem,
  overlap_problem_arrays), shared with the save planner and the foreign readers.

Import from those modules in new code. `Manifest.decode` and `Manifest.encode` arrive here
(decode_manifest, encode_manifest), which hands the bytes to the codec of their version.
No version executes code: a manifest is untrusted input, validated before anything is believed.
"""
from __future__ import annotations

import json

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import legacy, v3
from omnickpt.format.header import json_document, safe_relative_path, sibling_name
from omnickpt.format.records import (CHUNK_BYTES, CONTROL_DIR, DATA_DIR, FORMAT_NAME, FORMAT_VERSION,
                                     MANIFEST_NAME, BoxColumns, ColumnTable, FileEntry, Manifest, ObjectEntry,
                                     SavedBox, Sums, TensorEntry, WindowBox, dtype_from_name, dtype_name)
from omnickpt.format.v3 import MAGIC, read_header
from omnickpt.layout import overlap_problem, overlap_problem_arrays, tiling_problem
# Private names that modules and tests have imported from here, kept importable.
from omnickpt.format.header import MAX_DIMS as _MAX_DIMS, MAX_INT as _MAX_INT  # noqa: F401
from omnickpt.format.records import _DTYPES  # noqa: F401
from omnickpt.format.v3 import PRELUDE as _PRELUDE  # noqa: F401

__all__ = [
    "BoxColumns", "CHUNK_BYTES", "CONTROL_DIR", "ColumnTable", "DATA_DIR", "FORMAT_NAME", "FORMAT_VERSION",
    "FileEntry", "MAGIC", "MANIFEST_NAME", "Manifest", "ObjectEntry", "SavedBox", "Sums", "TensorEntry", "WindowBox",
    "decode_manifest", "dtype_from_name", "dtype_name", "encode_manifest", "manifest_document", "overlap_problem",
    "overlap_problem_arrays", "read_header", "safe_relative_path", "sibling_name", "tiling_problem",
]
# What malformed (not merely inconsistent) input raises while it is read.
_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError)


def encode_manifest(m: Manifest) -> bytes:
    """`Manifest.encode`: version 3 unless `m.version` asks for the JSON of version 2."""
    return legacy.encode(m) if m.version <= 2 else v3.encode(m)


def decode_manifest(data: bytes, where: str = "manifest", names=None) -> Manifest:
    """`Manifest.decode`: a manifest from its stored bytes (any version), validated as untrusted
    input: damage is a CorruptCheckpointError naming `where` and the field. With `names`, only
    those tensors are decoded and validated."""
    wanted = None if names is None else set(names)
    if bytes(data[:len(MAGIC)]) == MAGIC:
        return _reported(v3.decode, memoryview(data), where, wanted)
    return _reported(legacy.decode_document, json_document(data, where), where, wanted)


def _reported(decode, data, where: str, wanted: set | None) -> Manifest:
    try:
        return decode(data, where, wanted)
    except _MALFORMED as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); the manifest is "
                                     "damaged: restore it or load an earlier checkpoint") from None


def manifest_document(data: bytes, where: str = "manifest") -> dict:
    """A stored manifest (any version) as the JSON document of version 2, for tools and tests
    that read or edit a manifest by hand: a document written back as JSON still loads."""
    m = decode_manifest(data, where)
    m.version = 2
    return json.loads(legacy.encode(m))
