"""DeepSpeed adapter: a live DeepSpeedEngine (ZeRO-0/1/2/3) and its optimizer, saved from each rank's
flat fp32 partitions with no gather and no communication, named like a plain module and a torch
optimizer over it, so that checkpoints cross between DeepSpeed (any ZeRO stage, any data-parallel
size), FSDP2 and plain PyTorch.

What a rank holds. DeepSpeed's optimizer steps fp32 *master* tensors that the inner torch optimizer
(AdamW...) holds as its parameters and keys its state by; the model's own (bf16 or fp32) parameters
are copies refreshed from them after every step. The saved value of a trainable parameter is
therefore its fp32 master weight, of the parameter's global shape:
- ZeRO-1/2 (DeepSpeedZeroOptimizer, and BF16_Optimizer): one flat fp32 partition per param group
  (`single_partition_of_fp32_groups` / `fp32_groups_flat_partition`); which elements of which
  parameter lie where in it is `param._hp_mapping` (DeepSpeed's universal-checkpoint linkage:
  lp_fragment_address = elements of the parameter, hp_fragment_address = offset in the partition);
- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): one flat fp32 partition per sub group
  (`fp32_partitioned_groups_flat`), the concatenation of each parameter's partition `param.ds_tensor`:
  ceil(numel / world) elements, this rank's [rank*s, min((rank+1)*s, numel)), padding after;
- ZeRO-0 with bf16/fp16 (FP16_UnfusedOptimizer): one whole fp32 copy per parameter (`fp32_groups`);
- ZeRO-0 fp32: the torch optimizer steps the module's parameters themselves.
Each case is a list of `MasterPartition`s: a 1-D view of a master tensor and the FlatPieces of
original parameters it holds, turned into boxes by FlatPiece.shards (adapters/fsdp1.py), views with
no copy, padding never saved. Optimizer state shaped like a master tensor (exp_avg, exp_avg_sq) is
cut the same way; a scalar one (Adam's step) is saved under each parameter's name, as a torch Adam
over the plain module saves it. Frozen parameters and buffers are saved as the module adapter names
them (ZeRO-3's frozen parameters from their ds_tensor partition).

Loading fills the same views in place (this rank's destination boxes), then refreshes the model's
parameters from the fp32 masters the way DeepSpeed's own checkpoint load does (update_lp_params and
its all-gather for ZeRO-1/2, the ZeRO-3 partition reassign plus the all-gather of persistent
parameters, a copy for ZeRO-0): loads communicate, saves never do.

All of this is DeepSpeed's private state; nothing is patched, everything read is checked against the
sizes of the tensors it describes, so a DeepSpeed version that changes it fails loudly with
UnsupportedError. This module never imports deepspeed at import time: `claims` looks at class names.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard, full_shard, tensor_shards
from omnickpt.adapters.fsdp1 import FlatPiece, _extra_state_modules, _unflattened_state
from omnickpt.adapters.module import canonical_name, match_saved_names
from omnickpt.adapters.optimizer import _kind_difference, _Param, optimizer_kind
from omnickpt.errors import UnsupportedError

FRAMEWORK = "deepspeed"

# DeepSpeed optimizer wrappers whose layout this module reads, by class name (their modules start
# with "deepspeed."); any other DeepSpeed optimizer is refused by name rather than saved wrongly.
_LINKED = ("DeepSpeedZeroOptimizer", "BF16_Optimizer")     # flat partitions linked by _hp_mapping
_STAGE3 = "DeepSpeedZeroOptimizer_Stage3"
_UNFUSED = "FP16_UnfusedOptimizer"
_KNOWN = (*_LINKED, _STAGE3, _UNFUSED)


def _deepspeed_classes(value: Any) -> list[str]:
    """Names of the deepspeed.* classes `value` is an instance of (its MRO), without importing deepspeed."""
    return [c.__name__ for c in type(value).__mro__ if (c.__module__ or "").startswith("deepspeed.")]


def is_engine(value: Any) -> bool:
    """Whether `value` is a DeepSpeedEngine (or a subclass such as PipelineEngine)."""
    return "DeepSpeedEngine" in _deepspeed_classes(value)


def _wrapper_kind(optimizer: Any) -> str | None:
    """The DeepSpeed wrapper class this module knows that `optimizer` is, 'other' for another
    deepspeed.* optimizer, None for a torch optimizer that DeepSpeed did not wrap (ZeRO-0 fp32)."""
    names = _deepspeed_classes(optimizer)
    for name in names:
        if name in _KNOWN:
            return name
    return "other" if names else None


def _engine_of(key: str, optimizer: Any, state: dict) -> Any:
    """The engine of `state` whose optimizer `optimizer` is."""
    for v in state.values():
        if is_engine(v) and getattr(v, "optimizer", None) is optimizer:
            return v
    raise UnsupportedError(f"{key}: a DeepSpeed optimizer ({type(optimizer).__name__}) with no DeepSpeedEngine in the "
                           "same state; save {'model': engine, 'optimizer': engine.optimizer} together, so that its "
                           "state can be named by the model's parameter names")


@dataclass
class MasterPartition:
    """One tensor that the inner torch optimizer steps (a key of its state): `master`, its 1-D view
    `flat`, the pieces of original parameters it holds (`pieces`, one per parameter in group order,
    named by their first canonical name; `aliases`, the other names of tied parameters) and the index
    of its param group in the inner optimizer."""
    master: torch.Tensor
    flat: torch.Tensor
    pieces: list[FlatPiece]
    aliases: list[FlatPiece]
    group: int


@dataclass
class EngineLayout:
    """What a rank of a DeepSpeedEngine holds, as omnickpt names it."""
    engine: Any
    module: nn.Module
    optimizer: Any                           # engine.optimizer (a DeepSpeed wrapper or a torch optimizer), or None
    inner: torch.optim.Optimizer | None      # the torch optimizer that steps the masters
    kind: str                                # _KNOWN name, "torch" (ZeRO-0 fp32) or "none" (no optimizer)
    partitions: list[MasterPartition]
    # ZeRO-3 parameters that no partition holds (frozen): (piece, their ds_tensor as 1-D)
    frozen_pieces: list[tuple[FlatPiece, torch.Tensor]] = field(default_factory=list)
    managed: set[int] = field(default_factory=set)   # ids of the parameters saved from pieces


def _names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> its canonical names in `module`, first name first (tied parameters have several)."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(canonical_name(name))
    return out


def _fail(what: str) -> UnsupportedError:
    return UnsupportedError(f"{what}; this DeepSpeed version's ZeRO layout differs from what omnickpt reads (written "
                            "against DeepSpeed 0.19): save with engine.save_checkpoint, or report it")


def _whole(name: str, p: torch.Tensor) -> FlatPiece:
    return FlatPiece(name, tuple(p.shape), 0, 0, p.numel())


def _pieces(names: dict[int, list[str]], lp: torch.Tensor, piece: FlatPiece, where: str) -> tuple[FlatPiece, list]:
    fqns = names.get(id(lp))
    if not fqns:
        raise UnsupportedError(f"{where}: the optimizer steps a parameter of shape {tuple(lp.shape)} that is not a "
                               "parameter of engine.module; omnickpt names state by engine.module's parameter names")
    return replace(piece, fqn=fqns[0]), [replace(piece, fqn=n) for n in fqns[1:]]


def _linked_partitions(opt: Any, kind: str, names: dict[int, list[str]]) -> list[MasterPartition]:
    """ZeRO-1/2 and BF16_Optimizer: a flat fp32 partition per param group, located by _hp_mapping."""
    lp_groups = opt.bit16_groups if kind == "DeepSpeedZeroOptimizer" else opt.bf16_groups
    masters = opt.single_partition_of_fp32_groups if kind == "DeepSpeedZeroOptimizer" else \
        opt.fp32_groups_flat_partition
    if len(lp_groups) != len(masters) or len(masters) != len(opt.optimizer.param_groups):
        raise _fail(f"{kind}: {len(lp_groups)} parameter groups, {len(masters)} fp32 partitions and "
                    f"{len(opt.optimizer.param_groups)} optimizer param groups")
    out = []
    for gi, (lps, master) in enumerate(zip(lp_groups, masters)):
        if master.dim() != 1:
            raise _fail(f"{kind}: the fp32 partition of group {gi} has shape {tuple(master.shape)}, not 1-D")
        pieces, aliases, used = [], [], 0
        for lp in lps:
            if not hasattr(lp, "_hp_mapping"):
                raise _fail(f"{kind}: a parameter of group {gi} has no _hp_mapping")
            hm = lp._hp_mapping
            if hm is None:      # no element of it in this rank's partition
                piece = FlatPiece("", tuple(lp.shape), 0, 0, 0)
            else:
                lpa, hpa = hm.lp_fragment_address, hm.hp_fragment_address
                piece = FlatPiece("", tuple(lp.shape), int(hpa.start), int(lpa.start), int(hpa.numel))
                if (int(lpa.numel) != piece.numel or piece.offset + piece.numel > master.numel()
                        or piece.start + piece.numel > lp.numel()):
                    raise _fail(f"{kind}: a parameter of shape {tuple(lp.shape)} claims elements [{piece.start}, "
                                f"{piece.start + piece.numel}) at offset {piece.offset} of a {master.numel()}-element "
                                "fp32 partition")
            used += piece.numel
            primary, more = _pieces(names, lp, piece, f"{kind} group {gi}")
            pieces.append(primary)
            aliases.extend(more)
        if used > master.numel():
            raise _fail(f"{kind}: the parameters of group {gi} claim {used} elements of a {master.numel()}-element "
                        "fp32 partition")
        out.append(MasterPartition(master, master.detach(), pieces, aliases, gi))
    return out


def _stage3_partitions(opt: Any, names: dict[int, list[str]]) -> list[MasterPartition]:
    """ZeRO-3: a flat fp32 partition per sub group, each parameter's ds_tensor partition in turn."""
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
        # the partitions live in files between steps: what memory holds is not the state
        raise UnsupportedError("ZeRO-3 with NVMe offload (ZeRO-Infinity): omnickpt saves and loads only state held "
                               "in memory; use engine.save_checkpoint / engine.load_checkpoint")
    groups, masters = opt.fp16_groups, opt.fp32_partitioned_groups_flat
    to_group = getattr(opt, "sub_group_to_group_id", None)
    if len(groups) != len(masters) or to_group is None:
        raise _fail(f"ZeRO-3: {len(groups)} sub groups and {len(masters)} fp32 partitions")
    out = []
    for si, (params, master) in enumerate(zip(groups, masters)):
        pieces, aliases, offset = [], [], 0
        for p in params:
            piece = _ds_tensor_piece(p, offset, f"ZeRO-3 sub group {si}")
            offset += p.ds_tensor.numel()
            primary, more = _pieces(names, p, piece, f"ZeRO-3 sub group {si}")
            pieces.append(primary)
            aliases.extend(more)
        if master.dim() != 1 or offset != master.numel():
            raise _fail(f"ZeRO-3: the partitions of sub group {si} hold {offset} elements, its fp32 partition has "
                        f"shape {tuple(master.shape)}")
        out.append(MasterPartition(master, master.detach(), pieces, aliases, int(to_group[si])))
    return out


