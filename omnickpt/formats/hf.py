"""Hugging Face safetensors folders, read as our manifest (so one loads into any parallel layout). Writing
one from any checkpoint omnickpt reads is `omnickpt.export.hf.export_hf`.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [..], "data_offsets": [start, end]}, "__metadata__": {str: str}}`
and then the raw row-major little-endian tensor bytes, `data_offsets` counting from the byte after the
header. So every tensor is one box of one file at byte 8 + N + start, and once the headers are read
the planner, the ranged parallel reads, resharding and transforms are the same code as for our own
checkpoints. A header is untrusted input and is validated like `Manifest.decode` validates ours.

safetensors stores no checksums: boxes read from it have `sums=None`, and nothing read from a Hugging
Face folder is verified (a flipped bit loads silently, as it does with `from_pretrained`).
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any, Sequence

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedError
from omnickpt.format import FileEntry, Manifest, SavedBox, TensorEntry, dtype_name
from omnickpt.format.manifest import safe_relative_path
from omnickpt.storage import Storage

log = logging.getLogger("omnickpt")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
CONFIG_FILE = "config.json"
# safetensors' own limit: a longer header is damage or an attack (it would be read into memory).
MAX_HEADER_BYTES = 100_000_000
# First read of a file: the length and, for all but huge headers, the whole header in one request.
_FIRST_READ = 64 << 10
_MAX_DIMS = 64
_MAX_INT = 1 << 62
# The key our manifest files a Hugging Face folder's tensors under; the api binds it to the state's module.
KEY = "model"

# safetensors dtype names omnickpt reads and writes. Names are looked up in this table only.
_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
_NAMES = {d: n for n, d in _DTYPES.items()}
# Valid safetensors dtypes with no omnickpt counterpart: refused as unsupported, not as damage.
_OTHER_DTYPES = {"F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I4", "U4"}


# ---------------------------------------------------------------------- reading a folder
def read_manifest(storage: Storage) -> Manifest | None:
    """The manifest of the Hugging Face safetensors folder at `storage`, or None when it is not one.

    A folder is one when it holds `model.safetensors`, an index `*.safetensors.index.json` (then the
    files its weight_map names are the model; `model.safetensors.index.json` wins over other
    indexes), or exactly one `*.safetensors` file. One listing decides; a folder that does not exist
    is not one. Each tensor becomes one box `model/<name>` at its exact byte range, with no checksums
    (`sums=None`). `layout` holds {"format": "hf", "world_size": 1}, the files' `__metadata__`
    ("safetensors_metadata": {file: dict}) and, when config.json is there, {"metadata": {"config": ...}}.

    Raises CorruptCheckpointError (naming the file and tensor) for a header or index that cannot be
    trusted, UnsafeCheckpointError for an index naming a path outside the folder, UnsupportedError
    for a dtype omnickpt has no counterpart of or a folder whose model files cannot be told apart.
    """
    names = storage.children("")
    found = _model_files(storage, names)
    if found is None:
        return None
    files, weight_map, index = found
    entries: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    where_of: dict[str, str] = {}
    file_meta: dict[str, dict[str, str]] = {}
    for fi, path in enumerate(files):
        size, data_start, header = _read_header(storage, path)
        entries.append(FileEntry(path, 0, size))
        meta = header.pop("__metadata__", None)
        if meta:
            file_meta[path] = meta
        for name, (dtype, shape, start, end) in header.items():
            if name in where_of:
                raise CorruptCheckpointError(
                    f"tensor {name!r} is stored twice, in {storage.describe(where_of[name])} and "
                    f"{storage.describe(path)}; the folder mixes two models: keep the files its index names")
            where_of[name] = path
            boxes = []
            if math.prod(shape):   # a tensor with no elements has an entry and no boxes (docs/format.md)
                boxes.append(SavedBox((0,) * len(shape), shape, fi, data_start + start, end - start, None))
            tensors[f"{KEY}/{name}"] = TensorEntry(shape, dtype_name(dtype), boxes)
    if weight_map is not None:
        for name, path in weight_map.items():
            if where_of.get(name) != path:
                raise CorruptCheckpointError(
                    f"{storage.describe(index)} puts tensor {name!r} in {path}, but that file's header does not "
                    f"hold it" + (f" ({where_of[name]} does)" if name in where_of else "")
                    + "; the index and the files disagree: re-download or re-export the model")
    layout: dict[str, Any] = {"format": "hf", "world_size": 1, "frameworks": {KEY: "hf"}}
    if file_meta:
        layout["safetensors_metadata"] = file_meta
    config = _read_config(storage, names)
    if config is not None:
        layout["metadata"] = {"config": config}
    return Manifest(save_id="hf", world_size=1, files=entries, tensors=tensors, objects={}, layout=layout)


def _model_files(storage: Storage, names: Sequence[str]) -> tuple[list[str], dict[str, str] | None, str] | None:
    """(the model's safetensors files, the index's weight_map or None, the index's name) or None
    when `names` (the folder's listing) shows no Hugging Face model."""
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if INDEX_FILE in indexes:
        indexes = [INDEX_FILE]
    if len(indexes) > 1:
        raise UnsupportedError(
            f"{storage.describe()} holds several safetensors indexes ({', '.join(indexes)}) and none is "
            f"{INDEX_FILE}: omnickpt cannot tell which one is the model; move the others out of the folder")
    if indexes:
        index = indexes[0]
        weight_map = _read_index(storage, index)
        files = sorted(set(weight_map.values()))
        for f in files:
            if f not in names and not storage.exists(f):
                raise CorruptCheckpointError(f"{storage.describe(index)} names {f}, which is not there; the model "
                                             "is incomplete: download or copy the missing file")
        return files, weight_map, index
    if SINGLE_FILE in names:
        return [SINGLE_FILE], None, ""
    shards = [n for n in names if n.endswith(".safetensors")]
    if len(shards) == 1:
        return shards, None, ""
    if shards:
        shown = ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")
        raise UnsupportedError(
            f"{storage.describe()} holds {len(shards)} safetensors files ({shown}) but no {INDEX_FILE}: which "
            "of them form the model is unknown; add the index that came with them (Hugging Face's "
            "save_pretrained writes it), or keep only one file")
    return None


def _read_index(storage: Storage, index: str) -> dict[str, str]:
    where = storage.describe(index)
    try:
        doc = _json(storage.read_bytes(index), where)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is not a non-empty object")
        for name, path in weight_map.items():
            if not isinstance(path, str) or not path.endswith(".safetensors"):
                raise ValueError(f"tensor {name!r} is mapped to {path!r:.80}, not to a .safetensors file")
            safe_relative_path(path, where)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where} is not a safetensors index ({type(e).__name__}: {e}); "
                                     "re-download or re-export the model") from None
    return weight_map


