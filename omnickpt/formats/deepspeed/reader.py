"""`read_manifest`: a DeepSpeed checkpoint as our manifest (see the package docstring)."""
from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnickpt.errors import CheckpointError, CorruptCheckpointError, NotCommittedError, UnsupportedError
from omnickpt.format import FileEntry, Manifest, ObjectEntry, SavedBox, TensorEntry, dtype_name, encode_object
from omnickpt.formats.dcp.unpickle import MAX_INLINE_BYTES, _Budget, _StoredTensor
from omnickpt.formats.deepspeed.archive import Archive, open_archives
from omnickpt.formats.deepspeed.unpickle import fields
from omnickpt.formats.deepspeed.zero import (Piece, Planned, RankFiles, ZeroLayout, frozen, param_group_objects,
                                             param_shapes, whole, zero3, zero12)
from omnickpt.layout import flat_range_to_boxes
from omnickpt.storage import Storage

LATEST = "latest"
UNIVERSAL_DIR = "zero"
MODEL_KEY, OPTIMIZER_KEY, ENGINE_KEY = "model", "optimizer", "deepspeed"
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
# The model file's entries that are DeepSpeed's own bookkeeping; every other top-level key is the
# client_state a user passed to save_checkpoint.
_ENGINE_ENTRIES = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                   "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                   "checkpoint_parallel_dimensions", "ds_config", "ds_version", "iteration", "csr_tensor_module_names"}


def read_manifest(storage: Storage) -> Manifest | None:
    """The manifest of the DeepSpeed checkpoint at `storage`, or None when it is not one.

    `storage` is a checkpoint folder (with `latest` naming its tag), a tag folder, or a universal folder
    (`zero/<param>/fp32.pt`...). Names follow omnickpt's adapters: `model/<fqn>` (the fp32 master weights,
    as zero_to_fp32 rebuilds them; buffers and frozen parameters as saved), `optimizer/state/<fqn>/{exp_avg,
    exp_avg_sq,step}` and an `optimizer` object (param_groups naming parameters), `lr_scheduler` when one
    was saved, `deepspeed` (the engine's counters, loss scaler, ds_config) and the client_state entries,
    each an object. Every tensor is boxes at its bytes inside the archives, sums=None (DeepSpeed stores no
    checksums). `layout`: {"format": "deepspeed", "zero_stage", "world_size" (the data-parallel ranks that
    saved), "tag", "implied_keys": ["model", "optimizer"]}.
    """
    folder = _find(storage)
    if folder is None:
        return None
    tag, names = folder
    with ThreadPoolExecutor(8, thread_name_prefix="omnickpt-deepspeed") as pool:
        if UNIVERSAL_DIR in names and not any(_OPTIM.fullmatch(n) for n in names):
            return _universal(storage, tag, names, pool)
        return _native(storage, tag, names, pool)


def _find(storage: Storage) -> tuple[str, list[str]] | None:
    """(the tag folder, relative to `storage`, and its listing), or None when this is no DeepSpeed folder."""
    try:
        names = storage.children("")
    except (CheckpointError, FileNotFoundError, NotADirectoryError):
        return None
    if any(_MODEL.fullmatch(n) for n in names):
        return "", names
    if LATEST not in names:
        return None
    try:
        tag = storage.read_bytes(LATEST).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    if not tag or "/" in tag or tag in (".", ".."):
        return None
    try:
        inner = storage.children(tag)
    except (CheckpointError, FileNotFoundError, NotADirectoryError):
        inner = []
    if any(_MODEL.fullmatch(n) for n in inner):
        return tag, inner
    if "zero_to_fp32.py" in names:   # DeepSpeed's root, and `latest` names a tag that is not (all) there
        others = sorted(n for n in names if n not in (LATEST, "zero_to_fp32.py", "zero_to_torch.py", tag))
        raise NotCommittedError(
            f"{storage.describe(LATEST)} names tag {tag!r}, but {storage.describe(tag)} holds no DeepSpeed model "
            "states: DeepSpeed writes `latest` before every rank's files are done, so the save was interrupted. "
            + (f"Load one of the other tags ({', '.join(others[:5])}) by its folder" if others
               else "No other tag is there"))
    return None


def _join(tag: str, name: str) -> str:
    return f"{tag}/{name}" if tag else name