def _ds_tensor_piece(p: torch.Tensor, offset: int, where: str) -> FlatPiece:
    """The part of ZeRO-3 parameter `p` that this rank's partition (p.ds_tensor) holds, at `offset`
    of a flat tensor made of such partitions."""
    import deepspeed.comm as ds_comm   # an engine exists, so deepspeed is imported already
    shape = tuple(int(s) for s in getattr(p, "ds_shape", ()))
    numel, size = math.prod(shape), p.ds_tensor.numel()
    group = getattr(p, "ds_process_group", None)
    world, rank = ds_comm.get_world_size(group=group), ds_comm.get_rank(group=group)
    if size != math.ceil(numel / world) or p.ds_tensor.dim() != 1:
        raise _fail(f"{where}: a parameter of shape {list(shape)} has a partition of {size} elements over {world} "
                    f"ranks, not ceil({numel}/{world})")
    start = min(rank * size, numel)
    return FlatPiece("", shape, offset, start, min(size, numel - start))


def engine_layout(engine: Any) -> EngineLayout:
    """This rank's master partitions of `engine`, named by engine.module's parameter names. Reads
    DeepSpeed's attributes only (no communication); UnsupportedError for a layout it does not know."""
    module, opt = engine.module, getattr(engine, "optimizer", None)
    names = _names(module)
    kind = "none" if opt is None else (_wrapper_kind(opt) or "torch")
    if kind == "other":
        raise UnsupportedError(f"DeepSpeed optimizer {type(opt).__name__} (engine.optimizer) is not one omnickpt reads "
                               f"({', '.join(_KNOWN)}, or a torch optimizer at ZeRO-0): save with "
                               "engine.save_checkpoint")
    inner = None if opt is None else (opt if kind == "torch" else opt.optimizer)
    if inner is not None and not isinstance(inner, torch.optim.Optimizer):
        raise _fail(f"{type(opt).__name__}.optimizer is a {type(inner).__name__}, not a torch optimizer")
    if kind in _LINKED:
        partitions = _linked_partitions(opt, kind, names)
    elif kind == _STAGE3:
        partitions = _stage3_partitions(opt, names)
    elif kind == _UNFUSED:
        partitions = []
        for gi, (fp32s, lps) in enumerate(zip(opt.fp32_groups, opt.fp16_groups, strict=True)):
            for master, lp in zip(fp32s, lps, strict=True):
                if master.shape != lp.shape:
                    raise _fail(f"{kind}: an fp32 copy of shape {tuple(master.shape)} for a parameter of shape "
                                f"{tuple(lp.shape)}")
                primary, more = _pieces(names, lp, _whole("", lp), f"{kind} group {gi}")
                partitions.append(MasterPartition(master, master.detach().view(-1), [primary], more, gi))
    elif kind == "torch":
        partitions = []
        for gi, group in enumerate(inner.param_groups):
            for p in group["params"]:
                primary, more = _pieces(names, p, _whole("", p), f"optimizer group {gi}")
                partitions.append(MasterPartition(p, p.detach().view(-1), [primary], more, gi))
    else:
        partitions = []
    layout = EngineLayout(engine, module, opt, inner, kind, partitions)
    if kind == _STAGE3:
        layout.managed = {id(lp) for group in opt.fp16_groups for lp in group}
    elif kind in _LINKED:
        layout.managed = {id(lp) for group in (opt.bit16_groups if kind == "DeepSpeedZeroOptimizer"
                                               else opt.bf16_groups) for lp in group}
    elif kind in (_UNFUSED, "torch"):
        # ZeRO-0 trainable parameters are saved from their fp32 master (the parameter itself in fp32)
        layout.managed = {id(lp) for group in (opt.fp16_groups if kind == _UNFUSED else
                                               [g["params"] for g in inner.param_groups]) for lp in group}
    # Parameters ZeRO-3 partitions that no fp32 master holds (frozen ones, or all of them in an engine
    # without optimizer): saved from their ds_tensor partition, whose p.data may be empty.
    partitioned: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in layout.managed and hasattr(p, "ds_tensor"):
            piece = replace(_ds_tensor_piece(p, 0, f"ZeRO-3 parameter {name!r}"), fqn=canonical_name(name))
            layout.frozen_pieces.append((piece, p.ds_tensor.detach()))
            partitioned.add(id(p))
    layout.managed |= partitioned
    return layout


