"""Checkpoint at failure (just-in-time checkpointing): when a rank of a data-parallel job fails, the
ranks that still hold a complete replica of the state save the newest step before the job ends, so
at most the step in progress is lost.

How it goes (`CheckpointManager.guard(state)`, every rank):
1. An exception leaves the guarded block. A rank whose exception came from a collective that a peer
   broke (gloo's "Connection closed by peer", NCCL's aborted communicator, omnickpt's own
   CheckpointTimeoutError naming a rank that did not answer) is a *survivor*; any other exception
   makes the rank a *failed* one. Failed ranks and SIGTERM'd ranks (which raise via the manager's
   handler) write a marker and re-raise at once.
2. Survivors write a marker too, then wait (`grace` seconds at most) until every rank of the job
   has one; a rank without a marker by then is taken as dead (SIGKILL, a crashed node). A survivor
   sure not to save (its own replica group lost a rank, or no complete replica exists) leaves at
   once: gloo's abort does not unblock a peer stuck in a collective with it, its exit does.
3. The survivors pick the savers from the markers alone, so every survivor picks the same ones
   without a collective (the job's process group is broken): with DDP (every rank holds the whole
   state) the lowest surviving rank saves alone; with HSDP (a 2-D mesh, replicated across one
   dimension and sharded across the other) the first shard group whose ranks all survive saves,
   over its own process group, which does not contain the failed rank. With plain FSDP or TP no
   complete replica can survive a rank's loss: nothing is saved, and the manager says so (the
   newest committed checkpoint stays latest).
4. The savers save the state as of the last step given to `save()` (call it every step, with
   `every=`, for at most one lost step), to that step's folder, and update `latest`. Every rank then
   re-raises its exception: the job still ends, as it would have.

Markers live in the checkpoint root (`.omnickpt/failure/<run>/rNNNNN.json`), because storage is the
one channel left when the process group is broken. `pick_savers` is the pure decision.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from omnickpt.errors import CheckpointTimeoutError
from omnickpt.storage import Storage

log = logging.getLogger("omnickpt")

MARKERS = ".omnickpt/failure"
# Text of the errors torch.distributed raises when a peer went away (it raises plain RuntimeErrors).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "NCCL error", "Socket Timeout", "Timed out waiting", "failed to recv", "ProcessGroupGloo",
              "DistBackendError", "DistNetworkError")


def peer_failure(error: BaseException) -> bool:
    """Whether `error` means another rank failed (this rank's state is intact) rather than this one."""
    if isinstance(error, CheckpointTimeoutError):
        return True
    name = type(error).__name__
    if name in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in _PEER_GONE)


@dataclass(frozen=True)
class Replicas:
    """How the state is replicated across the job's ranks: `groups` are the sets of ranks that
    together hold one complete copy (DDP: each rank alone; HSDP: each shard group); empty when no
    set of ranks short of the whole job does (FSDP, TP)."""
    groups: tuple[tuple[int, ...], ...]


def pick_savers(replicas: Replicas, alive: Sequence[int]) -> tuple[int, ...] | None:
    """The replica group that saves: the first whose ranks all survive (pure); None if none does."""
    live = set(alive)
    for group in sorted(replicas.groups):
        if group and set(group) <= live:
            return group
    return None


def cannot_save(replicas: Replicas, rank: int, found: dict[int, dict]) -> bool:
    """Whether this rank is sure it will not save (pure): no group holds a complete replica, or a
    rank of its own group has said it failed. Such a rank leaves at once rather than wait out the
    grace period: a survivor blocked in a collective with it (gloo's abort does not unblock its
    peers) is freed only when its process goes, and must still post its marker in time."""
    mine = [g for g in replicas.groups if rank in g]
    return not mine or all(any(r in found and not found[r].get("survivor") for r in g) for g in mine)


def replicas_of(state: dict, world_size: int) -> Replicas:
    """From the state's tensors: DTensors on a mesh with Replicate on some dimensions and Shard on
    others give the shard groups (HSDP); any sharded tensor without a replicated dimension (FSDP,
    TP over the whole job) gives none; no DTensor at all (plain, DDP) gives every rank alone."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate
    meshes: dict[int, tuple[Any, tuple]] = {}
    for value in state.values():
        modules = [value] if isinstance(value, nn.Module) else []
        for module in modules:
            for p in module.parameters():
                if isinstance(p, DTensor):
                    meshes.setdefault(id(p.device_mesh), (p.device_mesh, tuple(p.placements)))
    if not meshes:
        return Replicas(tuple((r,) for r in range(world_size)))
    groups: set[tuple[int, ...]] | None = None
    for mesh, placements in meshes.values():
        rep_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
        if not rep_dims or mesh.mesh.numel() != world_size:
            return Replicas(())
        ranks = mesh.mesh
        # a shard group: the ranks that share one coordinate along every replicated dimension
        mine: set[tuple[int, ...]] = set()
        for index in _coordinates([ranks.shape[d] for d in rep_dims]):
            sub = ranks
            for d, i in sorted(zip(rep_dims, index), reverse=True):
                sub = sub.select(d, i)
            mine.add(tuple(sorted(int(r) for r in sub.reshape(-1).tolist())))
        groups = mine if groups is None else groups & mine
    return Replicas(tuple(sorted(groups or ())))


def _coordinates(shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out


def post_marker(storage: Storage, run: str, rank: int, doc: dict) -> None:
    try:
        storage.commit(f"{MARKERS}/{run}/r{rank:05d}.json", json.dumps(doc).encode())
    except Exception as e:   # the survivors take this rank as dead: say why
        log.error("omnickpt: rank %d could not post its failure marker to %s: %s", rank, storage.describe(), e)


def await_markers(storage: Storage, run: str, world_size: int, grace: float,
                  stop: Callable[[dict[int, dict]], bool] | None = None) -> dict[int, dict]:
    """Every rank's marker that arrives within `grace` seconds (a dead rank writes none), or the
    markers found once `stop(found)` is true."""
    deadline, delay, found = time.monotonic() + grace, 0.005, {}
    while True:
        for rel in storage.list(f"{MARKERS}/{run}"):
            name = rel.rsplit("/", 1)[-1]
            if name.startswith("r") and name.endswith(".json") and name[1:-5].isdigit():
                rank = int(name[1:-5])
                if rank not in found:
                    try:
                        found[rank] = json.loads(storage.read_bytes(rel))
                    except (FileNotFoundError, ValueError):
                        continue
        if len(found) >= world_size or time.monotonic() > deadline or (stop is not None and stop(found)):
            return found
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