def _native(storage: Storage, tag: str, names: list[str], pool: ThreadPoolExecutor) -> Manifest:
    where = storage.describe(tag)
    models = sorted((m for m in map(_MODEL.fullmatch, names) if m), key=lambda m: (int(m.group(2)), int(m.group(1) or 0)))
    optims = sorted((m for m in map(_OPTIM.fullmatch, names) if m), key=lambda m: (int(m.group(3)), int(m.group(2))))
    _refuse_model_parallel(where, models, optims, names)
    opened = open_archives(storage, [_join(tag, m.group(0)) for m in models + optims], pool)
    model_files = [(_join(tag, m.group(0)), _dict(opened[_join(tag, m.group(0))])) for m in models]
    ranks = [RankFiles(_join(tag, m.group(0)), _optimizer_state(opened[_join(tag, m.group(0))]))
             for m in optims]
    _require_every_rank(where, [int(m.group(2)) for m in optims], ranks)
    path0, first = model_files[0]
    stage = _stage(ranks, first)
    tensors: dict[str, Planned] = {}
    objects: dict[str, Any] = {}
    _buffers(path0, first, tensors)
    if stage == 0 or not ranks:
        layout = _zero0(path0, first, tensors)
    else:
        shapes = param_shapes(first, path0)
        layout = (zero3 if stage == 3 else zero12)(shapes, ranks, where)
        if stage == 3 and len(model_files) != len(ranks):
            raise NotCommittedError(f"{where}: {len(ranks)} optimizer files but {len(model_files)} ZeRO-3 model "
                                    "files: a rank's file is missing (an interrupted save); load an earlier tag")
        tensors.update({f"{MODEL_KEY}/{n}": p for n, p in layout.params.items()})
        tensors.update({f"{MODEL_KEY}/{n}": p for n, p in frozen(model_files, stage, len(ranks), where).items()})
    if layout is not None:
        _optimizer(layout, tensors, objects)
    _shared(first, tensors)
    objects.update(_engine_objects(opened[path0], first, ranks, stage))
    world = max(len(ranks), 1)
    return _manifest(opened, tensors, objects, {"zero_stage": stage, "world_size": world, "tag": tag})


def _require_every_rank(where: str, held: list[int], ranks: list[RankFiles]) -> None:
    """Every data-parallel rank's optimizer file is there: DeepSpeed publishes `latest` without waiting for
    the other ranks, so a crash can leave a tag with some of them."""
    if not ranks:
        return
    counts = ranks[0].osd.get("partition_count")
    world = max(counts) if isinstance(counts, list) and counts and all(type(c) is int for c in counts) else counts
    world = world if type(world) is int and world > 0 else len(ranks)
    missing = sorted(set(range(max(world, len(held)))) - set(held))
    if missing:
        raise NotCommittedError(
            f"{where}: the optimizer files of data-parallel rank(s) {', '.join(map(str, missing))} of {world} are "
            "missing (an interrupted save: DeepSpeed writes `latest` before every rank's files are done); load an "
            "earlier tag")


def _dict(archive: Archive) -> dict:
    if not isinstance(archive.value, dict):
        raise CorruptCheckpointError(f"{archive.where}: holds a {type(archive.value).__name__}, not DeepSpeed's dict")
    return archive.value


def _optimizer_state(archive: Archive) -> dict:
    osd = _dict(archive).get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise CorruptCheckpointError(f"{archive.where}: no optimizer_state_dict; not a DeepSpeed ZeRO optimizer file")
    return osd


def _stage(ranks: list[RankFiles], first: dict) -> int:
    if not ranks:
        return 0
    stage = ranks[0].osd.get("zero_stage")
    if stage not in (1, 2, 3):
        raise UnsupportedError(f"{ranks[0].path}: zero_stage {stage!r}; omnickpt reads ZeRO stages 0 to 3")
    return stage


def _refuse_model_parallel(where: str, models, optims, names: list[str]) -> None:
    mp = sorted({int(m.group(2)) for m in models} | {int(m.group(3)) for m in optims})
    layers = [n for n in names if _LAYER.fullmatch(n)]
    if mp and mp != [0]:
        raise UnsupportedError(
            f"{where}: a model-parallel DeepSpeed checkpoint (files for mp_rank {', '.join(map(str, mp))}): its "
            "tensor-parallel slices carry no record of how each parameter was split, so omnickpt cannot name their "
            "boxes. Convert it with DeepSpeed's ds_to_universal (which applies Megatron's split rules) and load the "
            "universal folder, or save the run with omnickpt's Megatron adapter")
    if layers:
        raise UnsupportedError(
            f"{where}: a pipeline-parallel DeepSpeed checkpoint (PipelineModule layer files such as {layers[0]}): "
            "its parameters are named by layer index per stage, not as the model names them; load it with "
            "DeepSpeed's load_checkpoint and save the run with omnickpt")
    if not models:
        raise NotCommittedError(f"{where}: no DeepSpeed model states file")