# ---- the model entry ---------------------------------------------------------------------------------

def _module_shards(key: str, layout: EngineLayout, for_load: bool) -> list[TensorShard]:
    shards: list[TensorShard] = []
    for part in layout.partitions:
        for piece in part.pieces + part.aliases:
            shards.extend(piece.shards(f"{key}{SEP}{piece.fqn}", part.flat, for_load=for_load))
    for piece, flat in layout.frozen_pieces:
        shards.extend(piece.shards(f"{key}{SEP}{piece.fqn}", flat, for_load=for_load))
    with torch.no_grad():
        for name, t in _unflattened_state(layout.module, layout.managed):
            shards.extend(tensor_shards(f"{key}{SEP}{name}", t.detach()))
    return shards


def save_engine(key: str, engine: Any) -> SaveItems:
    """Entry `key` of a DeepSpeedEngine: fp32 master weights of its trainable parameters from this
    rank's partitions, frozen parameters and buffers as the module adapter names them."""
    layout = engine_layout(engine)
    items = SaveItems(shards=_module_shards(key, layout, for_load=False), framework=FRAMEWORK)
    items.layout = {"zero_stage": _zero_stage(engine), "optimizer": layout.kind}
    extra = {name: m.get_extra_state() for name, m in _extra_state_modules(layout.module)}
    if extra:
        items.objects[key] = extra
    return items


