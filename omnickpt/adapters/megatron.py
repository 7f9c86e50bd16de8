"""Megatron-core adapter: a model's `sharded_state_dict()` (and its optimizer's) <-> boxes.

Megatron already says, for every local tensor, which part of which global tensor it is
(mapping.py's ShardedTensor), so this adapter only translates records:

- ShardedTensor(key, data, global_shape, global_offset, prepend_axis_num, flattened_range):
  the box starts at `global_offset`; its lengths are 1 for each of the `prepend_axis_num`
  leading axes (the layer index under the default stacked layout: a pipeline stage holds the
  boxes of its own layers of `decoder.layers.*` [num_layers, ...]) followed by `local_shape`.
  A `flattened_range` (distributed optimizer state) is a contiguous range of that local box's
  row-major flattening: it becomes at most 2*ndim-1 boxes (layout.flat_range_to_boxes).
  `replica_id` is not needed: replicas claim identical boxes and the save planner writes each
  box once. `axis_fragmentations` only restates the offsets.
- ShardedTensorFactory (SwiGLU `linear_fc1` [gate; up] under TP): saved as the ShardedTensors
  its `build()` makes; on load `build()` makes the destinations, and after they are filled its
  `merge_fn` turns them back into the local tensor, installed with `load_state_dict`.
- ShardedObject: one object per object shard, keyed by its `unique_key` (key, offset, shape),
  so the rank that needs it on load finds it whatever rank saved it.
- Everything else in the sharded state dict (an optimizer's param_groups, its common step) is
  common state: saved per rank, loaded from the lowest saving rank (Megatron keeps rank 0's),
  and merged back under the target's sharded values. LocalNonpersistentObjects stay local.

Names: model tensors are "<state key>/<ShardedTensor key>"; optimizer state tensors
"<optimizer key>/state/<parameter key>/<exp_avg|...>" (Megatron's "optimizer.state.exp_avg.<param
key>"), so transforms declared on a parameter name also apply to its optimizer state.

Optimizers: a Megatron optimizer (anything with `sharded_state_dict(model_sharded_state_dict,
is_loading)` and `load_state_dict`, e.g. FP32Optimizer) is saved through its own sharded state
dict. A plain `torch.optim` optimizer over a Megatron model's parameters is saved the way
Megatron's FP32Optimizer saves its inner optimizer (state sharded like the parameters, one
common step), so the two checkpoints are interchangeable.

Megatron is imported only when the state already contains Megatron objects.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard, empty_claim
from omnickpt.errors import MismatchError, UnsupportedError
from omnickpt.layout import Box, flat_range_to_boxes

_STATE_PREFIX = "optimizer.state."      # Megatron's prefix for optimizer state ShardedTensors
_COMMON_STEP = "common_step"


# ---------------------------------------------------------------------- detection
def _mcore_class(module: str, name: str):
    """A Megatron class if Megatron is already imported (else nothing can be an instance of it)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_megatron_module(value: Any) -> bool:
    cls = _mcore_class("megatron.core.transformer.module", "MegatronModule")
    return cls is not None and isinstance(value, cls) and callable(getattr(value, "sharded_state_dict", None))


def is_megatron_optimizer(value: Any) -> bool:
    """A megatron.core.optimizer optimizer (its own sharded_state_dict(model_sd, is_loading))."""
    cls = _mcore_class("megatron.core.optimizer.optimizer", "MegatronOptimizer")
    return cls is not None and isinstance(value, cls)


def megatron_modules(state: dict) -> dict[str, nn.Module]:
    return {k: v for k, v in state.items() if is_megatron_module(v)}


def owns_optimizer(value: Any, state: dict) -> bool:
    """True for an optimizer this adapter must handle: a Megatron optimizer, or a torch.optim
    optimizer over parameters of a Megatron model in the same state (the generic optimizer
    adapter would save their TP-local state as if it were whole tensors)."""
    if is_megatron_optimizer(value):
        return True
    if not isinstance(value, torch.optim.Optimizer):
        return False
    models = megatron_modules(state)
    if not models:
        return False
    owned = {id(p) for m in models.values() for p in m.parameters()}
    return any(id(p) in owned for g in value.param_groups for p in g["params"])


