"""What load_latest() restores from memory, and how. The decision is pure: the steps every node holds
complete, itself or through its peer's replica, or that another layout's memory holds whole on every
machine (restore_candidates), and the newest of them (choose_restore). The restore itself
(MemoryRestore) surveys memory and root, loads from this layout's node checkpoints (repaired from
peers first), or resharded from another layout's memory, and falls back to root.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from omnickpt.errors import (CheckpointError, CorruptCheckpointError, NotCommittedError,
                             UnsafeCheckpointError, error_class, rebuild_error)
from omnickpt.memory.layout import Placement, barrier

if TYPE_CHECKING:
    from omnickpt.memory.tier import MemoryTier
    from omnickpt.root import StepRoot


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step load_latest() may restore from memory: from the node checkpoints of this layout
    ("memory"; `broken` nodes first get theirs back from their peer), or resharded from the memory
    of another layout ("previous")."""
    step: int
    source: str
    broken: tuple[int, ...] = ()


def restore_candidates(views: Sequence[tuple[Sequence[int], Sequence[int]]], durable_step: int | None, peers: bool,
                       previous: Sequence[dict | None] = ()) -> tuple[list[Candidate], list[str]]:
    """The steps that can be restored from memory, newest first, and notes on memory that cannot be.

    views[k] = (steps complete in node k's memory, steps of node k-1 complete in node k's replica
    folder). A step every node has (itself or through the next node's replica) is a candidate.
    previous[m] = machine m's previous_view() (memory of another layout): a step is a candidate
    when every machine holds every old node's checkpoint of it (each machine builds the whole
    checkpoint from its own memory). Steps older than `durable_step` are stale: never candidates."""
    fresh = (lambda s: durable_step is None or s >= durable_step)
    out = _memory_candidates(views, peers, fresh)
    notes = []
    if previous and any(p is not None for p in previous):
        out += _previous_candidates(previous, fresh, notes)
    out.sort(key=lambda c: (c.step, c.source == "memory"), reverse=True)
    return out, notes


def _memory_candidates(views: Sequence[tuple[Sequence[int], Sequence[int]]], peers: bool,
                       fresh: Callable[[int], bool]) -> list[Candidate]:
    """Fresh steps every node of this layout has, itself or through the next node's replica."""
    n = len(views)
    own = [set(v[0]) for v in views]
    kept = [set(v[1]) for v in views]
    avail = [own[k] | (kept[(k + 1) % n] if peers and n > 1 else set()) for k in range(n)]
    return [Candidate(s, "memory", tuple(k for k in range(n) if s not in own[k]))
            for s in (set.intersection(*avail) if avail else set()) if fresh(s)]


def _previous_candidates(previous: Sequence[dict | None], fresh: Callable[[int], bool],
                         notes: list[str]) -> list[Candidate]:
    """Fresh steps of another layout's memory that every machine holds whole; the fresh steps some
    machine lacks go into `notes` (they cannot be resharded from memory)."""
    layouts = {(p["world_size"], p["ranks_per_node"]) for p in previous if p is not None}
    # A machine that saw no old memory, or machines that disagree on the old layout, hold nothing usable.
    per_machine = [set() if p is None or len(layouts) > 1 else _whole_steps(p) for p in previous]
    common = set.intersection(*per_machine)
    lost = _lost_steps(previous, fresh, common)
    if lost:
        notes.append(_lost_note(lost, layouts))
    return [Candidate(s, "previous") for s in common if fresh(s)]


def _lost_steps(previous: Sequence[dict | None], fresh: Callable[[int], bool], common: set) -> list[int]:
    """Fresh steps some machine's old memory holds that are not restorable from every machine, sorted."""
    return sorted({s for p in previous if p is not None for ss in p["nodes"].values() for s in ss
                   if fresh(s) and s not in common})


def _lost_note(lost: list[int], layouts: set[tuple[int, int]]) -> str:
    """Why the `lost` steps of another layout's memory cannot be restored; '?' when machines disagree on it."""
    w, r = next(iter(layouts)) if len(layouts) == 1 else ("?", "?")
    return (f"step(s) {lost} in shared memory were saved at world size {w} ({r} rank(s) per node) and "
            f"cannot be resharded from memory: not every machine of this job holds every old node's "
            f"checkpoint of them (a node's memory holds only its own ranks' part)")


