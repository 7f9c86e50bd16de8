"""Dataloader state: objects that implement omnickpt.data's DataParallelStateful protocol, and
torchdata's StatefulDataLoader.

Save: the rank's `dp_state_dict()` is one object (ranks of one DP group, tensor or pipeline peers,
save identical values, which the format stores once). Load: the object is wanted from every saving
rank; the values are grouped by dp_rank, checked for agreement, and handed to
`load_dp_state_dict(replicated, {dp_rank: shard}, saved_dp_size)`, which redistributes them when the
DP size changed (docs/dataloader.md).
"""
from __future__ import annotations

import sys
from typing import Any

from omnickpt.adapters.base import Adapter, LoadTarget, SaveItems
from omnickpt.adapters.generic import process_rank
from omnickpt.data import DP_STATE_KEYS, check_dp_rank, is_dp_state, is_dp_stateful
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.format.objects import encode_object


def _stateful_dataloader_type():
    # Only when the user already imported torchdata: omnickpt never imports it itself.
    module = sys.modules.get("torchdata.stateful_dataloader")
    return getattr(module, "StatefulDataLoader", None)


def is_stateful_dataloader(value: Any) -> bool:
    cls = _stateful_dataloader_type()
    return cls is not None and isinstance(value, cls)


def is_dataloader_state(value: Any) -> bool:
    """Values this adapter handles (it comes before the generic adapter, which would take them as Stateful)."""
    return is_dp_stateful(value) or is_stateful_dataloader(value)


class DataLoaderAdapter(Adapter):
    """DataParallelStateful objects and torchdata StatefulDataLoaders: one object per rank, resharded on load."""
    name = "dataloader"

    def claims(self, value: Any, state: dict) -> bool:
        return is_dataloader_state(value)

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_dataloader(key, value)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_dataloader(key, value)


class StatefulDataLoaderState:
    """The DataParallelStateful view of a torchdata StatefulDataLoader.

    Its whole `state_dict()` is the rank's shard; the DP rank and size come from its sampler (a
    ReshardableSampler or any DataParallelStateful sampler, or a DistributedSampler), else from the
    default process group (every rank its own DP rank). At the same DP size the loader's state is
    loaded as it was saved. At another DP size only a DataParallelStateful sampler can carry the
    position over: its state, which StatefulDataLoader snapshots in step with the batches it returned,
    is found inside each saved loader state and resharded; the loader itself then starts a fresh
    iterator (its other state, worker-side dataset state of iterable datasets, starts over).
    """

    def __init__(self, key: str, loader: Any):
        self.key, self.loader = key, loader
        self.sampler = None
        self.dp_rank, self.dp_size = 0, 1
        candidates = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
        from torch.utils.data.distributed import DistributedSampler
        for s in candidates:
            if is_dp_stateful(s) and hasattr(s, "dp_rank") and hasattr(s, "dp_size"):
                self.sampler, self.dp_rank, self.dp_size = s, s.dp_rank, s.dp_size
                return
        own = _own_dp_rank(loader)
        if own is not None:
            # The loader knows its data-parallel rank (torchtitan's ParallelAwareDataloader): under
            # tensor, pipeline or context parallelism it is not the global rank.
            self.dp_rank, self.dp_size = own
            return
        for s in candidates:
            if isinstance(s, DistributedSampler):
                self.dp_rank, self.dp_size = s.rank, s.num_replicas
                return
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()

    def dp_state_dict(self) -> dict:
        return {"replicated": {}, "shard": self.loader.state_dict(), "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_dp_state_dict(self, replicated: Any, shards: dict[int, Any], saved_dp_size: int) -> None:
        if saved_dp_size == self.dp_size:
            self.loader.load_state_dict(shards[self.dp_rank])
            return
        if self.sampler is None:
            raise UnsupportedError(
                f"{self.key}: this StatefulDataLoader was saved at data-parallel size {saved_dp_size} and is loaded at "
                f"{self.dp_size}; its state is per rank and cannot be split. Give it an "
                "omnickpt.data.ReshardableSampler (which reshards), load at the same DP size, or leave the loader "
                "out of the loaded state to start its epoch over")
        nested = {}
        for r, loader_state in shards.items():
            found = _find_dp_states(loader_state)
            if len(found) != 1:
                raise CheckpointError(
                    f"{self.key}: expected the state of one resharding sampler inside the loader state saved by DP rank "
                    f"{r}, found {len(found)}; was the loader saved with the same kind of sampler?")
            nested[r] = found[0]
        _, replicated, by_dp = _group_by_dp_rank(f"{self.key} (sampler)", nested)
        self.sampler.load_dp_state_dict(replicated, by_dp, saved_dp_size)


def _own_dp_rank(loader: Any) -> tuple[int, int] | None:
    """(dp_rank, dp_size) a loader states itself: `dp_rank` with `dp_world_size` (torchtitan) or
    `dp_size`, both non-negative ints with the rank below the size; None when it states none."""
    rank = getattr(loader, "dp_rank", None)
    size = getattr(loader, "dp_world_size", getattr(loader, "dp_size", None))
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, size)) or not 0 <= rank < size:
        return None
    return rank, size


