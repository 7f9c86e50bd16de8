"""TieredCheckpointManager: a memory tier in host shared memory in front of a durable checkpoint
root, with peer replicas and persist-on-failure (docs/memory_tier.md). It is made of parts, as the
plain manager (omnickpt/manager.py) is, and owns them: the StepRoot of its durable root
(omnickpt/root.py: lease, `latest`, retention, failed steps, exit hook), a SaveLoop (save() calls,
every=, on_error, guard()), the MemoryTier (memory/tier.py: the mechanics of shared memory) and a
MemoryRestore (memory/restore.py: load_latest()). What this module adds is policy: when to save to
memory, when to copy a step to the root, what to leave in memory at close. The durable copy
commits through omnickpt/commit.py's one choreography (run_round), as an async save does.

What it guards against, besides crashes: a second job writing the same memory job (owner leases),
a corrupt memory copy (checksummed on restore; it falls back to root and is removed, so a restart
does not meet it again), losing the only copy of a step (close() and exit keep it).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from omnickpt import commit
from omnickpt.api import Checkpointer, LoadResult, SaveHandle, default_checkpointer
from omnickpt.cadence import cadence_of
from omnickpt.engine.priority import background
from omnickpt.engine.save import collect_garbage
from omnickpt.errors import CheckpointError, CheckpointTimeoutError, rebuild_error
from omnickpt.failure import FailureGuard
from omnickpt.lease import acquire
from omnickpt.manager import ManagerOptions, SaveLoop, save_at_failure
from omnickpt.memory.durable import commit_durable, persist_rank
from omnickpt.memory.handle import TieredSave
from omnickpt.memory.layout import (NodeLayout, Placement, barrier, global_ranks, local_world_size, machines,
                                    memory_place, new_group)
from omnickpt.memory.options import MemoryTierOptions, tiered_options
from omnickpt.memory.restore import Candidate, MemoryRestore
from omnickpt.memory.tier import MemoryTier
from omnickpt.root import StepRoot
from omnickpt.steps import step_dir
from omnickpt.storage import storage_for
from omnickpt.version import __version__

log = logging.getLogger("omnickpt")


class TieredCheckpointManager:
    """A checkpoint manager whose saves go first to host shared memory (the stall is a copy into
    staging memory); every `persist_every`-th one is then copied to `root` in the background.
    load_latest() restores from memory when the memory holds the newest complete step (no read of
    `root`'s data), else from `root`. The memory job's lease (one per machine) is taken at
    construction, the root's at the first write there. It offers what CheckpointManager offers
    (save, wait, guard, steps, latest_step, load, load_latest, close, every=, on_error), plus
    memory_steps() and flush().

    Built as `TieredCheckpointManager(root, memory="shm://JOB", memory_keep=..., ...)`: the options
    are those of MemoryTierOptions, the others (keep_last, checkpointer, process_group, on_error,
    every=) the plain manager's. Equivalent: `memory=MemoryTierOptions("shm://JOB", ...)` (the same
    options as one value; then none as keywords). Incremental saves and read_only are refused.

    Every rank of the process group creates it (collectives: an all-gather of ids and machines, the
    agreement on the leases), saves the same steps and calls close() (collectives: two
    all-gathers). A manager still open at interpreter exit is finished there: its saves in flight
    committed and the newest step copied to root, or the process exits with status 1.
    """

    def __init__(self, root: str, *, memory: str | MemoryTierOptions, checkpointer: Checkpointer | None = None,
                 process_group: Any = None, options: ManagerOptions | None = None, **keywords):
        """`keywords`: MemoryTierOptions' fields (or all of them in `memory`), and ManagerOptions'
        (keep_last, on_error, every, max_overhead, max_interval; or all of them as `options`)."""
        memory, opts = tiered_options(memory, options, keywords)
        self.options = memory
        self._ckpt = checkpointer or default_checkpointer()
        self._group = process_group
        self._comm = self._ckpt.comm(self._group)
        self._root = StepRoot(root, self._comm, keep_last=opts.keep_last)
        self.root, self.keep_last = self._root.path, opts.keep_last
        self._closed = False
        self.restored: tuple[str, int] | None = None   # ("memory" | "durable", step) after load_latest
        self._overwrite = opts.overwrite
        self._guard = FailureGuard(self._root.storage, self._comm, self._group, outcome=self._failure_outcome,
                                   save=self._save_at_failure, latest=self.latest_step)
        cadence = cadence_of(opts.every, opts.max_overhead, opts.max_interval, self._comm)
        self._loop = SaveLoop(self._root, opts.on_error, cadence, self._guard, start=self._save, finish=self._wait,
                              in_flight=self._in_flight, checkpointer=self._ckpt)
        self._place = self._place_ranks(memory)
        self._restore = MemoryRestore(self._tier, self._place, self._comm, self._ckpt, self._root)
        # Background work, as the Checkpointer's own persist thread: it yields to training.
        lower = dict(initializer=background, initargs=(self._ckpt.background_nice,))
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-memory", **lower)
        self._durable_lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-durable", **lower)
        self._copy_io = ThreadPoolExecutor(4, thread_name_prefix="omnickpt-copy", **lower)
        # Re-entrant: the SIGTERM handler runs on the main thread, which may hold it when interrupted.
        self._lock = threading.RLock()
        self._mem_future: Future | None = None        # the memory lane's last job
        self._durable_future: Future | None = None    # the durable lane's last job
        self._pinned: set[int] = set()     # memory steps the durable lane still reads
        self._attempted: set[int] = set()  # steps this run has copied (or is copying) to root
        self._tries: dict[int, int] = {}   # copies of a step to root started, failed ones included
        self._durable_done: int | None = None
        self._memory_step: int | None = None   # newest step committed in memory, as this process knows
        self._saves = 0
        self._signals: dict[int, Any] = {}
        if memory.persist_on_failure:
            self._install_signals((signal.SIGTERM,))
        self._root.finish_at_exit(self._close_at_exit)

    def _place_ranks(self, memory: MemoryTierOptions) -> Placement:
        """Every rank, at construction: the node layout, the process groups, then (one all-gather
        and the agreement) which ranks share a machine, the leases and the tier's memory."""
        comm, world = self._comm, self._comm.world_size
        rpn = memory.ranks_per_node or local_world_size(world)
        layout = NodeLayout(world, rpn, comm.rank)
        if memory.peer_replicas and layout.nodes < 2:
            raise ValueError(f"peer_replicas needs at least two nodes; the group has {world} rank(s) with "
                             f"ranks_per_node={rpn}")
        ranks = global_ranks(self._group, world)
        node_group = self._group if layout.nodes == 1 else new_group(
            ranks[layout.node * rpn:(layout.node + 1) * rpn], self._group, world, timeout=self._ckpt.timeout)
        # Peer transfers run on a background thread: a group of their own, so they never
        # interleave with the training loop's collectives. Bounded by the Checkpointer's timeout: a
        # peer machine cut off mid-transfer fails the save by name instead of hanging the lane.
        side = (new_group(ranks, self._group, world, backend="gloo", timeout=self._ckpt.timeout)
                if memory.peer_replicas else None)
        self._tier = MemoryTier(memory.url, layout, self._root.storage.describe())
        leaders, leader, here = self._join_machines()
        return Placement(layout, self._group, node_group, side, tuple(ranks), leaders, leader, here)

    def _join_machines(self) -> tuple[tuple[int, ...], bool, tuple[int, ...]]:
        """Every rank (one all-gather, then the agreement): one run id, the job id of the leases
        (the coordinator's process), which ranks share one machine's memory; each machine leader
        takes the memory job's lease and prepares its memory. Returns machines()'s answer."""
        comm = self._comm
        place, error = None, None
        try:
            place = memory_place()
        except Exception as e:
            error = e
        gathered = comm.all_gather_object((uuid.uuid4().hex[:12], self._root.job_id, place))
        self._run_id, self._root.job_id = gathered[0][0], gathered[0][1]   # this run's id in control records
        self._guard.run = self._run_id   # guard()'s failure markers: one name on every rank
        leaders, leader, here = machines([g[2] for g in gathered], comm.rank, self._tier.layout.ranks_per_node)
        if leader and error is None:
            # Before anything in the job's memory is touched: a second live job of that name stops here.
            try:
                self._root.keep(acquire(self._tier.job, self._root.job_id, what=f"memory job {self._tier.url}"))
                self._tier.prepare(here)
            except Exception as e:
                error = e
        # Also makes every machine's prepare() finish before any rank looks at its memory.
        self._root.settle(error, f"starting the memory tier {self._tier.url}")
        return leaders, leader, here

    # ------------------------------------------------------------------ what the parts keep
    on_error = property(lambda self: self._loop.on_error, doc="'raise' or 'warn' (a failed save is listed)")
    failures = property(lambda self: self._loop.failures, doc="the newest FAILURES_KEPT failed saves (on_error='warn')")
    failure_count = property(lambda self: self._loop.failure_count, doc="failed saves, all of them")
    failure_save = property(lambda self: self._guard.failure_save, doc="what guard() did when the job failed")

    def step_path(self, step: int) -> str:
        return self._root.step_path(step)

    # ------------------------------------------------------------------ the public surface
    def save(self, step: int, state: dict, *, async_save: bool = False, force: bool = False, **kwargs):
        """Save step `step` to shared memory (CheckpointManager.save states the contract: every=,
        force, on_error, guard()'s capture); every `persist_every`-th save is then copied to root.
        Returns a TieredSave (None when the call did not save)."""
        return self._loop.save(step, state, async_save, force, kwargs)

    def wait(self) -> dict | None:
        """Wait for the save in flight: its commit in memory and its durable copy; returns the
        memory commit's report. A background failure is raised here, once (logged and listed in
        `self.failures` with on_error="warn")."""
        return self._loop.wait()

    def cadence_report(self) -> dict | None:
        """With every=: what the cadence chose and measured (CheckpointManager.cadence_report)."""
        return self._loop.cadence_report()

    def guard(self, state: dict, *, grace: float = 10.0):
        """Checkpoint at failure, as CheckpointManager.guard(): step N, saved to memory by save()
        and copied to root by its durable copy, or saved into root by the surviving replica."""
        return self._guard.guarding(state, grace, self)

    def steps(self) -> list[int]:
        """Committed steps in `root`, oldest first. Steps only in shared memory are not listed
        here (memory_steps()); latest_step() considers both."""
        return self._root.steps()

    def latest_step(self) -> int | None:
        """The step load_latest() restores: the newest committed step in `root`, or a newer one
        complete in memory (on every node, as load_latest() would restore it). None if there is
        none. With several nodes every rank calls it (one all-gather)."""
        survey = self._restore.survey(collective=self._tier.layout.nodes > 1)
        if survey.candidates:
            return survey.candidates[0].step
        if survey.durable_error is not None:
            raise rebuild_error(*survey.durable_error)
        return survey.durable_step

    def memory_steps(self) -> list[int]:
        """Steps complete in this node's shared memory, oldest first."""
        return self._tier.committed_steps()

    def load(self, step: int, state: dict, **kwargs) -> LoadResult:
        """Load step `step` from `root`."""
        with self._root.loading(step):
            return self._ckpt.load(self.step_path(step), state, process_group=self._group, **kwargs)

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        """Load the newest committed step: from shared memory when every node holds that step
        complete (itself or through its peer's replica; saved at another world size or node
        layout: resharded, when every machine holds all of it) and `root` holds nothing newer, else
        from `root`. Every byte read from memory is checksummed; a corrupt step falls back to the
        next memory step or `root`, with a warning, and is removed from memory. Raises
        CorruptCheckpointError when it was the only thing to restore. report["tier"] says where it
        came from; `self.restored` too."""
        self.wait()
        result, cand, survey = self._restore.restore(state, kwargs)
        if cand is not None:
            return self._restored_from_memory(cand, result, state, kwargs, survey.durable_step)
        self.restored = ("durable", survey.durable_step)
        result.report.update(tier="durable", step=survey.durable_step)
        return result

    def close(self) -> None:
        """Wait for what is in flight, copy the newest memory step to `root` if it is not there yet,
        give shared memory back per `on_close` (never a step `root` lacks), restore the signal
        handlers, give the owner leases back. Every rank calls it."""
        self._close_tiered(clean=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self.close()
            return False
        if self.options.persist_on_failure:
            self._flush_noting(f"{exc_type.__name__} leaving the training loop")
        self._close_tiered(clean=False)
        return False

    # ------------------------------------------------------------------ saving
    def _save(self, step: int, state: dict, async_save: bool, kwargs: dict) -> TieredSave:
        """The SaveLoop's start: this manager's checks, then the save to memory."""
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
        self._loop.check_new(step)
        # The previous save's memory commit (and peer copy) first: a failure there surfaces here,
        # once. The future is dropped only after it finished, so that a flush from a signal
        # handler that interrupts this wait still waits for that step.
        if self._mem_future is not None:
            try:
                self._mem_future.result()
            finally:
                self._mem_future = None
        if not self._loop.saved:
            self._first_save(step)
        self._loop.saved.add(step)
        try:
            return self._save_to_memory(step, state, async_save, kwargs)
        except BaseException:
            self._loop.saved.discard(step)
            raise

    def _first_save(self, step: int) -> None:
        """Before this run's first save: memory this run neither wrote nor restored is an earlier
        process's. Its steps newer than `step` would win a restart over this run's own steps, so
        they go (with a warning saying whether root holds them); so does memory of another layout."""
        if self.restored is None:
            if self._tier.layout.local == 0:
                gone = self._tier.purge_newer(step)
                if gone:
                    try:
                        in_root = [s for s in gone if s in set(self._root.steps())]
                    except (CheckpointError, OSError):
                        in_root = None
                    where = (f"{self.root} holds {in_root}" if in_root is not None else f"{self.root} is unreachable")
                    warnings.warn(f"omnickpt: shared memory {self._tier.node_url} held step(s) {gone} of an earlier "
                                  f"run of this job, newer than step {step} that this run saves first without having "
                                  f"restored them (load_latest()); they are removed so that a restart cannot restore "
                                  f"them over this run's steps ({where})", RuntimeWarning, stacklevel=5)
            if self._place.machine_leader:
                info = self._tier.previous_view()
                if info is not None and any(info["nodes"].values()):
                    warnings.warn(f"omnickpt: shared memory {self._tier.job.describe('previous')} held steps saved at "
                                  f"world size {info['world_size']}, which this run saves over without having restored "
                                  f"them (load_latest()); they are removed", RuntimeWarning, stacklevel=5)
                self._tier.drop_previous()
        self._root.first_save(step, self._overwrite, stacklevel=6)

    def _save_to_memory(self, step: int, state: dict, async_save: bool, kwargs: dict) -> TieredSave:
        due = (self._saves + 1) % self.options.persist_every == 0
        if due and self._durable_future is not None:
            # At most one durable copy in flight, and the same decision on every rank.
            try:
                self._durable_future.result()
            finally:
                self._durable_future = None
        handle = self._ckpt.save(self._tier.step_url(step), state, async_save=True,
                                 process_group=self._place.node_group, **kwargs)
        self._saves += 1
        if due:
            with self._lock:
                self._pinned.add(step)
        fut = self._lane.submit(self._memory_job, step, handle, due)
        self._mem_future = fut
        tiered = TieredSave(step, fut, handle)
        if not async_save:
            try:
                tiered.wait_memory()
            except BaseException:
                self._mem_future = None   # raised here: not again at the next save or close()
                raise
        return tiered

    def _memory_job(self, step: int, handle: SaveHandle, due: bool):
        """Memory lane (one thread, the same sequence on every rank): commit in memory, peer
        copy, durable copy when due, retention."""
        try:
            report = handle.wait()
        except BaseException as e:
            with self._lock:
                self._pinned.discard(step)
                self._loop.saved.discard(step)
            if isinstance(e, CheckpointError):
                if self._tier.layout.local == 0:
                    # Shared memory is scarce: the failed step's partial files go now (every rank
                    # of the node is done with them: the commit's failure comes after their records).
                    self._tier.storage.delete_tree(step_dir(step))
                raise rebuild_error(type(e).__name__, f"step {step} was not saved to shared memory "
                                    f"({self._tier.step_url(step)}): {e}; the previous memory step and {self.root} "
                                    "are untouched") from e
            raise
        try:
            side = self._place.side
            if side is not None:
                got = self._tier.send_replica(step, side, self._place.global_ranks)
                barrier(side)   # every holder rank has its part: the replica manifest goes last
                self._tier.commit_replica(step, got)
        except BaseException as e:
            log.error("omnickpt: sending memory step %d to the next node failed on rank %d: %s: %s", step,
                      self._tier.layout.rank, type(e).__name__, e)
            with self._lock:
                self._pinned.discard(step)
            if isinstance(e, CheckpointError) or not isinstance(e, Exception):
                raise
            raise self._replica_error(step, e) from e
        with self._lock:
            self._memory_step = step
        durable = None
        if due:
            durable = self._durable_lane.submit(self._durable_job, step, True)
            self._durable_future = durable
        if self._tier.layout.local == 0:
            with self._lock:
                pinned = set(self._pinned)
            self._tier.retain(self.options.memory_keep, pinned, upto=step)
        return report, durable

    def _replica_error(self, step: int, error: Exception) -> CheckpointError:
        """The peer copy of `step` failed (the gloo group's error, a plain RuntimeError): a named
        error saying with which ranks and what is left (the step stands in this node's memory)."""
        lay, ranks = self._tier.layout, self._place.global_ranks
        peers = sorted({ranks[lay.holder_of(lay.rank)], ranks[lay.source_for(lay.rank)]})
        text = str(error)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        cls = CheckpointTimeoutError if timed_out else CheckpointError
        return cls(f"step {step}: the peer replica exchange of rank {ranks[lay.rank]} (node {lay.node}) with "
                   f"rank(s) {peers} on the neighbouring node(s) "
                   + (f"did not finish within {self._ckpt.timeout:g} s (a machine down or cut off)" if timed_out
                      else "failed")
                   + f": {type(error).__name__}: {text[:500]}; the step is committed in this node's memory "
                   f"({self._tier.step_url(step)}) without a replica on the next node")

    def _durable_job(self, step: int, wait_commit: bool, timeout: float | None = None) -> str:
        """Copy memory step `step` to root, one commit round (commit.run_round): every rank copies its
        file and posts its record, the coordinator merges the node manifests and writes the manifest
        last, then `latest` and retention. A failed commit (every record came) removes the step's
        folder. A failure is logged when it happens (rank 0, and a rank whose own copy failed)."""
        t0 = time.perf_counter()
        timeout = self._ckpt.timeout if timeout is None else timeout
        lay = self._tier.layout
        attempt = self._attempt(step)
        try:
            durable = storage_for(self.step_path(step))
            round_ = commit.Round(durable, attempt, lay.rank, lay.world_size, timeout,
                                  f"persisting to {durable.describe()}")
            commit.run_round(
                round_, lambda: self._persist(step, durable),
                lambda records: commit_durable(durable, attempt, records, lay.ranks_per_node, __version__,
                                               total_seconds=time.perf_counter() - t0),
                after=lambda merged: self._after_copy(step, durable, merged), wait=wait_commit,
                on_failure=lambda _e, records: records is not None and self._root.discard_failed(step))
            with self._lock:
                self._durable_done = max(step, self._durable_done or step)
            return attempt
        except Exception as e:
            with self._lock:
                self._attempted.discard(step)   # flush() and close() try again
            if self._comm.is_coordinator:
                log.error("omnickpt: copying memory step %d to %s failed: %s: %s; the step stays in shared memory "
                          "(%s)", step, self.step_path(step), type(e).__name__, e, self._tier.node_url)
            raise
        finally:
            with self._lock:
                self._pinned.discard(step)

    def _after_copy(self, step: int, durable, merged) -> None:
        """Coordinator, once the copy of `step` is committed: files of earlier attempts there go,
        then `latest` and retention."""
        collect_garbage(durable, merged)
        self._root.after_commit(step)

    def _attempt(self, step: int) -> str:
        """The save id of a new copy of `step` to root. A new id for each try (the same sequence on
        every rank): a retry must not read the records or status of a failed one."""
        with self._lock:
            self._attempted.add(step)
            self._tries[step] = self._tries.get(step, 0) + 1
            return f"{self._run_id}-s{step}" + (f"-{self._tries[step]}" if self._tries[step] > 1 else "")

    def _persist(self, step: int, durable) -> dict:
        """The round's local part, every rank: this rank's file of memory step `step` copied to root
        (the coordinator first takes root's owner lease: a refusal fails the round for every rank)."""
        if self._comm.is_coordinator:
            self._root.hold()
        try:
            return persist_rank(self._tier, step, durable, self._tier.layout.rank, self._copy_io)
        except Exception as e:
            if not self._comm.is_coordinator:
                log.error("omnickpt: rank %d: copying memory step %d to %s failed: %s: %s", self._tier.layout.rank,
                          step, self.step_path(step), type(e).__name__, e)
            raise

    def _in_flight(self) -> bool:
        """The cadence's view: a save is in flight until its memory commit and its durable copy are done."""
        return any(f is not None and not f.done() for f in (self._mem_future, self._durable_future))

    def _wait(self) -> dict | None:
        """The SaveLoop's finish: the memory lane (its commit in memory), then the durable lane it may
        have fed; returns the memory commit's report. A lane's future is dropped once it finished."""
        report = None
        if self._mem_future is not None:
            try:
                report = self._mem_future.result()[0]
            finally:
                self._mem_future = None
        if self._durable_future is not None:
            try:
                self._durable_future.result()
            finally:
                self._durable_future = None
        return report

    def _quiesce(self, timeout: float | None) -> None:
        """Let both lanes finish (the memory lane first: it may still hand a copy to the durable
        lane), at most `timeout` each, ignoring their failures (wait() raises them)."""
        for lane in (lambda: self._mem_future, lambda: self._durable_future):
            fut = lane()
            if fut is not None:
                try:
                    fut.result(timeout)
                except Exception:
                    pass

    # ------------------------------------------------------------------ checkpoint at failure
    def _failure_outcome(self, step: int) -> dict | None:
        """The guard's question (FailureGuard): whether step `step` is to be saved at failure."""
        return self._loop.at_failure(step, self._closed)

    def _save_at_failure(self, step: int, state: dict, group: Any, kwargs: dict) -> str:
        return save_at_failure(self._ckpt, self._root, step, state, group, kwargs)

    # ------------------------------------------------------------------ restoring
    def _restored_from_memory(self, cand: Candidate, result: LoadResult, state: dict, kwargs: dict,
                              durable_step: int | None) -> LoadResult:
        """After a restore from memory: drop what is newer (an abandoned timeline); a step resharded
        from another layout is saved again in this layout's memory when root lacks it, so that
        flush(), close() and persist_every copy it as any other step."""
        step = cand.step
        if self._tier.layout.local == 0:
            self._tier.purge_newer(step)
        self.restored = ("memory", step)
        with self._lock:
            if durable_step == step:
                self._durable_done = max(step, self._durable_done or step)
            if cand.source == "memory":
                self._memory_step = step
        result.report.update(tier="memory", step=step, repaired_nodes=list(cand.broken))
        if cand.source == "memory":
            if self._place.machine_leader:
                self._tier.drop_previous()
            return result
        result.report["resharded"] = True
        keep_previous = durable_step != step and bool(result.differences)
        if durable_step != step and not result.differences:
            try:
                self._save_to_memory(step, state, False, {"allow_pickle": kwargs.get("allow_pickle", False)})
            except Exception as e:   # the same on every rank (the save's own exchange)
                keep_previous = True
                warnings.warn(f"omnickpt: step {step} was resharded from shared memory but could not be saved again in "
                              f"this layout ({type(e).__name__}: {e}); the memory it came from stays at "
                              f"{self._tier.job.describe('previous')}", RuntimeWarning, stacklevel=3)
        if self._place.machine_leader and not keep_previous:
            self._tier.drop_previous()
        return result

    # ------------------------------------------------------------------ flushing and closing
    def flush(self, timeout: float | None = None, *, wait_commit: bool = True) -> int | None:
        """Copy the newest memory step to root now, unless this run already did (a copy that failed
        is tried again); returns that step (None when there was nothing to copy). Every rank calls
        it; no collective (the copy commits through storage). wait_commit=False: ranks other than 0
        return once their own copy is done (a process that is leaving)."""
        self._quiesce(timeout)   # a failed save leaves the previous memory step, which is flushed
        with self._lock:
            step = self._memory_step
            if step is None or step in self._attempted or (self._durable_done or -1) >= step:
                return None
        self._durable_job(step, wait_commit, timeout)
        return step

    def _flush_noting(self, why: str) -> None:
        t0 = time.perf_counter()
        try:
            step = self.flush(self.options.flush_timeout, wait_commit=False)
        except BaseException as e:
            log.error("omnickpt: %s: could not copy the newest memory step to %s: %s: %s; it stays in shared memory "
                      "(%s)", why, self.root, type(e).__name__, e, self._tier.node_url)
            return
        if step is not None:
            log.warning("omnickpt: %s: copied memory step %d to %s in %.2f s", why, step, self.root,
                        time.perf_counter() - t0)

    def _close_tiered(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            if clean:
                error = self._close_clean()
            else:
                self._quiesce(self.options.flush_timeout)
        finally:
            self._restore_signals()
            for pool in (self._lane, self._durable_lane, self._copy_io):
                pool.shutdown(wait=clean)
            self._root.release()
            self._loop.drop_warmed()
            if clean and self._place.machine_leader:
                self._tier.remove_job_dir()
        if error is not None:
            raise error

    def _close_clean(self) -> Exception | None:
        """Every rank, at a clean close (two all-gathers): what is in flight finishes and the newest
        memory step reaches root, then shared memory goes back per on_close. Errors are returned, for
        the end: every rank must reach the exchanges."""
        error = None
        for part in (self._wait, self.flush):
            try:
                part()
            except Exception as e:
                error = error or e
        mine = self._memory_step is None or (self._durable_done or -1) >= self._memory_step
        newest = listed = None
        if self._comm.is_coordinator:
            try:
                steps = self._root.steps()
                newest, listed = (steps[-1] if steps else None), True
            except (CheckpointError, OSError):
                listed = False
        # Rank 0's listing says what root holds; the exchange also makes sure nobody still
        # reads this node's memory (a peer copy, a durable copy) when it goes.
        gathered = self._comm.all_gather_object((mine, newest, listed))
        safe = all(g[0] for g in gathered)
        newest, listed = gathered[0][1], gathered[0][2]
        root_newest = newest if listed else None   # unlisted: root may hold nothing
        if self._tier.layout.local == 0:
            self._tier.give_back_node(safe, root_newest, self.options.on_close, self.root, self._memory_step)
        if self._place.machine_leader:
            self._tier.give_back_previous(root_newest, self.root)
        self._comm.all_gather_object(None)   # every node of a machine is done before its lease goes
        return error

    def _close_at_exit(self) -> None:
        """The exit hook's close: what this run saved and is in flight finishes, the newest memory
        step it saved reaches root. A manager that saved nothing only gives its leases back (its
        memory stays as after a crash). With several ranks, no collective: the other ranks may be
        gone or busy with their own exit, so shared memory is kept (as after a failure)."""
        if self._closed:
            return
        if self._comm.world_size == 1 and self._loop.saved:
            self.close()
            return
        self._closed = True
        error = None
        try:
            parts = (self._wait, lambda: self.flush(self.options.flush_timeout)) if self._loop.saved else ()
            for part in parts:
                try:
                    part()
                except Exception as e:
                    error = error or e
        finally:
            self._restore_signals()
            for pool in (self._lane, self._durable_lane, self._copy_io):
                pool.shutdown(wait=True)
            self._root.release()
        if error is not None:
            raise CheckpointError(f"{type(error).__name__}: {error}; the newest memory step stays in "
                                  f"{self._tier.node_url}") from error

    # ------------------------------------------------------------------ signals
    def _install_signals(self, signums) -> None:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("omnickpt: CheckpointManager created outside the main thread: no SIGTERM handler, so no "
                          "flush to durable storage on SIGTERM", RuntimeWarning, stacklevel=4)
            return
        for s in signums:
            self._signals[s] = signal.signal(s, self._on_signal)

    def _restore_signals(self) -> None:
        signals, self._signals = self._signals, {}
        for s, prev in signals.items():
            # Only if ours is still installed: a handler set after us is someone else's to undo.
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        prev = self._signals.get(signum, signal.SIG_DFL)
        self._flush_noting(signal.Signals(signum).name)
        self._restore_signals()
        # Then the signal means what it meant before us: the previous handler, or the default
        # action (for SIGTERM: the process ends, killed by SIGTERM, as its supervisor expects).
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


__all__ = ["MemoryTierOptions", "TieredCheckpointManager", "TieredSave"]