def _whole_steps(view: dict) -> set:
    """Steps of which one machine's previous_view() holds every old node's checkpoint."""
    nodes = range(view["world_size"] // view["ranks_per_node"])
    return set.intersection(*(set(view["nodes"].get(j, ())) for j in nodes))


def choose_restore(views: Sequence[tuple[Sequence[int], Sequence[int]]], durable_step: int | None,
                   peers: bool) -> tuple[int | None, list[int]]:
    """Which step every node can restore from memory, and which nodes need their peer's replica:
    the newest candidate of restore_candidates(), unless durable storage holds a newer step (the
    memory is stale): then (None, [])."""
    found, _ = restore_candidates(views, durable_step, peers)
    if not found:
        return None, []
    return found[0].step, list(found[0].broken)


# ---------------------------------------------------------------------- restoring
def fatal_class(name: str) -> bool:
    """Failures of a restore from memory that root would not cure (the checkpoint asks for pickle, a
    wrong argument): raised, never fallen back from. A MismatchError falls back: memory may not
    cover what root does (a machine's memory lost, a view that lacks a node), and where the state
    truly does not fit, root's load raises the same class naming the same tensors."""
    return name == TypeError.__name__ or issubclass(error_class(name), UnsafeCheckpointError)


@dataclasses.dataclass(frozen=True)
class Survey:
    """What load_latest() and latest_step() decide from: memory candidates (newest first), notes on
    memory that cannot be restored, root's newest committed step or why it could not be listed."""
    candidates: list[Candidate]
    notes: list[str]
    durable_step: int | None
    durable_error: tuple[str, str] | None


class MemoryRestore:
    """How a TieredCheckpointManager restores: what memory and root hold (survey), and a restore
    from this layout's node checkpoints (after a repair from peers) or from another layout's memory
    (resharded), with the fallback to root. Every method is called by every rank; its phases end
    with an exchange of errors, so that all ranks fail together and fall back together."""

    def __init__(self, tier: MemoryTier, place: Placement, comm: Any, ckpt: Any, root: StepRoot):
        self.tier, self.place, self.comm, self.ckpt, self.root = tier, place, comm, ckpt, root

    def survey(self, collective: bool) -> Survey:
        """What memory and root hold. collective=True: every rank, one all-gather (node leaders
        list their memory, machine leaders previous/, rank 0 root). False (one node): each rank
        lists everything itself."""
        lay, comm = self.tier.layout, self.comm
        view = self.tier.view() if lay.local == 0 or not collective else None
        prev = self.tier.previous_view() if self.place.machine_leader or not collective else None
        durable_step, durable_error = None, None
        if comm.is_coordinator or not collective:
            try:   # a listing only: no checkpoint data is read from root to decide
                durable_step = self.root.latest_step()
            except (CheckpointError, OSError) as e:
                durable_error = (type(e).__name__, f"{type(e).__name__}: {e}")
        if collective:
            gathered = comm.all_gather_object((view, prev, durable_step, durable_error))
            views = [gathered[k * lay.ranks_per_node][0] for k in range(lay.nodes)]
            prevs = [gathered[r][1] for r in self.place.machine_leaders]
            durable_step, durable_error = gathered[0][2], gathered[0][3]
        else:
            views, prevs = [view], [prev]
        candidates, notes = restore_candidates(views, durable_step, self.place.side is not None, prevs)
        return Survey(candidates, notes, durable_step, durable_error)

    def restore(self, state: dict, kwargs: dict) -> tuple[Any, Candidate | None, Survey]:
        """Every rank: load the newest step, from memory when it can (None: from root). Returns the
        LoadResult, the memory candidate restored from (None: root) and the survey."""
        survey = self.survey(collective=True)
        durable_step = survey.durable_step
        failure = None   # (step, every rank's failure, whether the step was found corrupt)
        if survey.candidates:
            cand = survey.candidates[0]
            restore = self._restore_previous if cand.source == "previous" else self._restore_memory
            result, failed = restore(cand, state, dict(kwargs, dedup_reads=False))
            if not failed:
                return result, cand, survey
            failure = self._memory_restore_failed(cand, failed, durable_step)
        for note in survey.notes:
            warnings.warn(f"omnickpt: {note}; restoring from {self.root.path}. The memory is kept until this run's "
                          "first save: to restore from it, restart at the layout that saved it", RuntimeWarning,
                          stacklevel=3)
        if durable_step is None:
            self._raise_nothing_to_restore(survey, failure)
        with self.root.loading(durable_step):
            result = self.ckpt.load(self.root.step_path(durable_step), state, process_group=self.place.group,
                                    **kwargs)
        # Only once root loaded: where it cannot either (the state fits neither: a MismatchError
        # from both), a restart with the right state still finds memory as it was.
        error = None
        try:
            if self.tier.layout.local == 0:
                self.tier.purge_newer(None)   # older than root (stale), incomplete on some node, or corrupt
            if self.place.machine_leader and not survey.notes:
                self.tier.drop_previous()
        except Exception as e:
            error = e
        # Also a barrier: no rank saves a step into memory that a node leader is still purging.
        failed = self._failures(error)
        if failed:
            raise rebuild_error(*failed[0])
        return result, None, survey

    def _memory_restore_failed(self, cand: Candidate, failed: list[tuple[str, str]],
                               durable_step: int | None) -> tuple[int, list[tuple[str, str]], bool]:
        """Every rank, when restoring `cand` from memory failed: remove a corrupt step from memory and
        warn. Returns (step, every rank's failure, whether the step was found corrupt)."""
        lay = self.tier.layout
        corrupt = any(cls == CorruptCheckpointError.__name__ for cls, _ in failed)
        if corrupt:   # never again: a restart must not meet it (every rank is done with it)
            if cand.source == "memory" and lay.local == 0:
                self.tier.drop_step(cand.step)
            if cand.source == "previous" and self.place.machine_leader:
                self.tier.drop_previous(cand.step)
        then = (f"loading step {durable_step} from {self.root.path} instead" if durable_step is not None else
                f"and {self.root.path} holds no committed checkpoint to fall back to")
        # stacklevel 4: the caller of load_latest().
        warnings.warn(f"omnickpt: restoring step {cand.step} from shared memory failed ({describe(failed)})"
                      f"{'; the corrupt step is removed from shared memory' if corrupt else ''}; {then}",
                      RuntimeWarning, stacklevel=4)
        return cand.step, failed, corrupt

    def _raise_nothing_to_restore(self, survey: Survey,
                                  failure: tuple[int, list[tuple[str, str]], bool] | None) -> NoReturn:
        """Every rank, when root holds no committed step: raise the memory restore's failure (its
        class), or NotCommittedError when memory had nothing either."""
        where = f"{self.root.path} ({survey.durable_error[1]})" if survey.durable_error else self.root.path
        if failure is not None:
            step, failed, corrupt = failure
            raise rebuild_error(CorruptCheckpointError.__name__ if corrupt else failed[0][0],
                                f"restoring step {step} from shared memory ({self.tier.url}) failed: "
                                f"{describe(failed)}"
                                + ("; it was removed from shared memory, so a restart will not try it again"
                                   if corrupt else "")
                                + f"; and {where} holds no committed checkpoint to fall back to")
        raise NotCommittedError(f"nothing to restore: no complete step in shared memory ({self.tier.url}) "
                                f"and no committed checkpoint in {where}")

    def _failures(self, error: BaseException | None, view_of: int | None = None) -> list[tuple[str, str]]:
        """Every rank: each rank's failure as (class name, message naming the rank and node; files
        of the merged view of step `view_of` named in their node's folder)."""
        lay = self.tier.layout
        mine = None
        if error is not None:
            text = f"rank {lay.rank} (node {lay.node}): {type(error).__name__}: {error}"
            mine = (type(error).__name__, text if view_of is None else self.tier.attribute(text, view_of))
        return [g for g in self.comm.all_gather_object(mine) if g is not None]

    @staticmethod
    def _fatal(error: BaseException | None, failed: list[tuple[str, str]]) -> None:
        """The checkpoint asks for pickle, or a wrong argument: the durable copy would not do
        better, so every rank raises instead of falling back."""
        fatal = [f for f in failed if fatal_class(f[0])]
        if fatal:
            if error is not None:
                raise error
            raise rebuild_error(*fatal[0])

    def _restore_memory(self, cand: Candidate, state: dict, kwargs: dict):
        """Every rank: load `cand.step` from this layout's node checkpoints (after a repair from
        peers). Returns (LoadResult or None, the failures of all ranks)."""
        lay, step = self.tier.layout, cand.step
        result = None
        objects, error = self._repair_for_restore(cand)
        url, group = self.tier.step_url(step), self.place.node_group
        if lay.nodes > 1:
            # error is None past here: a failed repair fails the exchange in _merge_node_views.
            failed = self._merge_node_views(step, objects, error)
            if failed:
                return None, failed
            url, group = self.tier.view_url(step), self.place.group
        # With one node a failed repair still tries the load; its error is reported if the load fails too.
        try:
            result = self.ckpt.load(url, state, process_group=group, **kwargs)
        except Exception as e:
            error = e
        failed = self._failures(error, step if lay.nodes > 1 else None)
        if lay.nodes > 1 and self.place.machine_leader:
            self.tier.drop_world_view()
        self._fatal(error, failed)
        return (None if failed else result), failed

    def _repair_for_restore(self, cand: Candidate) -> tuple[list | None, BaseException | None]:
        """Every rank, _restore_memory's first phase: get broken nodes' checkpoints back from their
        peers; node leaders of a multi-node job read their node's objects. Returns (objects, error)."""
        lay, step, side = self.tier.layout, cand.step, self.place.side
        objects = None
        try:
            if cand.broken:
                self.tier.repair(step, cand.broken, side, self.place.global_ranks, lambda: barrier(side))
            if lay.nodes > 1 and lay.local == 0:
                objects = self.tier.node_objects(step)
        except Exception as e:
            return objects, e
        return objects, None

    def _merge_node_views(self, step: int, objects: list | None, error: BaseException | None) -> list[tuple[str, str]]:
        """Every rank of a multi-node job: exchange the first phase's errors and node objects; machine
        leaders write the merged view of `step`. Returns the failures of all ranks (empty: every view is
        written)."""
        lay = self.tier.layout
        # A node's checkpoint holds its own ranks' objects only; state that needs every rank's
        # value (a dataloader position) gets them through this exchange and a merged view, the
        # same URL on every machine.
        gathered = self.comm.all_gather_object((objects, None if error is None else (
            type(error).__name__, f"rank {lay.rank} (node {lay.node}): {type(error).__name__}: {error}")))
        failed = [g[1] for g in gathered if g[1] is not None]
        if failed:
            return failed
        try:
            if self.place.machine_leader:
                self.tier.world_view(step, self.place.nodes_here, [o for g in gathered if g[0] for o in g[0]])
        except Exception as e:
            error = e
        failed = self._failures(error)   # also: every machine's view is written before any rank reads one
        if failed and self.place.machine_leader:
            self.tier.drop_world_view()
        return failed

    def _restore_previous(self, cand: Candidate, state: dict, kwargs: dict):
        """Every rank: load `cand.step` from memory saved at another layout, resharded: each machine
        leader merges the old node checkpoints into one view, which the whole group loads."""
        error, result = None, None
        try:
            if self.place.machine_leader:
                self.tier.previous_world_view(cand.step)
        except Exception as e:
            error = e
        failed = self._failures(error)
        if not failed:
            try:
                result = self.ckpt.load(self.tier.view_url(cand.step), state, process_group=self.place.group,
                                        **kwargs)
            except Exception as e:
                error = e
            failed = self._failures(error)
        if self.place.machine_leader:
            self.tier.drop_world_view()
        self._fatal(error, failed)
        return (None if failed else result), failed


def describe(failed: list[tuple[str, str]]) -> str:
    """The failures of a restore, the ranks' own errors first (a rank that only heard of another
    rank's failure says so, and repeats it)."""
    own = [m for _, m in failed if "on another rank" not in m]
    return "; ".join(own or [m for _, m in failed])