def _buffers(path: str, first: dict, tensors: dict[str, Planned]) -> None:
    module = first.get("module") if isinstance(first.get("module"), dict) else {}
    for name in first.get("buffer_names") or []:
        t = module.get(name)
        if isinstance(name, str) and isinstance(t, _StoredTensor):
            tensors[f"{MODEL_KEY}/{name}"] = whole(path, t)


def _zero0(path: str, first: dict, tensors: dict[str, Planned]) -> ZeroLayout | None:
    """No ZeRO: the model file holds the module whole and, in `optimizer`, the torch optimizer's own state dict
    (parameters by index, in the order of module.parameters(): the module's tensors less buffers and ties)."""
    module = first.get("module") if isinstance(first.get("module"), dict) else {}
    buffers = set(first.get("buffer_names") or [])
    order, seen = [], set()
    for name, t in module.items():
        if isinstance(t, _StoredTensor) and name not in buffers:
            tensors[f"{MODEL_KEY}/{name}"] = whole(path, t)
            ident = (t.key, t.offset, t.shape, t.stride)
            if ident not in seen:
                seen.add(ident)
                order.append(name)
    osd = first.get("optimizer")
    # ZeRO-0 with bf16/fp16 (FP16_UnfusedOptimizer): the torch optimizer's state dict inside, and the fp32
    # master of every parameter in `fp32_groups` (per group, in the group's order): those, not the module's
    # bf16 copies, are the weights (as for ZeRO-1/2/3)
    masters = osd.get("fp32_groups") if isinstance(osd, dict) else None
    if isinstance(osd, dict) and isinstance(osd.get("optimizer_state_dict"), dict):
        osd = osd["optimizer_state_dict"]
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or "param_groups" not in osd:
        return None   # none saved: the weights only
    params: dict[str, Planned] = {}
    state: dict[str, dict[str, Planned]] = {}
    group_of: dict[str, int] = {}
    for gi, g in enumerate(osd["param_groups"]):
        for j, idx in enumerate((g.get("params") or []) if isinstance(g, dict) else []):
            if type(idx) is not int or idx >= len(order):
                raise CorruptCheckpointError(f"{path}: the optimizer names parameter {idx!r} of {len(order)}")
            name = order[idx]
            group_of[name] = gi
            if isinstance(masters, list):
                master = masters[gi][j] if gi < len(masters) and isinstance(masters[gi], list) \
                    and j < len(masters[gi]) else None
                if not isinstance(master, _StoredTensor) or master.shape != tensors[f"{MODEL_KEY}/{name}"].shape:
                    raise CorruptCheckpointError(f"{path}: fp32_groups[{gi}][{j}] is not the fp32 master of {name!r}")
                tensors[f"{MODEL_KEY}/{name}"] = whole(path, master)
            for k, t in (osd["state"].get(idx) or {}).items():
                if isinstance(t, _StoredTensor):
                    state.setdefault(name, {})[k] = whole(path, t)
    return ZeroLayout(params, state, group_of, osd["param_groups"])


def _optimizer(layout: ZeroLayout, tensors: dict[str, Planned], objects: dict[str, Any]) -> None:
    for name, per in layout.state.items():
        for k, p in per.items():
            tensors[f"{OPTIMIZER_KEY}/state/{name}/{k}"] = p
    if layout.groups:
        objects[OPTIMIZER_KEY] = {"param_groups": fields(param_group_objects(layout, lambda n: n)), "state": {}}


def _shared(first: dict, tensors: dict[str, Planned]) -> None:
    """Tied parameters: DeepSpeed saves one and names the others in `shared_params` {alias: saved}."""
    for alias, saved in (first.get("shared_params") or {}).items():
        src = tensors.get(f"{MODEL_KEY}/{saved}")
        if isinstance(alias, str) and src is not None:
            tensors.setdefault(f"{MODEL_KEY}/{alias}", src)


