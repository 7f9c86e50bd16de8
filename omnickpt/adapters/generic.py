"""Everything that is not a module or an optimizer: Stateful objects (anything with
state_dict()/load_state_dict(): LR schedulers, dataloaders, RNGState), DTensors, plain values.

DTensors inside them are stored as boxes and reshard; everything else is an object saved per
rank (identical values are stored once) and loaded back by the same rank, or by rank 0's value
when the loading world is larger.
"""
from __future__ import annotations

from typing import Any

import torch

from omnickpt.adapters.base import SEP, LoadTarget, SaveItems, collect_dtensors, is_dtensor, restore_refs, split_dtensors


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def save_value(key: str, value: Any) -> SaveItems:
    items = SaveItems()
    raw = value.state_dict() if is_stateful(value) else value
    skeleton = split_dtensors(raw, key, items.shards)
    if not (is_dtensor(value)):
        items.objects[key] = skeleton
    return items


def load_value(key: str, value: Any, state: dict) -> LoadTarget:
    stateful = is_stateful(value)
    current = value.state_dict() if stateful else value
    dtensors: dict[str, Any] = {}
    collect_dtensors(current, key, dtensors)
    target = LoadTarget(prefix=f"{key}{SEP}")
    for name, dt in dtensors.items():
        from omnickpt.adapters.base import dtensor_shards
        target.shards.extend(dtensor_shards(name, dt))
    if is_dtensor(value):
        return target     # filled in place; nothing else to install
    target.objects.append(key)

    def finish(objects):
        if key not in objects:
            return
        loaded = restore_refs(objects[key], dtensors.__getitem__)
        if stateful:
            value.load_state_dict(loaded)
        elif isinstance(value, dict) and isinstance(loaded, dict):
            value.update(loaded)
        elif (isinstance(value, torch.Tensor) and isinstance(loaded, torch.Tensor)
              and value.shape == loaded.shape and value.dtype == loaded.dtype):
            with torch.no_grad():
                value.copy_(loaded)
        else:
            state[key] = loaded

    target.finish = finish
    return target
