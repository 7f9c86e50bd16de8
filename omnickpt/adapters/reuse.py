"""What the adapters collected for a state whose layout did not change, reused by the next save.

Collecting a module's or an optimizer's shards walks state_dict() and builds a record per tensor:
~25 us a tensor, most of an async save's stall for an 18k-tensor MoE state (0.3-0.6 s of it).
Between two saves of a training loop nothing of that changes but the values, so a `SaveMemo` (one
per Checkpointer and process group) keeps each entry's SaveItems with a fingerprint of what they
were made from, and the next save reuses them when the fingerprint is unchanged.

The fingerprint is what the shards depend on, read straight from the objects without
state_dict(): a module's tree (every submodule's class, the names of its parameters, buffers and
children, which buffers are persistent, the state_dict hooks registered) and an optimizer's
parameter groups and per-parameter state keys; for every tensor its identity and its data's shape,
dtype, strides and address, and for a DTensor its spec (placements, device mesh, global shape and
dtype) and its local shard's identity, address, shape and contiguity. The memo holds a reference to
everything it compared by identity, so an id() it holds is never reused by another object. Values
are never cached: a snapshot reads the tensors themselves when it copies them.

Only entries whose state_dict() is exactly that walk are memoised (plain, DDP, FSDP2 and DTensor
modules whose classes leave state_dict alone and keep no extra state; torch optimizers whose
state_dict is torch's, over parameters of such modules): the first save of an entry checks that
its state_dict() names the walk's tensors, in order, and any other entry (FSDP1, DeepSpeed,
Megatron, hooks of its own, a custom state_dict) is collected anew on every save, as before.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import sys
from itertools import chain, compress, repeat
from operator import attrgetter, not_

import torch
from torch import nn

from omnickpt.adapters.base import SEP, Adapter, SaveItems
from omnickpt.adapters.module import ModuleAdapter, is_fsdp1, unwrap
from omnickpt.adapters.optimizer import OptimizerAdapter, state_modules, torch_layout

class SaveMemo:
    """The last SaveItems of each module and optimizer entry of a state, with their fingerprints.
    Owned by a Checkpointer (one per process group); not thread-safe (saves of one Checkpointer run
    on the training thread)."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.hits = 0      # entries reused (tests count them)
        self.misses = 0    # entries collected anew that could have been reused

    def clear(self) -> None:
        self.entries.clear()


class _Entry:
    """One state entry's memo: the value it was made from, its fingerprint and SaveItems."""

    def __init__(self, value: Any, adapter: Adapter, walk: Any, sig: list, items: SaveItems):
        self.value, self.adapter, self.walk, self.sig, self.items = value, adapter, walk, sig, items


def collect_reusing(state: dict, claimed: Sequence[tuple[str, Any, Adapter]], memo: SaveMemo, check_new: Callable
                    ) -> tuple[list[tuple[str, SaveItems]], bool]:
    """What every entry of `state` saves (`claimed`: each key, value and the adapter that claims
    it), reusing `memo` for module and optimizer entries whose fingerprint is unchanged.
    `check_new(list of (key, SaveItems))` refuses what the format cannot hold in the entries
    collected anew (those reused were checked when first collected). Returns (what every entry
    saves, in state order; whether every entry holding tensors was reused, so that what the caller
    derived from the shards last time holds too)."""
    out: dict[str, SaveItems] = {}
    fresh: list[tuple[str, SaveItems]] = []
    all_reused = True
    # Modules first: an optimizer names its tensors after the parameters of the modules beside
    # it, so it is reused only when every module of the state is.
    modules_reused = True
    for key, value, adapter in claimed:
        if isinstance(value, nn.Module):
            items = _reuse(memo, key, value, adapter, state, modules_reused=True)
            modules_reused &= items is not None
            if items is not None:
                out[key] = items
    for key, value, adapter in claimed:
        if key in out:
            continue
        items = None
        if not isinstance(value, nn.Module):
            items = _reuse(memo, key, value, adapter, state, modules_reused=modules_reused)
        if items is not None:
            out[key] = items
            continue
        items = adapter.save_items(key, value, state)
        fresh.append((key, items))
        out[key] = items
        if items.shards:
            all_reused = False
    check_new(fresh)   # before anything is memoised: a refused entry must be refused again next time
    renewed = {k for k, _ in fresh}
    for key, value, adapter in claimed:
        if key in renewed:
            memo.entries.pop(key, None)
            _remember(memo, key, value, adapter, state, out[key])
    for key in [k for k in memo.entries if k not in state]:   # no reference kept to what left the state
        del memo.entries[key]
    return [(k, out[k]) for k, _, _ in claimed], all_reused


