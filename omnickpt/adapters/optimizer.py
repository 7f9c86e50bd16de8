"""torch.optim adapter. State is keyed by parameter name, not index, so it reshards: each state
tensor follows its parameter's boxes (DTensor or replicated), param_groups name their params.

An FSDP1 parameter (a FlatParameter, or an original parameter's 1-D sharded view when
use_orig_params=True) stands for parts of several original parameters: its flat state (exp_avg...)
is cut into those parts' boxes like the parameter itself (adapters/fsdp1.py), its scalar state
(step) is saved under each original parameter's name, and param_groups list the original names.

The optimizer's class is recorded (as the entry's framework in the manifest's layout), and loading
checks it and the per-parameter state keys against the target before anything is read: the state of
one kind of optimizer installed into another would replace its param groups and fail on its next
step (SGD's momentum_buffer where Adam expects exp_avg, exp_avg_sq, step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from omnickpt.fence import innermost_optimizer
from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard, full_shard, tensor_shards
from omnickpt.adapters.fsdp1 import FlatOptimParam, optimizer_params
from omnickpt.adapters.generic import load_value, save_value
from omnickpt.adapters.module import canonical_name, is_fsdp1, match_saved_names, unwrap
from omnickpt.errors import CorruptCheckpointError, UnsupportedError


@dataclass
class _Param:
    """One parameter as the optimizer holds it: `names` are the original parameters it covers
    (one, unless it is an FSDP1 flat parameter); `flat` is its FSDP1 layout, or None."""
    param: torch.Tensor
    names: list[str]
    flat: FlatOptimParam | None = None


def _optimizer_params(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> list[_Param]:
    """The optimizer's parameters, in its own index order, with their names."""
    by_id: dict[int, str] = {}
    flat: dict[int, FlatOptimParam] = {}
    for mkey, module in modules.items():
        inner = unwrap(module)

        def qualify(name: str, mkey=mkey) -> str:
            return name if len(modules) == 1 else f"{mkey}{SEP}{name}"

        fsdp1 = is_fsdp1(inner)
        if fsdp1:
            for pid, fp in optimizer_params(inner).items():
                flat.setdefault(pid, replace(fp, pieces=[replace(p, fqn=qualify(p.fqn)) for p in fp.pieces]))
        for name, p in inner.named_parameters(remove_duplicate=False):
            # named as the module adapter names the parameter: without wrapper segments, as DCP
            # names it, so that state saved with activation checkpointing or a compiled block
            # loads without them and the other way round
            by_id.setdefault(id(p), qualify(canonical_name(name)))
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in flat:
                f = flat[id(p)]
                out.append(_Param(p, [piece.fqn for piece in f.pieces], f))
            elif id(p) in by_id:
                out.append(_Param(p, [by_id[id(p)]]))
            else:
                raise UnsupportedError(
                    f"{key}: the optimizer holds a parameter of shape {tuple(p.shape)} that belongs to no "
                    "nn.Module in the saved state; put the model in the same state dict so that optimizer "
                    "state can be keyed by parameter name")
    return out


def _is_flat_state(value: Any, flat: FlatOptimParam) -> bool:
    """A state tensor laid out like the flat parameter (exp_avg...), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat.numel


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """What the manifest records as the optimizer's kind: its class, 'torch.optim.adam.Adam' (the one
    that steps, behind a wrapper such as Accelerate's AcceleratedOptimizer)."""
    return _class_name(type(innermost_optimizer(optimizer)))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class OptimizerAdapter(Adapter):
    """torch.optim optimizers, their state named by the parameter names of the modules in the same
    state. An Optimizer subclass whose state_dict() has another layout than torch's goes through its
    own state_dict()/load_state_dict(): DCP's flattened layout (torchtitan's OptimizersContainer) is
    saved as omnickpt's optimizer layout (`save_flat_optimizer`), any other as a Stateful object
    (the generic adapter's way)."""
    name = "optimizer"

    def claims(self, value: Any, state: dict) -> bool:
        return isinstance(value, torch.optim.Optimizer)

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        osd = value.state_dict()
        if flat_layout(osd):
            return save_flat_optimizer(key, value, osd)
        if not torch_layout(osd):
            return save_value(key, osd)
        return save_optimizer(key, value, state_modules(state), osd)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        # Optimizer.state_dict() itself always has torch's layout: only a class that overrides it is asked
        if type(value).state_dict is not torch.optim.Optimizer.state_dict:
            current = value.state_dict()
            if flat_layout(current):
                return load_flat_optimizer(key, value, current)
            if not torch_layout(current):
                return load_value(key, value, state)
        return load_optimizer(key, value, state_modules(state))


