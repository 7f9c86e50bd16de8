"""The fields every manifest version shares, read as untrusted input and written back: the JSON
document of versions 1 and 2 less its tensors is the JSON header of version 3 less its array
index (docs/format.md). Used by the codecs, format/legacy.py and format/v3.py.

Reading validates every field before anything is believed or allocated from it: damage is a
CorruptCheckpointError naming `where` and the field (or a ValueError, KeyError or TypeError that
the caller, format/manifest.py's decode_manifest, reports as a malformed manifest), a path that
could lead outside the checkpoint an UnsafeCheckpointError.
"""
from __future__ import annotations

import json
import math
import posixpath
from typing import TYPE_CHECKING, Any, Callable

import orjson

from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from omnickpt.format.codec import STORED_CODECS
from omnickpt.format.records import (CHUNK_BYTES, FORMAT_NAME, FORMAT_VERSION, BoxColumns, FileEntry, ObjectEntry,
                                     TensorEntry)

if TYPE_CHECKING:   # Manifest sits above the codecs (format/manifest.py), which hands its class to them
    from omnickpt.format.manifest import Manifest

# What a manifest may declare before anything is believed: larger values are damage, not data.
MAX_DIMS = 64
MAX_INT = 1 << 62
# Versions are small integers, one per incompatible change; anything larger is a damaged field.
MAX_VERSION = 255


def corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the manifest is damaged: restore it or load an earlier checkpoint")


def refuse_constant(name: str):
    # NaN and Infinity are not JSON; a manifest holding them was not written by omnickpt.
    raise ValueError(f"non-JSON number {name}")


def dumps_json(doc: Any) -> bytes:
    """`doc` as compact JSON: orjson (20x json's speed on the header of 10^4 tensors: 2 ms, not 40 on
    every save's commit), json for what orjson refuses (integer keys, integers beyond 64 bits).
    Reading stays with json: orjson reads an integer beyond 64 bits as a float, which would change
    a value of the user's metadata without a word."""
    try:
        return orjson.dumps(doc)
    except TypeError:
        return json.dumps(doc, separators=(",", ":")).encode()


def json_document(data, where: str) -> dict:
    """The JSON object in `data` (a whole JSON manifest, or a version-3 header)."""
    try:
        doc = json.loads(bytes(data), parse_constant=refuse_constant)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a manifest; the manifest is damaged") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the manifest is damaged") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (a JSON {type(doc).__name__}, "
                                     "not an object); the manifest is damaged")
    return doc


def int_field(v: Any, what: str) -> int:
    """A manifest integer: a JSON integer (not a bool, not a float) in a sane range."""
    if type(v) is not int or not -MAX_INT <= v <= MAX_INT:
        raise ValueError(f"{what} must be an integer, got {v!r:.40}")
    return v


