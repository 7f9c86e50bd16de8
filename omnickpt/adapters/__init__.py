"""Adapters: framework objects <-> tensor shards (boxes) and plain objects.

One class per kind of state entry (adapters/base.py `Adapter`), one file per framework. `ADAPTERS`
is the registry: an ordered tuple, asked in order, the first adapter whose `claims` is true handles
the entry, so the most specific come first and the generic one, which claims everything, last.
Adding a framework is one file and one line here (docs/adapters.md). A caller may pass its own
registry (`adapters=`) to every function below; there is no global registration.
"""
from __future__ import annotations

from typing import Any, Sequence

from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard
from omnickpt.adapters.dataloader import DataLoaderAdapter
from omnickpt.adapters.deepspeed import DeepSpeedEngineAdapter, DeepSpeedOptimizerAdapter
from omnickpt.adapters.fsdp1 import Fsdp1Adapter
from omnickpt.adapters.generic import MIN_TENSOR_BYTES, GenericAdapter
from omnickpt.adapters.megatron import MegatronModelAdapter, MegatronOptimizerAdapter
from omnickpt.adapters.module import ModuleAdapter, detect_framework
from omnickpt.adapters.optimizer import OptimizerAdapter
from omnickpt.adapters.reuse import SaveMemo, collect_reusing
from omnickpt.adapters.rng import RNGState
from omnickpt.errors import UnsupportedError
from omnickpt.format.objects import tensor_problem, utf8_problem

ADAPTERS: tuple[Adapter, ...] = (
    DeepSpeedEngineAdapter(),     # a DeepSpeedEngine is an nn.Module: before ModuleAdapter ('module.' names)
    DeepSpeedOptimizerAdapter(),  # engine.optimizer (a ZeRO wrapper, or a torch optimizer at ZeRO-0): first
    MegatronModelAdapter(),       # a MegatronModule is an nn.Module: before ModuleAdapter
    MegatronOptimizerAdapter(),   # a torch optimizer over a Megatron model: before OptimizerAdapter
    Fsdp1Adapter(),               # an FSDP1 module: before ModuleAdapter, whose state_dict() would all-gather
    ModuleAdapter(),              # plain, DDP, FSDP2, TP, 2-D
    OptimizerAdapter(),
    DataLoaderAdapter(),          # these are Stateful too: before GenericAdapter
    GenericAdapter(),             # claims everything: last
)


def as_registry(adapters: Sequence[Any]) -> tuple[Adapter, ...]:
    """`adapters` checked as a registry (an ordered sequence of Adapter-like objects), as a tuple.
    TypeError naming the entry that lacks a method. For options that take a registry, e.g.
    `(MyAdapter(), *ADAPTERS)`: the new adapter is asked first."""
    if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence) or not adapters:
        raise TypeError(f"adapters must be a non-empty sequence of adapters such as (MyAdapter(), *ADAPTERS), got "
                        f"{adapters!r:.80}")
    for i, a in enumerate(adapters):
        lacking = [m for m in ("claims", "save_items", "load_target") if not callable(getattr(a, m, None))]
        if lacking:
            raise TypeError(f"adapters[{i}] ({a!r:.80}) has no {', '.join(lacking)} method; an adapter implements "
                            "omnickpt.adapters.base.Adapter (docs/adapters.md)")
    return tuple(adapters)


def adapter_for(key: str, value: Any, state: dict, adapters: Sequence[Adapter] = ADAPTERS) -> Adapter:
    """The first adapter of `adapters` that claims entry `key`. UnsupportedError when none does (a
    registry without a generic adapter last)."""
    for adapter in adapters:
        if adapter.claims(value, state):
            return adapter
    raise UnsupportedError(f"state entry {key!r} ({type(value).__name__}): no adapter claims it (the registry holds "
                           f"{', '.join(_name(a) for a in adapters)}); add one that does, or end the registry with "
                           "GenericAdapter()")


def frameworks(adapters: Sequence[Adapter] = ADAPTERS) -> tuple[str, ...]:
    """The values `framework=` accepts with this registry, in registry order."""
    out: dict[str, None] = {}
    for a in adapters:
        out.update(dict.fromkeys(getattr(a, "frameworks", None) or {}))
    return tuple(out)


FRAMEWORKS = frameworks()


def _name(adapter: Any) -> str:
    return str(getattr(adapter, "name", None) or type(adapter).__name__)


def _check_keys(state: dict) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of name -> module/optimizer/value, got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str) or not k or SEP in k:
            raise UnsupportedError(f"state key {k!r}: keys must be non-empty strings without {SEP!r}")
        problem = utf8_problem(k)
        if problem:
            raise UnsupportedError(f"state key {k!r} {problem}; checkpoint names are UTF-8 text: rename the key")


