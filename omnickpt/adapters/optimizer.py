"""torch.optim adapter. State is keyed by parameter name, not index, so it reshards: each state
tensor follows its parameter's boxes (DTensor or replicated), param_groups name their params."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnickpt.adapters.base import SEP, LoadTarget, SaveItems, tensor_shards
from omnickpt.adapters.module import unwrap
from omnickpt.errors import MismatchError, UnsupportedError


def param_names(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> list[str]:
    """Names of the optimizer's parameters, in its own index order."""
    by_id: dict[int, str] = {}
    for mkey, module in modules.items():
        for name, p in unwrap(module).named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), name if len(modules) == 1 else f"{mkey}{SEP}{name}")
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise UnsupportedError(
                    f"{key}: the optimizer holds a parameter of shape {tuple(p.shape)} that belongs to no "
                    "nn.Module in the saved state; put the model in the same state dict so that optimizer "
                    "state can be keyed by parameter name")
            names.append(by_id[id(p)])
    return names


def save_optimizer(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> SaveItems:
    names = param_names(key, optimizer, modules)
    osd = optimizer.state_dict()
    items = SaveItems()
    extra: dict[str, dict[str, Any]] = {}
    for idx, st in osd["state"].items():
        fqn = names[idx]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                items.shards.extend(tensor_shards(f"{key}{SEP}state{SEP}{fqn}{SEP}{k}", v.detach()))
            else:
                extra.setdefault(fqn, {})[k] = v
    groups = []
    for g in osd["param_groups"]:
        groups.append({**g, "params": [names[i] for i in g["params"]]})
    items.objects[key] = {"param_groups": groups, "state": extra}
    return items


def load_optimizer(key: str, optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> LoadTarget:
    names = param_names(key, optimizer, modules)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    target = LoadTarget(prefix=f"{key}{SEP}", objects=[key])
    dests: dict[int, dict[str, torch.Tensor]] = {}

    def prepare(manifest) -> None:
        # Destinations for every saved state tensor of every parameter we have: the optimizer's
        # own tensors when they already exist, otherwise new ones sharded like the parameter.
        from omnickpt.format.manifest import dtype_from_name
        wanted: dict[str, list[tuple[str, str]]] = {}
        prefix = f"{key}{SEP}state{SEP}"
        for tname in manifest.tensors:
            if tname.startswith(prefix):
                fqn, _, k = tname[len(prefix):].rpartition(SEP)
                wanted.setdefault(fqn, []).append((k, tname))
        for idx, (p, fqn) in enumerate(zip(params, names)):
            for k, tname in wanted.get(fqn, []):
                entry = manifest.tensors[tname]
                dtype = dtype_from_name(entry.dtype)
                cur = optimizer.state.get(p, {}).get(k)
                if isinstance(cur, torch.Tensor) and tuple(cur.shape) == entry.shape and cur.dtype == dtype:
                    dest = cur.detach()
                elif tuple(p.shape) == entry.shape:
                    dest = torch.zeros_like(p.detach(), dtype=dtype)
                else:
                    dest = torch.zeros(entry.shape, dtype=dtype)
                dests.setdefault(idx, {})[k] = dest
                target.shards.extend(tensor_shards(tname, dest))

    def finish(objects) -> None:
        saved = objects.get(key)
        if saved is None:
            return
        extra = saved.get("state", {})
        state = {}
        for idx, fqn in enumerate(names):
            st = dict(extra.get(fqn, {}))
            st.update(dests.get(idx, {}))
            if st:
                state[idx] = st
        saved_groups = saved["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise MismatchError(
                f"{key}: the checkpoint has {len(saved_groups)} param groups, the optimizer has "
                f"{len(optimizer.param_groups)}", [f"{key}: param group count differs"])
        groups, diffs, start = [], [], 0
        for gi, (sg, tg) in enumerate(zip(saved_groups, optimizer.param_groups)):
            mine = names[start:start + len(tg["params"])]
            if set(sg["params"]) != set(mine):
                diffs.append(f"{key}: param group {gi} holds {sorted(set(sg['params']) ^ set(mine))[:5]} "
                             "in only one of checkpoint and optimizer")
            groups.append({**sg, "params": list(range(start, start + len(mine)))})
            start += len(mine)
        if diffs:
            raise MismatchError(f"{key}: param groups differ:\n  " + "\n  ".join(diffs), diffs)
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    target.prepare = prepare
    target.finish = finish
    return target