def torch_layout(osd: Any) -> bool:
    """Whether an optimizer's state_dict() has torch's layout: {"state": {index: {...}},
    "param_groups": [{..., "params": [index...]}]}."""
    return isinstance(osd, dict) and isinstance(osd.get("state"), dict) and isinstance(osd.get("param_groups"), list)


def flat_layout(osd: Any) -> bool:
    """Whether an optimizer's state_dict() has the layout of DCP's get_optimizer_state_dict(...,
    options=StateDictOptions(flatten_optimizer_state_dict=True)), which torchtitan's
    OptimizersContainer returns: {"state.<fqn>.<state key>": value, "param_groups.<fqn>.<field>": value}."""
    return (isinstance(osd, dict) and bool(osd)
            and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in osd))


def state_modules(state: dict) -> dict[str, nn.Module]:
    """The modules of a state, by state key: the names an optimizer's parameters take."""
    return {k: v for k, v in state.items() if isinstance(v, nn.Module)}


def save_optimizer(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module],
                   osd: dict | None = None) -> SaveItems:
    """`osd`: the optimizer's state_dict() when the caller has it already."""
    params = _optimizer_params(key, optimizer, modules)
    osd = optimizer.state_dict() if osd is None else osd
    items = SaveItems(framework=optimizer_kind(optimizer))
    extra: dict[str, dict[str, Any]] = {}
    for idx, st in osd["state"].items():
        par = params[idx]
        for k, v in st.items():
            if par.flat is None:
                fqn = par.names[0]
                if isinstance(v, torch.Tensor):
                    items.shards.extend(tensor_shards(f"{key}{SEP}state{SEP}{fqn}{SEP}{k}", _nograd(v)))
                else:
                    extra.setdefault(fqn, {})[k] = v
            elif _is_flat_state(v, par.flat):
                for piece in par.flat.pieces:
                    items.shards.extend(piece.shards(f"{key}{SEP}state{SEP}{piece.fqn}{SEP}{k}", _nograd(v)))
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                # one step counter for the whole flat parameter: every original parameter's
                for fqn in par.names:
                    items.shards.append(full_shard(f"{key}{SEP}state{SEP}{fqn}{SEP}{k}", _nograd(v)))
            elif isinstance(v, torch.Tensor):
                raise UnsupportedError(
                    f"{key}: optimizer state {k!r} of the FSDP1 parameter holding {par.names[:3]} has shape "
                    f"{tuple(v.shape)}, neither a scalar nor laid out like the flat parameter "
                    f"({par.flat.numel} elements); omnickpt cannot tell which original parameter it belongs to")
            else:
                for fqn in par.names:
                    extra.setdefault(fqn, {})[k] = v
    groups = []
    for g in osd["param_groups"]:
        groups.append({**g, "params": [name for i in g["params"] for name in params[i].names]})
    items.objects[key] = {"param_groups": groups, "state": extra}
    return items


def _flat_destinations(key: str, par: _Param, cur_state: dict, wanted: dict[str, list[tuple[str, str]]],
                       manifest) -> tuple[list[TensorShard], dict[str, torch.Tensor]]:
    """Load destinations for an FSDP1 parameter's state: (shards to fill, state key -> tensor).

    Every state key saved for any of its original parameters is wanted for all of them, so a part
    missing from the checkpoint is reported rather than left as zeros. Flat state is filled in
    place when the optimizer already has it.
    """
    from omnickpt.format.manifest import dtype_from_name
    keys: dict[str, list[Any]] = {}
    for fqn in par.names:
        for k, tname in wanted.get(fqn, []):
            keys.setdefault(k, []).append(manifest.tensors[tname])
    only_scalar_params = all(piece.shape == () for piece in par.flat.pieces)
    prefix = f"{key}{SEP}state{SEP}"
    shards: list[TensorShard] = []
    dests: dict[str, torch.Tensor] = {}
    for k, entries in keys.items():
        dtype = dtype_from_name(entries[0].dtype)
        # Scalar state (step) is 0-d for every parameter; flat state is shaped like each
        # parameter, so it is 0-d everywhere only when all parameters are 0-d (then by name).
        if all(e.shape == () for e in entries) and (not only_scalar_params or k == "step"):
            # A scalar (step) per original parameter, but one per flat parameter: it takes the
            # first one's (they agree when all were stepped together, as in FSDP1).
            scalars = [torch.zeros((), dtype=dtype) for _ in par.names]
            shards += [full_shard(f"{prefix}{fqn}{SEP}{k}", t) for fqn, t in zip(par.names, scalars)]
            dests[k] = scalars[0]
            continue
        cur = cur_state.get(k)
        if _is_flat_state(cur, par.flat) and cur.dtype == dtype:
            flat = cur.detach()
        else:
            flat = torch.zeros(par.flat.numel, dtype=dtype, device=par.param.device)
        for piece in par.flat.pieces:
            shards += piece.shards(f"{prefix}{piece.fqn}{SEP}{k}", flat, for_load=True)
        dests[k] = flat
    return shards, dests


