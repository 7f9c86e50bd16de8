"""`read_manifest`: a DCP folder as our manifest (see the package docstring)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.format import FileEntry, Manifest, ObjectEntry, TensorEntry, encode_object
from omnickpt.storage import Storage
from omnickpt.storage.base import require_length
from omnickpt.formats.dcp.archive import _WINDOW, _locate, _Windows
from omnickpt.formats.dcp.metadata import (_DISTCP_FILE, MEGATRON_COMMON, MEGATRON_METADATA, METADATA_NAME, _Chunk,
                                           _parse_metadata, _Parsed, _unpickle_metadata)
from omnickpt.formats.dcp.names import _as_saved_entries, _entries, _megatron_entries, _paths, _top_keys
from omnickpt.formats.dcp.unpickle import MAX_INLINE_BYTES, _Budget, _decode_value, _unzip_bounded


# ---------------------------------------------------------------------- reading a folder
def read_manifest(storage: Storage, names: str = "adapters") -> Manifest | None:
    """The manifest of the PyTorch DCP checkpoint at `storage`, or None when it is not one (no
    `.metadata` there; a folder that does not exist is not one: one failed read decides).

    Every tensor chunk becomes a box at its raw bytes inside its `.distcp` file, with `sums=None` (DCP
    stores no checksums omnickpt can use). Names and objects follow omnickpt's adapters (see the module
    docstring and docs/dcp.md): a checkpoint written by `dcp.save({"model": get_model_state_dict(m),
    "optimizer": get_optimizer_state_dict(m, o)})` loads with `omnickpt.load(path, {"model": m,
    "optimizer": o})` at any world size. `layout` holds {"format": "dcp", "world_size": the saving
    ranks, "dcp_version"}; "implied_keys" lists the state keys the reader chose because the checkpoint
    has none ("model" for a model state dict saved at the top level; "model" and "optimizer" for a
    Megatron torch_dist checkpoint); and, for Megatron, {"megatron": its metadata.json, "skipped": ...}.

    Raises UnsafeCheckpointError for a `.metadata` or tensor pickle naming anything but DCP's own
    classes, or a value torch's weights-only unpickler refuses (nothing is executed either way);
    CorruptCheckpointError (naming the file, and the tensor) for damaged metadata, a missing or
    truncated data file, or an item that is not what the metadata says; UnsupportedError for what
    omnickpt cannot map (stream transforms such as compression, safetensors-serialised items,
    non-row-major or big-endian tensors, dtypes the omnickpt format lacks).

    `names="as_saved"` keeps DCP's own keys instead (what omnickpt.dcp.load reads): every top-level
    entry of the saved state dict is one object, its nested value with a ShardRef where each tensor is,
    each tensor named by its path (`names.py` `_as_saved_entries`); a Megatron torch_dist checkpoint is
    read as Megatron's adapter names it either way. `layout["names"]` says which view was read.
    """
    if names not in ("adapters", "as_saved"):
        raise ValueError(f"names={names!r}: expected 'adapters' (omnickpt's adapters' names) or 'as_saved' "
                         "(DCP's own keys)")
    try:
        raw = storage.read_bytes(METADATA_NAME)
    except FileNotFoundError:
        return None
    where = storage.describe(METADATA_NAME)
    parsed = _parse_metadata(_unpickle_metadata(raw, where), where)
    megatron = _megatron_info(storage)
    files, index = _files(storage, parsed)
    _check_value_bytes(parsed, storage)
    as_saved = names == "as_saved" and megatron is None
    tensors, objects = _read_entries(storage, parsed, megatron, index, as_saved)
    world = 1 + max((f.rank for f in files), default=0)
    layout: dict[str, Any] = {"format": "dcp", "world_size": world, "dcp_version": parsed.version}
    if as_saved:
        layout["names"] = "as_saved"
    implied = [] if as_saved else _implied_keys(parsed, megatron, tensors, objects)
    if implied:
        layout["implied_keys"] = implied
    if megatron is not None:
        layout["megatron"] = megatron
    return Manifest(save_id=parsed.save_id or "dcp", world_size=world, files=files, tensors=tensors,
                    objects={k: [_inline(v, k)] for k, v in objects.items()}, layout=layout)


def _read_entries(storage: Storage, parsed: _Parsed, megatron: dict | None,
                  index: dict[str, int], as_saved: bool = False) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """The checkpoint's tensors (each chunk located in its archive) and objects (values decoded), named.
    Megatron's common.pt, read here, records what it skips in `megatron`."""
    budget = _Budget()
    with ThreadPoolExecutor(8, thread_name_prefix="omnickpt-dcp") as pool:
        windows = _Windows(storage, pool)
        windows.prefetch(_windows_wanted(parsed))
        located: dict[str, list[tuple[_Chunk, int]]] = {
            fqn: [(c, _locate(windows, fqn, t, c, storage.describe) if c.item is not None else -1) for c in t.chunks]
            for fqn, t in parsed.tensors.items()}
        values = {fqn: _decode_value(fqn, bytes(windows.read(it.path, it.offset, it.offset + it.length)),
                                     storage.describe(it.path), budget)
                  for fqn, it in parsed.values.items()}
        if as_saved:
            tensors, objects = _as_saved_entries(_paths(parsed), parsed, located, values, index, storage.describe(""))
        elif megatron is not None:
            tensors, objects = _megatron_entries(parsed, located, values, index, storage.describe(""))
            objects.update(_megatron_common(storage, megatron, budget))
        else:
            tensors, objects = _entries(_paths(parsed), parsed, located, values, index, windows, storage.describe(""),
                                        budget)
    return tensors, objects