class MegatronModelAdapter(Adapter):
    """Megatron-core modules (MegatronModule with sharded_state_dict()); before the module adapter."""
    name = "megatron"
    frameworks = {"megatron": frozenset({"megatron"})}

    def claims(self, value: Any, state: dict) -> bool:
        return is_megatron_module(value)

    def detect(self, value: Any) -> str | None:
        return "megatron"

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_megatron_model(key, value)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_megatron_model(key, value)


class MegatronOptimizerAdapter(Adapter):
    """Megatron optimizers, and torch optimizers over a Megatron model's parameters (`owns_optimizer`);
    before the torch optimizer adapter."""
    name = "megatron-optimizer"

    def claims(self, value: Any, state: dict) -> bool:
        return owns_optimizer(value, state)

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_megatron_optimizer(key, value, state)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_megatron_optimizer(key, value, state)


# ---------------------------------------------------------------------- sharded state dict walking
def _mapping():
    from megatron.core.dist_checkpointing import mapping
    return mapping


def _leaves(tree: Any) -> Iterator[Any]:
    """Every leaf of nested dicts/lists (as in Megatron's dict_utils, a tuple is a leaf)."""
    if isinstance(tree, (dict, list)):
        for v in (tree.values() if isinstance(tree, dict) else tree):
            yield from _leaves(v)
    else:
        yield tree


def _map_tree(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tree(v, fn) for v in tree]
    return fn(tree)


_DROP = object()