def _nograd(t: torch.Tensor) -> torch.Tensor:
    # Optimizer state never requires grad; detach (a dispatch per DTensor) only if it does.
    return t.detach() if t.requires_grad else t


def _kind_difference(key: str, optimizer: torch.optim.Optimizer, params: list[_Param],
                     wanted: dict[str, list[tuple[str, str]]], saved_kind: str | None,
                     states: list[dict | None] | None = None) -> str | None:
    """Why the checkpoint's optimizer state cannot be installed into `optimizer`, or None.

    Per parameter, the tensor state keys saved (from the manifest's names) must be the ones the
    optimizer holds, where it holds state already. Where it holds none (never stepped: the usual
    resume), the recorded class must be the optimizer's or one of its bases (Adam's state loads into
    AdamW); checkpoints that recorded no class are judged by their keys alone. `states`: each
    parameter's optimizer.state entry (None where it has none), looked up here when not given.
    """
    if states is None:
        states = [optimizer.state.get(par.param) for par in params]

    def saved_keys(par: _Param) -> set[str]:
        return {k for fqn in par.names for k, _ in wanted.get(fqn, ())}

    mine = optimizer_kind(optimizer)
    if saved_kind is not None and saved_kind != mine:
        fix = f"load into a {saved_kind}"
    else:
        fix = "load into an optimizer of the class and options the checkpoint was saved with"
    for par, state in zip(params, states):
        if not state:
            continue
        theirs_set = saved_keys(par)
        if not theirs_set:
            continue
        own_set = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
        if own_set != theirs_set:
            theirs, own = sorted(theirs_set), sorted(own_set)
            return (f"{key}: the checkpoint's optimizer state does not fit this optimizer: parameter {par.names[0]!r} "
                    f"has state {theirs} in the checkpoint (saved by {saved_kind or 'an unrecorded optimizer class'}) "
                    f"but {own} in the optimizer ({mine}); {fix}, or pass strict=False to load the rest and leave "
                    "this optimizer as it is")
    if saved_kind is None or any(saved_kind == _class_name(c) for o in (optimizer, innermost_optimizer(optimizer))
                                 for c in type(o).__mro__):
        return None
    if any(state and saved_keys(par) for par, state in zip(params, states)):
        return None     # another class, but the same state keys, parameter by parameter (checked above)
    theirs = sorted({k for par in params for k in saved_keys(par)})
    return (f"{key}: the checkpoint's optimizer state was saved by {saved_kind}"
            + (f" (per-parameter state {theirs})" if theirs else "")
            + f" but the optimizer is {mine} (no state yet); its param groups and state would not fit: {fix}, or "
            "pass strict=False to load the rest and leave this optimizer as it is")


def _param_changed(manifest, modules: dict[str, nn.Module], fqn: str, param: torch.Tensor) -> bool:
    """Whether the checkpoint saved this parameter (under a module of the state) with another shape."""
    for mkey in modules:
        entry = manifest.tensors.get(f"{mkey}{SEP}{fqn}")
        if entry is not None:
            return tuple(entry.shape) != tuple(param.shape)
    return False