def _windows_wanted(parsed: _Parsed) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges to read up front, by file: every value whole, and each tensor chunk's head and tail
    (its archive's headers and data.pkl, and its central directory)."""
    wanted: dict[str, list[tuple[int, int]]] = {}
    for item in parsed.values.values():
        wanted.setdefault(item.path, []).append((item.offset, item.offset + item.length))
    for t in parsed.tensors.values():
        for it in (c.item for c in t.chunks if c.item is not None):
            head, tail = min(it.length, _WINDOW), max(0, it.length - _WINDOW)
            wanted.setdefault(it.path, []).extend([(it.offset, it.offset + head),
                                                   (it.offset + tail, it.offset + it.length)])
    return wanted


def _implied_keys(parsed: _Parsed, megatron: dict | None, tensors: dict[str, TensorEntry],
                  objects: dict[str, Any]) -> list[str]:
    """State keys the checkpoint does not hold but this reader chose (like "model" for a Hugging Face
    folder), so that the api may bind them to the state's own keys."""
    if megatron is not None:
        return sorted({n.split("/", 1)[0] for n in [*tensors, *objects]} & {"model", "optimizer"})
    if "model" not in _top_keys(parsed) and any(n.startswith("model/") for n in tensors):
        return ["model"]
    return []


def _check_value_bytes(parsed: _Parsed, storage: Storage) -> None:
    """Refuse, before reading them, non-tensor values whose stored bytes (read into memory with the metadata)
    exceed MAX_INLINE_BYTES in all."""
    stored = sum(it.length for it in parsed.values.values())
    if stored > MAX_INLINE_BYTES:
        fqn, it = max(parsed.values.items(), key=lambda kv: kv[1].length)
        raise UnsupportedError(
            f"{storage.describe()}: the checkpoint's non-tensor values take {stored} bytes (the largest, {fqn!r}, "
            f"{it.length} bytes in {storage.describe(it.path)}), which omnickpt reads into memory with the metadata; "
            f"more than {MAX_INLINE_BYTES >> 20} MiB is refused: load this checkpoint with dcp.load (and save it "
            "with omnickpt, the large tensors as tensors of their own)")


def _files(storage: Storage, parsed: _Parsed) -> tuple[list[FileEntry], dict[str, int]]:
    """The data files the metadata names, with their sizes (one query each); a file that is missing or
    shorter than an item in it fails here, naming what lies past its end."""
    ends: dict[str, list[tuple[int, str]]] = {}
    for fqn, it in parsed.values.items():
        ends.setdefault(it.path, []).append((it.offset + it.length, f"value {fqn!r}"))
    for fqn, t in parsed.tensors.items():
        for c in t.chunks:
            if c.item is not None:
                ends.setdefault(c.item.path, []).append((c.item.offset + c.item.length,
                                                         f"tensor {fqn!r} chunk at offsets {list(c.offsets)}"))
    files, index = [], {}
    for path in sorted(ends):
        size = storage.size(path)
        require_length(storage, path, size, ends[path], "DCP metadata")
        m = _DISTCP_FILE.fullmatch(path.rsplit("/", 1)[-1])
        index[path] = len(files)
        files.append(FileEntry(path, int(m.group(1)) if m else 0, size))
    return files, index


def _inline(value: Any, key: str) -> ObjectEntry:
    data = encode_object(value, where=key)
    return ObjectEntry(ranks=[0], file=-1, offset=0, nbytes=len(data), checksum=0, inline=data)


def _megatron_info(storage: Storage) -> dict | None:
    """Megatron-core's metadata.json beside a torch_dist save, or None when there is none."""
    try:
        doc = json.loads(storage.read_bytes(MEGATRON_METADATA))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):
        return None     # not Megatron's file: the folder reads as plain DCP
    if not isinstance(doc, dict) or doc.get("sharded_backend") != "torch_dist":
        return None
    return {k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _megatron_common(storage: Storage, info: dict, budget: _Budget) -> dict[str, Any]:
    """The top-level entries of Megatron's common.pt (its non-sharded state: an optimizer's param groups and
    step, the iteration, ...), each one object, read with torch's weights-only unpickler (argparse.Namespace
    admitted, read as a dict) after `_unzip_bounded` (a damaged or inflating archive is CorruptCheckpointError).
    What cannot be read without running code, or encoded, is left out and named in `info["skipped"]`; so is
    a common.pt larger than MAX_INLINE_BYTES (it is not read)."""
    import argparse
    if not storage.exists(MEGATRON_COMMON):
        return {}
    size = storage.size(MEGATRON_COMMON)
    if size > MAX_INLINE_BYTES:
        info["skipped"] = {MEGATRON_COMMON: f"{size} bytes, more than the {MAX_INLINE_BYTES >> 20} MiB omnickpt reads "
                                            "with the metadata; not read"}
        return {}
    archive = _unzip_bounded(storage.read_bytes(MEGATRON_COMMON), storage.describe(MEGATRON_COMMON),
                             "Megatron's non-sharded state", budget)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(archive, weights_only=True, map_location="cpu")
    except Exception as e:
        info["skipped"] = {MEGATRON_COMMON: f"not readable without running code ({type(e).__name__}: "
                                            f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"}
        return {}
    if not isinstance(common, dict):
        return {}
    out = {}
    for key, value in common.items():
        value = _namespaces_as_dicts(value)
        try:
            encode_object(value, where=str(key))
        except CheckpointError as e:
            info.setdefault("skipped", {})[str(key)] = str(e)[:200]
            continue
        if isinstance(key, str) and key and "/" not in key:
            out[key] = value
    return out


def _namespaces_as_dicts(value: Any, depth: int = 0) -> Any:
    import argparse
    if depth > 32:
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: _namespaces_as_dicts(v, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_namespaces_as_dicts(v, depth + 1) for v in value)
    return value


__all__ = ["read_manifest"]
