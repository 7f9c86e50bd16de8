"""CheckpointManager: step directories, a `latest` pointer, retention, and async saves that the
next save waits for. `CheckpointManager(root, memory="shm://JOB", ...)` builds the tiered manager
of omnickpt/tiered.py instead (a memory tier in host shared memory in front of the durable root;
docs/memory_tier.md), which shares this class's root handling: the lease, `latest`, retention,
failed saves and on_error.

What it guards against, besides crashes: a second job writing the same root (owner leases,
omnickpt/lease.py), retiring a new run's steps in favour of an abandoned run's newer ones, and an
unclosed manager at interpreter exit (what is in flight is finished, or the process fails loudly).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from omnickpt.cadence import Cadence
from omnickpt.api import Checkpointer, LoadResult, SaveHandle, at_shutdown, default_checkpointer, step_number
from omnickpt.errors import CheckpointError, NotCommittedError
from omnickpt.failure import (MARKERS, StepCapture, await_markers, cannot_save, exit_kind, peer_failure, pick_savers,
                              post_marker, replicas_of)
from omnickpt.format import MANIFEST_NAME
from omnickpt.lease import Lease, acquire
from omnickpt.steps import committed_steps, discard_folder, retire, step_dir, write_latest
from omnickpt.storage import storage_for

log = logging.getLogger("omnickpt")
FAILURES_KEPT = 100   # the newest failed saves listed in manager.failures (failure_count counts all)


class CheckpointManager:
    """Saves `root/global_step_N` checkpoints; keeps the newest `keep_last` committed ones.

    A step directory without a committed manifest is never reported as latest. Retention runs on
    the coordinator right after a commit and only retires steps older than the one just written
    (never that step, a step this manager is loading, or a newer step: in flight, or an abandoned
    run's that this run has not passed yet; the first save warns when root holds such steps).
    save() takes a new step number each time (a non-negative int); a save that fails leaves no
    step folder behind.

    One job at a time: the coordinator takes the root's owner lease at construction (a second live
    manager on the same root, in another process, gets CheckpointLockedError naming it; one of a
    job that died is taken over with a warning) and gives it back in close(). read_only=True takes
    no lease, for a process that only lists or loads (evaluation, inspection) while a job trains.

    The memory tier (every save to host shared memory first, every `persist_every`-th copied to
    `root`) is built as `TieredCheckpointManager(root, memory="shm://JOB", ...)` (omnickpt/tiered.py).
    `CheckpointManager(root, memory=...)` with the same arguments is equivalent: it returns that
    TieredCheckpointManager. The tier's options (memory_keep, persist_every, ranks_per_node,
    peer_replicas, persist_on_failure, on_close, flush_timeout) without `memory` are a TypeError.

    Every rank of the process group must create the manager (a collective with several ranks: one
    all-gather, so that a refused lease raises on every rank), save the same steps and call close()
    (a collective when there are several ranks). A manager still open at interpreter exit is
    finished there: its saves in flight committed, or the process exits with status 1 and the
    error on stderr.
    """

    def __new__(cls, root: str, *args, memory: Any = None, **kwargs):
        if cls is CheckpointManager and memory is not None:
            # CheckpointManager(root, memory=...) has always been the way to get the memory tier:
            # it stays so (the tiered class lives above this module, hence the import here).
            from omnickpt.tiered import TieredCheckpointManager
            return super().__new__(TieredCheckpointManager)
        return super().__new__(cls)

    def __init__(self, root: str, *, keep_last: int | None = None, checkpointer: Checkpointer | None = None,
                 process_group: Any = None, read_only: bool = False, on_error: str = "raise", memory: None = None,
                 every: int | str | None = None, max_overhead: float = 0.02, max_interval: int = 10_000,
                 incremental: bool = False, full_every: int | None = 10, block_bytes: int | None = None,
                 **memory_options):
        # The memory tier's options (tiered.MemoryTierOptions' fields: this module cannot import it)
        # reach here only without `memory` (with it, __new__ built the tiered manager). They used to
        # be ignored, so a forgotten memory= silently ran without the tier: refused now.
        from_tier = {"memory_keep", "persist_every", "ranks_per_node", "peer_replicas", "persist_on_failure",
                     "on_close", "flush_timeout"}
        unknown = sorted(set(memory_options) - from_tier)
        if unknown:
            raise TypeError(f"CheckpointManager() got unexpected keyword argument(s) {unknown}")
        if memory is not None:
            # Only a subclass gets here with memory= (__new__ swaps in the tiered manager for this class
            # alone): it would run without the tier it was given.
            raise TypeError(f"{type(self).__name__}(memory={memory!r}): a subclass of CheckpointManager has no memory "
                            "tier; subclass TieredCheckpointManager for one")
        if memory_options:
            given = ", ".join(f"{k}={v!r}" for k, v in sorted(memory_options.items()))
            raise TypeError(f"CheckpointManager({str(root)!r}, {given}): {sorted(memory_options)} are options of the "
                            "memory tier, which is off without memory=; pass memory='shm://JOB' with them (or build "
                            "TieredCheckpointManager(root, memory='shm://JOB', ...)), or drop them")
        self._setup(root, keep_last, checkpointer, process_group, read_only, on_error,
                    cadence_of(every, max_overhead, max_interval))
        if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int)
                                       or full_every < 1):
            raise ValueError(f"full_every={full_every!r}: must be a positive int (a full save every that many saves)")
        # Incremental: each save writes only the blocks changed since the previous committed step
        # and references that step's data; a full save every `full_every` saves bounds how far back
        # retention must keep data (omnickpt/steps.py keeps what a kept step references).
        if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
                                        or block_bytes < 1):
            raise ValueError(f"block_bytes={block_bytes!r}: must be a positive int (bytes of rows per hashed block)")
        self.incremental, self.full_every, self.block_bytes = bool(incremental), full_every, block_bytes
        if not read_only:
            error = None
            if self._comm.is_coordinator:
                try:
                    self._hold_root()
                except Exception as e:   # every rank must learn of it
                    error = e
            # the coordinator's process id names this run (the failure markers of guard())
            self._run = self._agree(error, f"taking the checkpoint root {self.root}", self._job_id)[0]
            finish_at_exit(self)

    def _setup(self, root: str, keep_last: int | None, checkpointer: Checkpointer | None, process_group: Any,
               read_only: bool, on_error: str, cadence: Cadence | None = None) -> None:
        """The state both managers share (called first by either __init__); no collective."""
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={on_error!r}: must be 'raise' or 'warn'")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r}: must be an integer of at least 1 (or None to keep everything)")
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self._ckpt = checkpointer or default_checkpointer()
        self._group = process_group
        self._storage = storage_for(self.root)
        self._comm = self._ckpt.comm(self._group)
        self._read_only = read_only
        self._pending: tuple[int, SaveHandle] | None = None
        self._loading: int | None = None
        self._saved: set[int] = set()     # steps of this run in flight or committed: never saved twice
        self._closed = False
        self.restored: tuple[str, int] | None = None   # ("memory" | "durable", step) after load_latest
        # on_error="warn": a failed save is logged and listed here, and training goes on. Only the
        # newest FAILURES_KEPT are kept (a save failing for days must not grow the list without
        # bound); failure_count counts them all.
        self.on_error = on_error
        self.failures: list[dict] = []
        self.failure_count = 0
        # Leases go back in close(), or when an unclosed manager is collected or the interpreter ends.
        self._leases: list[Lease] = []
        self._root_lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self._release = weakref.finalize(self, _release_all, self._leases)
        self._job_id = _process_id()   # the coordinator's: the one that holds the root
        # every=: which save() calls save (omnickpt/cadence.py), and what it measures for "auto"
        self._cadence = cadence
        self._busy = False                        # a save of ours was in flight at the previous call
        self._started: tuple[float, float] | None = None   # (start, stall) of the save in flight
        self._flight_calls = 0                    # save() calls while it was in flight
        self._last_step: int | None = None        # the newest step given to save(): guard()'s to save
        self._capture = StepCapture()             # its state, when that call did not save (guard())
        self._guarding = 0                        # guard() blocks open: save() captures only inside one
        self._run = self._job_id                  # agreed by the ranks in __init__ (several ranks)
        self.failure_save: dict | None = None     # what guard() did when the job failed
        self.incremental, self.full_every, self.block_bytes = False, None, None   # CheckpointManager(incremental=True)

    def step_path(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    def save(self, step: int, state: dict, *, async_save: bool = False, force: bool = False, **kwargs):
        """Save step `step` (a non-negative int, not one this manager saved before); first waits
        for the previous async save to commit. A save that fails removes its step folder (when it
        holds no committed checkpoint), so it is retried with the same step number.

        With every= (an int, "auto" or "continuous"), call save() at every step: it saves only the
        steps the cadence makes due and returns None for the others (force=True saves anyway).
        "auto" measures the step time, the stall and the slowdown of steps with a save in flight,
        and saves as often as keeps that cost under max_overhead (cadence_report() says what it
        chose and measured); "continuous" saves as soon as the previous save is durable (one small
        all-gather per call with several ranks, so that every rank decides alike).

        With on_error="warn" a failure of this save (or of the previous async one, found here) is
        logged and appended to `self.failures` (the newest FAILURES_KEPT; `failure_count` counts
        all) instead of raised, and None is returned: training goes on, `latest` still names the
        newest committed step. With every=, a failed save counts as the cadence's attempt: the
        next is due an interval later, and failures in a row space attempts out up to 8 intervals
        (omnickpt/cadence.py); without every=, the next call tries again. Misuse (a bad or repeated
        step number) is always raised.

        A call that does not save (not due, or failed) captures the state as step `step` for
        guard() (omnickpt/failure.py StepCapture: the objects of dataloaders, schedulers, RNG and
        user values, module buffers, param-group hyperparameters; parameters and optimizer state
        are not copied)."""
        step = step_number(step)
        self._last_step = step
        error = None
        try:
            if self._cadence is not None:
                if not self._due(step) and not force:
                    self._capture_for_guard(step, state, kwargs)
                    return None
                if self._started is not None:
                    # The previous save is still in flight: this one would wait for it first anyway. Wait
                    # here, so that its time until durable is measured and this one's stall is its own.
                    if self.wait() is not None:
                        self._cadence.succeeded()
                    self._observe_durable(time.monotonic())
            t0 = time.monotonic()
            try:
                handle = self._save(step, state, async_save, kwargs)
            except CheckpointError as e:
                error = e
        except BaseException:
            self._capture_for_guard(step, state, kwargs)   # whatever stopped this save, guard() saves this step
            raise
        if error is not None:
            self._capture_for_guard(step, state, kwargs)
            return self._failed(step, error)
        if self._cadence is not None:
            if not async_save:
                self._cadence.succeeded()
            self._saved_by_cadence(step, t0, async_save)
        return handle

    # ------------------------------------------------------------------ checkpoint at failure
    def _capture_for_guard(self, step: int, state: dict, kwargs: dict) -> None:
        """A save() call that did not save: inside guard(), the state is captured as step `step`
        (a fraction of a millisecond for a model with a dataloader and RNG state, mostly their own
        state_dict() calls); outside, nothing is, and a loop without guard() pays nothing."""
        if self._guarding:
            self._capture.take(step, state, kwargs)

    @contextlib.contextmanager
    def guard(self, state: dict, *, grace: float = 10.0):
        """`with manager.guard(state):` around the training loop. When a rank fails inside it (an
        exception, SystemExit with a non-zero code, KeyboardInterrupt, or SIGTERM turned into one of
        those), the ranks that still hold a complete replica of `state` save step N, the last step
        given to save(), then every rank re-raises: the job ends as it would have, with step N
        committed. A clean exit (SystemExit with code 0 or None, GeneratorExit) saves nothing.

        Only the exact state of step N is saved (omnickpt/failure.py StepCapture): parameters and
        optimizer state as they were at save(N) (no optimizer step began since, none is half
        applied), the dataloader position, schedulers, RNG and other objects, module buffers and
        param-group hyperparameters captured at that call, and no NaN or Inf in any floating tensor.
        Otherwise nothing is saved, and the log and `failure_save` say why. Call save() every step,
        with every=, to lose at most the step in progress. A step N that save() itself saved (or
        has in flight) is not saved again.

        DDP: the lowest surviving rank saves alone; HSDP: the first shard group whose ranks all
        survive, over its own process group (every rank of it must have the exact state); FSDP or TP
        over the whole job: no complete replica survives a rank's loss, nothing is saved and the
        error log says so. Survivors wait up to `grace` seconds for every rank's marker (a rank
        killed outright leaves none). `self.failure_save` says what happened on this rank: "saved",
        "step", "reason" when nothing was saved, "captured" (what came from the capture of step N),
        "trigger" (the exception)."""
        self._guarding += 1
        try:
            yield self
        except BaseException as e:
            trigger = f"{type(e).__name__}: {e}"[:500]
            if exit_kind(e) == "clean":
                self.failure_save = {"saved": False, "trigger": trigger, "reason": "a clean exit, not a failure"}
                raise
            try:
                self.failure_save = self._save_at_failure(state, e, grace)
            except Exception as inner:   # the job's own failure is the one to raise
                self.failure_save = {"saved": False, "reason": f"{type(inner).__name__}: {inner}"}
                log.error("omnickpt: checkpoint at failure to %s failed: %s: %s", self.root, type(inner).__name__,
                          inner, exc_info=True)
            self.failure_save["trigger"] = trigger
            raise
        finally:
            self._guarding -= 1

    def _save_at_failure(self, state: dict, error: BaseException, grace: float) -> dict:
        """Every rank, once `error` left guard(): post this rank's marker, learn who survives and
        which replica group saves (omnickpt/failure.py), then that group saves step N exactly or
        not at all. Returns this rank's failure_save."""
        rank, world, step = self._comm.rank, self._comm.world_size, self._last_step
        # KeyboardInterrupt (Ctrl-C) leaves the rank's state intact: it may save, as a survivor does
        survivor = world > 1 and (peer_failure(error) or exit_kind(error) == "interrupt")
        run = f"{self._run}-s{step}"
        if world > 1:
            post_marker(self._storage, run, rank, {"rank": rank, "survivor": survivor, "step": step,
                                                   "error": f"{type(error).__name__}: {error}"[:500]})
        outcome = self._nothing_to_save_at_failure(step, survivor or world <= 1)
        if outcome is not None:
            return outcome
        savers, alive, outcome = self._failure_savers(state, rank, world, run, grace)
        if outcome is not None:
            return outcome
        return self._save_exact_at_failure(state, step, rank, run, savers, alive)

    def _nothing_to_save_at_failure(self, step: int | None, may_save: bool) -> dict | None:
        """This rank's failure_save when it has nothing to save at failure (it failed itself, or there
        is no uncommitted step); None when it goes on to learn who saves."""
        if not may_save:
            return {"saved": False, "reason": "this rank failed; the surviving ranks save"}
        if self._read_only or self._closed or step is None:
            return {"saved": False, "reason": "no step to save (read-only, closed, or save() never called)"}
        if step in self._saved:
            return self._saved_by_save(step)
        if step in self.steps():
            return {"saved": False, "step": step, "reason": f"step {step}, the newest, is already committed"}
        return None

    def _save_exact_at_failure(self, state: dict, step: int, rank: int, run: str, savers: tuple[int, ...],
                               alive: list[int]) -> dict:
        """Every rank of the replica group `savers`: save step `step` from the capture, exactly or not at
        all, once this group has claimed it. Returns this rank's failure_save."""
        from omnickpt.comm import SOLO, Comm
        group = SOLO if len(savers) == 1 else _shard_group(state)
        with self._capture.state_to_save(step) as (exact, problem):
            if len(savers) > 1:   # every rank of the group holds part of the step: all exact, or none saves
                problems = Comm(group).all_gather_object(problem, step="checkpoint at failure")
                problem = next((f"rank {r}: {p}" for r, p in zip(savers, problems) if p), None)
            if problem is not None:
                log.error("omnickpt: not saving step %d to %s at failure: %s; step %s stays the newest committed "
                          "one", step, self.root, problem, self.latest_step())
                return {"saved": False, "step": step, "alive": alive, "savers": list(savers), "reason": problem}
            # A survivor still blocked in a collective when the others decided can see more ranks alive
            # and pick another group: the first group to claim the step saves it, the other stands down.
            won = rank != savers[0] or self._storage.create_exclusive(
                f"{MARKERS}/{run}/claim.json", json.dumps({"savers": list(savers)}).encode())
            if len(savers) > 1:
                won = Comm(group).broadcast_object(won, step="checkpoint at failure")
            if not won:
                return {"saved": False, "alive": alive, "reason": "another replica group saved this step"}
            self._ckpt.save(self.step_path(step), exact, process_group=group,
                            on_commit=lambda _m: write_latest(self._storage, step), **self._capture.kwargs).wait()
        log.warning("omnickpt: saved step %d to %s at failure (ranks %s, surviving ranks %s; from the capture of "
                    "save(%d): %s)", step, self.step_path(step), list(savers), alive, step,
                    ", ".join(self._capture.taken_from_capture()) or "nothing")
        return {"saved": True, "step": step, "path": self.step_path(step), "savers": list(savers), "alive": alive,
                "captured": self._capture.taken_from_capture()}

    def _failure_savers(self, state: dict, rank: int, world: int, run: str,
                        grace: float) -> tuple[tuple[int, ...], list[int], dict | None]:
        """A survivor (or the one rank): (the replica group that saves, the surviving ranks, None),
        or (.., .., this rank's failure_save) when this rank does not save."""
        alive, replicas = [rank], replicas_of(state, world)
        if world == 1:
            return (rank,), alive, None
        # Ranks still blocked in a collective with this one would wait for the process group's
        # own timeout: closing this rank's connections fails their collective now.
        abort_groups(self._group, state)
        markers = await_markers(self._storage, run, world, grace, stop=lambda found: cannot_save(replicas, rank, found))
        alive = sorted(r for r, m in markers.items() if m.get("survivor"))
        if replicas.groups and cannot_save(replicas, rank, markers) and len(markers) < world:
            return (), alive, {"saved": False, "alive": alive, "reason": "this rank's replica group lost a rank: it "
                               "leaves, the other groups decide"}
        savers = pick_savers(replicas, alive)
        if savers is None:
            log.error("omnickpt: rank(s) %s failed and no complete replica of the state survives (surviving ranks %s); "
                      "nothing was saved at failure, step %s of %s stays the newest committed one",
                      sorted(set(range(world)) - set(alive)), alive, self.latest_step(), self.root)
            return (), alive, {"saved": False, "alive": alive, "reason": "no complete replica survives"}
        if rank not in savers:
            return savers, alive, {"saved": False, "alive": alive, "savers": list(savers),
                                   "reason": "another replica saves"}
        return savers, alive, None

    def _saved_by_save(self, step: int) -> dict:
        """guard()'s step was saved by save() itself (committed, or in flight): not saved again from
        the live state, which may be a later step's. A lone rank waits for a save in flight."""
        if self._comm.world_size == 1 and self._pending is not None and self._pending[0] == step:
            self.wait()   # raises (guard() reports it) or, with on_error="warn", lists the failure
            if step not in self._saved:
                return {"saved": False, "step": step, "reason": f"the save of step {step} by save() failed"}
        in_flight = self._in_flight()
        return {"saved": False, "step": step, "by_save": True, "path": self.step_path(step),
                "reason": f"step {step} was saved by save()" + ("; it is still in flight (finished at exit, or the "
                                                                 "process exits with status 1)" if in_flight else "")}

    # ------------------------------------------------------------------ cadence
    def _in_flight(self) -> bool:
        """Whether a save of ours is still on its way to being durable (this rank's view)."""
        return self._pending is not None and not self._pending[1].done()

    def _due(self, step: int) -> bool:
        """Every rank, at each save() call with every=: measure, then decide alike on every rank."""
        cadence, now, in_flight = self._cadence, time.monotonic(), self._in_flight()
        cadence.observe_call(step, now, self._busy)
        if self._busy and self._started is not None:
            # the step that just ended ran with the save in flight (counted even when the save became
            # durable during it: a save durable within one step still slowed that step)
            self._flight_calls += 1
        self._busy = in_flight
        if not in_flight and self._started is not None:   # the save in flight became durable since the last call
            self._observe_durable(now)
        if cadence.every == "continuous":
            # each rank sees the previous save become durable at its own moment
            if self._comm.world_size > 1:
                in_flight = any(self._comm.all_gather_object(in_flight, step="cadence"))
            return not in_flight
        return cadence.due(step, in_flight)

    def _observe_durable(self, now: float) -> None:
        start, stall = self._started
        self._cadence.observe_save(stall, now - start, self._flight_calls)
        self._started = None

    def _saved_by_cadence(self, step: int, t0: float, async_save: bool) -> None:
        """Every rank, after a save started: its stall, and (auto) the interval until the next one,
        the coordinator's measurement handed to every rank (one broadcast per save)."""
        cadence, stall = self._cadence, time.monotonic() - t0
        cadence.saved(step)
        if async_save:
            self._started, self._flight_calls = (t0, stall), 0
            self._busy = True    # the next step runs with this save in flight (and may wait at its fence)
        else:
            cadence.observe_save(stall, 0.0, 0)
        if cadence.every == "auto":
            mine = (cadence.interval(), cadence.basis())
            cadence.adopt(*(self._comm.broadcast_object(mine, step="cadence") if self._comm.world_size > 1
                            else mine))

    def cadence_report(self) -> dict | None:
        """With every=: the mode, the interval in force, and what it was chosen from (seconds per
        step, stall, background time, interference per save) with the overhead they give."""
        return None if self._cadence is None else dataclasses.asdict(self._cadence.report())

    def _failed(self, step: int | None, error: CheckpointError):
        """A save of `step` failed (None: an async save, found failed here): the cadence counts it as
        its attempt, then it is raised, or (on_error="warn") logged and listed."""
        if self._cadence is not None:
            self._cadence.failed(step)
        if self.on_error == "raise":
            raise error
        self.failure_count += 1
        self.failures.append({"step": step, "error": f"{type(error).__name__}: {error}", "time": time.time()})
        del self.failures[:-FAILURES_KEPT]   # a list still (slices, ==), trimmed to the newest
        log.error("omnickpt: checkpoint step %s to %s failed, training goes on (on_error='warn'): %s",
                  "?" if step is None else step, self.root, error)
        return None

    def _save(self, step: int, state: dict, async_save: bool, kwargs: dict):
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
        if self._read_only:
            raise CheckpointError(f"the CheckpointManager of {self.root} is read-only (read_only=True)")
        if step in self._saved:
            raise ValueError(f"step {step} was already saved by this CheckpointManager (to {self.step_path(step)}); "
                             "each save takes a new step number")
        return self._start_save(step, state, async_save, kwargs)

    def _start_save(self, step: int, state: dict, async_save: bool, kwargs: dict):
        """After save()'s checks: the save itself (the tiered manager saves to memory instead)."""
        self.wait()
        if not self._saved:
            self._warn_newer_in_root(step)
        self._saved.add(step)
        if self.incremental or kwargs.get("incremental"):
            # incremental against the previous step (unless the call names its own base)
            kwargs = {**self._incremental_options(step), **kwargs}
        try:
            handle = self._ckpt.save(self.step_path(step), state, async_save=async_save, process_group=self._group,
                                     on_commit=lambda _m, step=step: self._after_commit(step), **kwargs)
        except Exception:
            self._saved.discard(step)
            self._discard_failed(step)
            raise
        self._pending = (step, handle) if async_save else None
        return handle

    def _incremental_options(self, step: int) -> dict:
        """The save options of an incremental step: its base is the newest committed step before it
        (the coordinator reads that step's manifest; every rank passes the same path)."""
        earlier = [s for s in committed_steps(self._storage) if s < step][-1:] if self._comm.is_coordinator else []
        if self._comm.world_size > 1:
            earlier = self._comm.broadcast_object(earlier, step="incremental base")
        base = self.step_path(earlier[-1]) if earlier else None
        return {"incremental": True, "base": base, "full_every": self.full_every, "block_bytes": self.block_bytes}

    def wait(self) -> dict | None:
        """Wait for the in-flight async save, if any (with a memory tier: its commit in memory and
        its durable copy); returns its report. A background failure is raised here, once (logged
        and listed in `self.failures` with on_error="warn")."""
        try:
            return self._wait()
        except CheckpointError as e:
            return self._failed(None, e)

    def _wait(self) -> dict | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        step, handle = pending
        try:
            report = handle.wait()
            if self._cadence is not None and isinstance(report, dict):
                report = {**report, "cadence": self.cadence_report()}
            return report
        except Exception:
            self._saved.discard(step)
            self._discard_failed(step)
            raise

    def steps(self) -> list[int]:
        """Committed steps in `root`, oldest first. Steps only in shared memory are not listed
        here (memory_steps()); latest_step() considers both."""
        return committed_steps(self._storage)

    def latest_step(self) -> int | None:
        """The step load_latest() restores: the newest committed step in `root` (None if none).
        Reads storage only."""
        steps = self.steps()
        return steps[-1] if steps else None

    def memory_steps(self) -> list[int]:
        """Steps complete in this node's shared memory, oldest first ([]: no memory tier here)."""
        return []

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        """Load the newest committed step of `root`; NotCommittedError when there is none."""
        step = self.latest_step()
        if step is None:
            raise NotCommittedError(f"{self.root} holds no committed checkpoint (no global_step_N/{MANIFEST_NAME})")
        return self.load(step, state, **kwargs)

    def load(self, step: int, state: dict, **kwargs) -> LoadResult:
        """Load step `step` from `root`."""
        self._loading = int(step)
        try:
            return self._ckpt.load(self.step_path(step), state, process_group=self._group, **kwargs)
        finally:
            self._loading = None

    def close(self) -> None:
        """Wait for what is in flight, give the owner lease back. Every rank calls it."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self.close()
            return False
        try:
            self.close()
        except Exception as e:   # the exception on its way out matters more
            log.error("omnickpt: closing the CheckpointManager of %s after %s: %s", self.root, exc_type.__name__, e)
        return False

    def _close_at_exit(self) -> None:
        """The exit hook's close: what is in flight finishes (the tiered manager does less)."""
        self.close()

    # ------------------------------------------------------------------ root: lease, retention, failed saves
    def _hold_root(self) -> None:
        """Coordinator, before its first write to root: make this job the root's owner."""
        with self._lease_lock:
            if self._root_lease is None:
                self._root_lease = acquire(self._storage, self._job_id, what=f"checkpoint root {self.root}")
                self._leases.append(self._root_lease)

    def _agree(self, error: BaseException | None, what: str, payload: Any = None) -> list:
        """Every rank: raise on all ranks (the same class) if any failed; leases taken go back first.
        Returns every rank's payload."""
        try:
            return self._comm.settle(what, error, payload)
        except BaseException:
            self._release()
            self._closed = True
            raise

    def _after_commit(self, step: int) -> None:
        """Coordinator, once step `step` is committed in root: `latest`, then retention among the
        steps up to `step` only (an abandoned run's newer steps are not this run's to retire)."""
        write_latest(self._storage, step)
        retire(self._storage, self.keep_last, step, pinned=() if self._loading is None else (self._loading,))

    def _discard_failed(self, step: int) -> None:
        """Coordinator, once every rank is done with a failed save of `step`: its folder goes unless
        it holds a committed checkpoint (an earlier save of that number), so that failed folders do
        not pile up (a full disk gets its space back); but not the files that checkpoints next to it
        reference (a retired step stripped to them, saved into again after a rollback: steps.py).
        Best effort: the storage may be what failed."""
        if not self._comm.is_coordinator or self._root_lease is None:
            return
        name = step_dir(step)
        try:
            discard_folder(self._storage, name)
        except Exception as e:
            log.warning("omnickpt: could not remove %s of the failed save of step %d: %s",
                        self._storage.describe(name), step, e)

    def _warn_newer_in_root(self, step: int, stacklevel: int = 5) -> None:
        """Coordinator, at this run's first save: root's committed steps newer than it are another run's.
        `stacklevel` points the warning at the caller of save()."""
        if not self._comm.is_coordinator:
            return
        try:
            newer = [s for s in committed_steps(self._storage) if s > step]
        except (CheckpointError, OSError):
            return   # root unreachable: the save itself will say so
        if newer:
            warnings.warn(f"omnickpt: {self.root} holds committed step(s) {newer} newer than step {step}, this run's "
                          f"first save: another (abandoned?) run's. They are kept (retention only retires steps older "
                          f"than the one just saved), and latest_step()/load_latest() pick step {newer[-1]} until this "
                          f"run passes it: remove them, or save to another root, if they are not to be resumed from",
                          RuntimeWarning, stacklevel=stacklevel)


