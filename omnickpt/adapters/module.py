"""nn.Module adapter: plain modules, DDP, FSDP1, FSDP2 (fully_shard), DTensor tensor parallel, 2-D meshes.

Uses the public state_dict()/load_state_dict() contract: FSDP2 and tensor-parallel modules
already hand out DTensors whose boxes we read off, DDP and plain modules hand out whole tensors.
FSDP1 modules go to adapters/fsdp1.py instead (its adapter comes first in the registry), since
their state_dict() would all-gather. This file also tells the parallel wrappers apart
(`detect_framework`), for every module adapter and for `framework=`.
"""
from __future__ import annotations

import sys

from typing import Any

import torch
from torch import nn

from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard, is_dtensor, tensor_shards
from omnickpt.errors import UnsupportedError
from omnickpt.spec import ShardSpec

# Name segments that wrappers insert and the plain module has not: activation checkpointing's
# checkpoint_wrapper, torch.compile's OptimizedModule (at any depth: a compiled block inside a model,
# compiled again or not) and FSDP1. PyTorch DCP drops the same ones
# (torch.distributed.checkpoint.state_dict._get_fqns), so names without them are the ones DCP
# checkpoints (torchtitan's) hold, and a model loads whether it is wrapped or not.
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(name: str) -> str:
    """`name` (a parameter name, or a whole tensor name such as 'optim/state/fc._orig_mod.weight/exp_avg')
    without wrapper segments: the name the same tensor has in the plain module, as DCP names it.
    Every adapter names module and optimizer tensors through this function."""
    if "_mod" not in name:     # a substring of every wrapper name: the common case costs one scan
        return name
    return SEP.join(".".join(part for part in piece.split(".") if part and part not in WRAPPER_NAMES)
                    for piece in name.split(SEP))


def match_saved_names(shards: list[TensorShard], manifest, prefix: str) -> None:
    """Rename, in place, each shard whose (canonical) name the manifest lacks to the name the
    manifest holds it under with wrapper segments: checkpoints written before names were canonical
    (optimizer state keyed by named_parameters(), so 'layers.0._checkpoint_wrapped_module.w', and
    module tensors of a model with compiled blocks) keep loading, into wrapped models and plain ones.
    Only names under `prefix` (one state entry's) are looked at. Called from `prepare` hooks."""
    saved: dict[str, str] = {}
    for name in manifest.tensors:
        if name.startswith(prefix):
            clean = canonical_name(name)
            if clean != name:
                saved.setdefault(clean, name)
    if not saved:
        return
    for i, s in enumerate(shards):
        if s.name not in manifest.tensors and s.name in saved:
            shards[i] = TensorShard(saved[s.name], s.shape, s.dtype, s.box, s.local)


def canonical_names(where: str, names) -> dict[str, str]:
    """name -> canonical_name(name) for those of `names` (one module's or optimizer's) that it
    changes; look names up with `.get(name, name)`. UnsupportedError when two names would become
    one (two wrapped copies of one module side by side), which DCP refuses too. Costs one substring
    test per name when nothing is wrapped: it runs on the stall path of every save."""
    names = list(names)
    changed = {n: c for n in names if "_mod" in n and (c := canonical_name(n)) != n}
    if changed:
        seen: dict[str, str] = {}
        for name in names:
            clean = changed.get(name, name)
            other = seen.setdefault(clean, name)
            if other != name:
                raise UnsupportedError(
                    f"{where}: tensors {other!r} and {name!r} both take the name {clean!r} once wrapper segments "
                    f"({', '.join(sorted(WRAPPER_NAMES))}) are dropped; rename one of the modules")
    return changed


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's names (no 'module.' / '_orig_mod.')."""
    from torch.nn.parallel import DistributedDataParallel
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def is_fsdp1(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")   # not imported: nothing can be wrapped by it
    return fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in module.modules())


def detect_framework(module: nn.Module) -> str:
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    inner = unwrap(module)
    # torch.distributed.fsdp costs seconds to import on a restart; if nothing imported it, no
    # module can be wrapped by it.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        if is_fsdp1(inner):
            return "fsdp"
        if any(isinstance(m, fsdp.FSDPModule) for m in inner.modules()):
            return "fsdp2"
    if any(is_dtensor(p) for p in inner.parameters()):
        return "dtensor"
    return "plain"


class ModuleAdapter(Adapter):
    """Any nn.Module the adapters before it in the registry left (plain, DDP, FSDP2, TP, 2-D)."""
    name = "module"
    frameworks = {"plain": frozenset({"plain"}), "ddp": frozenset({"ddp"}), "fsdp2": frozenset({"fsdp2"}),
                  "dtensor": frozenset({"dtensor", "fsdp2"})}

    def claims(self, value: Any, state: dict) -> bool:
        return isinstance(value, nn.Module)

    def detect(self, value: Any) -> str | None:
        return detect_framework(value)

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_module(key, value)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_module(key, value)