def _check_saveable(collected: list[tuple[str, SaveItems]]) -> None:
    """Refuse, before anything is written, what the adapters produced but the format cannot hold:
    names that are not valid Unicode text (a parameter or buffer called 'w\\ud800'), tensors of a
    dtype or layout the format has no encoding for, tensors on the meta device (no data)."""
    for key, items in collected:
        for s in items.shards:
            problem = utf8_problem(s.name)
            if problem:
                raise UnsupportedError(f"tensor {s.name!r}: its name {problem}; checkpoint names are UTF-8 text: "
                                       "rename the parameter or buffer")
            problem = tensor_problem(s.local)
            if problem:
                raise UnsupportedError(f"tensor {s.name!r} {problem}")
        for name in items.objects:
            problem = utf8_problem(name)
            if problem:
                raise UnsupportedError(f"object {name!r}: its name {problem}; rename the state key")


def _check_loadable(targets: list[tuple[str, LoadTarget]]) -> None:
    """Refuse destinations that cannot be filled (meta tensors, dtypes or layouts the format lacks)
    before anything is read."""
    for _, target in targets:
        for s in target.shards:
            problem = tensor_problem(s.local, loading=True)
            if problem:
                raise UnsupportedError(f"tensor {s.name!r} of the state to load {problem}")


def collect_save(state: dict, adapters: Sequence[Adapter] = ADAPTERS) -> list[tuple[str, SaveItems]]:
    """What every entry of `state` saves, in state order, each from the first adapter of `adapters`
    that claims it. Raises UnsupportedError, naming the key or tensor, for anything the checkpoint
    format cannot hold; nothing has been written then."""
    _check_keys(state)
    out = [(key, adapter_for(key, value, state, adapters).save_items(key, value, state))
           for key, value in state.items()]
    _check_saveable(out)
    return out


def collect_save_reusing(state: dict, memo: SaveMemo, adapters: Sequence[Adapter] = ADAPTERS
                         ) -> tuple[list[tuple[str, SaveItems]], bool]:
    """collect_save, reusing what `memo` kept of the last save of this state for each module and
    optimizer entry whose layout did not change (adapters/reuse.py). Returns (what collect_save
    returns; whether every entry holding tensors was reused: the shards are then the very lists of
    the last save, and whatever was derived from them holds)."""
    _check_keys(state)
    claimed = [(key, value, adapter_for(key, value, state, adapters)) for key, value in state.items()]
    return collect_reusing(state, claimed, memo, _check_saveable)


def collect_load(state: dict, adapters: Sequence[Adapter] = ADAPTERS) -> list[tuple[str, LoadTarget]]:
    """Where every entry of `state` loads to, in state order, each from the first adapter of
    `adapters` that claims it. Raises UnsupportedError for a target that cannot be loaded into (a
    module still on the meta device); nothing has been read then."""
    _check_keys(state)
    out = [(key, adapter_for(key, value, state, adapters).load_target(key, value, state))
           for key, value in state.items()]
    _check_loadable(out)
    return out


def check_framework(state: dict, framework: str | None, adapters: Sequence[Adapter] = ADAPTERS) -> None:
    """ByteCheckpoint-style `framework=`: optional, and checked against what each entry's adapter
    detects (modules; other entries detect nothing and are not checked)."""
    if framework is None:
        return
    _check_keys(state)
    known = frameworks(adapters)
    if framework not in known:
        raise UnsupportedError(f"framework={framework!r} is not one of {', '.join(known)}")
    compatible = {f for a in adapters for f in (getattr(a, "frameworks", None) or {}).get(framework, ())}
    found = {}
    for k, v in state.items():
        detect = getattr(adapter_for(k, v, state, adapters), "detect", None)
        detected = detect(v) if detect is not None else None
        if detected is not None:
            found[k] = detected
    wrong = {k: f for k, f in found.items() if f not in compatible}
    if wrong:
        raise UnsupportedError(
            f"framework={framework!r} was given but the modules are " +
            ", ".join(f"{k!r}: {f}" for k, f in wrong.items()) + "; omit framework= to detect it")


__all__ = ["ADAPTERS", "FRAMEWORKS", "MIN_TENSOR_BYTES", "Adapter", "DataLoaderAdapter", "DeepSpeedEngineAdapter",
           "DeepSpeedOptimizerAdapter", "Fsdp1Adapter",
           "GenericAdapter", "LoadTarget", "MegatronModelAdapter", "MegatronOptimizerAdapter", "ModuleAdapter",
           "OptimizerAdapter", "RNGState", "SaveItems", "SaveMemo", "TensorShard", "adapter_for", "as_registry",
           "check_framework", "collect_load", "collect_save", "collect_save_reusing", "detect_framework", "frameworks"]