def _unlike_param(name: str, entry, dtype: torch.dtype) -> torch.Tensor:
    """A destination for saved state whose shape is not its parameter's (a scalar step, factored
    second moments), sized by the manifest: so nothing is allocated before the manifest is shown to
    store every element (a damaged or hostile one could declare any shape), and the memory is left
    unfilled (every element is read; a later size check of the data files may still fail the
    load, which then frees it untouched)."""
    from omnickpt.format import tiling_problem
    problem = tiling_problem(entry.shape, entry.boxes)
    if problem:
        raise CorruptCheckpointError(f"optimizer state {name!r} of shape {list(entry.shape)}: {problem}; the "
                                     "manifest is damaged")
    try:
        return torch.empty(entry.shape, dtype=dtype)
    except RuntimeError as e:   # the allocator refused: no real checkpoint stores more than memory holds
        raise CorruptCheckpointError(f"optimizer state {name!r} declares shape {list(entry.shape)}, which cannot be "
                                     f"allocated ({e}); the manifest is damaged") from None


def load_optimizer(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> LoadTarget:
    params = _optimizer_params(key, optimizer, modules)
    target = LoadTarget(prefix=f"{key}{SEP}", objects=[key])
    dests: dict[int, dict[str, torch.Tensor]] = {}
    renamed = []   # set by prepare: the manifest went through transforms
    dropped = []   # set by prepare: the checkpoint's state does not fit, install nothing
    mismatched_groups = []   # set by check: the saved param groups do not fit (strict=False goes on)
    unfit: set[int] = set()  # set by prepare: parameters whose saved state does not fit (they keep theirs)

    def prepare(manifest) -> list[str] | None:
        renamed.append(manifest.derived)
        # Destinations for every saved state tensor of every parameter we have: the optimizer's
        # own tensors when they already exist, otherwise new ones sharded like the parameter.
        from omnickpt.format.manifest import dtype_from_name
        wanted: dict[str, list[tuple[str, str]]] = {}
        prefix = f"{key}{SEP}state{SEP}"
        for tname in manifest.tensors:
            if tname.startswith(prefix):
                fqn, _, k = tname[len(prefix):].rpartition(SEP)
                # by canonical name: checkpoints saved before names were canonical hold wrapper segments
                wanted.setdefault(canonical_name(fqn), []).append((k, tname))
        # each parameter's state looked up once (a DTensor's hash is a Python call)
        states = [optimizer.state.get(par.param) for par in params]
        difference = _kind_difference(key, optimizer, params, wanted,
                                      (manifest.layout.get("frameworks") or {}).get(key), states)
        if difference is not None:
            # Nothing of it is read or installed; its tensors are left unclaimed, which a strict load
            # reports along with this line.
            dropped.append(True)
            target.objects.clear()
            return [difference]
        differences: list[str] = []
        tensors = manifest.tensors
        dtypes: dict[str, torch.dtype] = {}   # per dtype name, not per tensor
        for idx, par in enumerate(params):
            p = par.param
            own = states[idx] or {}
            if par.flat is not None:
                shards, dests[idx] = _flat_destinations(key, par, own, wanted, manifest)
                target.shards.extend(shards)
                continue
            found = []
            for k, tname in wanted.get(par.names[0], ()):
                entry = tensors[tname]
                dtype = dtypes.get(entry.dtype)
                if dtype is None:
                    dtype = dtypes[entry.dtype] = dtype_from_name(entry.dtype)
                cur = own.get(k)
                if isinstance(cur, torch.Tensor) and cur.shape == entry.shape and cur.dtype == dtype:
                    # filled in place; detached only if it requires grad (optimizer state does not):
                    # a detach is a dispatch per DTensor, 0.3 s for 12k moments on the load path
                    dest = _nograd(cur)
                elif p.shape == entry.shape:
                    # zeros_like makes no graph (no detach first: a dispatch per DTensor)
                    dest = torch.zeros_like(p, dtype=dtype, requires_grad=False)
                elif _param_changed(manifest, modules, par.names[0], p) or (
                        math.prod(entry.shape) > 1 and math.prod(entry.shape) >= p.numel()):
                    # The parameter changed shape since the save (the module reports it too), so
                    # its state would not fit it; smaller shapes are factored state (Adafactor).
                    found.append(f"{tname}: shape {list(entry.shape)} in the checkpoint does not fit parameter "
                                 f"{par.names[0]!r} of shape {list(p.shape)}; its optimizer state is not loaded")
                    break
                else:
                    dest = _unlike_param(tname, entry, dtype)
                dests.setdefault(idx, {})[k] = dest
            if found:
                # All of a parameter's state or none of it: a step with half its moments would fail.
                dests.pop(idx, None)
                unfit.add(idx)
                differences.extend(found)
                continue
            for k, dest in dests.get(idx, {}).items():
                target.shards.extend(tensor_shards(f"{prefix}{par.names[0]}{SEP}{k}", dest))
        match_saved_names(target.shards, manifest, target.prefix)
        return differences or None

    def check(objects) -> list[str]:
        """Param groups that do not fit (count, or the parameters in a group): with strict=False
        the optimizer keeps its own groups and loads the state of the parameters that match."""
        saved = objects.get(key)
        if saved is None or dropped:
            return []
        saved_groups = saved["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            mismatched_groups.append(True)
            return [f"{key}: the checkpoint has {len(saved_groups)} param groups, the optimizer has "
                    f"{len(optimizer.param_groups)}; its param groups (learning rates...) are not loaded"]
        diffs, start = [], 0
        for gi, (sg, tg) in enumerate(zip(saved_groups, optimizer.param_groups)):
            count = len(tg["params"])
            mine = [name for par in params[start:start + count] for name in par.names]
            # After transforms the saved groups still name the saved parameters; the state tensors
            # were renamed with them, so groups match by position and the target's names stand.
            theirs = {canonical_name(n) if isinstance(n, str) else n for n in sg["params"]}
            if theirs != set(mine) and not any(renamed):
                diffs.append(f"{key}: param group {gi} holds {sorted(theirs ^ set(mine), key=str)[:5]} "
                             "in only one of checkpoint and optimizer; its param groups are not loaded")
            start += count
        if diffs:
            mismatched_groups.append(True)
        return diffs

    def finish(objects) -> None:
        saved = objects.get(key)
        if saved is None or dropped:
            return
        extra = {canonical_name(n) if isinstance(n, str) else n: v for n, v in saved.get("state", {}).items()}
        state = {}
        for idx, par in enumerate(params):
            if par.flat is not None and par.flat.numel == 0:
                # a use_orig_params view with nothing on this rank: FSDP1 gives it no state either
                continue
            if idx in unfit:   # strict=False: it keeps its own state, which fits it
                st = dict(optimizer.state.get(par.param, {}))
            else:
                st = dict(extra.get(par.names[0], {}))
                st.update(dests.get(idx, {}))
            if st:
                state[idx] = st
        if mismatched_groups or check(objects):   # strict=False: check() already reported why
            groups = optimizer.state_dict()["param_groups"]
        else:
            groups, start = [], 0
            for sg, tg in zip(saved["param_groups"], optimizer.param_groups):
                count = len(tg["params"])
                # A range, not a list: load_state_dict looks each state entry's index up in its
                # group's "params" (`in`), which is a scan of a list: 18k entries took a second.
                groups.append({**sg, "params": range(start, start + count)})
                start += count
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    target.prepare = prepare
    target.check = check
    target.finish = finish
    return target


# ---- DCP's flattened layout (torchtitan's OptimizersContainer) -------------------------------------
def _flat_key(name: str) -> tuple[str, str, str]:
    """("state" or "param_groups", canonical parameter name, state key or group field) of a key of
    the flattened layout, e.g. "state.layers.0.attn.wq.weight.exp_avg"; state keys and group fields
    hold no dot."""
    kind, _, rest = name.partition(".")
    fqn, _, field = rest.rpartition(".")
    if not fqn or not field:
        raise UnsupportedError(f"optimizer state {name!r}: a key of a flattened optimizer state dict is "
                               "'state.<parameter>.<state key>' or 'param_groups.<parameter>.<field>'")
    return kind, canonical_name(fqn), field


def save_flat_optimizer(key: str, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> SaveItems:
    """Save a flattened optimizer state dict (`flat_layout`) as omnickpt's optimizer layout: state
    tensors as "<key>/state/<fqn>/<state key>" (DTensors by their boxes, plain tensors whole), the
    param groups and non-tensor state as one object, parameters named, as DCP's reader of such
    checkpoints makes them (formats/dcp): so torchtitan's DCP checkpoints load into the container,
    and its checkpoints reshard like any optimizer's."""
    items = SaveItems(framework=optimizer_kind(optimizer))
    extra: dict[str, dict[str, Any]] = {}
    fields: dict[str, dict[str, Any]] = {}
    for name, v in osd.items():
        kind, fqn, field = _flat_key(name)
        if kind == "param_groups":
            fields.setdefault(fqn, {})[field] = v
        elif isinstance(v, torch.Tensor):
            items.shards.extend(tensor_shards(f"{key}{SEP}state{SEP}{fqn}{SEP}{field}", _nograd(v)))
        else:
            extra.setdefault(fqn, {})[field] = v
    # The flattened layout repeats a group's fields for each parameter: parameters with the same
    # fields are one group (as the DCP reader groups them).
    groups: dict[str, dict[str, Any]] = {}
    for fqn, f in fields.items():
        groups.setdefault(repr(sorted(f.items())), {**f, "params": []})["params"].append(fqn)
    items.objects[key] = {"param_groups": list(groups.values()), "state": extra}
    return items


def load_flat_optimizer(key: str, optimizer: torch.optim.Optimizer, current: dict[str, Any]) -> LoadTarget:
    """Load omnickpt's optimizer layout (saved by save_flat_optimizer, by a torch optimizer over the
    same parameters, or read from a DCP checkpoint) into an optimizer whose state_dict() is
    flattened. `current`, its state_dict() now, gives the destinations (its state tensors, filled in
    place) and the keys; the filled dict goes to its load_state_dict()."""
    target = LoadTarget(prefix=f"{key}{SEP}", objects=[key], framework=optimizer_kind(optimizer))
    own: dict[str, set[str]] = {}     # canonical parameter name -> its tensor state keys
    flat_names: dict[tuple[str, str, str], str] = {}
    for name, v in current.items():
        kind, fqn, field = _flat_key(name)
        flat_names[kind, fqn, field] = name
        if kind == "state" and isinstance(v, torch.Tensor):
            own.setdefault(fqn, set()).add(field)
            target.shards.extend(tensor_shards(f"{key}{SEP}state{SEP}{fqn}{SEP}{field}", _nograd(v)))
    params = {fqn for _, fqn, _ in flat_names}
    dropped: list[bool] = []    # set by prepare: the checkpoint's state does not fit, install nothing

    def prepare(manifest) -> list[str] | None:
        match_saved_names(target.shards, manifest, target.prefix)
        prefix = f"{key}{SEP}state{SEP}"
        saved: dict[str, set[str]] = {}
        for tname in manifest.tensors:
            if tname.startswith(prefix):
                fqn, _, k = tname[len(prefix):].rpartition(SEP)
                saved.setdefault(canonical_name(fqn), set()).add(k)
        for fqn, keys in own.items():
            if fqn in saved and saved[fqn] != keys:
                saved_kind = (manifest.layout.get("frameworks") or {}).get(key) or "an unrecorded optimizer class"
                dropped.append(True)
                target.shards.clear()
                target.objects.clear()
                return [f"{key}: the checkpoint's optimizer state does not fit this optimizer: parameter {fqn!r} has "
                        f"state {sorted(saved[fqn])} in the checkpoint (saved by {saved_kind}) but {sorted(keys)} in "
                        f"the optimizer ({optimizer_kind(optimizer)}); load into an optimizer of the kind and options "
                        "it was saved with, or pass strict=False to load the rest and leave this one as it is"]
        return None

    def check(objects) -> list[str]:
        saved = objects.get(key)
        if saved is None or dropped:
            return []
        if not torch_layout(saved):
            return [f"{key}: the checkpoint's entry {key!r} is not an optimizer's state (no param_groups); load it "
                    "into what it was saved from"]
        covered = {canonical_name(n) for g in saved["param_groups"] for n in g.get("params", ()) if isinstance(n, str)}
        missing = sorted(params - covered)
        if not missing:
            return []
        return [f"{key}: the checkpoint's param groups hold no settings (lr...) for {len(missing)} parameter(s) of "
                f"the optimizer, such as {missing[:3]}; they keep their own"]

    def finish(objects) -> None:
        saved = objects.get(key)
        if saved is None or dropped or not torch_layout(saved):
            return
        flat = dict(current)    # its state tensors are filled in place already
        for group in saved["param_groups"]:
            for param in group.get("params", ()):
                fqn = canonical_name(param) if isinstance(param, str) else param
                if fqn not in params:
                    continue
                for field, v in group.items():
                    if field != "params":
                        flat[flat_names.get(("param_groups", fqn, field), f"param_groups.{fqn}.{field}")] = v
        for param, st in saved["state"].items():
            fqn = canonical_name(param) if isinstance(param, str) else param
            if fqn in params:
                for field, v in st.items():
                    flat[flat_names.get(("state", fqn, field), f"state.{fqn}.{field}")] = v
        optimizer.load_state_dict(flat)

    target.prepare = prepare
    target.check = check
    target.finish = finish
    return target