def _zero_stage(engine: Any) -> int | None:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:   # an engine without a ZeRO config object: recorded for people only
        return None


def load_engine(key: str, engine: Any) -> LoadTarget:
    """Load into a DeepSpeedEngine in place: the fp32 master partitions (this rank's boxes), frozen
    parameters and buffers; `finish` then refreshes the model's parameters from the masters, with
    the collectives DeepSpeed's own load makes (every rank calls it)."""
    layout = engine_layout(engine)
    target = LoadTarget(prefix=f"{key}{SEP}", shards=_module_shards(key, layout, for_load=True), framework=FRAMEWORK)
    extra_modules = dict(_extra_state_modules(layout.module))
    if extra_modules:
        target.objects.append(key)

    def prepare(manifest) -> None:
        match_saved_names(target.shards, manifest, target.prefix)

    def finish(objects: dict[str, Any]) -> None:
        for name, value in (objects.get(key) or {}).items():
            if name in extra_modules:
                extra_modules[name].set_extra_state(value)
        refresh_model_params(layout)

    target.prepare = prepare
    target.finish = finish
    return target


@torch.no_grad()
def refresh_model_params(layout: EngineLayout) -> None:
    """Copy the fp32 masters into the model's (low-precision) parameters as DeepSpeed does after
    loading its own checkpoint. Every rank of the engine's data-parallel group calls it: ZeRO-1/2 and
    ZeRO-3 all-gather."""
    opt, kind = layout.optimizer, layout.kind
    if kind in _LINKED:
        opt.update_lp_params()      # fp32 partition -> bit16 partition, all-gather of the flat groups
    elif kind == _STAGE3:
        if any(m is None for m in opt.fp16_partitioned_groups_flat):
            raise UnsupportedError("ZeRO-3 with NVMe-offloaded parameters: omnickpt loads only parameters held in "
                                   "memory; load with engine.load_checkpoint")
        for si, master in enumerate(opt.fp32_partitioned_groups_flat):
            if master.numel():
                opt.fp16_partitioned_groups_flat[si].copy_(master)
            # the model's partitions (ds_tensor) as views of the refreshed flat group, as DeepSpeed's load does
            for part, q in zip(opt.fp16_partitioned_groups[si],
                               opt.unflatten(opt.fp16_partitioned_groups_flat[si], opt.fp16_partitioned_groups[si])):
                part.data = q.data
        persistent = getattr(opt, "persistent_parameters", None)
        if persistent:
            # parameters ZeRO-3 keeps gathered between steps: gathered again from the new partitions
            persistent[0].all_gather(persistent)
        invalidate = getattr(opt, "invalidate_secondary_tensor", None)
        if callable(invalidate):
            invalidate()
    elif kind == _UNFUSED:
        for fp32s, lps in zip(opt.fp32_groups, opt.fp16_groups):
            for master, lp in zip(fp32s, lps):
                lp.data.copy_(master.data)
    # "torch": the optimizer steps the parameters themselves, filled in place already