def _engine_objects(archive: Archive, first: dict, ranks: list[RankFiles], stage: int) -> dict[str, Any]:
    """The engine's own state and the user's client_state, as objects: tensors inside them read now (bounded)."""
    budget = _Budget()
    engine = {k: first.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "dp_world_size",
                                       "mp_world_size", "ds_version", "ds_config") if k in first}
    engine["zero_stage"] = stage
    if ranks:
        osd = ranks[0].osd
        engine.update({k: osd[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad") if k in osd})
    out = {ENGINE_KEY: engine}
    if first.get("lr_scheduler") is not None:
        out["lr_scheduler"] = first["lr_scheduler"]
    for k, v in first.items():
        if isinstance(k, str) and k not in _ENGINE_ENTRIES and k and "/" not in k:
            out[k] = v
    decoded = {}
    for k, v in out.items():
        value = _materialise(fields(v), archive, budget, k)
        try:
            encode_object(value, where=k)
        except CheckpointError:
            continue     # a value the format cannot carry (it is DeepSpeed's own or the user's): left out
        decoded[k] = value
    return decoded


def _materialise(value: Any, archive: Archive, budget: _Budget, what: str) -> Any:
    if isinstance(value, _StoredTensor):
        if not budget.take(math.prod(value.shape) * value.dtype.itemsize):
            raise UnsupportedError(f"{archive.where}: the tensors inside {what!r} exceed the {MAX_INLINE_BYTES >> 20} "
                                   "MiB omnickpt reads with a checkpoint's metadata")
        return archive.read_tensor(value, what)
    if isinstance(value, dict):
        return {k: _materialise(v, archive, budget, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_materialise(v, archive, budget, what) for v in value)
    return value


# ---------------------------------------------------------------------- universal folders
def _universal(storage: Storage, tag: str, names: list[str], pool: ThreadPoolExecutor) -> Manifest:
    """A folder of DeepSpeed's ds_to_universal: `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt` (a tensor, or
    {"param": tensor, "cat_dim": ...}; ZeRO-3's are flat), the model states beside them for names and shapes."""
    where = storage.describe(tag)
    models = sorted((m for m in map(_MODEL.fullmatch, names) if m), key=lambda m: int(m.group(1) or 0))
    _refuse_model_parallel(where, models, [], names)
    zero = _join(tag, UNIVERSAL_DIR)
    params = storage.children(zero)
    files = [f"{zero}/{p}/{f}" for p in params for f in storage.children(f"{zero}/{p}") if f.endswith(".pt")]
    model_path = _join(tag, models[0].group(0))
    extra = [f"{zero}/optimizer_state.pt"] if "optimizer_state.pt" in params else []
    opened = open_archives(storage, [model_path, *extra, *[f for f in files if f not in extra]], pool)
    first = _dict(opened[model_path])
    shapes = {n: s for g in param_shapes(first, model_path) for n, s in g.items()}
    tensors: dict[str, Planned] = {}
    _buffers(model_path, first, tensors)
    state: dict[str, dict[str, Planned]] = {}
    for name, shape in shapes.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            path = f"{zero}/{name}/{key}.pt"
            if path not in opened:
                if key == "fp32":
                    raise CorruptCheckpointError(f"{where}: no {path} for parameter {name!r}; the universal folder "
                                                 "is incomplete: convert it again")
                continue
            t = opened[path].value
            t = t.get("param") if isinstance(t, dict) else t
            if not isinstance(t, _StoredTensor):
                raise CorruptCheckpointError(f"{storage.describe(path)}: not a tensor")
            if key == "step":
                state.setdefault(name, {})[key] = whole(path, t)
                continue
            if math.prod(t.shape) != math.prod(shape):
                raise CorruptCheckpointError(f"{storage.describe(path)}: {math.prod(t.shape)} elements for "
                                             f"{name!r} of shape {list(shape)}")
            planned = Planned(shape, t.dtype, [Piece(path, t, 0, 0, math.prod(shape))])
            if key == "fp32":
                tensors[f"{MODEL_KEY}/{name}"] = planned
            else:
                state.setdefault(name, {})[key] = planned
    objects: dict[str, Any] = {}
    osd = _dict(opened[extra[0]]) if extra else {}
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    if len(groups) > 1:
        raise UnsupportedError(f"{where}: {len(groups)} parameter groups; a universal folder does not say which "
                               "parameter is in which, so omnickpt reads single-group ones only")
    # ZeRO-3's converter writes no step.pt: the step is the inner optimizer's, in optimizer_state.pt
    inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
    step = ((inner.get("state") or {}).get(0) or {}).get("step") if isinstance(inner.get("state"), dict) else None
    if isinstance(step, _StoredTensor):
        for name in shapes:
            state.setdefault(name, {}).setdefault("step", whole(extra[0], step))
    _optimizer(ZeroLayout({}, state, {n: 0 for n in shapes}, groups), tensors, objects)
    _shared(first, tensors)
    objects.update(_engine_objects(opened[model_path], first, [], 0))
    objects[ENGINE_KEY].pop("zero_stage", None)
    stage = osd.get("zero_stage") if type(osd.get("zero_stage")) is int else None
    return _manifest(opened, tensors, objects, {"zero_stage": stage, "world_size": 1, "tag": tag, "universal": True})


# ---------------------------------------------------------------------- the manifest
def _manifest(opened: dict[str, Archive], tensors: dict[str, Planned], objects: dict[str, Any],
              info: dict) -> Manifest:
    paths = sorted(opened)
    index = {p: i for i, p in enumerate(paths)}
    files = [FileEntry(p, _rank_of(p), opened[p].size) for p in paths]
    entries = {}
    for name, planned in tensors.items():
        boxes = []
        for piece in planned.pieces:
            boxes.extend(_boxes(name, planned, piece, opened[piece.file], index[piece.file]))
        entries[name] = TensorEntry(planned.shape, dtype_name(planned.dtype), boxes)
    layout = {"format": "deepspeed", **info, "implied_keys": [MODEL_KEY, OPTIMIZER_KEY],
              "frameworks": {MODEL_KEY: "deepspeed", OPTIMIZER_KEY: _optimizer_kind(objects)}}
    return Manifest(save_id=f"deepspeed:{info.get('tag') or ''}", world_size=info["world_size"], files=files,
                    tensors=entries, objects={k: [_inline(v, k)] for k, v in objects.items()}, layout=layout)


def _optimizer_kind(objects: dict[str, Any]) -> str:
    """The torch optimizer DeepSpeed's config built (the files do not name it): {"type": "Adam"} is torch's
    AdamW unless adam_w_mode is false, as a live engine's adapter records it."""
    config = (objects.get(ENGINE_KEY) or {}).get("ds_config") or {}
    opt = config.get("optimizer") if isinstance(config, dict) else None
    kind = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
    params = opt.get("params") if isinstance(opt, dict) and isinstance(opt.get("params"), dict) else {}
    if kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True) is not False):
        return "torch.optim.adamw.AdamW"
    return "torch.optim.adam.Adam"


def _boxes(name: str, planned: Planned, piece: Piece, archive: Archive, file: int) -> list[SavedBox]:
    if piece.flat.dtype != planned.dtype:
        raise CorruptCheckpointError(f"{archive.where}: {name!r} is held as {piece.flat.dtype} here and "
                                     f"{planned.dtype} elsewhere; the checkpoint is damaged")
    itemsize = planned.dtype.itemsize
    if piece.offset == 0 and piece.start == 0 and piece.numel == math.prod(planned.shape) \
            and piece.flat.shape == planned.shape:
        at = archive.offset_of(piece.flat, name)
        shape = planned.shape
        return [SavedBox((0,) * len(shape), shape, file, at, piece.numel * itemsize, None)] if piece.numel else []
    at = archive.offset_of(piece.flat, name, piece.offset + piece.numel) + piece.offset * itemsize
    out = []
    for box in flat_range_to_boxes(planned.shape or (1,), piece.start, piece.numel):
        offsets, lengths = (box.offsets, box.lengths) if planned.shape else ((), ())
        out.append(SavedBox(offsets, lengths, file, at, box.numel * itemsize, None))
        at += box.numel * itemsize
    return out


def _rank_of(path: str) -> int:
    m = _OPTIM.fullmatch(path.rsplit("/", 1)[-1]) or _MODEL.fullmatch(path.rsplit("/", 1)[-1])
    if m is None:
        return 0
    return int(m.group(2) if m.re is _OPTIM else (m.group(1) or 0))


def _inline(value: Any, key: str) -> ObjectEntry:
    data = encode_object(value, where=key)
    return ObjectEntry(ranks=[0], file=-1, offset=0, nbytes=len(data), checksum=0, inline=data)


__all__ = ["LATEST", "read_manifest"]