def _read_config(storage: Storage, names: Sequence[str]) -> dict | None:
    """config.json as a dict, or None. A damaged one does not stop the tensors from loading: it is
    only carried along for export, so it is logged and left out."""
    if CONFIG_FILE not in names:
        return None
    try:
        config = _json(storage.read_bytes(CONFIG_FILE), storage.describe(CONFIG_FILE))
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        log.warning("omnickpt: %s is not readable JSON (%s); the tensors load, but an export will have no "
                    "config.json", storage.describe(CONFIG_FILE), e)
        return None
    return config if isinstance(config, dict) else None


def _json(raw: bytes, where: str) -> Any:
    """Parse untrusted JSON: no NaN/Infinity, no duplicate keys (a reader could pick either)."""
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"key {k!r:.80} appears twice")
            out[k] = v
        return out

    def constant(name):
        raise ValueError(f"non-JSON number {name}")

    try:
        return json.loads(raw, object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e})") from None


def _read_header(storage: Storage, path: str) -> tuple[int, int, dict]:
    """(file size, byte where the data starts, {tensor: (dtype, shape, start, end)} plus
    "__metadata__") of one safetensors file, every field checked against the file's size."""
    where = storage.describe(path)
    size = storage.size(path)
    damaged = "the file is damaged or not a safetensors file: re-download or re-export the model"
    if size < 8:
        raise CorruptCheckpointError(f"{where}: {size} bytes, too short for a safetensors header length; {damaged}")
    first = bytearray(min(size, _FIRST_READ))
    storage.read_into(path, 0, [memoryview(first)])
    n = int.from_bytes(first[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpointError(f"{where}: header length {n} runs past the file's {size} bytes or over the "
                                     f"{MAX_HEADER_BYTES}-byte limit; {damaged}")
    if 8 + n <= len(first):
        raw = bytes(first[8:8 + n])
    else:
        rest = bytearray(8 + n - len(first))
        storage.read_into(path, len(first), [memoryview(rest)])
        raw = bytes(first[8:]) + bytes(rest)
    try:
        doc = _json(raw, where)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: the header is not valid JSON ({e}); {damaged}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: the header is a JSON {type(doc).__name__}, not an object; {damaged}")
    data_start, data_bytes = 8 + n, size - 8 - n
    out: dict[str, Any] = {}
    meta = doc.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CorruptCheckpointError(f"{where}: __metadata__ is not an object of strings; {damaged}")
        out["__metadata__"] = meta
    spans = []
    for name, rec in doc.items():
        try:
            dtype, shape, start, end = _tensor_record(rec, data_bytes)
        except UnsupportedError as e:
            raise UnsupportedError(f"{where}: tensor {name!r}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: {e}; {damaged}") from None
        if end > start:
            spans.append((start, end, name))
        out[name] = (dtype, shape, start, end)
    spans.sort()
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            raise CorruptCheckpointError(f"{where}: tensors {a!r} and {b!r} overlap in the file; {damaged}")
    return size, data_start, out


def _tensor_record(rec: Any, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(rec, dict):
        raise ValueError(f"its record is a JSON {type(rec).__name__}, not an object")
    name = rec["dtype"]
    if name in _OTHER_DTYPES:
        raise UnsupportedError(f"dtype {name} has no omnickpt counterpart (supported: {', '.join(_DTYPES)}); "
                               "convert the model to one of them first")
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r:.40}")
    dtype = _DTYPES[name]
    shape = rec["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or any(
            type(s) is not int or not 0 <= s <= _MAX_INT for s in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of at most {_MAX_DIMS} non-negative integers")
    offsets = rec["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or any(type(o) is not int or not 0 <= o <= _MAX_INT for o in offsets)):
        raise ValueError(f"data_offsets {offsets!r:.80} is not a pair of non-negative integers")
    start, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if start > end or end > data_bytes:
        raise ValueError(f"data_offsets [{start}, {end}] lie outside the file's {data_bytes} data bytes")
    if end - start != nbytes:
        raise ValueError(f"data_offsets [{start}, {end}] hold {end - start} bytes but shape {shape} of {name} "
                         f"needs {nbytes}")
    return dtype, tuple(shape), start, end


# Moved up to omnickpt.export (exporters sit above the readers). Resolving them here would import the
# layer above, so asking for one names its new home instead.
_MOVED = {"export_hf": "omnickpt.export.hf.export_hf (omnickpt.export.export_hf)",
          "TOP_LEVEL": "omnickpt.export.hf.TOP_LEVEL", "_tied_duplicates": "omnickpt.export.hf._tied_duplicates"}


def __getattr__(name: str):
    if name in _MOVED:
        # ImportError, not AttributeError: `from omnickpt.formats.hf import export_hf` would replace an
        # AttributeError with a bare "cannot import name", losing where the name went.
        raise ImportError(f"{__name__}.{name} moved to {_MOVED[name]}", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONFIG_FILE", "INDEX_FILE", "INDEX_SUFFIX", "KEY", "SINGLE_FILE", "read_manifest"]