class DeepSpeedEngineAdapter(Adapter):
    """A DeepSpeedEngine (any ZeRO stage): before ModuleAdapter, which would save it under
    'module.' names with ZeRO-3's empty parameters."""
    name = "deepspeed"
    frameworks = {FRAMEWORK: frozenset({FRAMEWORK})}

    def claims(self, value: Any, state: dict) -> bool:
        return isinstance(value, nn.Module) and is_engine(value)

    def detect(self, value: Any) -> str | None:
        return FRAMEWORK

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_engine(key, value)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_engine(key, value)


# ---- the optimizer entry ----------------------------------------------------------------------------

def _nograd(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _is_master_shaped(v: Any, part: MasterPartition) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == part.master.shape


def _flat_view(key: str, k: str, v: torch.Tensor, part: MasterPartition) -> torch.Tensor:
    if not v.is_contiguous():
        raise UnsupportedError(f"{key}: optimizer state {k!r} of the partition holding {part.pieces[0].fqn!r} is not "
                               "contiguous; omnickpt saves flat optimizer state as views")
    return _nograd(v).view(-1)


def save_engine_optimizer(key: str, layout: EngineLayout) -> SaveItems:
    """The optimizer entry of an engine, named as OptimizerAdapter names a torch optimizer over the
    plain module: '<key>/state/<fqn>/<state key>' and one object {param_groups (params by name), state}."""
    inner = layout.inner
    items = SaveItems(framework=optimizer_kind(inner))
    extra: dict[str, dict[str, Any]] = {}
    prefix = f"{key}{SEP}state{SEP}"
    for part in layout.partitions:
        for k, v in inner.state.get(part.master, {}).items():
            # a 0-d parameter's moments are 0-d too: only its "step" is the scalar counter then
            if _is_master_shaped(v, part) and (v.dim() > 0 or k != "step"):
                flat = _flat_view(key, k, v, part)
                for piece in part.pieces:
                    items.shards.extend(piece.shards(f"{prefix}{piece.fqn}{SEP}{k}", flat))
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                # one step counter for the whole partition: every parameter's, as torch keeps one each
                for piece in part.pieces:
                    items.shards.append(full_shard(f"{prefix}{piece.fqn}{SEP}{k}", _nograd(v)))
            elif isinstance(v, torch.Tensor):
                raise UnsupportedError(
                    f"{key}: optimizer state {k!r} of the fp32 partition holding {[p.fqn for p in part.pieces][:3]} "
                    f"has shape {tuple(v.shape)}, neither a scalar nor laid out like the partition "
                    f"{tuple(part.master.shape)}; omnickpt cannot tell which parameter it belongs to")
            else:
                for piece in part.pieces:
                    extra.setdefault(piece.fqn, {})[k] = v
    groups = []
    for gi, g in enumerate(inner.param_groups):
        names = [piece.fqn for part in layout.partitions if part.group == gi for piece in part.pieces]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    items.objects[key] = {"param_groups": groups, "state": extra}
    return items


def load_engine_optimizer(key: str, layout: EngineLayout) -> LoadTarget:
    """Load optimizer state saved by an engine (any stage, any size) or by a torch optimizer over the
    same model (plain, FSDP2...) into the engine's inner optimizer, this rank's part of each
    partition filled in place; state that does not exist yet (an engine that never stepped) is made."""
    inner = layout.inner
    target = LoadTarget(prefix=f"{key}{SEP}", objects=[key], framework=optimizer_kind(inner))
    dests: dict[int, dict[str, torch.Tensor]] = {}   # partition index -> state key -> tensor to install
    dropped: list[bool] = []
    mismatched: list[bool] = []
    prefix = f"{key}{SEP}state{SEP}"

    def prepare(manifest) -> list[str] | None:
        from omnickpt.format.manifest import dtype_from_name
        wanted: dict[str, list[tuple[str, str]]] = {}
        for tname in manifest.tensors:
            if tname.startswith(prefix):
                fqn, _, k = tname[len(prefix):].rpartition(SEP)
                wanted.setdefault(canonical_name(fqn), []).append((k, tname))
        params = [_Param(part.master, [p.fqn for p in part.pieces]) for part in layout.partitions]
        difference = _kind_difference(key, inner, params, wanted, (manifest.layout.get("frameworks") or {}).get(key))
        if difference is not None:
            dropped.append(True)
            target.objects.clear()
            return [difference]
        for pi, part in enumerate(layout.partitions):
            entries: dict[str, list[Any]] = {}
            for piece in part.pieces:
                for k, tname in wanted.get(piece.fqn, []):
                    entries.setdefault(k, []).append(manifest.tensors[tname])
            cur_state = inner.state.get(part.master, {})
            for k, es in entries.items():
                dtype = dtype_from_name(es[0].dtype)
                # Scalar state (step) is 0-d for every parameter; state laid out like the parameters
                # is 0-d everywhere only when all of them are 0-d (then by name, as for FSDP1).
                if all(e.shape == () for e in es) and (any(p.shape for p in part.pieces) or k == "step"):
                    # a scalar per parameter, one per partition: it takes the first one's (they agree
                    # when the parameters were stepped together, as in every DeepSpeed or torch run)
                    scalars = [torch.zeros((), dtype=dtype) for _ in part.pieces]
                    target.shards.extend(full_shard(f"{prefix}{p.fqn}{SEP}{k}", t)
                                         for p, t in zip(part.pieces, scalars))
                    dests.setdefault(pi, {})[k] = scalars[0]
                    continue
                cur = cur_state.get(k)
                if _is_master_shaped(cur, part) and cur.dtype == dtype and cur.is_contiguous():
                    dest = _nograd(cur)
                else:
                    dest = torch.zeros_like(part.master, dtype=dtype, requires_grad=False)
                flat = dest.view(-1)
                for piece in part.pieces:
                    target.shards.extend(piece.shards(f"{prefix}{piece.fqn}{SEP}{k}", flat, for_load=True))
                dests.setdefault(pi, {})[k] = dest
        match_saved_names(target.shards, manifest, target.prefix)
        return None

    def check(objects) -> list[str]:
        saved = objects.get(key)
        if saved is None or dropped:
            return []
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list):
            mismatched.append(True)
            return [f"{key}: the checkpoint's entry {key!r} is not an optimizer's state (no param_groups); load it "
                    "into what it was saved from"]
        if len(groups) != len(inner.param_groups):
            mismatched.append(True)
            return [f"{key}: the checkpoint has {len(groups)} param groups, the engine's optimizer has "
                    f"{len(inner.param_groups)}; its param groups (learning rates...) are not loaded"]
        diffs = []
        for gi, sg in enumerate(groups):
            mine = {p.fqn for part in layout.partitions if part.group == gi for p in part.pieces}
            theirs = {canonical_name(n) if isinstance(n, str) else n for n in sg.get("params", ())}
            if theirs != mine:
                diffs.append(f"{key}: param group {gi} holds {sorted(theirs ^ mine, key=str)[:5]} in only one of "
                             "checkpoint and engine; its param groups are not loaded")
        if diffs:
            mismatched.append(True)
        return diffs

    def finish(objects) -> None:
        saved = objects.get(key)
        if not isinstance(saved, dict) or dropped:
            return
        extra = {canonical_name(n) if isinstance(n, str) else n: v for n, v in saved.get("state", {}).items()}
        for pi, part in enumerate(layout.partitions):
            installed = dict(extra.get(part.pieces[0].fqn, {})) if part.pieces else {}
            installed.update(dests.get(pi, {}))
            if installed:
                inner.state[part.master].update(installed)
        if not mismatched and not check(objects):
            for sg, g in zip(saved["param_groups"], inner.param_groups):
                g.update({k: v for k, v in sg.items() if k != "params"})
        _relink_optimizer_state(layout.optimizer)

    target.prepare = prepare
    target.check = check
    target.finish = finish
    return target


