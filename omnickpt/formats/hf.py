"""Hugging Face safetensors folders: read one as our manifest (so it loads into any parallel layout)
and write one from any checkpoint omnickpt reads (`export_hf`).

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

import dataclasses
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, MismatchError, UnsupportedError
from omnickpt.format import FileEntry, Manifest, SavedBox, TensorEntry, dtype_from_name, dtype_name
from omnickpt.format.cast import CastLosses
from omnickpt.format.manifest import safe_relative_path
from omnickpt.formats.export import FULL_DISK_HINT, byte_progress, local_dir, make_destination, remove_written
from omnickpt.storage import Storage
from omnickpt.storage.base import os_failure

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
# export_hf's `key` for tensors saved at the top level of the state (names with no "/": `Rename`d ones, say).
TOP_LEVEL = ""

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


# ---------------------------------------------------------------------- export
def export_hf(src: str, dst: str, *, key: str | None = None, dtype: torch.dtype | None = None,
              max_shard_size: int = 5 * 10**9, transforms: Sequence[Any] = (), workers: int = 4,
              progress: bool = True, durable: bool = True, losses: CastLosses | None = None) -> dict:
    """Write the module saved under `key` in the checkpoint at `src` as a Hugging Face folder at `dst`.
    With `durable` (the default) every file is fsynced before this returns; durable=False leaves
    that to the OS (an export for a quick evaluation, as DCP's consolidated files are written).

    `src` is anything omnickpt reads (an omnickpt checkpoint of any world size and layout, a Hugging
    Face folder, a DCP checkpoint); `transforms` rewrite its manifest first (e.g. Megatron names to
    Hugging Face ones). `key` defaults to the only state entry holding a model's tensors (not an optimizer's,
    not a plain value's; TOP_LEVEL, "", for tensors saved at the top level of the state), else "model". An
    optimizer's state is never exported as a model: asked for by `key` or the only entry with tensors, it is
    refused (UnsupportedError naming it and the model entries there are). The tensors under `key/` are written
    under the rest of their names (the module's own parameter names) to `model.safetensors`, or, past
    `max_shard_size` bytes, to `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`, with
    `__metadata__ = {"format": "pt"}`. `dtype` casts floating-point tensors (integer and bool ones keep
    theirs); with `losses` (format/cast.py) every cast goes through it: one that turns finite values into inf
    or non-zero values into 0 fails the export (UnsupportedError naming the tensor) unless `losses` allows it,
    and then is counted in `losses.counts`. config.json is written from the checkpoint's
    `layout["metadata"]["config"]` when present (with its dtype updated on a cast). When that config ties the
    word embeddings and `lm_head.weight` holds the same values as another tensor (same stored bytes, or equal
    chunk checksums), or two names point at the same stored bytes, the duplicate is written once, as
    `save_pretrained` does.

    Streams: each tensor is read whole (from all its boxes, verified against the checkpoint's
    checksums where it has them), cast, and written at its offset, on `workers` threads; tensors in
    flight are bounded to about the largest one, so memory stays a few times the largest tensor (its
    landing buffer and its copy, and what the allocator keeps), whatever the model's size. `dst` must
    be a local folder holding no safetensors files yet. Returns {"path", "key", "entry": what was exported in
    words ("state entry 'model' (fsdp2)"), "files", "tensors", "bytes", "seconds", "dropped": {name: the name
    it duplicates}, "config": bool}. A failed export removes the files it wrote (and `dst` when it made it); a
    write that fails (a full disk, a read-only file system) raises StorageError naming the file.
    """
    # Export is an api-level flow over any checkpoint; read_manifest gives the errors for folders
    # holding none (imported here: api imports the readers of this package).
    from omnickpt.formats import read_manifest as read_any
    from omnickpt.storage import storage_for
    from omnickpt.storage.linked import with_siblings

    t0 = time.perf_counter()
    if dtype is not None and not dtype.is_floating_point:
        raise UnsupportedError(f"export dtype {dtype} is not a floating-point dtype; pass e.g. torch.bfloat16")
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    out_dir = local_dir(str(dst))
    storage = storage_for(str(src))
    if os.path.isdir(out_dir) and os.path.realpath(out_dir) == os.path.realpath(storage.root):
        raise UnsupportedError(f"export destination {dst} is the source checkpoint itself; pass another folder")
    manifest = read_any(storage)
    storage = with_siblings(storage, str(src), manifest.files)   # an incremental checkpoint's referenced files
    for transform in transforms:
        manifest = transform.apply(manifest)
    key = _module_key(manifest, key, storage.describe())
    exported = _describe_entry(manifest, key)
    log.info("omnickpt: exporting %s of %s to %s", exported, src, dst)
    entries = {n: (full, manifest.tensors[full]) for n, full in _entry_tensors(manifest, key).items()}
    config = (manifest.layout.get("metadata") or {}).get("config")
    config = dict(config) if isinstance(config, dict) else None
    dropped = _tied_duplicates({n: t for n, (_, t) in entries.items()}, config)
    names = [n for n in entries if n not in dropped]

    # What each tensor becomes in the output: its name, stored dtype, written dtype, shape.
    out: list[tuple[str, str, torch.dtype, torch.dtype, tuple[int, ...]]] = []
    for name in names:
        full, entry = entries[name]
        stored = dtype_from_name(entry.dtype)
        written = dtype if dtype is not None and stored.is_floating_point else stored
        if written not in _NAMES:
            raise UnsupportedError(f"tensor {full!r} has dtype {entry.dtype}, which safetensors cannot store; "
                                   "drop it with a transform (omnickpt.transforms.Drop) or pass dtype=")
        out.append((name, full, stored, written, entry.shape))
    # Plan every read before writing anything: a tensor the checkpoint does not fully hold fails now.
    from omnickpt.engine.load import check_file_sizes
    from omnickpt.layout import Box
    from omnickpt.planner import plan_reads
    items = plan_reads(manifest, [(full, Box.full(shape)) for _, full, _, _, shape in out])
    check_file_sizes(storage, manifest, items, [])
    # Each tensor is read on its own, into a destination list of one.
    by_tensor: list[list] = [[] for _ in out]
    for it in items:
        by_tensor[it.dest].append(dataclasses.replace(it, dest=0))

    shards = _shard_plan([(name, math.prod(shape) * w.itemsize) for name, _, _, w, shape in out], max_shard_size)
    layouts = [_file_layout([out[i] for i in shard]) for shard in shards]
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    _check_destination(out_dir)
    created = make_destination(out_dir)
    total = sum(math.prod(o[4]) * o[3].itemsize for o in out)
    written_paths: list[str] = []
    fds: list[int] = []
    try:
        try:
            for fname, (header, data_size, _) in zip(files, layouts):
                path = os.path.join(out_dir, fname)
                fd = _os_call("creating", path, os.open, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o644)
                fds.append(fd)
                written_paths.append(path)
                _os_call("sizing", path, os.ftruncate, fd, len(header) + data_size)
                _pwrite_all(fd, memoryview(header), 0, path)
            tasks = [(fds[k], os.path.join(out_dir, files[k]), len(header) + offset, shards[k][local])
                     for k, (header, _, offsets) in enumerate(layouts) for local, offset in offsets.items()]
            _write_tensors(storage, manifest, out, by_tensor, tasks, workers, progress, total, losses)
            for fd, path in zip(fds, written_paths) if durable else ():
                _os_call("syncing", path, os.fsync, fd)
        finally:
            for fd in fds:
                os.close(fd)
        if len(files) > 1:
            index = {"metadata": {"total_size": total, "total_parameters": sum(math.prod(o[4]) for o in out)},
                     "weight_map": {out[i][0]: files[k] for k, shard in enumerate(shards) for i in shard}}
            written_paths.append(_write_json(out_dir, INDEX_FILE, index, durable))
        if config is not None:
            if dtype is not None:   # transformers 5 reads "dtype", older versions "torch_dtype"
                config["dtype"] = str(dtype).removeprefix("torch.")
                if "torch_dtype" in config:
                    config["torch_dtype"] = config["dtype"]
            written_paths.append(_write_json(out_dir, CONFIG_FILE, config, durable))
    except BaseException:
        remove_written(written_paths, out_dir if created else None)
        raise
    return {"path": out_dir, "key": key, "entry": exported, "files": files, "tensors": len(out), "bytes": total,
            "seconds": time.perf_counter() - t0, "dropped": dropped, "config": config is not None}


def _os_call(op: str, path: str, fn, *args):
    """`fn(*args)`, an OSError as the StorageError that names `path` and says what to do."""
    try:
        return fn(*args)
    except OSError as e:
        raise os_failure(f"{op} the Hugging Face export file", path, e, device=path, hint=FULL_DISK_HINT) from e


def _check_destination(out_dir: str) -> None:
    """Refuse a folder that already holds a model: stale shards next to new ones would be read as one."""
    if not os.path.isdir(out_dir):
        return
    there = [n for n in sorted(os.listdir(out_dir)) if n.endswith((".safetensors", INDEX_SUFFIX))]
    if there:
        raise CheckpointError(f"export destination {out_dir} already holds {', '.join(there[:3])}"
                              + (f" and {len(there) - 3} more" if len(there) > 3 else "")
                              + "; remove them or pass an empty folder")


def _module_key(manifest: Manifest, key: str | None, where: str) -> str:
    """The state entry whose tensors export_hf writes: `key` when given, else the only entry holding a model's
    tensors, else "model" (TOP_LEVEL for tensors saved at the top level of the state). An entry holding an
    optimizer's state is refused either way (UnsupportedError): its moments are no model's weights, and
    writing them under the parameters' names makes a folder that loads without complaint."""
    from omnickpt.adapters.generic import parse_per_rank_name   # export is an api-level flow
    by_key: dict[str, list[str]] = {}
    for name in manifest.tensors:
        top, sep, _ = name.partition("/")
        by_key.setdefault(top if sep else TOP_LEVEL, []).append(name)
    optimizers = {k: kind for k, names in by_key.items() if (kind := _optimizer_kind(manifest, k, names))}
    # Tensors of plain values saved per rank ("extra/buf/@rank0"): no module's either.
    values = sorted(k for k, names in by_key.items()
                    if k not in optimizers and all(parse_per_rank_name(n) is not None for n in names))
    modules = [k for k in sorted(by_key) if k not in optimizers and k not in values]
    shown = ", ".join(_entry_label(k) for k in sorted(by_key)) or "none"
    if key is not None:
        if key not in by_key:
            raise MismatchError(f"{where} holds no tensors under {key!r} (state entries with tensors: {shown}); "
                                "pass key= one of them", [f"{key}: missing"])
        if key in optimizers:
            raise UnsupportedError(
                f"{where}: {_entry_label(key)} holds an optimizer's state ({optimizers[key]}; tensors such as "
                f"{by_key[key][0]!r}), not a model's weights, and a Hugging Face folder holds a model only: pass "
                f"key= the model's entry ({', '.join(map(_entry_label, modules)) or 'this checkpoint has none'}); "
                "to keep optimizer state, convert to omnickpt or dcp instead")
        return key
    if len(modules) == 1:
        return modules[0]
    if "model" in modules:
        return "model"
    if not modules and by_key:
        held = "; ".join([f"{_entry_label(k)} holds an optimizer's state ({kind})" for k, kind in optimizers.items()]
                         + [f"{_entry_label(k)} holds a plain value's tensors" for k in values])
        raise UnsupportedError(
            f"{where}: no state entry holds a model's weights to export ({held}); a Hugging Face folder holds a "
            "model only. Save the model under a key of its own (omnickpt.save(path, {'model': model, ...})) and "
            "export that, or pass key= to export a plain value's tensors on purpose")
    raise MismatchError(f"{where}: which state entry is the model is ambiguous (entries with tensors: "
                        f"{shown}); pass key=", [f"{k}: candidate" for k in modules])


def _optimizer_kind(manifest: Manifest, key: str, names: list[str]) -> str | None:
    """Why the tensors `names` under `key` are an optimizer's state, in words, or None when they are not."""
    framework = str((manifest.layout.get("frameworks") or {}).get(key) or "")
    if "." in framework:    # omnickpt's optimizer adapter records its class path, 'torch.optim.adam.Adam'
        return framework
    # How every reader names optimizer state (omnickpt's adapters, DCP's and Megatron's checkpoints):
    # "<key>/state/<parameter>/<exp_avg|exp_avg_sq|step|...>"; a module's tensor is "<key>/<fqn>".
    if key and all(n.startswith(f"{key}/state/") and n.count("/") >= 3 for n in names):
        return "tensors state/<parameter>/<moment>"
    return None


def _entry_label(key: str) -> str:
    return "the top-level tensors" if key == TOP_LEVEL else repr(key)


def _entry_tensors(manifest: Manifest, key: str) -> dict[str, str]:
    """{name in the exported folder: manifest tensor name} of the entry `key`."""
    if key == TOP_LEVEL:
        return {n: n for n in manifest.tensors if "/" not in n}
    prefix = f"{key}/"
    return {n[len(prefix):]: n for n in manifest.tensors if n.startswith(prefix)}


def _describe_entry(manifest: Manifest, key: str) -> str:
    """What export_hf writes, for its summary and log: "state entry 'model' (fsdp2)", "the top-level tensors"."""
    if key == TOP_LEVEL:
        return "the top-level tensors of the state"
    framework = (manifest.layout.get("frameworks") or {}).get(key)
    return f"state entry {key!r}" + (f" ({framework})" if framework else "")


def _tied_duplicates(tensors: dict[str, TensorEntry], config: dict | None) -> dict[str, str]:
    """{name to leave out: the name that holds the same values}, for tied parameters.

    Two names whose boxes are the very same stored bytes are one tensor. With a config that ties the
    word embeddings, `lm_head.weight` is also left out when another tensor has equal chunk checksums
    (omnickpt saves each name of a tied parameter separately): what save_pretrained leaves out.
    Equal values alone are not enough without the config (two LayerNorms initialised to ones are
    equal and are not tied)."""
    def where(t: TensorEntry) -> tuple:
        return (t.shape, t.dtype, tuple((b.offsets, b.lengths, b.file, b.offset, b.nbytes) for b in t.boxes))

    def sums(t: TensorEntry) -> tuple | None:
        if any(b.sums is None for b in t.boxes):
            return None
        return (t.shape, t.dtype, tuple((b.offsets, b.lengths, b.sums.size, b.sums.crcs) for b in t.boxes))

    dropped: dict[str, str] = {}
    # Output embeddings last, so that the name kept is the input embedding, as in Hugging Face's files.
    order = sorted(tensors, key=lambda n: n.endswith("lm_head.weight"))
    seen: dict[tuple, str] = {}
    for name in order:
        t = tensors[name]
        if not t.boxes or any(b.file < 0 for b in t.boxes):
            continue
        kept = seen.setdefault(where(t), name)
        if kept != name:
            dropped[name] = kept
    if config and config.get("tie_word_embeddings") and "lm_head.weight" in tensors and "lm_head.weight" not in dropped:
        head = sums(tensors["lm_head.weight"])
        if head is not None:
            for name, t in tensors.items():
                if name != "lm_head.weight" and name not in dropped and sums(t) == head:
                    dropped["lm_head.weight"] = name
                    break
    return dropped


def _shard_plan(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[int]]:
    """Indices of the tensors in each output file, in order: a new file starts when the next tensor
    would take the current one past `max_shard_size` (a larger tensor gets a file of its own), as
    huggingface_hub's split_torch_state_dict_into_shards does."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, nbytes) in enumerate(sizes):
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _file_layout(tensors: Sequence[tuple[str, str, torch.dtype, torch.dtype, tuple[int, ...]]]
                 ) -> tuple[bytes, int, dict[int, int]]:
    """(length + header bytes, padded to 8, data bytes, {position in `tensors`: offset in the data}). Tensors are
    laid out widest dtype first, as safetensors does, so each starts aligned to its item size."""
    positions = sorted(range(len(tensors)), key=lambda i: (-tensors[i][3].itemsize, tensors[i][0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[int, int] = {}
    pos = 0
    for i in positions:
        name, _, _, written, shape = tensors[i]
        nbytes = math.prod(shape) * written.itemsize
        header[name] = {"dtype": _NAMES[written], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets[i] = pos
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, pos, offsets


def _write_tensors(storage: Storage, manifest: Manifest, out, by_tensor, tasks, workers: int, progress: bool,
                   total: int, losses: CastLosses | None = None) -> None:
    """Read, cast (through `losses` when given) and pwrite every tensor; at most about the largest tensor's
    bytes are in flight. The first failure cancels the tensors not yet started and is raised."""
    from omnickpt.engine.load import read_tensors
    from omnickpt.layout import Box
    from omnickpt.monitor import PhaseTimer

    sizes = {i: math.prod(out[i][4]) * out[i][2].itemsize for _, _, _, i in tasks}
    budget = max(max(sizes.values(), default=0), 64 << 20)
    gate = threading.Condition()
    in_flight = [0]
    bar = byte_progress(total, progress)

    def one(fd: int, path: str, at: int, i: int) -> None:
        name, full, stored, written, shape = out[i]
        with gate:   # admit a tensor once the ones in flight leave room for it (one always fits)
            gate.wait_for(lambda: in_flight[0] == 0 or in_flight[0] + sizes[i] <= budget)
            in_flight[0] += sizes[i]
        try:
            t = torch.empty(shape, dtype=stored)
            if by_tensor[i]:
                read_tensors(storage, manifest, by_tensor[i], [Box.full(shape)], [t], io, verify=True,
                             timer=PhaseTimer())
            if written != stored:
                # checked here, in the one read the export makes, not by a second pass over the source
                t = losses.cast(t, written, full) if losses is not None else t.to(written)
            if t.numel():
                _pwrite_all(fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()), at, path)
            del t
            if bar is not None:
                bar.update(math.prod(shape) * written.itemsize)
        finally:
            with gate:
                in_flight[0] -= sizes[i]
                gate.notify_all()

    # Largest first: the long reads start early and the small ones fill in around them.
    tasks = sorted(tasks, key=lambda t: -sizes[t[3]])
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="omnickpt-export-io") as io, \
            ThreadPoolExecutor(max(1, workers), thread_name_prefix="omnickpt-export") as pool:
        futures = [pool.submit(one, *task) for task in tasks]
        try:
            for f in futures:
                f.result()
        except BaseException:
            # a refused cast or a full disk fails the export: the tensors after it would only be removed again
            for f in futures:
                f.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()


def _pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    from omnickpt.storage.base import os_failure
    data = data.cast("B") if data.format != "B" else data
    try:
        while len(data):
            n = os.pwrite(fd, data[:1 << 30], offset)
            data, offset = data[n:], offset + n
    except OSError as e:
        raise os_failure("writing", path, e, needed=len(data), device=path, hint=FULL_DISK_HINT) from e


def _write_json(out_dir: str, name: str, doc: dict, durable: bool = True) -> str:
    path = os.path.join(out_dir, name)
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=name == INDEX_FILE)
            f.write("\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException as e:
        if os.path.exists(path):
            os.unlink(path)
        if isinstance(e, OSError):
            raise os_failure("writing the Hugging Face export file", path, e, device=path, hint=FULL_DISK_HINT) from e
        raise
    return path


__all__ = ["export_hf", "read_manifest"]
