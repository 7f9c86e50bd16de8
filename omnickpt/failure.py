"""Checkpoint at failure (just-in-time checkpointing): when a rank of a data-parallel job fails, the
ranks that still hold a complete replica of the state save the newest step before the job ends, so
at most the step in progress is lost.

How it goes (`CheckpointManager.guard(state)`, every rank, through the manager's FailureGuard below):
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
4. The savers save step N, the last step given to `save()` (call it every step, with `every=`, for
   at most one lost step), to that step's folder, and update `latest`, but only the exact state of
   step N (`StepCapture` below), agreed by every saver; otherwise nothing, and `failure_save` and
   the log say why. Every rank then re-raises its exception: the job still ends, as it would have.

What is a failure (`exit_kind`): any exception, SystemExit with a non-zero code, and
KeyboardInterrupt (a user's Ctrl-C: the rank's state is intact, so it takes part as a survivor and
the stop loses no step). Not a failure, nothing saved: SystemExit with code 0 or None (a clean
exit) and GeneratorExit (a training loop written as a generator that its consumer closed).

Markers live in the checkpoint root (`.omnickpt/failure/<run>/rNNNNN.json`), because storage is the
one channel left when the process group is broken. `pick_savers` is the pure decision. The exact
state of step N (StepCapture) lives in omnickpt/capture.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from omnickpt.capture import BUFFER_BYTES, StepCapture, non_finite  # noqa: F401  (their home was this module)
from omnickpt.comm import SOLO, Comm
from omnickpt.commit import poll
from omnickpt.errors import CheckpointError, CheckpointTimeoutError
from omnickpt.storage import Storage

log = logging.getLogger("omnickpt")

MARKERS = ".omnickpt/failure"
# Text of the errors torch.distributed raises when a peer went away (it raises plain RuntimeErrors).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "NCCL error", "Socket Timeout", "Timed out waiting", "failed to recv", "ProcessGroupGloo",
              "DistBackendError", "DistNetworkError")


def exit_kind(error: BaseException) -> str:
    """How an exception leaving guard() counts: "clean" (SystemExit with code 0 or None,
    GeneratorExit: nothing is saved), "interrupt" (KeyboardInterrupt: a failure, but this rank's
    state is intact, as a survivor's), or "failure"."""
    if isinstance(error, GeneratorExit) or (isinstance(error, SystemExit) and error.code in (0, None)):
        return "clean"
    return "interrupt" if isinstance(error, KeyboardInterrupt) else "failure"


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
    from torch.distributed.tensor import Replicate
    meshes: dict[int, tuple[Any, tuple]] = {}
    for p in _dtensors(state):
        meshes.setdefault(id(p.device_mesh), (p.device_mesh, tuple(p.placements)))
    if not meshes:
        return Replicas(tuple((r,) for r in range(world_size)))
    groups: set[tuple[int, ...]] | None = None
    for mesh, placements in meshes.values():
        rep_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
        if not rep_dims or mesh.mesh.numel() != world_size:
            return Replicas(())
        mine = _shard_groups(mesh.mesh, rep_dims)
        groups = mine if groups is None else groups & mine
    return Replicas(tuple(sorted(groups or ())))


def _shard_groups(ranks, rep_dims: list[int]) -> set[tuple[int, ...]]:
    """The shard groups of a mesh (a tensor of ranks): the ranks that share one coordinate along
    every replicated dimension."""
    mine: set[tuple[int, ...]] = set()
    for index in _coordinates([ranks.shape[d] for d in rep_dims]):
        sub = ranks
        for d, i in sorted(zip(rep_dims, index), reverse=True):
            sub = sub.select(d, i)
        mine.add(tuple(sorted(int(r) for r in sub.reshape(-1).tolist())))
    return mine


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
    markers found once `stop(found)` is true (polled through omnickpt.commit.poll)."""
    found: dict[int, dict] = {}

    def probe() -> dict[int, dict] | None:
        for rel in storage.list(f"{MARKERS}/{run}"):
            name = rel.rsplit("/", 1)[-1]
            if name.startswith("r") and name.endswith(".json") and name[1:-5].isdigit():
                rank = int(name[1:-5])
                if rank not in found:
                    try:
                        found[rank] = json.loads(storage.read_bytes(rel))
                    except (FileNotFoundError, ValueError):
                        continue
        return found if len(found) >= world_size or (stop is not None and stop(found)) else None

    try:
        return poll(probe, grace, _GraceOver)
    except _GraceOver:   # the ranks without a marker by then are taken as dead
        return found


class _GraceOver(Exception):
    """await_markers' grace period ran out (caught there: not an error)."""


# ---------------------------------------------------------------------- the guard
class FailureGuard:
    """Checkpoint at failure for one manager: `with guard.guarding(state):` around the training
    loop (the manager's guard() returns it). It keeps what guard() needs between save() calls: the
    last step given to save() (`last_step`, set by the manager), the capture of its state
    (`capture`, taken by `capture_unsaved` at a call that did not save, inside a guarded block
    only), and after a failure what it did (`failure_save`).

    What it asks of the manager, as callables (weakly held: the guard never keeps its manager
    alive): `outcome(step)`, this rank's failure_save when step N is not to be saved at failure
    (read-only, closed, saved by save() itself, already committed) or None; `save(step, state,
    group, kwargs)`, a synchronous save of step N into root over `group` that updates `latest`,
    returning its path; `latest()`, the newest committed step (for messages). `storage` is the
    checkpoint root (the markers live there), `comm` the manager's process group, `run` the name
    every rank agreed on for this run (set by the manager once agreed)."""

    def __init__(self, storage: Storage, comm: Any, group: Any, *, outcome: Callable[[int], dict | None],
                 save: Callable[[int, dict, Any, dict], str], latest: Callable[[], int | None]):
        self.storage, self.comm, self.group = storage, comm, group
        self._outcome, self._save, self._latest = _weak(outcome), _weak(save), _weak(latest)
        self.run = ""
        self.last_step: int | None = None   # the newest step given to save(): the one to save at failure
        self.capture = StepCapture()        # its state, when that call did not save
        self.failure_save: dict | None = None
        self._depth = 0                     # guarded blocks open: save() captures only inside one

    def capture_unsaved(self, step: int, state: dict, kwargs: dict) -> None:
        """A save() call that did not save: inside guarding(), the state is captured as step `step`
        (a fraction of a millisecond for a model with a dataloader and RNG state, mostly their own
        state_dict() calls); outside, nothing is, and a loop without guard() pays nothing."""
        if self._depth:
            self.capture.take(step, state, kwargs)

    @contextlib.contextmanager
    def guarding(self, state: dict, grace: float, owner: Any = None):
        """The guard() block (CheckpointManager.guard states the contract): yields `owner`. When an
        exception leaves it, every rank records in `failure_save` what it did, and re-raises."""
        self._depth += 1
        try:
            yield owner
        except BaseException as e:
            trigger = f"{type(e).__name__}: {e}"[:500]
            if exit_kind(e) == "clean":
                self.failure_save = {"saved": False, "trigger": trigger, "reason": "a clean exit, not a failure"}
                raise
            try:
                self.failure_save = self._save_at_failure(state, e, grace)
            except Exception as inner:   # the job's own failure is the one to raise
                self.failure_save = {"saved": False, "reason": f"{type(inner).__name__}: {inner}"}
                log.error("omnickpt: checkpoint at failure to %s failed: %s: %s", self.storage.describe(),
                          type(inner).__name__, inner, exc_info=True)
            self.failure_save["trigger"] = trigger
            raise
        finally:
            self._depth -= 1

    def _save_at_failure(self, state: dict, error: BaseException, grace: float) -> dict:
        """Every rank, once `error` left guarding(): post this rank's marker, learn who survives and
        which replica group saves, then that group saves step N exactly or not at all. Returns this
        rank's failure_save."""
        rank, world, step = self.comm.rank, self.comm.world_size, self.last_step
        # KeyboardInterrupt (Ctrl-C) leaves the rank's state intact: it may save, as a survivor does
        survivor = world > 1 and (peer_failure(error) or exit_kind(error) == "interrupt")
        run = f"{self.run}-s{step}"
        if world > 1:
            post_marker(self.storage, run, rank, {"rank": rank, "survivor": survivor, "step": step,
                                                  "error": f"{type(error).__name__}: {error}"[:500]})
        if not (survivor or world <= 1):
            return {"saved": False, "reason": "this rank failed; the surviving ranks save"}
        outcome = self._outcome()(step) if step is not None else {
            "saved": False, "reason": "no step to save (read-only, closed, or save() never called)"}
        if outcome is not None:
            return outcome
        savers, alive, outcome = self._savers(state, rank, world, run, grace)
        if outcome is not None:
            return outcome
        return self._save_exact(state, step, rank, run, savers, alive)

    def _savers(self, state: dict, rank: int, world: int, run: str,
                grace: float) -> tuple[tuple[int, ...], list[int], dict | None]:
        """A survivor (or the one rank): (the replica group that saves, the surviving ranks, None),
        or (.., .., this rank's failure_save) when this rank does not save."""
        alive, replicas = [rank], replicas_of(state, world)
        if world == 1:
            return (rank,), alive, None
        # Ranks still blocked in a collective with this one would wait for the process group's
        # own timeout: closing this rank's connections fails their collective now.
        abort_groups(self.group, state)
        markers = await_markers(self.storage, run, world, grace, stop=lambda found: cannot_save(replicas, rank, found))
        alive = sorted(r for r, m in markers.items() if m.get("survivor"))
        if replicas.groups and cannot_save(replicas, rank, markers) and len(markers) < world:
            return (), alive, {"saved": False, "alive": alive, "reason": "this rank's replica group lost a rank: it "
                               "leaves, the other groups decide"}
        savers = pick_savers(replicas, alive)
        if savers is None:
            log.error("omnickpt: rank(s) %s failed and no complete replica of the state survives (surviving ranks %s); "
                      "nothing was saved at failure, step %s of %s stays the newest committed one",
                      sorted(set(range(world)) - set(alive)), alive, self._latest()(), self.storage.describe())
            return (), alive, {"saved": False, "alive": alive, "reason": "no complete replica survives"}
        if rank not in savers:
            return savers, alive, {"saved": False, "alive": alive, "savers": list(savers),
                                   "reason": "another replica saves"}
        return savers, alive, None

    def _save_exact(self, state: dict, step: int, rank: int, run: str, savers: tuple[int, ...],
                    alive: list[int]) -> dict:
        """Every rank of the replica group `savers`: save step `step` from the capture, exactly or not at
        all, once this group has claimed it. Returns this rank's failure_save."""
        group = SOLO if len(savers) == 1 else shard_group(state)
        with self.capture.state_to_save(step) as (exact, problem):
            if len(savers) > 1:   # every rank of the group holds part of the step: all exact, or none saves
                problems = Comm(group).all_gather_object(problem, step="checkpoint at failure")
                problem = next((f"rank {r}: {p}" for r, p in zip(savers, problems) if p), None)
            if problem is not None:
                log.error("omnickpt: not saving step %d to %s at failure: %s; step %s stays the newest committed "
                          "one", step, self.storage.describe(), problem, self._latest()())
                return {"saved": False, "step": step, "alive": alive, "savers": list(savers), "reason": problem}
            # A survivor still blocked in a collective when the others decided can see more ranks alive
            # and pick another group: the first group to claim the step saves it, the other stands down.
            won = rank != savers[0] or self.storage.create_exclusive(
                f"{MARKERS}/{run}/claim.json", json.dumps({"savers": list(savers)}).encode())
            if len(savers) > 1:
                won = Comm(group).broadcast_object(won, step="checkpoint at failure")
            if not won:
                return {"saved": False, "alive": alive, "reason": "another replica group saved this step"}
            path = self._save()(step, exact, group, self.capture.kwargs)
        log.warning("omnickpt: saved step %d to %s at failure (ranks %s, surviving ranks %s; from the capture of "
                    "save(%d): %s)", step, path, list(savers), alive, step,
                    ", ".join(self.capture.taken_from_capture()) or "nothing")
        return {"saved": True, "step": step, "path": path, "savers": list(savers), "alive": alive,
                "captured": self.capture.taken_from_capture()}


def _weak(method: Callable) -> Callable[[], Callable]:
    """A weak reference to a bound method (a plain function is held as it is)."""
    if hasattr(method, "__self__"):
        return weakref.WeakMethod(method)
    return lambda: method


def abort_groups(group: Any, state: dict) -> None:
    """Abort (close the connections of) the job's process group and the state's device-mesh groups
    that span replicas: a peer blocked in a collective with this rank then fails at once instead of
    at the group's timeout. The groups along sharded mesh dimensions stay: a replica group that
    survives whole saves over its own (the job's store may be gone with the failed ranks, so no
    new group could be made). Only after a failure: aborted groups are unusable."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    groups = [group if group is not None else dist.group.WORLD]
    for p in _dtensors(state):
        mesh = p.device_mesh
        groups += [mesh.get_group(d) for d, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
    seen: set[int] = set()
    for g in groups:
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        try:
            g.abort()
        except Exception as e:   # already broken, or a backend without abort: the grace period covers it
            log.debug("omnickpt: aborting a process group after a failure: %s", e)


def _dtensors(state: dict):
    from torch.distributed.tensor import DTensor
    for value in state.values():
        if isinstance(value, nn.Module):
            yield from (p for p in value.parameters() if isinstance(p, DTensor))


def shard_group(state: dict) -> Any:
    """This rank's process group along the sharded dimension of the state's HSDP mesh."""
    from torch.distributed.tensor import Replicate
    for p in _dtensors(state):
        dims = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
        if len(dims) == 1:
            return p.device_mesh.get_group(dims[0])
    raise CheckpointError("checkpoint at failure: the state's replica group has no single sharded mesh dimension")