def _common(tree: Any, is_sharded: Callable[[Any], bool]) -> Any:
    """The tree without its sharded and local-only leaves (what Megatron calls common state).
    Containers that only held such leaves disappear; containers that were empty stay."""
    if isinstance(tree, (dict, list)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        kept = {k: _common(v, is_sharded) for k, v in items}
        kept = {k: v for k, v in kept.items() if v is not _DROP}
        if tree and not kept:
            return _DROP
        return kept if isinstance(tree, dict) else list(kept.values())
    return _DROP if is_sharded(tree) else tree


def _overlay(target: Any, common: Any, where: str) -> Any:
    """The target's sharded tree with the checkpoint's common values put in (Megatron's merge of
    common and sharded state): sharded and local-only leaves of the target win."""
    m = _mapping()
    if isinstance(target, (m.ShardedBase, m.LocalNonpersistentObject)):
        return target
    if isinstance(target, dict) and isinstance(common, dict):
        out = dict(target)
        for k, v in common.items():
            out[k] = _overlay(target[k], v, f"{where}/{k}") if k in target else v
        return out
    if isinstance(target, list) and isinstance(common, list):
        if len(target) != len(common):
            raise MismatchError(
                f"{where}: the checkpoint has {len(common)} entries, the target {len(target)} (e.g. a different "
                "number of optimizer param groups); build the target like the saving job",
                [f"{where}: {len(common)} entries in the checkpoint, {len(target)} in the target"])
        return [_overlay(t, c, f"{where}/{i}") for i, (t, c) in enumerate(zip(target, common))]
    return common


# ---------------------------------------------------------------------- ShardedTensor -> boxes
def tensor_boxes(sh) -> list[tuple[Box, torch.Tensor]]:
    """The boxes (global coordinates) of a Megatron ShardedTensor, each with the view of its data
    that holds it (the same memory: filling the view on load fills the tensor)."""
    pre = sh.prepend_axis_num
    lead_off, lead_len = tuple(int(o) for o in sh.global_offset[:pre]), (1,) * pre
    local_off = tuple(int(o) for o in sh.global_offset[pre:])
    local_shape = tuple(int(n) for n in sh.local_shape)
    data = sh.data
    if sh.flattened_range is None:
        if tuple(data.shape) != local_shape:
            raise UnsupportedError(f"Megatron tensor {sh.key!r}: data shape {tuple(data.shape)} differs from its "
                                   f"local_shape {local_shape}")
        return [(Box(lead_off + local_off, lead_len + local_shape), data[(None,) * pre])]
    start, stop = sh.flattened_range.start or 0, sh.flattened_range.stop
    out, at = [], 0
    for b in flat_range_to_boxes(local_shape, start, stop - start):
        piece = data[at:at + b.numel].view(lead_len + b.lengths)
        at += b.numel
        out.append((Box(lead_off + tuple(o + lo for o, lo in zip(b.offsets, local_off)), lead_len + b.lengths),
                    piece))
    return out


def _tensor_name(prefix: str, key: str, optimizer: bool) -> str:
    if optimizer and key.startswith(_STATE_PREFIX):
        state_key, _, param_key = key[len(_STATE_PREFIX):].partition(".")
        if state_key and param_key:
            return f"{prefix}{SEP}state{SEP}{param_key}{SEP}{state_key}"
    return f"{prefix}{SEP}{key}"


def _shards(prefix: str, sh, optimizer: bool) -> list[TensorShard]:
    if sh.data is None:
        raise UnsupportedError(f"Megatron tensor {sh.key!r} under {prefix!r} has no data")
    name = _tensor_name(prefix, sh.key, optimizer)
    shape = tuple(int(n) for n in sh.global_shape)
    return [TensorShard(name, shape, sh.dtype, box, local) for box, local in tensor_boxes(sh)]


def _object_key(prefix: str, obj) -> str:
    return f"{prefix}{SEP}{obj.unique_key}"


def _build_factories(tree: Any) -> tuple[Any, dict[int, Any]]:
    """(the tree with each ShardedTensorFactory replaced by what its build() makes, {id(factory):
    that sub-tree}). Each factory is built once: on load the built tensors are the destinations
    that _materialize later hands to the factory's merge_fn."""
    m = _mapping()
    built: dict[int, Any] = {}

    def leaf(x):
        if isinstance(x, m.ShardedTensorFactory):
            built[id(x)] = x.build()
            return _map_tree(built[id(x)], leaf)
        return x

    return _map_tree(tree, leaf), built


def _flatten(prefix: str, tree: Any, optimizer: bool) -> tuple[list[TensorShard], dict[str, Any]]:
    """The tensor shards and the object shards (by object key) of a tree with factories built."""
    m = _mapping()
    shards: list[TensorShard] = []
    objects: dict[str, Any] = {}
    for leaf in _leaves(tree):
        if isinstance(leaf, m.ShardedTensor):
            shards.extend(_shards(prefix, leaf, optimizer))
        elif isinstance(leaf, m.ShardedObject):
            objects[_object_key(prefix, leaf)] = leaf
        elif isinstance(leaf, m.ShardedBase):
            raise UnsupportedError(f"{prefix}: Megatron {type(leaf).__name__} {leaf.key!r} is not supported")
    return shards, objects


def _is_sharded(leaf) -> bool:
    m = _mapping()
    return isinstance(leaf, (m.ShardedBase, m.LocalNonpersistentObject))


def _save_tree(key: str, tree: Any, optimizer: bool, framework: str | None) -> SaveItems:
    shards, objects = _flatten(key, _build_factories(tree)[0], optimizer)
    items = SaveItems(shards=shards, framework=framework)
    for okey, obj in objects.items():
        items.objects[okey] = obj.data
    common = _common(tree, _is_sharded)
    if common is not _DROP and common != {}:
        items.objects[key] = common
    return items


# ---------------------------------------------------------------------- load
def _materialize(tree: Any, built: dict[int, Any], objects: dict[str, Any], prefix: str) -> Any:
    """Megatron's loaded state dict: filled tensors, merged factories, loaded object shards."""
    m = _mapping()

    def leaf(x):
        if isinstance(x, m.ShardedTensor):
            return x.data
        if isinstance(x, m.ShardedTensorFactory):
            # The tensors the factory built were filled; merge_fn makes the local tensor of them.
            return x.merge_fn(_map_tree(built[id(x)], leaf))
        if isinstance(x, m.ShardedObject):
            return objects.get(_object_key(prefix, x), x.data)
        if isinstance(x, m.LocalNonpersistentObject):
            return x.unwrap()
        return x

    return _map_tree(tree, leaf)


def _module_path(key: str) -> str:
    return key.rpartition(".")[0]


def _other_stage_claims(target: LoadTarget, manifest, local_keys: set[str], key_of: Callable[[str], str | None]) -> None:
    """Under pipeline parallelism a stage holds only its own modules (the first the embedding,
    the last the output layer): tensors of modules this stage does not build are another
    stage's, not a difference. Tensors of modules it does build are still checked."""
    local_paths = {_module_path(k) for k in local_keys}
    have = {s.name for s in target.shards}
    for name, entry in manifest.tensors.items():
        if name in have or not name.startswith(target.prefix):
            continue
        k = key_of(name)
        if k is not None and _module_path(k) not in local_paths:
            target.shards.append(empty_claim(name, entry))


def _pipeline_parallel(modules) -> bool:
    return any(getattr(getattr(m, "config", None), "pipeline_model_parallel_size", 1) > 1 for m in modules)


def _wanted_objects(target: LoadTarget, manifest, key: str, objects: dict[str, Any], common_required: bool) -> None:
    target.objects.extend(objects)
    # A model usually has no common state (it is then not saved); an optimizer always has some,
    # so a checkpoint without it is reported as a difference.
    if common_required or key in manifest.objects:
        target.objects_from_all_ranks.append(key)


def _lowest_rank(value: dict | None) -> Any:
    return None if not value else value[min(value)]


# ---------------------------------------------------------------------- model
def save_megatron_model(key: str, module: nn.Module) -> SaveItems:
    with torch.no_grad():
        return _save_tree(key, module.sharded_state_dict(), False, "megatron")


def load_megatron_model(key: str, module: nn.Module) -> LoadTarget:
    tree = module.sharded_state_dict()
    flat, built = _build_factories(tree)
    shards, objects = _flatten(key, flat, False)
    target = LoadTarget(prefix=f"{key}{SEP}", shards=shards, framework="megatron")
    local_keys = {s.name[len(target.prefix):] for s in shards}

    def prepare(manifest) -> None:
        _wanted_objects(target, manifest, key, objects, False)
        if _pipeline_parallel([module]):
            _other_stage_claims(target, manifest, local_keys, lambda n: n[len(target.prefix):])

    def finish(loaded: dict) -> None:
        values = {k: loaded[k] for k in objects if k in loaded}
        common = _lowest_rank(loaded.get(key))
        merged = _overlay(tree, common, key) if common is not None else tree
        state = _materialize(merged, built, values, key)
        own = module.state_dict(keep_vars=True)
        # Tensors read in place are the module's own: only what was rebuilt (factories merged
        # from their parts, objects) goes through load_state_dict.
        install = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and own.get(k) is v)}
        if install:
            with torch.no_grad():
                module.load_state_dict(install, strict=False)

    target.prepare = prepare
    target.finish = finish
    return target