def ints_field(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        raise ValueError(f"{what} must be a list of at most {MAX_DIMS} integers, got {v!r:.60}")
    return tuple(int_field(x, what) for x in v)


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


def sibling_name(name: Any, where: str) -> str:
    """A checkpoint folder next to this one, named by an incremental checkpoint's file record:
    one path component, nothing that could lead elsewhere."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\:\x00")):
        raise UnsafeCheckpointError(f"{where}: data file base {name!r:.80} is not the name of a checkpoint folder "
                                    "next to this one; refusing to load")
    return name


# ------------------------------------------------------------------------------------ reading
def check_version(doc: dict, where: str, binary: bool) -> int:
    """The format version a document declares, refused unless this omnickpt reads it in the form
    it came in (`binary`: a version-3 header; else a JSON manifest of version 1 or 2)."""
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (format={doc.get('format')!r})")
    version = int_field(doc["version"], "version")
    if not 1 <= version <= MAX_VERSION:
        # JSON carries no checksum: a version no omnickpt could have reached is damage, not a newer format
        raise CorruptCheckpointError(f"{where}: format version {version} does not exist; the manifest is damaged")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version} is newer than this omnickpt reads ({FORMAT_VERSION}); "
            "upgrade omnickpt")
    if binary != (version >= 3):
        raise CorruptCheckpointError(f"{where}: a version-{version} manifest must be "
                                     f"{'binary' if version >= 3 else 'JSON'}; the manifest is damaged")
    return version


def chunk_bytes_field(doc: dict, version: int) -> int:
    """The checksum chunk size (0 for version 1: one CRC per box)."""
    chunk_bytes = int_field(doc["chunk_bytes"], "chunk_bytes") if version >= 2 else 0
    if version >= 2 and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunk_bytes


def decode_files(doc: dict, where: str, version: int) -> list[FileEntry]:
    files = [FileEntry(_file_path(f, where, version), int_field(f["rank"], "file rank"),
                       int_field(f["bytes"], "file bytes"))
             for f in doc["files"]]
    for f in files:
        if f.rank < 0 or f.bytes < 0:
            raise CorruptCheckpointError(f"{where}: data file {f.path!r} has an inconsistent record "
                                         f"(rank {f.rank}, {f.bytes} bytes)")
    return files


def _file_path(record: dict, where: str, version: int) -> str:
    """The in-memory path of a file record: a file of a sibling checkpoint (an incremental save's
    reference, version 3) is "../<sibling>/<path inside it>"."""
    path = safe_relative_path(record["path"], where)
    if version >= 3 and "base" in record:
        return f"../{sibling_name(record['base'], where)}/{path}"
    return path


def decode_objects(doc: dict, where: str, files: list[FileEntry]) -> dict[str, list[ObjectEntry]]:
    objects: dict[str, list[ObjectEntry]] = {}
    for key, entries in doc["objects"].items():
        objects[key] = [_object_entry(e, key, where, files) for e in entries]
    return objects


def _object_entry(e: dict, key: str, where: str, files: list[FileEntry]) -> ObjectEntry:
    oe = ObjectEntry(list(ints_field(e["ranks"], "object ranks")), int_field(e["file"], "object file"),
                     int_field(e["offset"], "object offset"), int_field(e["nbytes"], "object bytes"),
                     int_field(e["checksum"], "object checksum"))
    if (not 0 <= oe.file < len(files) or not oe.ranks or oe.offset < 0 or oe.nbytes < 0
            or oe.offset + oe.nbytes > files[oe.file].bytes or any(r < 0 for r in oe.ranks)):
        raise CorruptCheckpointError(f"{where}: object {key!r} has an inconsistent record {e}")
    return oe


def decode_manifest_fields(doc: dict, where: str, version: int, chunk_bytes: int, files: list[FileEntry],
                           tensors: dict[str, TensorEntry], make: Callable[..., Manifest]) -> Manifest:
    """The manifest of a document whose version, chunk size, files and tensors are read already:
    its objects and the save's facts, checked in that order, given to `make` (the Manifest class,
    which format/manifest.py passes down) as keywords."""
    objects = decode_objects(doc, where, files)
    world_size = int_field(doc["world_size"], "world_size")
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
    return make(
        save_id=str(doc["save_id"]), world_size=world_size, files=files, tensors=tensors,
        objects=objects, layout=dict(doc.get("layout") or {}), tool_version=str(doc.get("tool_version", "")),
        created=float(created), version=version, chunk_bytes=chunk_bytes or CHUNK_BYTES, compression=compression,
        block_bytes=block_bytes, base=base, chain=chain)


def _incremental(doc: dict, where: str, version: int) -> tuple[int | None, str | None, int]:
    inc = doc.get("incremental") if version >= 3 else None
    if inc is None:
        return None, None, 0
    if not isinstance(inc, dict):
        raise corrupt(where, "field 'incremental' is not an object")
    block_bytes = int_field(inc.get("block_bytes"), "incremental block_bytes")
    chain = int_field(inc.get("chain", 0), "chain")
    base = inc.get("base")
    if block_bytes < 1 or chain < 0 or not (base is None or isinstance(base, str)):
        raise corrupt(where, f"field 'incremental' is inconsistent ({inc!r:.80})")
    return block_bytes, base, chain


# ------------------------------------------------------------------------------------ writing
def encode_header(m: Manifest) -> dict:
    """The shared fields of `m` as the JSON document (or header) holds them."""
    return {
        "format": FORMAT_NAME,
        "version": m.version,
        "tool_version": m.tool_version,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "layout": m.layout,
        "checksum": "crc32c",
        "chunk_bytes": m.chunk_bytes,
        "files": [_file_record(f) for f in m.files],
        "objects": {k: [e.encode() for e in v] for k, v in m.objects.items()},
    } | ({"compression": m.compression} if m.compression else {}) | (
        {"incremental": {"block_bytes": m.block_bytes, "base": m.base, "chain": m.chain}}
        if m.block_bytes else {})


def _file_record(f: FileEntry) -> dict:
    if f.path.startswith("../"):
        name, _, rest = f.path[3:].partition("/")
        return {"path": rest, "rank": f.rank, "bytes": f.bytes, "base": name}
    return {"path": f.path, "rank": f.rank, "bytes": f.bytes}


def stored_columns(m: Manifest, name: str, t: TensorEntry) -> BoxColumns:
    """Tensor `name`'s boxes as they may be stored: each on a checksum grid of its own bytes in
    chunks of the manifest's chunk_bytes, with the manifest's compression (or the tensor's own
    quantization). ValueError otherwise: derived manifests (transforms) are never stored."""
    c = t.columns
    if c is None:
        raise ValueError(f"tensor {name!r}: its boxes have no checksum grid of their own bytes in chunks of "
                         f"{m.chunk_bytes}; only stored boxes can be encoded")
    check_stored(m, name, len(c), c.chunk_bytes, c.codec)
    return c


def check_stored(m: Manifest, name: str, boxes: int, chunk_bytes: int | None, codec: str | None) -> None:
    """ValueError unless `boxes` boxes of tensor `name` on a grid of `chunk_bytes` stored with `codec`
    can be encoded in `m` (see stored_columns)."""
    if boxes and chunk_bytes != m.chunk_bytes:
        raise ValueError(f"tensor {name!r}: its boxes have no checksum grid of their own bytes in chunks of "
                         f"{m.chunk_bytes}; only stored boxes can be encoded")
    if boxes and codec != m.compression and codec != m.quantized.get(name, {}).get("scheme"):
        raise ValueError(f"tensor {name!r}: its boxes are stored with compression {codec!r}, the manifest "
                         f"says {m.compression!r}")