def _find_dp_states(value: Any) -> list[dict]:
    if is_dp_state(value):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _find_dp_states(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _find_dp_states(v)]
    return []


def _protocol_view(key: str, value: Any) -> Any:
    return value if is_dp_stateful(value) else StatefulDataLoaderState(key, value)


def save_dataloader(key: str, value: Any) -> SaveItems:
    state = _protocol_view(key, value).dp_state_dict()
    if not is_dp_state(state):
        raise UnsupportedError(
            f"{key}: dp_state_dict() of {type(value).__name__} must return a dict with exactly the keys "
            f"{', '.join(DP_STATE_KEYS)}; it returned {sorted(state) if isinstance(state, dict) else type(state).__name__}")
    try:
        check_dp_rank(state["dp_rank"], state["dp_size"], key)
    except ValueError as e:
        raise UnsupportedError(f"{e} (from dp_state_dict() of {type(value).__name__})") from None
    return SaveItems(objects={key: state})


def _same(a: Any, b: Any) -> bool:
    # Equality of encodings: works for nested tensors and arrays, where == does not.
    return encode_object(a, allow_pickle=True) == encode_object(b, allow_pickle=True)


def _group_by_dp_rank(key: str, by_rank: dict[int, Any]) -> tuple[int, Any, dict[int, Any]]:
    """{saved rank: dp state} -> (saved DP size, replicated part, {dp_rank: shard}), checked."""
    sizes: dict[int, list[int]] = {}
    replicated, first = None, None
    by_dp: dict[int, Any] = {}
    owner: dict[int, int] = {}
    for rank, state in sorted(by_rank.items()):
        if not is_dp_state(state):
            raise CheckpointError(
                f"{key}: the value saved by rank {rank} is not a data-parallel state (keys {', '.join(DP_STATE_KEYS)}); "
                "it was saved by an object without dp_state_dict(). Load it into the same kind of object, or leave "
                f"{key!r} out of the loaded state")
        sizes.setdefault(state["dp_size"], []).append(rank)
        if first is None:
            replicated, first = state["replicated"], rank
        elif not _same(state["replicated"], replicated):
            raise CheckpointError(
                f"{key}: ranks {first} and {rank} saved different replicated parts ({replicated!r} vs "
                f"{state['replicated']!r}); save at a point where every rank has the same epoch and position "
                "(after the same number of steps and set_epoch calls)")
        r = state["dp_rank"]
        if r in by_dp:
            if not _same(by_dp[r], state["shard"]):
                raise CheckpointError(
                    f"{key}: ranks {owner[r]} and {rank} both saved dp_rank {r} with different shards; ranks of one "
                    "data-parallel group (tensor/pipeline peers) must consume the same data")
        else:
            by_dp[r], owner[r] = state["shard"], rank
    if len(sizes) != 1:
        raise CheckpointError(f"{key}: the saving ranks disagree on the data-parallel size: " +
                              "; ".join(f"dp_size {n} on ranks {rs}" for n, rs in sorted(sizes.items())))
    (saved_dp_size,) = sizes
    missing = sorted(set(range(saved_dp_size)) - set(by_dp))
    if missing:
        raise CheckpointError(
            f"{key}: saved at data-parallel size {saved_dp_size} but no rank saved dp_rank(s) {missing}; the "
            "checkpoint lacks part of the dataloader position")
    return saved_dp_size, replicated, dict(sorted(by_dp.items()))


def load_dataloader(key: str, value: Any) -> LoadTarget:
    view = _protocol_view(key, value)
    target = LoadTarget(prefix=f"{key}/", objects_from_all_ranks=[key])

    def finish(objects):
        if key not in objects:
            return
        by_rank = objects[key]
        if isinstance(view, StatefulDataLoaderState) and not any(is_dp_state(v) for v in by_rank.values()):
            # The loader's own state_dict(), not omnickpt's per-rank record: a DCP folder's value (DCP
            # keeps one per key; torchtitan's loaders key theirs by dp rank inside it) or one saved by
            # the generic adapter. The loader picks its part, as it does under dcp.load.
            value = by_rank.get(process_rank(), by_rank[min(by_rank)])
            view.loader.load_state_dict(value)
            return
        saved_dp_size, replicated, by_dp = _group_by_dp_rank(key, by_rank)
        view.load_dp_state_dict(replicated, by_dp, saved_dp_size)

    target.finish = finish
    return target


def merged_loader_state(by_dp: dict[int, Any]) -> Any:
    """One state for a loader saved per data-parallel rank, as DCP stores one value per key: the union
    of the ranks' dicts when their keys are disjoint but for equal values (torchtitan's loaders save
    {"dp_rank_<r>": ..., "world_size": n}), else the lowest dp rank's (what dcp.save keeps)."""
    values = [by_dp[r] for r in sorted(by_dp)]
    if not values or not all(isinstance(v, dict) for v in values):
        return values[0] if values else None
    merged: dict = {}
    for v in values:
        for k, x in v.items():
            if k in merged and not _same(merged[k], x):
                return values[0]
            merged[k] = x
    return merged