# ---------------------------------------------------------------------- optimizer
def _model_sharded_state_dict(key: str, state: dict) -> dict:
    models = megatron_modules(state)
    if not models:
        raise UnsupportedError(f"{key}: a Megatron optimizer needs its Megatron model in the same state dict "
                               "(its state is sharded like the model's parameters)")
    # Only the ShardedTensors matter (found by their data, the parameters), not the dict keys.
    return {mkey: m.sharded_state_dict() for mkey, m in models.items()}


def _torch_sharded_state_dict(key: str, optimizer: torch.optim.Optimizer, model_sd: dict,
                              state_dict: dict) -> dict:
    """What Megatron's FP32Optimizer.sharded_state_dict makes of its inner torch optimizer:
    every state tensor sharded like its parameter, the per-parameter steps as one common step."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    steps = {}
    for idx, st in state_dict["state"].items():
        if "step" in st:
            steps[idx] = st["step"]
    values = {float(s) for s in steps.values()}
    if len(values) > 1:
        raise UnsupportedError(f"{key}: the optimizer's step differs between parameters ({sorted(values)[:4]}); "
                               "Megatron checkpoints keep one step for all parameters")
    missing = [tuple(params[i].shape) for i in state_dict["state"] if i not in id_map]
    if missing:
        raise UnsupportedError(f"{key}: the optimizer holds parameters of shapes {missing[:4]} that are in no "
                               "Megatron model's sharded_state_dict() in the saved state")
    optim_state_to_sharding_state(state_dict, id_map, exclude_keys=("step",))
    if steps:
        state_dict["state"][_COMMON_STEP] = next(iter(steps.values()))
    return state_dict


def save_megatron_optimizer(key: str, optimizer, state: dict) -> SaveItems:
    model_sd = _model_sharded_state_dict(key, state)
    with torch.no_grad():
        if is_megatron_optimizer(optimizer):
            tree = optimizer.sharded_state_dict(model_sd, is_loading=False)
        else:
            tree = _torch_sharded_state_dict(key, optimizer, model_sd, optimizer.state_dict())
    return _save_tree(key, tree, True, None)


def _state_keys(manifest, key: str) -> dict[str, dict[str, Any]]:
    """parameter key -> {state key: manifest entry} of the optimizer state in the checkpoint."""
    prefix = f"{key}{SEP}state{SEP}"
    out: dict[str, dict[str, Any]] = {}
    for name, entry in manifest.tensors.items():
        if name.startswith(prefix):
            pkey, _, k = name[len(prefix):].rpartition(SEP)
            out.setdefault(pkey, {})[k] = entry
    return out


def load_megatron_optimizer(key: str, optimizer, state: dict) -> LoadTarget:
    model_sd = _model_sharded_state_dict(key, state)
    target = LoadTarget(prefix=f"{key}{SEP}")
    held: dict[str, Any] = {}

    def torch_destinations(manifest) -> dict:
        # Destinations for the checkpoint's state of each parameter: the optimizer's own tensors
        # where they exist, else new zeros shaped like the parameter. The optimizer is not
        # touched until everything is read.
        from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
        from omnickpt.format.manifest import dtype_from_name
        params = [p for g in optimizer.param_groups for p in g["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        saved = _state_keys(manifest, key)
        sd = optimizer.state_dict()
        state_dict = {"state": {}, "param_groups": sd["param_groups"]}
        for idx, sh in id_map.items():
            p, cur = params[idx], optimizer.state.get(params[idx], {})
            for k, entry in saved.get(sh.key, {}).items():
                dtype = dtype_from_name(entry.dtype)
                have = cur.get(k)
                ok = isinstance(have, torch.Tensor) and have.shape == p.shape and have.dtype == dtype
                state_dict["state"].setdefault(idx, {})[k] = have.detach() if ok else torch.zeros_like(
                    p.detach(), dtype=dtype)
        return _torch_sharded_state_dict(key, optimizer, model_sd, state_dict)

    def prepare(manifest) -> None:
        with torch.no_grad():
            if is_megatron_optimizer(optimizer):
                tree = optimizer.sharded_state_dict(model_sd, is_loading=True)
            else:
                tree = torch_destinations(manifest)
        flat, built = _build_factories(tree)
        shards, objects = _flatten(key, flat, True)
        held.update(tree=tree, built=built, objects=objects)
        target.shards.extend(shards)
        _wanted_objects(target, manifest, key, objects, True)
        if _pipeline_parallel(megatron_modules(state).values()):
            state_prefix = f"{key}{SEP}state{SEP}"
            local = {s.name[len(state_prefix):].rpartition(SEP)[0] for s in shards if s.name.startswith(state_prefix)}
            _other_stage_claims(target, manifest, local,
                                lambda n: n[len(state_prefix):].rpartition(SEP)[0] if n.startswith(state_prefix) else None)

    def finish(loaded: dict) -> None:
        common = _lowest_rank(loaded.get(key))
        if common is None:
            return   # nothing of this optimizer in the checkpoint (strict=False)
        tree = _overlay(held["tree"], common, key)
        values = {k: loaded[k] for k in held["objects"] if k in loaded}
        osd = _materialize(tree, held["built"], values, key)
        if is_megatron_optimizer(optimizer):
            optimizer.load_state_dict(osd)
            return
        step = osd["state"].pop(_COMMON_STEP, None)
        if step is not None:
            for st in osd["state"].values():
                st["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        optimizer.load_state_dict(osd)

    target.prepare = prepare
    target.finish = finish
    return target