def _relink_optimizer_state(wrapper: Any) -> None:
    """Point each parameter's `_hp_mapping` at the optimizer state now installed. ZeRO-1/2 and BF16_Optimizer
    link it only after their first step (`_lazy_init_hp_params_optimizer_state`, once): without this, an engine
    loaded before it ever stepped answers safe_get_full_optimizer_state with an error, and one whose state
    tensors were replaced with the old ones, as DeepSpeed's own load relinks them."""
    relink = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if callable(relink) and hasattr(wrapper, "_hp_optimizer_states_linked"):
        wrapper._hp_optimizer_states_linked = False
        relink()


class DeepSpeedOptimizerAdapter(Adapter):
    """engine.optimizer of a DeepSpeedEngine in the same state (a ZeRO wrapper, or at ZeRO-0 fp32 the
    torch optimizer itself): before OptimizerAdapter, which would name state by the engine's 'module.'
    names and miss the fp32 partitions."""
    name = "deepspeed-optimizer"

    def claims(self, value: Any, state: dict) -> bool:
        names = _deepspeed_classes(value)
        if names:   # a DeepSpeed optimizer wrapper (not its lr schedulers, also deepspeed.* classes)
            return any(n in _KNOWN or n in ("DeepSpeedOptimizer", "ZeROOptimizer") for n in names)
        if not isinstance(value, torch.optim.Optimizer) or sys.modules.get("deepspeed") is None:
            return False
        return any(is_engine(v) and getattr(v, "optimizer", None) is value for v in state.values())

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_engine_optimizer(key, engine_layout(_engine_of(key, value, state)))

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_engine_optimizer(key, engine_layout(_engine_of(key, value, state)))


__all__ = ["DeepSpeedEngineAdapter", "DeepSpeedOptimizerAdapter", "EngineLayout", "MasterPartition", "engine_layout",
           "is_engine", "load_engine", "load_engine_optimizer", "refresh_model_params", "save_engine",
           "save_engine_optimizer"]