def _reuse(memo: SaveMemo, key: str, value: Any, adapter: Adapter, state: dict, *, modules_reused: bool
           ) -> SaveItems | None:
    entry = memo.entries.get(key)
    if entry is None or entry.value is not value or entry.adapter is not adapter:
        return None
    if isinstance(value, nn.Module):
        if unwrap(value) is not entry.walk[0][0]:
            return None
        ok = _module_sig(entry.walk) == entry.sig
        items = entry.items if ok else None
    else:
        items = None
        if modules_reused and entry.walk.modules == _module_entries(state):
            sig, extra = _optimizer_sig(value, entry.walk)
            if sig == entry.sig:
                items = _optimizer_items(value, entry.walk, entry.items, extra)
    if items is None:
        memo.misses += 1
        del memo.entries[key]
        return None
    memo.hits += 1
    return items


def _remember(memo: SaveMemo, key: str, value: Any, adapter: Adapter, state: dict, items: SaveItems) -> None:
    """Memoise entry `key` just collected anew, when its kind is one whose fingerprint says
    everything its SaveItems depend on (see the module docstring)."""
    if type(adapter) is ModuleAdapter and isinstance(value, nn.Module):
        walk = _module_walk(unwrap(value))
        if walk is not None and not items.objects and _walk_is_state_dict(walk, items, key):
            memo.entries[key] = _Entry(value, adapter, walk, _module_sig(walk), items)
    elif type(adapter) is OptimizerAdapter and isinstance(value, torch.optim.Optimizer):
        walk = _optimizer_walk(key, value, state, items)
        if walk is not None:
            memo.entries[key] = _Entry(value, adapter, walk, _optimizer_sig(value, walk)[0], items)