def save_module(key: str, module: nn.Module) -> SaveItems:
    framework = detect_framework(module)
    items = SaveItems(framework=framework)
    extra = {}
    placements: dict[Any, int] = {}
    mesh = None
    with torch.no_grad():
        inner = unwrap(module)
        # keep_vars=True: the parameters and buffers themselves. state_dict() detaches each one,
        # which for a DTensor is a dispatch through DTensor's sharding propagation (FSDP2 GPT, 101
        # parameters: ~1 ms of the first save's stall); dtensor_shards reads a DTensor's local
        # shard directly (detached if it requires grad) and a plain tensor is detached here, as
        # state_dict() would have (cheap): a lazy snapshot copies it on a thread where grad is on.
        sd = inner.state_dict(keep_vars=True)
        names = canonical_names(key, sd)
        for name, value in sd.items():
            if isinstance(value, torch.Tensor):
                if not is_dtensor(value):
                    value = value.detach()
                items.shards.extend(tensor_shards(f"{key}{SEP}{names.get(name, name)}", value))
                if framework in ("fsdp2", "dtensor") and is_dtensor(value):
                    # counted by the placements tuple itself: no string per tensor on the stall path
                    placements[value.placements] = placements.get(value.placements, 0) + 1
                    mesh = mesh or value.device_mesh
            else:
                extra[names.get(name, name)] = value   # e.g. get_extra_state() values
    if extra:
        items.objects[key] = extra
    if mesh is not None:
        items.layout = {"mesh": {"shape": list(mesh.shape), "dims": list(mesh.mesh_dim_names or [])},
                        "placements": {str(p): n for p, n in placements.items()}}
    return items


def load_module(key: str, module: nn.Module) -> LoadTarget:
    framework = detect_framework(module)
    inner = unwrap(module)
    # keep_vars=True hands back the parameters and buffers themselves: filling them in place
    # loads the module with no second copy.
    sd = inner.state_dict(keep_vars=True)
    names = canonical_names(key, sd)
    # one walk of the tree, not two through parameters() and buffers() (3,000 modules: 7.6 -> 3.1 ms)
    owned = {id(t) for m in inner.modules() for d in (m._parameters, m._buffers) for t in d.values()
             if t is not None}
    target = LoadTarget(prefix=f"{key}{SEP}", framework=framework)
    copies: dict[str, torch.Tensor] = {}
    extra_keys = []
    # Names of one tensor object (tied parameters: an LM head sharing the embedding's weight).
    tied: dict[int, list[str]] = {}
    for name, value in sd.items():
        if isinstance(value, torch.Tensor):
            tied.setdefault(id(value), []).append(f"{key}{SEP}{names.get(name, name)}")
            # A parameter's or buffer's own DTensor is filled through its local shard (dtensor_shards
            # detaches that if needed): detaching the DTensor first is a dispatch per tensor.
            dest = value if id(value) in owned and is_dtensor(value) and not isinstance(value, ShardSpec) \
                else value.detach()
            target.shards.extend(tensor_shards(f"{key}{SEP}{names.get(name, name)}", dest))
            if id(value) not in owned:
                copies[name] = dest   # produced by a state-dict hook: install with load_state_dict
        else:
            extra_keys.append(name)
    if extra_keys:
        target.objects.append(key)

    dropped: list[bool] = []    # set by prepare: the checkpoint holds no module here, install nothing

    def prepare(manifest) -> list[str] | None:
        match_saved_names(target.shards, manifest, target.prefix)
        _satisfy_tied(manifest, target, tied)
        # A module's tensors are stored as tensors under `key/`. When none of them is there but the
        # entry was saved (as an object), it was saved as a plain value: say so, instead of listing
        # every tensor of the module as missing.
        if not target.shards or key not in manifest.objects or any(s.name in manifest.tensors for s in target.shards):
            return None
        prefix = f"{key}{SEP}"
        if any(name.startswith(prefix) for name in manifest.tensors):
            return None     # renamed or restructured tensors: the per-tensor differences say more
        count = len(target.shards)
        target.shards.clear()
        target.objects.clear()
        dropped.append(True)
        return [f"{key}: state entry {key!r} was saved as a plain value (one object, e.g. a state_dict() dict; no "
                f"tensors under {prefix!r}) but the target is a module with {count} tensor(s); save the module "
                f"itself ({{{key!r}: model}}), or load into a dict ({{{key!r}: {{}}}}) and call "
                "model.load_state_dict() on it"]

    def finish(objects):
        if dropped:
            return
        install = dict(copies)
        # saved under canonical names (or, before, under the module's own): installed under the target's
        own = {names.get(n, n): n for n in extra_keys}
        install.update({own.get(canonical_name(n), n): v for n, v in (objects.get(key) or {}).items()})
        if install:
            inner.load_state_dict(install, strict=False)

    target.prepare = prepare
    target.finish = finish
    return target


def _satisfy_tied(manifest, target: LoadTarget, tied: dict[int, list[str]]) -> None:
    """Foreign formats store a tied parameter once (Hugging Face keeps `model.embed_tokens.weight`
    and leaves out `lm_head.weight`): a name such a checkpoint lacks is no difference when another
    name of the same parameter object is there, since filling that one fills both. Our own
    checkpoints store every name, and a name missing from them stays a difference."""
    if not manifest.layout.get("format"):
        return
    satisfied = {n for names in tied.values() if len(names) > 1 and any(n in manifest.tensors for n in names)
                 for n in names if n not in manifest.tensors}
    if satisfied:
        target.shards[:] = [s for s in target.shards if s.name not in satisfied]
