"""Writing a Hugging Face safetensors folder from any checkpoint omnickpt reads (`export_hf`): the source is
read through a CheckpointReader, tensor by tensor, and each tensor written at its offset in its file; the
folder's format (headers, index, config.json) is omnickpt.formats.hf's. With a `mapping` (a model's own
state-dict adapter: export/mapping.py, docs/hf_mapping.md) it is read group by group (a layer's tensors) and
what the mapping makes of each group is written instead."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from omnickpt.adapters.generic import parse_per_rank_name
from omnickpt.adapters.module import canonical_names
from omnickpt.errors import MismatchError, UnsafeCheckpointError, UnsupportedError
from omnickpt.export.destination import FULL_DISK_HINT, Destination, byte_progress
from omnickpt.export.sidecars import copy_sidecars, folder_config
from omnickpt.export.mapping import (GroupFn, GroupPlan, GroupSource, MappingFn, group_names, layer_group,
                                     plan_groups, run_bounded, write_groups)
from omnickpt.format import Manifest, TensorEntry, dtype_from_name
from omnickpt.format.cast import CastLosses
from omnickpt.format.objects import ShardRef
from omnickpt.formats.hf import _NAMES, CONFIG_FILE, INDEX_FILE, INDEX_SUFFIX, SINGLE_FILE
from omnickpt.layout import Box
from omnickpt.planner import plan_reads
from omnickpt.reader import CheckpointReader
from omnickpt.storage.base import os_failure

log = logging.getLogger("omnickpt")

# export_hf's `key` for tensors saved at the top level of the state (names with no "/": `Rename`d ones, say).
TOP_LEVEL = ""


def export_hf(src: str, dst: str, *, key: str | None = None, dtype: torch.dtype | None = None,
              max_shard_size: int = 5 * 10**9, transforms: Sequence[Any] = (), workers: int = 4,
              progress: bool = True, durable: bool = True, losses: CastLosses | None = None,
              mapping: MappingFn | None = None, group: GroupFn | None = None) -> dict:
    """Write the module saved under `key` in the checkpoint at `src` as a Hugging Face folder at `dst`.
    With `durable` (the default) every file is fsynced before this returns; durable=False leaves
    that to the OS (an export for a quick evaluation, as DCP's consolidated files are written).

    `src` is anything omnickpt reads (an omnickpt checkpoint of any world size and layout, a Hugging
    Face folder, a DCP checkpoint); `transforms` rewrite its manifest first (e.g. Megatron names to
    Hugging Face ones). `key` defaults to the only state entry holding a model's tensors (not an optimizer's,
    not a plain value's), else "model"; TOP_LEVEL, "", is the tensors saved at the top level of the state (a
    flat model: `omnickpt.save(path, {"layer.weight": t, ...})`, whether its tensors are stored as boxes,
    per rank, or, small ones, inside their objects). An optimizer's state (its adapter's class path, tensors
    "state/<param>/<moment>", or a saved value holding param_groups, as a flattened optimizer state dict
    does) is never exported as a model: asked for by `key` it is refused (UnsupportedError naming it and the
    model entries there are), and it is never chosen by default. The tensors under `key/` are written
    under the rest of their names (the module's own parameter names) to `model.safetensors`, or, past
    `max_shard_size` bytes, to `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`, with
    `__metadata__ = {"format": "pt"}`. `dtype` casts floating-point tensors (integer and bool ones keep
    theirs); with `losses` (format/cast.py) every cast goes through it: one that turns finite values into inf
    or non-zero values into 0 fails the export (UnsupportedError naming the tensor) unless `losses` allows it,
    and then is counted in `losses.counts`. config.json is written from the checkpoint's
    `layout["metadata"]["config"]` when present, else from the config.json beside the checkpoint in a local source
    folder (an HF Trainer's checkpoint-N; with its dtype updated on a cast; its "architectures" from the
    metadata's "model_class" when the config has none, else left out, never null). When that config ties the
    word embeddings and `lm_head.weight` holds the same values as another tensor (same stored bytes, or equal
    chunk checksums), or two names point at the same stored bytes, the duplicate is written once, as
    `save_pretrained` does. The source folder's generation_config.json and tokenizer files (export/sidecars.py)
    are copied beside the weights ("copied" in the result).

    Streams: each tensor is read whole through a CheckpointReader (from all its boxes, verified against
    the checkpoint's checksums where it has them), cast, and written at its offset, on `workers` threads; tensors in
    flight are bounded to about the largest one, so memory stays a few times the largest tensor (its
    landing buffer and its copy, and what the allocator keeps), whatever the model's size. `dst` must
    be a local folder holding no safetensors files yet. Returns {"path", "key", "entry": what was exported in
    words ("state entry 'model' (fsdp2)"), "files", "tensors", "bytes", "seconds", "dropped": {name: the name
    it duplicates}, "config": bool}. A failed export removes the files it wrote (and `dst` when it made it); a
    write that fails (a full disk, a read-only file system) raises StorageError naming the file.

    `mapping` (docs/hf_mapping.md), a function {name: tensor} -> {Hugging Face name: tensor} such as torchtitan's
    `StateDictAdapter.to_hf`, makes the folder's tensors instead of the names alone: it may rename, permute, split
    or fuse. It is called on one group of the entry's tensors at a time (names as under `key/`, after
    `transforms`), never the whole model: `group(name)` gives a tensor's group key, by default
    omnickpt.export.mapping.layer_group (the name up to and including its first integer segment, "layers.3.";
    the tensors with no integer segment form one group). It must return tensors only (UnsupportedError), no name
    that another group returned (MismatchError naming both groups), and the same names, shapes and dtypes for a
    group's meta tensors as for its values: it is called on meta tensors first, to lay the files out before
    writing (a mapping that fails on them is called on the values, the group then being read twice), and from
    one thread at a time. With a mapping nothing is dropped as a tied duplicate (the mapping decides: torchtitan's
    adapters leave out a tied lm_head), `dtype` casts what it returns, and memory holds at most twice the largest
    group (with what the mapping returns) or 256 MiB.
    """
    t0 = time.perf_counter()
    _check_export_options(dtype, max_shard_size)
    dest = Destination(src, dst)
    with CheckpointReader(str(src), transforms=transforms, workers=workers) as reader:
        manifest = reader.manifest
        entries_found = _entries(manifest, _plain_values(reader))
        key = _module_key(entries_found, key, reader.location)
        exported = _describe_entry(manifest, key)
        log.info("omnickpt: exporting %s of %s to %s", exported, reader.location, dst)
        chosen = _entry_tensors(entries_found, key)
        inline = {n: v for n, v in chosen.items() if isinstance(v, torch.Tensor)}
        entries = {n: (full, manifest.tensors[full]) for n, full in chosen.items() if n not in inline}
        # the checkpoint's recorded config, else the one saved beside it (an HF Trainer checkpoint folder)
        config = _saved_config(manifest) or folder_config(src)
        if mapping is None:
            dropped = _tied_duplicates({n: t for n, (_, t) in entries.items()}, config)
            out = _outputs({n: e for n, e in entries.items() if n not in dropped}, dtype, inline)
            # Plan every read before writing anything: a tensor the checkpoint does not fully hold fails now.
            plan_reads(manifest, [(full, Box.full(shape)) for name, full, _, _, shape in out if name not in inline])

            def fill(tasks):
                _write_tensors(reader, out, tasks, workers, progress, total, losses, inline)
        else:
            dropped = {}
            plan_reads(manifest, [(full, Box.full(t.shape)) for full, t in entries.values()])
            source = GroupSource(reader, entries, inline)
            plans = plan_groups(group_names(list(chosen), group or layer_group), mapping, source.meta, source.read)
            out = _mapped_outputs(plans, dtype)

            def fill(tasks):
                _write_mapped(source, mapping, plans, out, tasks, workers, progress, total, losses)
        shards = _shard_plan([(name, math.prod(shape) * w.itemsize) for name, _, _, w, shape in out], max_shard_size)
        files = _shard_files(len(shards))
        # Only a model's files clash: a folder may hold a tokenizer beside the weights.
        dest.refuse_occupied(lambda n: n.endswith((".safetensors", INDEX_SUFFIX)),
                             why="stale shards beside new ones would be read as one model")
        total = sum(math.prod(o[4]) * o[3].itemsize for o in out)
        with dest:
            _write_model(dest, files, shards, out, durable, fill)
            if len(files) > 1:
                _write_index(dest, files, shards, out, total, durable)
            if config is not None:
                _write_config(dest, config, dtype, durable)
            sidecars = copy_sidecars(src, dest, durable)
    return {"path": dest.path, "key": key, "entry": exported, "files": files, "tensors": len(out), "bytes": total,
            "seconds": time.perf_counter() - t0, "dropped": dropped, "config": config is not None,
            "copied": sidecars}


def _check_export_options(dtype: torch.dtype | None, max_shard_size: int) -> None:
    """export_hf's refusals of its options, made before it opens the source."""
    if dtype is not None and not dtype.is_floating_point:
        raise UnsupportedError(f"export dtype {dtype} is not a floating-point dtype; pass e.g. torch.bfloat16")
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")


def _saved_config(manifest: Manifest) -> dict | None:
    """A copy of the model config the checkpoint holds (layout["metadata"]["config"]), None when it holds none:
    a copy, because the export updates its dtype. Its "architectures" are kept when the config has them;
    a config without them (`model.config.to_dict()` of a model built with from_config has
    "architectures": None, which some readers of config.json choke on) takes them from the metadata's
    "architectures" (a list of class names) or "model_class" (a class name, "LlamaForCausalLM", or its dotted
    path) when the save recorded one, and otherwise leaves the key out."""
    metadata = manifest.layout.get("metadata") or {}
    config = metadata.get("config") if isinstance(metadata, dict) else None
    if not isinstance(config, dict):
        return None
    config = dict(config)
    if not config.get("architectures"):
        config.pop("architectures", None)
        known = _recorded_architectures(metadata)
        if known:
            config["architectures"] = known
    return config


def _recorded_architectures(metadata: dict) -> list[str] | None:
    """The model class names the save's metadata records beside its config, None when it records none."""
    names = metadata.get("architectures")
    if isinstance(names, list) and names and all(isinstance(n, str) and n for n in names):
        return list(names)
    cls = metadata.get("model_class")
    if isinstance(cls, str) and cls.strip():
        return [cls.strip().rsplit(".", 1)[-1]]
    return None


def _shard_files(count: int) -> list[str]:
    """The safetensors file names of an export in `count` files, as save_pretrained names them."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def _write_index(dest: Destination, files: list[str], shards: list[list[int]], out, total: int,
                 durable: bool) -> None:
    """Write model.safetensors.index.json: which file holds each tensor, for an export in several files."""
    index = {"metadata": {"total_size": total, "total_parameters": sum(math.prod(o[4]) for o in out)},
             "weight_map": {out[i][0]: files[k] for k, shard in enumerate(shards) for i in shard}}
    _write_json(dest, INDEX_FILE, index, durable)


def _write_config(dest: Destination, config: dict, dtype: torch.dtype | None, durable: bool) -> None:
    """Write config.json, its dtype updated when the export casts."""
    if dtype is not None:   # transformers 5 reads "dtype", older versions "torch_dtype"
        config["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
    _write_json(dest, CONFIG_FILE, config, durable)


def _outputs(entries: dict[str, tuple[str, TensorEntry]], dtype: torch.dtype | None,
             inline: dict[str, torch.Tensor] | None = None
             ) -> list[tuple[str, str, torch.dtype, torch.dtype, tuple[int, ...]]]:
    """What each tensor becomes in the output: (its name there, its manifest name (for a small plain value held
    in its object, `inline`, the object's key), stored dtype, written dtype, shape). UnsupportedError for a
    dtype safetensors cannot store."""
    found = [(name, full, dtype_from_name(entry.dtype), entry.shape) for name, (full, entry) in entries.items()]
    found += [(name, name, t.dtype, tuple(t.shape)) for name, t in (inline or {}).items()]
    out = []
    for name, full, stored, shape in found:
        written = dtype if dtype is not None and stored.is_floating_point else stored
        if written not in _NAMES:
            raise UnsupportedError(f"tensor {full!r} has dtype {str(stored).removeprefix('torch.')}, which "
                                   "safetensors cannot store; drop it with a transform (omnickpt.transforms.Drop) "
                                   "or pass dtype=")
        out.append((name, full, stored, written, tuple(shape)))
    return out


def _write_model(dest: Destination, files: list[str], shards: list[list[int]], out, durable: bool,
                 fill: Callable[[list[tuple[int, str, int, int]]], None]) -> None:
    """Create each safetensors file at its full size with its header, then have `fill` write every tensor at its
    offset: fill([(fd, path, offset in the file, index in `out`)])."""
    layouts = [_file_layout([out[i] for i in shard]) for shard in shards]
    fds: list[int] = []
    try:
        for fname, (header, data_size, _) in zip(files, layouts):
            path = dest.file(fname)
            fd = _os_call("creating", path, os.open, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fds.append(fd)
            dest.wrote(path)
            _os_call("sizing", path, os.ftruncate, fd, len(header) + data_size)
            _pwrite_all(fd, memoryview(header), 0, path)
        tasks = [(fds[k], dest.file(files[k]), len(header) + offset, shards[k][local])
                 for k, (header, _, offsets) in enumerate(layouts) for local, offset in offsets.items()]
        fill(tasks)
        for fd, fname in zip(fds, files) if durable else ():
            _os_call("syncing", dest.file(fname), os.fsync, fd)
    finally:
        for fd in fds:
            os.close(fd)


def _os_call(op: str, path: str, fn, *args):
    """`fn(*args)`, an OSError as the StorageError that names `path` and says what to do."""
    try:
        return fn(*args)
    except OSError as e:
        raise os_failure(f"{op} the Hugging Face export file", path, e, device=path, hint=FULL_DISK_HINT) from e


@dataclass(frozen=True)
class _Entries:
    """The state entries of a checkpoint that hold tensors, by what they hold: export_hf's candidates for `key`."""
    by_key: dict[str, list[str]]   # entry: its tensor names (TOP_LEVEL: the tensors saved at the top level)
    optimizers: dict[str, str]     # entry holding an optimizer's state: why, in words
    values: list[str]              # entries holding plain values' tensors, saved per rank
    modules: list[str]             # the rest: a model's
    # TOP_LEVEL's tensors saved as plain values ({"w": t} beside the others): {key: the stored tensor's name
    # (a large one, saved per rank), or the tensor itself (a small one, inside its object)}
    plain: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def shown(self) -> str:
        """Every entry with tensors, for an error message."""
        return ", ".join(_entry_label(k) for k in sorted(self.by_key)) or "none"


def _plain_values(reader: CheckpointReader) -> dict[str, Any]:
    """The decoded values of the checkpoint's top-level objects that are a tensor or hold an optimizer's
    param groups ({key: tensor, ShardRef, or the dict}): tensors saved as plain values at the top level of the
    state (omnickpt.save(path, {"layer.weight": t, ...}) stores a small one inside its object, a large one as
    a tensor of its own that the object refers to), and what says an entry is an optimizer's. A value saved
    with pickle is never unpickled here: it is left out."""
    out: dict[str, Any] = {}
    for key in reader.object_keys():
        if "/" in key:
            continue   # a per-object key ("<state key>/<unique key>"): part of an entry, never one
        try:
            value = reader.objects([key])[key]
        except UnsafeCheckpointError:
            continue
        if isinstance(value, (torch.Tensor, ShardRef)) or _holds_param_groups(value):
            out[key] = value
    return out


def _holds_param_groups(value: Any) -> bool:
    """An optimizer's state dict: nested ({"state", "param_groups"}) or flattened by DCP's
    flatten_optimizer_state_dict (torchtitan's OptimizersContainer: "param_groups.<fqn>.lr", ...)."""
    return isinstance(value, dict) and any(isinstance(k, str) and (k == "param_groups" or k.startswith("param_groups."))
                                           for k in value)


def _module_key(entries: _Entries, key: str | None, where: str) -> str:
    """The state entry whose tensors export_hf writes: `key` when given, else the only entry holding a model's
    tensors, else "model" (TOP_LEVEL for tensors saved at the top level of the state). An entry holding an
    optimizer's state is refused either way (UnsupportedError): its moments are no model's weights, and
    writing them under the parameters' names makes a folder that loads without complaint."""
    if key is not None:
        _check_chosen_key(entries, key, where)
        return key
    return _inferred_key(entries, where)


def _entries(manifest: Manifest, values: dict[str, Any]) -> _Entries:
    """The manifest's state entries with tensors, sorted into optimizers', plain values' and modules'; `values`
    are _plain_values' (top-level tensors saved as plain values join TOP_LEVEL)."""
    plain = {k: (v.name if isinstance(v, ShardRef) else v) for k, v in values.items()
             if isinstance(v, torch.Tensor) or isinstance(v, ShardRef) and v.name in manifest.tensors}
    referred = {v for v in plain.values() if isinstance(v, str)}
    by_key: dict[str, list[str]] = {}
    for name in manifest.tensors:
        if name in referred:
            continue   # listed under TOP_LEVEL by its value's key
        top, sep, _ = name.partition("/")
        by_key.setdefault(top if sep else TOP_LEVEL, []).append(name)
    if plain:
        by_key.setdefault(TOP_LEVEL, []).extend(plain)
    optimizers = {k: kind for k, names in by_key.items()
                  if (kind := _optimizer_kind(manifest, k, names, values.get(k) if k else None))}
    # Tensors of plain values saved per rank ("extra/buf/@rank0"): no module's either.
    values_keys = sorted(k for k, names in by_key.items()
                         if k not in optimizers and all(parse_per_rank_name(n) is not None for n in names))
    modules = [k for k in sorted(by_key) if k not in optimizers and k not in values_keys]
    return _Entries(by_key, optimizers, values_keys, modules, plain)


def _check_chosen_key(entries: _Entries, key: str, where: str) -> None:
    """MismatchError when the caller's `key` holds no tensors; UnsupportedError when it holds an optimizer's state."""
    if key not in entries.by_key:
        raise MismatchError(f"{where} holds no tensors under {key!r} (state entries with tensors: {entries.shown}); "
                            f"pass key= one of them{_TOP_LEVEL_HINT if TOP_LEVEL in entries.by_key else ''}",
                            [f"{key}: missing"])
    if key in entries.optimizers:
        raise UnsupportedError(
            f"{where}: {_entry_label(key)} holds an optimizer's state ({entries.optimizers[key]}; tensors such as "
            f"{entries.by_key[key][0]!r}), not a model's weights, and a Hugging Face folder holds a model only: pass "
            f"key= the model's entry ({', '.join(map(_entry_label, entries.modules)) or 'this checkpoint has none'}); "
            "to keep optimizer state, convert to omnickpt or dcp instead")


# How a caller names TOP_LEVEL, for messages: the library's key and the command line's spelling.
_TOP_LEVEL_HINT = " (the top-level tensors: key='', on the command line --key .)"


def _inferred_key(entries: _Entries, where: str) -> str:
    """The model's entry when the caller named none: the only one, else "model"; an error saying why not.
    Tensors saved as plain values at the top level (an RNG state beside {"net": model}) are the model only
    when no entry holds stored tensors of a model (a flat model saved as plain tensors)."""
    modules = entries.modules
    stored = [k for k in modules if k != TOP_LEVEL or any(n not in entries.plain for n in entries.by_key[k])]
    if len(stored) == 1:
        return stored[0]
    if "model" in stored:
        return "model"
    if modules == [TOP_LEVEL]:
        return TOP_LEVEL
    if not modules and entries.by_key:
        held = "; ".join([f"{_entry_label(k)} holds an optimizer's state ({kind})"
                          for k, kind in entries.optimizers.items()]
                         + [f"{_entry_label(k)} holds a plain value's tensors" for k in entries.values])
        raise UnsupportedError(
            f"{where}: no state entry holds a model's weights to export ({held}); a Hugging Face folder holds a "
            "model only. Save the model under a key of its own (omnickpt.save(path, {'model': model, ...})) and "
            "export that, or pass key= to export a plain value's tensors on purpose")
    raise MismatchError(f"{where}: which state entry is the model is ambiguous (entries with tensors: "
                        f"{entries.shown}); pass key={_TOP_LEVEL_HINT if TOP_LEVEL in modules else ''}",
                        [f"{_entry_label(k)}: candidate" for k in modules])


def _optimizer_kind(manifest: Manifest, key: str, names: list[str], value: Any = None) -> str | None:
    """Why the tensors `names` under `key` are an optimizer's state, in words, or None when they are not.
    `value` is the entry's decoded object, when it has one."""
    framework = str((manifest.layout.get("frameworks") or {}).get(key) or "")
    if "." in framework:    # omnickpt's optimizer adapter records its class path, 'torch.optim.adam.Adam'
        return framework
    # How every reader names optimizer state (omnickpt's adapters, DCP's and Megatron's checkpoints):
    # "<key>/state/<parameter>/<exp_avg|exp_avg_sq|step|...>"; a module's tensor is "<key>/<fqn>".
    if key and all(n.startswith(f"{key}/state/") and n.count("/") >= 3 for n in names):
        return "tensors state/<parameter>/<moment>"
    # An optimizer's state dict saved as a plain value (a flattened one, "state.<fqn>.exp_avg", as torchtitan's
    # OptimizersContainer gives it): its param groups say what it is.
    if key and _holds_param_groups(value):
        return "a state dict with param_groups"
    return None


def _entry_label(key: str) -> str:
    return "the top-level tensors" if key == TOP_LEVEL else repr(key)


def _entry_tensors(entries: _Entries, key: str) -> dict[str, Any]:
    """{name in the exported folder: manifest tensor name, or the tensor itself (a small plain value)} of the
    entry `key`."""
    if key == TOP_LEVEL:
        out: dict[str, Any] = {n: n for n in entries.by_key.get(TOP_LEVEL, ()) if n not in entries.plain}
        return out | entries.plain
    prefix = f"{key}/"
    names = [n[len(prefix):] for n in entries.by_key.get(key, ())]
    # A checkpoint written before names were canonical (a compiled block's `_orig_mod`) exports the names
    # the plain model has, which a Hugging Face class loads.
    clean = canonical_names(f"state entry {key!r}", names)
    return {clean.get(n, n): f"{prefix}{n}" for n in names}


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


def _write_tensors(reader: CheckpointReader, out, tasks, workers: int, progress: bool, total: int,
                   losses: CastLosses | None = None, inline: dict[str, torch.Tensor] | None = None) -> None:
    """Read (through `reader`: verified against the checkpoint's checksums where it has them), cast (through
    `losses` when given) and pwrite every tensor; at most about the largest tensor's bytes are in flight
    (run_bounded). The first failure cancels the tensors not yet started and is raised."""
    bar = byte_progress(total, progress)

    def one(task) -> None:
        fd, path, at, i = task
        name, full, stored, written, shape = out[i]
        if inline and name in inline:
            t = inline[name].detach().contiguous()
        else:
            t = torch.empty(shape, dtype=stored)
            if t.numel():
                reader.read_into([(full, Box.full(shape))], [t])
        if written != stored:
            # checked here, in the one read the export makes, not by a second pass over the source
            t = losses.cast(t, written, full) if losses is not None else t.to(written)
        if t.numel():
            _pwrite_all(fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()), at, path)
        del t
        if bar is not None:
            bar.update(math.prod(shape) * written.itemsize)

    try:
        run_bounded(one, tasks, [math.prod(out[i][4]) * out[i][2].itemsize for _, _, _, i in tasks], workers)
    finally:
        if bar is not None:
            bar.close()


def _mapped_outputs(plans: Sequence[GroupPlan], dtype: torch.dtype | None) -> list[tuple[str, str, torch.dtype,
                                                                                       torch.dtype, tuple[int, ...]]]:
    """export_hf's `out` for an export through a mapping: (Hugging Face name, the group in words, dtype the
    mapping returns, dtype written, shape) of every tensor the mapping returns, group by group.
    UnsupportedError for a dtype safetensors cannot store."""
    out = []
    for plan in plans:
        for name, (made, shape) in plan.outputs.items():
            written = dtype if dtype is not None and made.is_floating_point else made
            if written not in _NAMES:
                raise UnsupportedError(f"the export's mapping returned {name!r} with dtype "
                                       f"{str(made).removeprefix('torch.')} for {plan.where}, which safetensors "
                                       "cannot store; return another dtype, or pass dtype=")
            out.append((name, plan.where, made, written, shape))
    return out


def _write_mapped(source: GroupSource, mapping: MappingFn, plans: Sequence[GroupPlan], out, tasks, workers: int,
                  progress: bool, total: int, losses: CastLosses | None) -> None:
    """Write what the mapping makes of each group (write_groups) at its offset, cast to its `out` dtype (through
    `losses` when given)."""
    at = {out[i][0]: (fd, path, offset, out[i][3]) for fd, path, offset, i in tasks}
    bar = byte_progress(total, progress)

    def write(name: str, t: torch.Tensor) -> None:   # from write_groups' threads
        fd, path, offset, written = at[name]
        if written != t.dtype:
            t = losses.cast(t, written, name) if losses is not None else t.to(written)
        if t.numel():
            # cpu(): an adapter may hand back CUDA tensors
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            _pwrite_all(fd, memoryview(data.numpy()), offset, path)
        if bar is not None:
            bar.update(t.numel() * written.itemsize)

    try:
        write_groups(source, mapping, plans, write, workers)
    finally:
        if bar is not None:
            bar.close()


def _pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    data = data.cast("B") if data.format != "B" else data
    try:
        while len(data):
            n = os.pwrite(fd, data[:1 << 30], offset)
            data, offset = data[n:], offset + n
    except OSError as e:
        raise os_failure("writing", path, e, needed=len(data), device=path, hint=FULL_DISK_HINT) from e


def _write_json(dest: Destination, name: str, doc: dict, durable: bool = True) -> str:
    """Write `doc` as the JSON file `name` of the export (removed again if the export fails)."""
    path = dest.file(name)
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
    return dest.wrote(path)


__all__ = ["TOP_LEVEL", "export_hf"]