# ---------------------------------------------------------------------------- modules
def _module_walk(root: nn.Module) -> list[tuple[nn.Module, str]] | None:
    """(module, prefix) in the order state_dict() visits them (a shared submodule once per place);
    None when a module of the tree saves otherwise than its parameters and persistent buffers
    (its own state_dict or _save_to_state_dict, extra state, hooks other than FSDP2's)."""
    out: list[tuple[nn.Module, str]] = []
    stack = [(root, "")]
    while stack:
        m, prefix = stack.pop()
        cls = type(m)
        if (cls.state_dict is not nn.Module.state_dict or cls._save_to_state_dict is not nn.Module._save_to_state_dict
                or getattr(cls, "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state
                or m._state_dict_hooks or not all(_benign_pre_hook(h) for h in m._state_dict_pre_hooks.values())):
            return None
        out.append((m, prefix))
        stack.extend((c, f"{prefix}{n}.") for n, c in reversed(list(m._modules.items())) if c is not None)
    return out


def _benign_pre_hook(hook: Any) -> bool:
    """FSDP2's state_dict pre-hook (to_sharded_hook) only puts sharded parameters back in place of
    unsharded ones: a module whose registered parameters are the sharded ones of the last save
    (the fingerprint compares them) gets nothing from it."""
    return (getattr(hook, "__name__", "") == "to_sharded_hook"
            and getattr(hook, "__module__", "").startswith("torch.distributed.fsdp"))


def _module_sig(walk: list[tuple[nn.Module, str]]) -> list:
    """The fingerprint of a module tree walked earlier (see the module docstring). Built from
    whole lists by map() rather than an attribute read per module in Python: it runs on every
    save, and a model has thousands of modules."""
    mods = [m for m, _ in walk]
    params = list(map(_PARAMETERS, mods))
    buffers = list(map(_BUFFERS, mods))
    children = list(map(_MODULES, mods))
    kids = list(chain.from_iterable(map(dict.values, children)))
    sig: list = [list(map(type, mods)), list(map(tuple, params)), list(map(tuple, buffers)),
                 list(map(tuple, children)), list(map(id, kids)), _Held(kids),
                 list(map(tuple, map(_NON_PERSISTENT, mods))), list(map(tuple, map(_PRE_HOOKS, mods))),
                 list(map(len, map(_POST_HOOKS, mods)))]
    tensors = [t for t in chain(chain.from_iterable(map(dict.values, params)),
                                chain.from_iterable(map(dict.values, buffers))) if t is not None]
    sig += _tensors_sig(tensors)
    return sig


_PARAMETERS, _BUFFERS, _MODULES = attrgetter("_parameters"), attrgetter("_buffers"), attrgetter("_modules")
_NON_PERSISTENT, _PRE_HOOKS = attrgetter("_non_persistent_buffers_set"), attrgetter("_state_dict_pre_hooks")
_POST_HOOKS = attrgetter("_state_dict_hooks")
_SHAPE_DTYPE, _SHAPE = attrgetter("shape", "dtype"), attrgetter("shape")
_LOCAL, _SPEC = attrgetter("_local_tensor"), attrgetter("_spec")
_SPEC_PARTS = (attrgetter("placements"), attrgetter("mesh"), attrgetter("tensor_meta"))


def _tensors_sig(tensors: list) -> list:
    """The tensors' part of a fingerprint: their identities and which are DTensors; for a plain
    tensor its shape, dtype, strides and address (a detached view the memo holds is stale once the
    tensor's data is replaced); for a DTensor its spec by identity with its placements, mesh and
    tensor_meta (global shape, stride, dtype), and its local shard's identity, address, shape and
    contiguity: a redistributed or converted DTensor gets a new spec and local shard (module._apply
    swaps both into the same parameter object; FSDP2 assigns a new local shard when it pads one). The
    local shard's dtype and strides are not read (timeit: 0.4 us a tensor, 5 ms of the 12,000 DTensor
    moments of an 18k-tensor Adam state): its dtype is the spec's, and a contiguous shard of an
    unchanged shape and address has unchanged strides. What is left unseen is an in-place edit of a
    DTensor's private shard that keeps its object, address, shape and contiguity (a view of another
    dtype set into it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None:
        is_dt: list = []
        dts, plain = [], tensors
    else:
        is_dt = list(map(isinstance, tensors, repeat(mod.DTensor)))
        dts = list(compress(tensors, is_dt))
        plain = list(compress(tensors, map(not_, is_dt))) if dts else tensors
    locals_ = list(map(_LOCAL, dts))
    specs = list(map(_SPEC, dts))
    parts = [list(map(get, specs)) for get in _SPEC_PARTS]
    # strides too: an in-place transpose of a square tensor (t_(), transpose_) keeps its address,
    # shape and dtype, and a reused layout would write its bytes in the old order
    return [list(map(id, tensors)), is_dt, list(map(_SHAPE_DTYPE, plain)), list(map(torch.Tensor.data_ptr, plain)),
            list(map(torch.Tensor.stride, plain)), list(map(id, locals_)), list(map(torch.Tensor.data_ptr, locals_)),
            list(map(_SHAPE, locals_)), list(map(torch.Tensor.is_contiguous, locals_)), list(map(id, specs)),
            *(list(map(id, p)) for p in parts), _Held((tensors, locals_, specs, parts))]


class _Held:
    """Objects a fingerprint names by id(), held by it so that no other object can take one of
    those ids while the memo keeps the fingerprint. Equal to any other _Held: never compared."""
    __slots__ = ("objects",)

    def __init__(self, objects: Any):
        self.objects = objects

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held)

    __hash__ = None   # type: ignore[assignment]


def _walk_is_state_dict(walk: list[tuple[nn.Module, str]], items: SaveItems, key: str) -> bool:
    """Whether the shards collected from state_dict() are the walk's tensors, name for name: what
    makes the walk's fingerprint a fingerprint of those shards."""
    names = []
    for m, prefix in walk:
        names += [f"{prefix}{n}" for n, t in m._parameters.items() if t is not None]
        names += [f"{prefix}{n}" for n, t in m._buffers.items()
                  if t is not None and n not in m._non_persistent_buffers_set]
    from omnickpt.adapters.module import canonical_names
    renamed = canonical_names(key, names)
    expected = [f"{key}{SEP}{renamed.get(n, n)}" for n in names]
    if [s.name for s in items.shards] != expected:
        return False
    # and the same data: state_dict() hands out detached views of the walk's tensors
    tensors = [t for m, _ in walk for d in (m._parameters, m._buffers) for n, t in d.items()
               if t is not None and (d is m._parameters or n not in m._non_persistent_buffers_set)]
    return all(s.local.data_ptr() == getattr(t, "_local_tensor", t).data_ptr() for s, t in zip(items.shards, tensors))


# ---------------------------------------------------------------------------- optimizers
class _OptimizerWalk:
    """What an optimizer's memo needs besides its SaveItems: the modules its names came from, the
    name of each parameter, and each parameter group's names."""

    def __init__(self, modules: list, names: dict[int, str], groups: list[list[str]], params: list):
        self.modules, self.names, self.groups, self.params = modules, names, groups, params


def _module_entries(state: dict) -> list:
    return [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]


def _optimizer_walk(key: str, opt: torch.optim.Optimizer, state: dict, items: SaveItems) -> _OptimizerWalk | None:
    """The walk of an optimizer saved the plain torch way (save_optimizer over modules that are not
    FSDP1), else None."""
    cls = type(opt)
    if (cls.state_dict is not torch.optim.Optimizer.state_dict or getattr(opt, "_optimizer_state_dict_pre_hooks", None)
            or getattr(opt, "_optimizer_state_dict_post_hooks", None) or not torch_layout(items.objects.get(key))):
        return None
    modules = state_modules(state)
    if any(is_fsdp1(unwrap(m)) for m in modules.values()):
        return None
    groups = [list(g["params"]) for g in items.objects[key]["param_groups"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    if [len(g) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        return None
    names = {id(p): n for p, n in zip(params, (n for g in groups for n in g))}
    return _OptimizerWalk(_module_entries(state), names, groups, params)


def _optimizer_sig(opt: torch.optim.Optimizer, walk: _OptimizerWalk) -> tuple[list, list]:
    """(the fingerprint of an optimizer, its non-tensor per-parameter state as (parameter, state
    key, value)): its groups' parameters, and the keys and tensors of its state."""
    groups = [g["params"] for g in opt.param_groups]
    states = list(opt.state.values())
    values = list(chain.from_iterable(map(dict.values, states)))
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    extra = []
    if len(tensors) != len(values):
        extra = [(p, k, v) for p, st in opt.state.items() for k, v in st.items() if not isinstance(v, torch.Tensor)]
    params = list(chain.from_iterable(groups))
    keys = list(opt.state)
    sig = [type(opt), len(getattr(opt, "_optimizer_state_dict_pre_hooks", ())),
           len(getattr(opt, "_optimizer_state_dict_post_hooks", ())),
           list(map(len, groups)), list(map(id, params)), list(map(id, keys)), _Held((params, keys)),
           list(map(tuple, states)), [(id(p), k) for p, k, _ in extra]]
    return sig + _tensors_sig(tensors), extra


def _optimizer_items(opt: torch.optim.Optimizer, walk: _OptimizerWalk, cached: SaveItems, extra: list) -> SaveItems:
    """The optimizer's SaveItems of the last save with its objects made anew: param_groups (the
    learning rate and the other options change between saves) and non-tensor state, as
    save_optimizer makes them."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(opt.param_groups, walk.groups)]
    state: dict[str, dict[str, Any]] = {}
    for p, k, v in extra:
        state.setdefault(walk.names[id(p)], {})[k] = v
    key = next(iter(cached.objects))
    return SaveItems(cached.shards, {key: {"param_groups": groups, "state": state}}, cached.framework, cached.layout)