# ---------------------------------------------------------------------- helpers
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
    from torch import nn
    from torch.distributed.tensor import DTensor
    for value in state.values():
        if isinstance(value, nn.Module):
            yield from (p for p in value.parameters() if isinstance(p, DTensor))


def _shard_group(state: dict) -> Any:
    """This rank's process group along the sharded dimension of the state's HSDP mesh."""
    from torch.distributed.tensor import Replicate
    for p in _dtensors(state):
        dims = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
        if len(dims) == 1:
            return p.device_mesh.get_group(dims[0])
    raise CheckpointError("checkpoint at failure: the state's replica group has no single sharded mesh dimension")


def cadence_of(every: int | str | None, max_overhead: float, max_interval: int) -> Cadence | None:
    return None if every is None else Cadence(every, max_overhead=max_overhead, max_interval=max_interval)


def _release_all(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()


def _process_id() -> str:
    """This process as the holder of owner leases. One process is one job: a second manager in
    it (a restore check, a notebook cell run again) takes the first one's record over as its own,
    while another process, on this machine or any other, is another job."""
    try:
        with open("/proc/self/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]   # the process's start time: pids are reused
    except (OSError, IndexError):
        start = "0"
    return f"{socket.gethostname()}-{os.getpid()}-{start}"


def finish_at_exit(manager: CheckpointManager) -> None:
    """Finish `manager` at interpreter exit if nobody closed it: registered with threading's exit
    hooks, which run before concurrent.futures stops taking work (as the Checkpointer's; this one
    runs first, being registered later). If it cannot finish, the error goes to stderr and the
    process exits with status 1, never 0 with a step lost. A weak reference: the hook never keeps
    a manager alive."""
    ref = weakref.ref(manager)

    def finish() -> None:
        m = ref()
        if m is None or m._closed:
            return
        try:
            m._close_at_exit()
        except BaseException as e:
            print(f"omnickpt: ERROR: the CheckpointManager of {m.root}, still open at exit, could not finish: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            for h in logging.getLogger().handlers + log.handlers:
                try:
                    h.flush()
                except Exception:
                    pass
            sys.stdout.flush()
            os._exit(1)

    at_shutdown(finish)
