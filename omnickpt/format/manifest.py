"""`Manifest`, the one global record of a checkpoint, and the codec its stored bytes take; also the names
this module has always exported, now defined where each idea lives (issue 18):

- format/records.py: the records a manifest is made of (TensorEntry, SavedBox, WindowBox, Sums,
  BoxColumns, ColumnTable, FileEntry, ObjectEntry), the dtype names, the format's constants;
- format/header.py: the fields every version shares, read as untrusted input and written back;
- format/v3.py: the binary version 3 (written by default), and `read_header`, which reads only a
  manifest's prelude and header (retention, omnickpt/steps.py);
- format/legacy.py: the JSON of versions 1 and 2 (version 2 still written on request);
- omnickpt/layout.py: whether boxes overlap or tile a shape (overlap_problem, tiling_problem,
  overlap_problem_arrays), shared with the save planner and the foreign readers.

`Manifest` is defined here, on top of its codecs, because `Manifest.encode` and `Manifest.decode`
need them: the codecs import only the records below them, are handed the class to build
(`make=Manifest`) and read a manifest's attributes when they encode one, so the package's imports
all point downwards. No version executes code: a manifest is untrusted input, validated before
anything is believed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import legacy, v3
from omnickpt.format.header import json_document, safe_relative_path, sibling_name
from omnickpt.format.records import (CHUNK_BYTES, CONTROL_DIR, DATA_DIR, FORMAT_NAME, FORMAT_VERSION,
                                     MANIFEST_NAME, BoxColumns, ColumnTable, FileEntry, ObjectEntry,
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


@dataclass
class Manifest:
    """What a checkpoint holds: its data files, its tensors (each a global shape and dtype and the
    boxes stored of it), its objects (safely encoded values) and the save's facts (layout,
    compression, incremental base). `encode` gives its stored bytes, `decode` reads them back."""
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

    def encode(self) -> bytes:
        """The stored manifest: version 3 (binary, docs/format.md) unless `version` asks for the JSON
        of version 2. Every box must carry its own chunk grid (start = its offset, end = its end,
        size = chunk_bytes): derived manifests (transforms) are never stored."""
        return encode_manifest(self)

    @staticmethod
    def decode(data: bytes, where: str = "manifest", names=None) -> "Manifest":
        """A manifest from its stored bytes (any version), validated as untrusted input: damage is a
        CorruptCheckpointError naming `where` and the field. With `names`, only those tensors are
        decoded and validated (the others are absent from `tensors`); a version-3 manifest then
        costs in proportion to their boxes."""
        return decode_manifest(data, where, names)


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
        return decode(data, where, wanted, make=Manifest)
    except _MALFORMED as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); the manifest is "
                                     "damaged: restore it or load an earlier checkpoint") from None


def manifest_document(data: bytes, where: str = "manifest") -> dict:
    """A stored manifest (any version) as the JSON document of version 2, for tools and tests
    that read or edit a manifest by hand: a document written back as JSON still loads."""
    m = decode_manifest(data, where)
    m.version = 2
    return json.loads(legacy.encode(m))
