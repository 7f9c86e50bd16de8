"""TieredCheckpointManager: a memory tier in host shared memory in front of the durable root of a
CheckpointManager, with peer replicas and persist-on-failure (docs/memory_tier.md). What it adds
to the plain manager (omnickpt/manager.py, whose root handling it shares: lease, `latest`,
retention, failed saves, on_error) is policy: when to save to memory, when to copy a step to the
root, what to restore from, what to leave in memory at close. The mechanics are tiers.py's; the
durable copy commits through omnickpt/commit.py like an async save.

What it guards against, besides crashes: a second job writing the same memory job (owner leases),
a corrupt memory copy (checksummed on restore; it falls back to root and is removed, so a restart
does not meet it again), losing the only copy of a step (close() and exit keep it).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

from omnickpt import commit
from omnickpt.api import Checkpointer, LoadResult, SaveHandle
from omnickpt.errors import (CheckpointError, UnsupportedError, CorruptCheckpointError, MismatchError, NotCommittedError,
                             UnsafeCheckpointError, error_class, rebuild_error)
from omnickpt.lease import acquire
from omnickpt.manager import CheckpointManager, cadence_of, finish_at_exit
from omnickpt.steps import committed_steps, step_dir
from omnickpt.storage import storage_for
from omnickpt.storage.shm import shm_dir
from omnickpt.tiers import Candidate, MemoryTier, NodeLayout, commit_durable, persist_rank, restore_candidates
from omnickpt.version import __version__

log = logging.getLogger("omnickpt")
ON_CLOSE = ("remove", "keep_latest")


def _fatal_class(name: str) -> bool:
    """Failures of a restore from memory that root would not cure (the state does not fit, the
    checkpoint asks for pickle, a wrong argument): raised, never fallen back from."""
    return name == TypeError.__name__ or issubclass(error_class(name), (MismatchError, UnsafeCheckpointError))


@dataclasses.dataclass(frozen=True)
class MemoryTierOptions:
    """The memory tier of a TieredCheckpointManager (checked when built):

    - url: `shm://JOB`, the job's memory (letters, digits, `.`, `_`, `-`).
    - memory_keep: complete steps kept in memory per node (plus one still being copied to `root`).
    - persist_every: copy every N-th save to `root`. A save due for copying first waits for the
      previous copy (so at most one is in flight): pick N so that a copy finishes within N saves.
    - ranks_per_node: ranks per machine (default $LOCAL_WORLD_SIZE, else the whole group). Each
      node keeps a complete checkpoint of its own ranks, so a restore reads tensors from local
      memory only.
    - peer_replicas: also send each node's snapshot to the next node (rank r -> r + ranks_per_node),
      which keeps it in its memory; a node whose memory is lost restores from that peer.
    - persist_on_failure: on SIGTERM (handler installed by the manager, the previous one restored
      by close()) or an exception leaving `with manager:`, the newest memory step is copied to
      `root` first.
    - on_close: what a clean close() leaves in shared memory once `root` holds the newest step:
      "remove" (nothing) or "keep_latest" (the newest step, for a restart on the same machine).
      A step `root` lacks is always kept. omnickpt.storage.shm.clear_memory("JOB")
      (`omnickpt clear-memory JOB`) removes it all.
    - flush_timeout: seconds a flush on failure waits for the other ranks' copies.
    """
    url: str
    memory_keep: int = 1
    persist_every: int = 1
    ranks_per_node: int | None = None
    peer_replicas: bool = False
    persist_on_failure: bool = True
    on_close: str = "remove"
    flush_timeout: float = 120.0

    def __post_init__(self):
        if not str(self.url).startswith("shm://"):
            raise ValueError(f"memory={self.url!r}: the memory tier is host shared memory, give it as shm://JOBNAME")
        if self.memory_keep < 1 or self.persist_every < 1:
            raise ValueError("memory_keep and persist_every must be at least 1")
        if self.on_close not in ON_CLOSE:
            raise ValueError(f"on_close={self.on_close!r}: must be one of {ON_CLOSE}")


class TieredSave:
    """A save to the memory tier; a SaveHandleProtocol (omnickpt/api.py) like every save handle.
    wait_memory() returns once the step is committed in shared memory (its report: the stall and the
    snapshot timings); wait() also waits for the step's durable copy when this step is one that is
    persisted (report["durable"] is then the durable manifest's save id).

    fence() waits for the memory save's snapshot: that save is an async Checkpointer save, so its
    snapshot is lazy unless save() was given snapshot="eager" (then fence() returns at once, the data
    having been copied before save() returned; so does it after a save without async_save, which
    fenced before returning). The durable copy reads shared memory, never the state, so it is no
    part of the fence."""

    def __init__(self, step: int, memory: Future, handle: SaveHandle):
        self.step = step
        self._memory = memory
        self._handle = handle   # the Checkpointer's save into shared memory: its fence is this save's
        self._training_thread = threading.get_ident()   # the one that called save()

    def fence(self) -> None:
        """The training thread: wait until the snapshot is complete and take its step hooks off the
        optimizers; after it the state may change without reaching the checkpoint. Raises nothing
        about the save itself: wait() / wait_memory() do."""
        self._handle.fence()

    def done(self) -> bool:
        if not self._memory.done():
            return False
        if self._memory.exception() is not None:
            return True
        durable = self._memory.result()[1]
        return durable is None or durable.done()

    def wait_memory(self, timeout: float | None = None) -> dict:
        self._fence_here()
        return self._memory.result(timeout)[0]

    def wait(self, timeout: float | None = None) -> dict:
        self._fence_here()
        report, durable = self._memory.result(timeout)
        report = dict(report)
        if durable is not None:
            report["durable"] = durable.result(timeout)
        return report

    def _fence_here(self) -> None:
        # As SaveHandle.wait(): the training thread also takes the hooks off (the memory lane's
        # wait leaves them, being another thread); any other thread leaves them alone.
        if threading.get_ident() == self._training_thread:
            self.fence()


@dataclasses.dataclass(frozen=True)
class _Survey:
    """What load_latest() and latest_step() decide from: memory candidates (newest first), notes on
    memory that cannot be restored, root's newest committed step or why it could not be listed."""
    candidates: list[Candidate]
    notes: list[str]
    durable_step: int | None
    durable_error: tuple[str, str] | None


class TieredCheckpointManager(CheckpointManager):
    """A CheckpointManager whose saves go first to host shared memory (the stall is a copy into
    staging memory); every `persist_every`-th one is then copied to `root` in the background.
    load_latest() restores from memory when the memory holds the newest complete step (no read of
    `root`'s data), else from `root`. The memory job's lease (one per machine) is taken at
    construction, the root's at the first write there.

    Built as `TieredCheckpointManager(root, memory="shm://JOB", memory_keep=..., ...)`: the options
    are those of MemoryTierOptions, the others (keep_last, checkpointer, process_group, on_error,
    every=) the plain manager's. Equivalent: `memory=MemoryTierOptions("shm://JOB", ...)` (the same
    options as one value; then none as keywords), and `CheckpointManager(root, memory=..., ...)` with
    the same arguments, which returns this class. Incremental saves and read_only are refused.

    Every rank of the process group creates it (collectives: an all-gather of ids and machines, the
    agreement on the leases), saves the same steps and calls close() (collectives: two
    all-gathers). A manager still open at interpreter exit is finished there: its saves in flight
    committed and the newest step copied to root, or the process exits with status 1.
    """

    def __init__(self, root: str, *, memory: str | MemoryTierOptions, keep_last: int | None = None,
                 checkpointer: Checkpointer | None = None, process_group: Any = None, read_only: bool = False,
                 on_error: str = "raise", every: int | str | None = None, max_overhead: float = 0.02,
                 max_interval: int = 10_000, **options):
        if options.pop("incremental", False) or {"full_every", "block_bytes"} & set(options):
            raise UnsupportedError("incremental=True with a memory tier: the memory tier keeps whole steps in shared "
                                   "memory; use incremental saves on a CheckpointManager without memory=")
        if isinstance(memory, MemoryTierOptions):
            if options:
                raise TypeError(f"memory=MemoryTierOptions(...) carries the memory tier's options; do not also pass "
                                f"{sorted(options)}")
        else:
            memory = MemoryTierOptions(url=memory, **options)
        if read_only:
            raise ValueError("read_only=True cannot have a memory tier (it writes shared memory); list or load the "
                             "durable root with a read-only manager of its own")
        self._setup(root, keep_last, checkpointer, process_group, read_only, on_error,
                    cadence_of(every, max_overhead, max_interval))
        self.options = memory
        comm, world = self._comm, self._comm.world_size
        rpn = memory.ranks_per_node or _local_world_size(world)
        layout = NodeLayout(world, rpn, comm.rank)
        if memory.peer_replicas and layout.nodes < 2:
            raise ValueError(f"peer_replicas needs at least two nodes; the group has {world} rank(s) with "
                             f"ranks_per_node={rpn}")
        self._global_ranks = _global_ranks(self._group, world)
        self._node_group = self._group if layout.nodes == 1 else _new_group(
            self._global_ranks[layout.node * rpn:(layout.node + 1) * rpn], self._group, world)
        # Peer transfers run on a background thread: a group of their own, so they never
        # interleave with the training loop's collectives.
        self._side = (_new_group(self._global_ranks, self._group, world, backend="gloo") if memory.peer_replicas
                      else None)
        self._tier = MemoryTier(memory.url, layout, self._storage.describe())
        self._run_id = ""               # this run's id in the control records of its durable copies
        self._machine_leaders: list[int] = []   # the lowest rank on each machine: it owns the job's folder there
        self._machine_leader = False
        self._nodes_here: list[int] = []        # the nodes whose memory this machine holds
        self._join_machines()
        self._run = self._run_id or self._run   # guard()'s failure markers: one name on every rank
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-memory")
        self._durable_lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-durable")
        self._copy_io = ThreadPoolExecutor(4, thread_name_prefix="omnickpt-copy")
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
        finish_at_exit(self)

    def _join_machines(self) -> None:
        """Every rank (one all-gather, then the agreement): one run id, the job id of the leases
        (the coordinator's process), which ranks share one machine's memory; each machine leader
        takes the memory job's lease and prepares its memory."""
        comm, rpn = self._comm, self._tier.layout.ranks_per_node
        place, error = None, None
        try:
            place = _memory_place()
        except Exception as e:
            error = e
        gathered = comm.all_gather_object((uuid.uuid4().hex[:12], self._job_id, place))
        self._run_id, self._job_id = gathered[0][0], gathered[0][1]
        places = [g[2] for g in gathered]
        first: dict[Any, int] = {}
        for r, p in enumerate(places):
            first.setdefault(p, r)
        self._machine_leaders = sorted(first.values())
        self._machine_leader = first[places[comm.rank]] == comm.rank
        self._nodes_here = sorted({r // rpn for r, p in enumerate(places) if p == places[comm.rank]})
        if self._machine_leader and error is None:
            # Before anything in the job's memory is touched: a second live job of that name stops here.
            try:
                self._leases.append(acquire(self._tier.job, self._job_id, what=f"memory job {self._tier.url}"))
                self._tier.prepare(self._nodes_here)
            except Exception as e:
                error = e
        # Also makes every machine's prepare() finish before any rank looks at its memory.
        self._agree(error, f"starting the memory tier {self._tier.url}")

    # ------------------------------------------------------------------ the public surface, tiered
    def latest_step(self) -> int | None:
        """The step load_latest() restores: the newest committed step in `root`, or a newer one
        complete in memory (on every node, as load_latest() would restore it). None if there is
        none. With several nodes every rank calls it (one all-gather)."""
        survey = self._survey(collective=self._tier.layout.nodes > 1)
        if survey.candidates:
            return survey.candidates[0].step
        if survey.durable_error is not None:
            raise rebuild_error(*survey.durable_error)
        return survey.durable_step

    def memory_steps(self) -> list[int]:
        """Steps complete in this node's shared memory, oldest first."""
        return self._tier.committed_steps()

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        """Load the newest committed step: from shared memory when every node holds that step
        complete (itself or through its peer's replica; saved at another world size or node
        layout: resharded, when every machine holds all of it) and `root` holds nothing newer, else
        from `root`. Every byte read from memory is checksummed; a corrupt step falls back to the
        next memory step or `root`, with a warning, and is removed from memory. Raises
        CorruptCheckpointError when it was the only thing to restore. report["tier"] says where it
        came from; `self.restored` too."""
        return self._load_latest_tiered(state, kwargs)

    def close(self) -> None:
        """Wait for what is in flight, copy the newest memory step to `root` if it is not there yet,
        give shared memory back per `on_close` (never a step `root` lacks), restore the signal
        handlers, give the owner leases back. Every rank calls it."""
        self._close_tiered(clean=True)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self.close()
            return False
        if self.options.persist_on_failure:
            self._flush_noting(f"{exc_type.__name__} leaving the training loop")
        self._close_tiered(clean=False)
        return False

    # ------------------------------------------------------------------ saving
    def _start_save(self, step: int, state: dict, async_save: bool, kwargs: dict) -> TieredSave:
        # The previous save's memory commit (and peer copy) first: a failure there surfaces here,
        # once. The future is dropped only after it finished, so that a flush from a signal
        # handler that interrupts this wait still waits for that step.
        if self._mem_future is not None:
            try:
                self._mem_future.result()
            finally:
                self._mem_future = None
        if not self._saved:
            self._first_save_tiered(step)
        self._saved.add(step)
        try:
            return self._save_to_memory(step, state, async_save, kwargs)
        except BaseException:
            self._saved.discard(step)
            raise

    def _first_save_tiered(self, step: int) -> None:
        """Before this run's first save: memory this run neither wrote nor restored is an earlier
        process's. Its steps newer than `step` would win a restart over this run's own steps, so
        they go (with a warning saying whether root holds them); so does memory of another layout."""
        if self.restored is None:
            if self._tier.layout.local == 0:
                gone = self._tier.purge_newer(step)
                if gone:
                    try:
                        in_root = [s for s in gone if s in set(committed_steps(self._storage))]
                    except (CheckpointError, OSError):
                        in_root = None
                    where = (f"{self.root} holds {in_root}" if in_root is not None else f"{self.root} is unreachable")
                    warnings.warn(f"omnickpt: shared memory {self._tier.node_url} held step(s) {gone} of an earlier "
                                  f"run of this job, newer than step {step} that this run saves first without having "
                                  f"restored them (load_latest()); they are removed so that a restart cannot restore "
                                  f"them over this run's steps ({where})", RuntimeWarning, stacklevel=5)
            if self._machine_leader:
                info = self._tier.previous_view()
                if info is not None and any(info["nodes"].values()):
                    warnings.warn(f"omnickpt: shared memory {self._tier.job.describe('previous')} held steps saved at "
                                  f"world size {info['world_size']}, which this run saves over without having restored "
                                  f"them (load_latest()); they are removed", RuntimeWarning, stacklevel=5)
                self._tier.drop_previous()
        self._warn_newer_in_root(step, stacklevel=6)

    def _save_to_memory(self, step: int, state: dict, async_save: bool, kwargs: dict) -> TieredSave:
        due = (self._saves + 1) % self.options.persist_every == 0
        if due and self._durable_future is not None:
            # At most one durable copy in flight, and the same decision on every rank.
            try:
                self._durable_future.result()
            finally:
                self._durable_future = None
        handle = self._ckpt.save(self._tier.step_url(step), state, async_save=True, process_group=self._node_group,
                                 **kwargs)
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
                self._saved.discard(step)
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
            if self._side is not None:
                got = self._tier.send_replica(step, self._side, self._global_ranks)
                _barrier(self._side)   # every holder rank has its part: the replica manifest goes last
                self._tier.commit_replica(step, got)
        except BaseException as e:
            log.error("omnickpt: sending memory step %d to the next node failed on rank %d: %s: %s", step,
                      self._tier.layout.rank, type(e).__name__, e)
            with self._lock:
                self._pinned.discard(step)
            raise
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

    def _durable_job(self, step: int, wait_commit: bool, timeout: float | None = None) -> str:
        """Copy memory step `step` to root: every rank its file, the coordinator the manifest last.
        A failure is logged when it happens (rank 0, and a rank whose own copy failed)."""
        timeout = self._ckpt.timeout if timeout is None else timeout
        rank = self._tier.layout.rank
        with self._lock:
            self._attempted.add(step)
            # A new id for each try (the same sequence on every rank): a retry must not read the
            # records or status of a failed one.
            self._tries[step] = self._tries.get(step, 0) + 1
            attempt = f"{self._run_id}-s{step}" + (f"-{self._tries[step]}" if self._tries[step] > 1 else "")
        try:
            durable = storage_for(self.step_path(step))
            what = f"persisting to {durable.describe()}"
            if self._comm.is_coordinator:
                try:
                    self._hold_root()
                except Exception as e:   # the other ranks wait for a status: give them this one
                    commit.set_status(durable, attempt, (type(e).__name__, f"rank 0: {type(e).__name__}: {e}"))
                    raise
            try:
                persist_rank(self._tier, step, durable, attempt, rank, self._copy_io)
            except Exception as e:
                # Tell the coordinator now rather than let it wait for this rank until its timeout.
                failure = (type(e).__name__, f"rank {rank}: copying memory step {step} to {self.step_path(step)} "
                                             f"failed: {type(e).__name__}: {e}")
                commit.post_failure(durable, attempt, rank, failure)
                if self._comm.is_coordinator:
                    commit.set_status(durable, attempt, failure)   # the others stop waiting now
                else:
                    log.error("omnickpt: rank %d: copying memory step %d to %s failed: %s: %s", rank, step,
                              self.step_path(step), type(e).__name__, e)
                raise
            if self._comm.is_coordinator:
                records = None
                try:
                    records = commit.await_records(durable, attempt, self._tier.layout.world_size, timeout, what)
                    commit_durable(durable, attempt, records, self._tier.layout.ranks_per_node, __version__)
                except Exception as e:
                    if records is not None:   # await_records set the status of its own failures
                        commit.set_status(durable, attempt, (type(e).__name__, f"rank 0: {type(e).__name__}: {e}"))
                        self._discard_failed(step)   # every rank is done with the folder
                    raise
                self._after_commit(step)
            elif wait_commit:
                # Wait for the commit so that retention knows every rank has copied this step.
                commit.await_status(durable, attempt, timeout, what)
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

    def _in_flight(self) -> bool:
        """The cadence's view: a save is in flight until its memory commit and its durable copy are done."""
        return any(f is not None and not f.done() for f in (self._mem_future, self._durable_future))

    def _wait(self) -> dict | None:
        """wait(): the memory lane (its commit in memory), then the durable lane it may have fed;
        returns the memory commit's report. A lane's future is dropped once it finished."""
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
        lay = self._tier.layout
        error = None
        try:
            if clean:
                # Errors are kept for the end: every rank must reach the exchanges below.
                for part in (self._wait, self.flush):
                    try:
                        part()
                    except Exception as e:
                        error = error or e
                mine = self._memory_step is None or (self._durable_done or -1) >= self._memory_step
                newest = listed = None
                if self._comm.is_coordinator:
                    try:
                        steps = committed_steps(self._storage)
                        newest, listed = (steps[-1] if steps else None), True
                    except (CheckpointError, OSError):
                        listed = False
                # Rank 0's listing says what root holds; the exchange also makes sure nobody still
                # reads this node's memory (a peer copy, a durable copy) when it goes.
                gathered = self._comm.all_gather_object((mine, newest, listed))
                safe = all(g[0] for g in gathered)
                newest, listed = gathered[0][1], gathered[0][2]
                root_newest = newest if listed else None   # unlisted: root may hold nothing
                if lay.local == 0:
                    self._give_back_node(safe, root_newest)
                if self._machine_leader:
                    self._give_back_previous(root_newest)
                self._comm.all_gather_object(None)   # every node of a machine is done before its lease goes
            else:
                self._quiesce(self.options.flush_timeout)
        finally:
            self._restore_signals()
            for pool in (self._lane, self._durable_lane, self._copy_io):
                pool.shutdown(wait=clean)
            self._release()
            if clean and self._machine_leader:
                self._tier.remove_job_dir()
        if error is not None:
            raise error

    def _give_back_node(self, safe: bool, root_newest: int | None) -> None:
        """Node leader, at a clean close: shared memory goes back per on_close, but a step root
        lacks (newer than root's newest) is kept, with a warning saying where."""
        unsaved = [s for s in self._tier.committed_steps() if root_newest is None or s > root_newest]
        if safe and not unsaved and self.options.on_close == "remove":
            self._tier.remove()
            return
        if unsaved:
            warnings.warn(f"omnickpt: {self.root} does not hold memory step {unsaved[-1]}; it is kept in "
                          f"{self._tier.storage.describe(step_dir(unsaved[-1]))} (load_latest() restores it on this "
                          f"machine; CheckpointManager.flush() copies it to root)", RuntimeWarning, stacklevel=4)
        elif not safe and self.options.on_close == "remove":
            warnings.warn(f"omnickpt: the copy of memory step {self._memory_step} to {self.root} did not complete "
                          f"on every rank; the step is kept in {self._tier.node_url}", RuntimeWarning, stacklevel=4)
        self._tier.retain(1)

    def _give_back_previous(self, root_newest: int | None) -> None:
        """Machine leader, at a clean close: memory of another layout goes unless it holds a step
        root lacks (the only copy: kept for a restart at that layout)."""
        info = self._tier.previous_view()
        if info is None:
            self._tier.drop_previous()
            return
        steps = sorted({s for ss in info["nodes"].values() for s in ss})
        if steps and (root_newest is None or steps[-1] > root_newest):
            warnings.warn(f"omnickpt: {self._tier.job.describe('previous')} keeps step {steps[-1]}, saved at world "
                          f"size {info['world_size']} and not in {self.root}", RuntimeWarning, stacklevel=4)
            return
        self._tier.drop_previous()

    def _close_at_exit(self) -> None:
        """The exit hook's close: what this run saved and is in flight finishes, the newest memory
        step it saved reaches root. A manager that saved nothing only gives its leases back (its
        memory stays as after a crash). With several ranks, no collective: the other ranks may be
        gone or busy with their own exit, so shared memory is kept (as after a failure)."""
        if self._comm.world_size == 1 and self._saved:
            self.close()
            return
        self._closed = True
        error = None
        try:
            parts = (self._wait, lambda: self.flush(self.options.flush_timeout)) if self._saved else ()
            for part in parts:
                try:
                    part()
                except Exception as e:
                    error = error or e
        finally:
            self._restore_signals()
            for pool in (self._lane, self._durable_lane, self._copy_io):
                pool.shutdown(wait=True)
            self._release()
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

    # ------------------------------------------------------------------ restoring
    def _survey(self, collective: bool) -> _Survey:
        """What memory and root hold. collective=True: every rank, one all-gather (node leaders
        list their memory, machine leaders previous/, rank 0 root). False (one node): each rank
        lists everything itself."""
        lay, comm = self._tier.layout, self._comm
        view = self._tier.view() if lay.local == 0 or not collective else None
        prev = self._tier.previous_view() if self._machine_leader or not collective else None
        durable_step, durable_error = None, None
        if comm.is_coordinator or not collective:
            try:   # a listing only: no checkpoint data is read from root to decide
                steps = committed_steps(self._storage)
                durable_step = steps[-1] if steps else None
            except (CheckpointError, OSError) as e:
                durable_error = (type(e).__name__, f"{type(e).__name__}: {e}")
        if collective:
            gathered = comm.all_gather_object((view, prev, durable_step, durable_error))
            views = [gathered[k * lay.ranks_per_node][0] for k in range(lay.nodes)]
            prevs = [gathered[r][1] for r in self._machine_leaders]
            durable_step, durable_error = gathered[0][2], gathered[0][3]
        else:
            views, prevs = [view], [prev]
        candidates, notes = restore_candidates(views, durable_step, self._side is not None, prevs)
        return _Survey(candidates, notes, durable_step, durable_error)

    def _load_latest_tiered(self, state: dict, kwargs: dict) -> LoadResult:
        lay = self._tier.layout
        self.wait()
        survey = self._survey(collective=True)
        durable_step = survey.durable_step
        failure = None   # (step, every rank's failure, whether the step was found corrupt)
        if survey.candidates:
            cand = survey.candidates[0]
            restore = self._restore_previous if cand.source == "previous" else self._restore_memory
            result, failed = restore(cand, state, dict(kwargs, dedup_reads=False))
            if not failed:
                return self._restored_from_memory(cand, result, state, kwargs, durable_step)
            failure = self._memory_restore_failed(cand, failed, durable_step)
        for note in survey.notes:
            warnings.warn(f"omnickpt: {note}; restoring from {self.root}. The memory is kept until this run's first "
                          "save: to restore from it, restart at the layout that saved it", RuntimeWarning, stacklevel=3)
        if durable_step is None:
            self._raise_nothing_to_restore(survey, failure)
        if lay.local == 0:
            self._tier.purge_newer(None)   # older than root (stale), incomplete on some node, or corrupt
        if self._machine_leader and not survey.notes:
            self._tier.drop_previous()
        result = self.load(durable_step, state, **kwargs)
        self.restored = ("durable", durable_step)
        result.report.update(tier="durable", step=durable_step)
        return result

    def _memory_restore_failed(self, cand: Candidate, failed: list[tuple[str, str]],
                               durable_step: int | None) -> tuple[int, list[tuple[str, str]], bool]:
        """Every rank, when restoring `cand` from memory failed: remove a corrupt step from memory and
        warn. Returns (step, every rank's failure, whether the step was found corrupt)."""
        lay = self._tier.layout
        corrupt = any(cls == CorruptCheckpointError.__name__ for cls, _ in failed)
        if corrupt:   # never again: a restart must not meet it (every rank is done with it)
            if cand.source == "memory" and lay.local == 0:
                self._tier.drop_step(cand.step)
            if cand.source == "previous" and self._machine_leader:
                self._tier.drop_previous(cand.step)
        then = (f"loading step {durable_step} from {self.root} instead" if durable_step is not None else
                f"and {self.root} holds no committed checkpoint to fall back to")
        # stacklevel 4: the caller of load_latest(), as when this was written inline in _load_latest_tiered.
        warnings.warn(f"omnickpt: restoring step {cand.step} from shared memory failed ({_describe(failed)})"
                      f"{'; the corrupt step is removed from shared memory' if corrupt else ''}; {then}",
                      RuntimeWarning, stacklevel=4)
        return cand.step, failed, corrupt

    def _raise_nothing_to_restore(self, survey: _Survey,
                                  failure: tuple[int, list[tuple[str, str]], bool] | None) -> NoReturn:
        """Every rank, when root holds no committed step: raise the memory restore's failure (its
        class), or NotCommittedError when memory had nothing either."""
        where = f"{self.root} ({survey.durable_error[1]})" if survey.durable_error else self.root
        if failure is not None:
            step, failed, corrupt = failure
            raise rebuild_error(CorruptCheckpointError.__name__ if corrupt else failed[0][0],
                                f"restoring step {step} from shared memory ({self._tier.url}) failed: "
                                f"{_describe(failed)}"
                                + ("; it was removed from shared memory, so a restart will not try it again"
                                   if corrupt else "")
                                + f"; and {where} holds no committed checkpoint to fall back to")
        raise NotCommittedError(f"nothing to restore: no complete step in shared memory ({self._tier.url}) "
                                f"and no committed checkpoint in {where}")

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
            if self._machine_leader:
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
                              f"{self._tier.job.describe('previous')}", RuntimeWarning, stacklevel=4)
        if self._machine_leader and not keep_previous:
            self._tier.drop_previous()
        return result

    def _failures(self, error: BaseException | None, view_of: int | None = None) -> list[tuple[str, str]]:
        """Every rank: each rank's failure as (class name, message naming the rank and node; files
        of the merged view of step `view_of` named in their node's folder)."""
        lay = self._tier.layout
        mine = None
        if error is not None:
            text = f"rank {lay.rank} (node {lay.node}): {type(error).__name__}: {error}"
            mine = (type(error).__name__, text if view_of is None else self._tier.attribute(text, view_of))
        return [g for g in self._comm.all_gather_object(mine) if g is not None]

    def _fatal(self, error: BaseException | None, failed: list[tuple[str, str]]) -> None:
        """The state does not fit the checkpoint, or the checkpoint asks for pickle: the durable
        copy would not do better, so every rank raises instead of falling back."""
        fatal = [f for f in failed if _fatal_class(f[0])]
        if fatal:
            if error is not None:
                raise error
            raise rebuild_error(*fatal[0])

    def _restore_memory(self, cand: Candidate, state: dict, kwargs: dict):
        """Every rank: load `cand.step` from this layout's node checkpoints (after a repair from
        peers). Phases end with an exchange of errors, so that all ranks fail together and fall
        back together. Returns (LoadResult or None, the failures of all ranks)."""
        lay, step = self._tier.layout, cand.step
        result = None
        objects, error = self._repair_for_restore(cand)
        url, group = self._tier.step_url(step), self._node_group
        if lay.nodes > 1:
            # error is None past here: a failed repair fails the exchange in _merge_node_views.
            failed = self._merge_node_views(step, objects, error)
            if failed:
                return None, failed
            url, group = self._tier.view_url(step), self._group
        # With one node a failed repair still tries the load; its error is reported if the load fails too.
        try:
            result = self._ckpt.load(url, state, process_group=group, **kwargs)
        except Exception as e:
            error = e
        failed = self._failures(error, step if lay.nodes > 1 else None)
        if lay.nodes > 1 and self._machine_leader:
            self._tier.drop_world_view()
        self._fatal(error, failed)
        return (None if failed else result), failed

    def _repair_for_restore(self, cand: Candidate) -> tuple[list | None, BaseException | None]:
        """Every rank, _restore_memory's first phase: get broken nodes' checkpoints back from their
        peers; node leaders of a multi-node job read their node's objects. Returns (objects, error)."""
        lay, step = self._tier.layout, cand.step
        objects = None
        try:
            if cand.broken:
                self._tier.repair(step, cand.broken, self._side, self._global_ranks, lambda: _barrier(self._side))
            if lay.nodes > 1 and lay.local == 0:
                objects = self._tier.node_objects(step)
        except Exception as e:
            return objects, e
        return objects, None

    def _merge_node_views(self, step: int, objects: list | None, error: BaseException | None) -> list[tuple[str, str]]:
        """Every rank of a multi-node job: exchange the first phase's errors and node objects; machine
        leaders write the merged view of `step`. Returns the failures of all ranks (empty: every view is
        written)."""
        lay = self._tier.layout
        # A node's checkpoint holds its own ranks' objects only; state that needs every rank's
        # value (a dataloader position) gets them through this exchange and a merged view, the
        # same URL on every machine.
        gathered = self._comm.all_gather_object((objects, None if error is None else (
            type(error).__name__, f"rank {lay.rank} (node {lay.node}): {type(error).__name__}: {error}")))
        failed = [g[1] for g in gathered if g[1] is not None]
        if failed:
            return failed
        try:
            if self._machine_leader:
                self._tier.world_view(step, self._nodes_here, [o for g in gathered if g[0] for o in g[0]])
        except Exception as e:
            error = e
        failed = self._failures(error)   # also: every machine's view is written before any rank reads one
        if failed and self._machine_leader:
            self._tier.drop_world_view()
        return failed

    def _restore_previous(self, cand: Candidate, state: dict, kwargs: dict):
        """Every rank: load `cand.step` from memory saved at another layout, resharded: each machine
        leader merges the old node checkpoints into one view, which the whole group loads."""
        error, result = None, None
        try:
            if self._machine_leader:
                self._tier.previous_world_view(cand.step)
        except Exception as e:
            error = e
        failed = self._failures(error)
        if not failed:
            try:
                result = self._ckpt.load(self._tier.view_url(cand.step), state, process_group=self._group, **kwargs)
            except Exception as e:
                error = e
            failed = self._failures(error)
        if self._machine_leader:
            self._tier.drop_world_view()
        self._fatal(error, failed)
        return (None if failed else result), failed



# ---------------------------------------------------------------------- helpers
def _describe(failed: list[tuple[str, str]]) -> str:
    """The failures of a restore, the ranks' own errors first (a rank that only heard of another
    rank's failure says so, and repeats it)."""
    own = [m for _, m in failed if "on another rank" not in m]
    return "; ".join(own or [m for _, m in failed])


def _memory_place() -> str:
    """Which shared memory this process sees: the same string for the processes of one machine
    (one tmpfs at $OMNICKPT_SHM_DIR or /dev/shm/omnickpt), another for any other machine."""
    base = shm_dir()
    os.makedirs(base, exist_ok=True)
    st = os.stat(base)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{st.st_dev}:{st.st_ino}"



def _local_world_size(world: int) -> int:
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return world
    return n if 0 < n <= world and world % n == 0 else world


def _global_ranks(group: Any, world: int) -> list[int]:
    import torch.distributed as dist
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return list(range(world))
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _new_group(ranks: list[int], parent: Any, world: int, backend: str | None = None) -> Any:
    """A process group of `ranks`. Only its members call it (groups are made locally), so the
    manager's own group may be a sub-group of the world."""
    import torch.distributed as dist
    if backend is None:
        backend = dist.get_backend(parent if parent is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True)


def _barrier(group: Any) -> None:
    import torch.distributed as dist
    if group is not None:
        dist.barrier(group=group)
