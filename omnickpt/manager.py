"""CheckpointManager: step directories, a `latest` pointer, retention, and async saves that the
next save waits for. The memory tier (host shared memory in front of the durable root;
docs/memory_tier.md) is TieredCheckpointManager (omnickpt/memory/manager.py), a manager of its own.

A manager is made of parts that each hold one idea, shared by both managers:
- the StepRoot (omnickpt/root.py): the root's owner lease, `latest`, retention, the removal of a
  failed save's folder, the exit hook;
- the SaveLoop (below): the training loop's save() calls, which of them save (the CadencePolicy
  of omnickpt/cadence.py, with every=), what a failed one does (on_error), and what checkpoint at
  failure (the FailureGuard of omnickpt/failure.py, guard()) captures at a call that did not save.
The manager itself only saves: here, a Checkpointer save of the step folder in root.

What it guards against, besides crashes: a second job writing the same root (owner leases,
omnickpt/lease.py), retiring a new run's steps in favour of an abandoned run's newer ones, and an
unclosed manager at interpreter exit (what is in flight is finished, or the process fails loudly).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Callable

from omnickpt.api import Checkpointer, LoadResult, SaveHandle, default_checkpointer, step_number
from omnickpt.cadence import CadencePolicy, cadence_of, check_cadence
from omnickpt.errors import CheckpointError, NotCommittedError
from omnickpt.failure import FailureGuard
from omnickpt.format import MANIFEST_NAME
from omnickpt.root import StepRoot, check_keep_last
from omnickpt.steps import write_latest

log = logging.getLogger("omnickpt")
FAILURES_KEPT = 100   # the newest failed saves listed in manager.failures (failure_count counts all)
# The options of the memory tier (MemoryTierOptions' fields but its url: this module is below it).
MEMORY_OPTIONS = frozenset({"memory_keep", "persist_every", "ranks_per_node", "peer_replicas", "persist_on_failure",
                            "on_close", "flush_timeout"})


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """The options of a checkpoint manager, of either kind (checked when built). The managers'
    keywords build one; `options=ManagerOptions(...)` gives them as one value instead.

    - keep_last: committed steps that retention keeps in root (None: every one).
    - read_only: no owner lease and no save, for a process that only lists or loads (evaluation,
      inspection) while a job trains. Not with a memory tier.
    - on_error: "raise" a failed save; or "warn": log it, list it in `failures`, and go on.
    - every, max_overhead, max_interval: the cadence (omnickpt/cadence.py): save() saves only the
      steps due (every: an int, "auto" keeping the cost under max_overhead, or "continuous").
    - incremental, full_every, block_bytes: each save writes only the blocks (of about block_bytes)
      changed since the previous committed step, a full one every full_every saves. Not with a
      memory tier.
    - overwrite: this run knowingly starts over in a root that holds committed steps. Without it,
      the first save of a run that loaded no step refuses (CheckpointError on every rank, nothing
      written) a step number root already holds, and committed steps newer than it (a restarted job
      that did not resume). With it, or after a load (a resume or a rollback), newer steps only warn
      and are kept until this run's saves replace or retire them.
    """
    keep_last: int | None = None
    read_only: bool = False
    on_error: str = "raise"
    every: int | str | None = None
    max_overhead: float = 0.02
    max_interval: int = 10_000
    incremental: bool = False
    full_every: int | None = 10
    block_bytes: int | None = None
    overwrite: bool = False

    def __post_init__(self):
        check_on_error(self.on_error)
        if not isinstance(self.overwrite, bool):
            raise TypeError(f"overwrite={self.overwrite!r}: expected True or False")
        check_keep_last(self.keep_last)
        if self.every is not None:
            check_cadence(self.every, self.max_overhead, self.max_interval)
        _check_incremental(self.full_every, self.block_bytes)


MANAGER_OPTIONS = frozenset(f.name for f in dataclasses.fields(ManagerOptions))


class SaveLoop:
    """The save() calls of a training loop, as both managers take them: which calls save (the
    cadence policy, with every=), what a failure does (on_error="raise", or "warn": logged and
    listed in `failures`, the newest FAILURES_KEPT; `failure_count` counts all), what guard()
    captures at a call that did not save (the FailureGuard), and which steps this run has saved or
    has in flight (`saved`: a step is never saved twice).

    The manager does the saving itself, through callables (held weakly: the loop never keeps its
    manager alive): `start(step, state, async_save, kwargs)` checks the call and starts the save
    (returns its handle), `finish()` waits for the save in flight (returns its report, raises its
    failure), `in_flight()` says whether one is still on its way to being durable. With a cadence,
    the loop has `checkpointer` (the manager's, whose staging its saves use) warm the next save's
    staging a few calls ahead of it (Checkpointer.warm_staging), where the last save released it."""

    def __init__(self, root: StepRoot, on_error: str, cadence: CadencePolicy | None, guard: FailureGuard, *,
                 start: Callable, finish: Callable[[], dict | None], in_flight: Callable[[], bool],
                 checkpointer: Checkpointer | None = None):
        check_on_error(on_error)
        self.root, self.on_error, self.cadence, self.guard = root, on_error, cadence, guard
        self._start, self._finish, self._in_flight = (weakref.WeakMethod(start), weakref.WeakMethod(finish),
                                                      weakref.WeakMethod(in_flight))
        self._ckpt = checkpointer
        self.saved: set[int] = set()     # steps of this run in flight or committed: never saved twice
        self.failures: list[dict] = []
        self.failure_count = 0

    def save(self, step: int, state: dict, async_save: bool, force: bool, kwargs: dict):
        """CheckpointManager.save() (its docstring is the contract): the handle, or None when the
        call did not save (not due, or failed with on_error="warn")."""
        step = step_number(step)
        self.guard.last_step = step
        error = None
        try:
            if self.cadence is not None:
                due = self.cadence.due(step, self.in_flight())
                if not due and not force:
                    self._warm_ahead(step)
                    self.guard.capture_unsaved(step, state, kwargs)
                    return None
                self.cadence.before_save(self.wait)
            t0 = time.monotonic()
            try:
                handle = self._start()(step, state, async_save, kwargs)
            except CheckpointError as e:
                error = e
        except BaseException:
            self.guard.capture_unsaved(step, state, kwargs)   # whatever stopped this save, guard() saves this step
            raise
        if error is not None:
            self.guard.capture_unsaved(step, state, kwargs)
            return self.failed(step, error)
        if self.cadence is not None:
            self.cadence.started(step, t0, async_save)
        return handle

    def _warm_ahead(self, step: int) -> None:
        """A call that does not save: when the next due save is near, its staging is faulted in now,
        in the background, if the last save did not leave it warm (release_staging=True): the save's
        copy then runs at memcpy speed instead of faulting memory in while the optimizer step after
        it waits. Rank-local (no collective): a rank that warms later only pays the faults itself."""
        ckpt = self._ckpt
        if ckpt is None or not ckpt.release_staging:
            return
        pool = ckpt._pool
        if self.cadence.warm_due(step, pool.cold(), pool.warm_rate):
            ckpt.warm_staging()

    def drop_warmed(self) -> None:
        """At the manager's close: staging warmed for a save that will not come is freed once the
        warm is done."""
        if self._ckpt is not None and self._ckpt.release_staging:
            self._ckpt.drop_warmed_staging()

    def check_new(self, step: int) -> None:
        """Misuse, always raised: a step number this run saved before."""
        if step in self.saved:
            raise ValueError(f"step {step} was already saved by this CheckpointManager (to "
                             f"{self.root.step_path(step)}); each save takes a new step number")

    def in_flight(self) -> bool:
        return self._in_flight()()

    def wait(self) -> dict | None:
        """The manager's wait(): the save in flight's report; its failure raised, or listed."""
        try:
            return self._finish()()
        except CheckpointError as e:
            return self.failed(None, e)

    def failed(self, step: int | None, error: CheckpointError):
        """A save of `step` failed (None: an async save, found failed here): the cadence counts it as
        its attempt, then it is raised, or (on_error="warn") logged and listed."""
        if self.cadence is not None:
            self.cadence.failed(step)
        if self.on_error == "raise":
            raise error
        self.failure_count += 1
        self.failures.append({"step": step, "error": f"{type(error).__name__}: {error}", "time": time.time()})
        del self.failures[:-FAILURES_KEPT]   # a list still (slices, ==), trimmed to the newest
        log.error("omnickpt: checkpoint step %s to %s failed, training goes on (on_error='warn'): %s",
                  "?" if step is None else step, self.root.path, error)
        return None

    def at_failure(self, step: int, closed: bool) -> dict | None:
        """guard()'s question at a failure: this rank's failure_save when step `step` is not to be
        saved (the manager is closed or read-only, save() saved it, root holds it), else None."""
        if closed:
            return {"saved": False, "reason": "no step to save (read-only, closed, or save() never called)"}
        if step in self.saved:
            # saved by save() (committed, or in flight): not saved again from the live state, which
            # may be a later step's
            return {"saved": False, "step": step, "by_save": True, "path": self.root.step_path(step),
                    "reason": f"step {step} was saved by save()" + (
                        "; it is still in flight (finished at exit, or the process exits with status 1)"
                        if self.in_flight() else "")}
        if step in self.root.steps():
            return {"saved": False, "step": step, "reason": f"step {step}, the newest, is already committed"}
        return None

    def cadence_report(self) -> dict | None:
        return None if self.cadence is None else self.cadence.report()


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
    `root`) is another class: `TieredCheckpointManager(root, memory="shm://JOB", ...)`
    (omnickpt/memory/manager.py). `CheckpointManager(root, memory=...)` is a TypeError saying so,
    and so are the tier's options (memory_keep, persist_every, ranks_per_node, peer_replicas,
    persist_on_failure, on_close, flush_timeout) here.

    Every rank of the process group must create the manager (a collective with several ranks: one
    all-gather, so that a refused lease raises on every rank), save the same steps and call close()
    (a collective when there are several ranks). A manager still open at interpreter exit is
    finished there: its saves in flight committed, or the process exits with status 1 and the
    error on stderr.
    """

    def __init__(self, root: str, *, checkpointer: Checkpointer | None = None, process_group: Any = None,
                 options: ManagerOptions | None = None, memory: Any = None, **keywords):
        """`keywords`: ManagerOptions' fields (keep_last, read_only, on_error, every, max_overhead,
        max_interval, incremental, full_every, block_bytes, overwrite), or all of them as `options`."""
        opts = manager_options(type(self).__name__, root, options, memory, keywords)
        self._ckpt = checkpointer or default_checkpointer()
        self._group = process_group
        self._comm = self._ckpt.comm(self._group)
        self._root = StepRoot(root, self._comm, keep_last=opts.keep_last)
        self.root, self.keep_last = self._root.path, opts.keep_last
        self._read_only = read_only = opts.read_only
        self._overwrite = opts.overwrite
        self._pending: tuple[int, SaveHandle] | None = None
        self._closed = False
        self.restored: tuple[str, int] | None = None   # ("durable", step) after load_latest
        self._guard = FailureGuard(self._root.storage, self._comm, self._group, outcome=self._failure_outcome,
                                   save=self._save_at_failure, latest=self.latest_step)
        cadence = cadence_of(opts.every, opts.max_overhead, opts.max_interval, self._comm)
        self._loop = SaveLoop(self._root, opts.on_error, cadence, self._guard, start=self._save, finish=self._wait,
                              in_flight=self._in_flight, checkpointer=self._ckpt)
        # Incremental: each save writes only the blocks changed since the previous committed step
        # and references that step's data; a full save every `full_every` saves bounds how far back
        # retention must keep data (omnickpt/steps.py keeps what a kept step references).
        self.incremental, self.full_every, self.block_bytes = bool(opts.incremental), opts.full_every, opts.block_bytes
        self._guard.run = self._root.job_id
        if not read_only:
            # the coordinator's process id names this run (the failure markers of guard())
            self._guard.run = self._root.take()
            self._root.finish_at_exit(self._close_at_exit)

    # ------------------------------------------------------------------ what the parts keep
    on_error = property(lambda self: self._loop.on_error, doc="'raise' or 'warn' (a failed save is listed)")
    failures = property(lambda self: self._loop.failures, doc="the newest FAILURES_KEPT failed saves (on_error='warn')")
    failure_count = property(lambda self: self._loop.failure_count, doc="failed saves, all of them")
    failure_save = property(lambda self: self._guard.failure_save, doc="what guard() did when the job failed")

    def step_path(self, step: int) -> str:
        return self._root.step_path(step)

    # ------------------------------------------------------------------ saving
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
        return self._loop.save(step, state, async_save, force, kwargs)

    def _save(self, step: int, state: dict, async_save: bool, kwargs: dict):
        """The SaveLoop's start: this manager's checks, then the save of the step folder."""
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
        if self._read_only:
            raise CheckpointError(f"the CheckpointManager of {self.root} is read-only (read_only=True)")
        self._loop.check_new(step)
        self.wait()
        if not self._loop.saved:
            self._root.first_save(step, self._overwrite, stacklevel=5)
        self._loop.saved.add(step)
        if self.incremental or kwargs.get("incremental"):
            # incremental against the previous step (unless the call names its own base)
            kwargs = {**self._incremental_options(step), **kwargs}
        try:
            handle = self._ckpt.save(self.step_path(step), state, async_save=async_save, process_group=self._group,
                                     on_commit=lambda _m, step=step: self._root.after_commit(step), **kwargs)
        except Exception:
            self._loop.saved.discard(step)
            self._root.discard_failed(step)
            raise
        self._pending = (step, handle) if async_save else None
        return handle

    def _incremental_options(self, step: int) -> dict:
        """The save options of an incremental step: its base is the newest committed step before it
        (the coordinator reads that step's manifest; every rank passes the same path)."""
        earlier = [s for s in self.steps() if s < step][-1:] if self._comm.is_coordinator else []
        if self._comm.world_size > 1:
            earlier = self._comm.broadcast_object(earlier, step="incremental base")
        base = self.step_path(earlier[-1]) if earlier else None
        return {"incremental": True, "base": base, "full_every": self.full_every, "block_bytes": self.block_bytes}

    def wait(self) -> dict | None:
        """Wait for the in-flight async save, if any; returns its report. A background failure is
        raised here, once (logged and listed in `self.failures` with on_error="warn")."""
        return self._loop.wait()

    def _wait(self) -> dict | None:
        """The SaveLoop's finish: the async save in flight, its folder removed if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        step, handle = pending
        try:
            report = handle.wait()
            if self._loop.cadence is not None and isinstance(report, dict):
                report = {**report, "cadence": self.cadence_report()}
            return report
        except Exception:
            self._loop.saved.discard(step)
            self._root.discard_failed(step)
            raise

    def _in_flight(self) -> bool:
        """Whether a save of ours is still on its way to being durable (this rank's view)."""
        return self._pending is not None and not self._pending[1].done()


    def cadence_report(self) -> dict | None:
        """With every=: the mode, the interval in force, and what it was chosen from (seconds per
        step, stall, background time, interference per save) with the overhead they give."""
        return self._loop.cadence_report()

    # ------------------------------------------------------------------ checkpoint at failure
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
        "trigger" (the exception). The block's value is the manager."""
        return self._guard.guarding(state, grace, self)

    def _failure_outcome(self, step: int) -> dict | None:
        """The guard's question (FailureGuard): whether step `step` is to be saved at failure. A lone
        rank first waits for that step's save in flight (raised, or listed with on_error="warn")."""
        if self._comm.world_size == 1 and self._pending is not None and self._pending[0] == step:
            self.wait()
            if step not in self._loop.saved:
                return {"saved": False, "step": step, "reason": f"the save of step {step} by save() failed"}
        return self._loop.at_failure(step, self._read_only or self._closed)

    def _save_at_failure(self, step: int, state: dict, group: Any, kwargs: dict) -> str:
        return save_at_failure(self._ckpt, self._root, step, state, group, kwargs)

    # ------------------------------------------------------------------ listing and loading
    def steps(self) -> list[int]:
        """Committed steps in `root`, oldest first."""
        return self._root.steps()

    def latest_step(self) -> int | None:
        """The step load_latest() restores: the newest committed step in `root` (None if none).
        Reads storage only."""
        return self._root.latest_step()

    def memory_steps(self) -> list[int]:
        """Steps complete in this node's shared memory ([]: no memory tier here)."""
        return []

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        """Load the newest committed step of `root`; NotCommittedError when there is none."""
        step = self.latest_step()
        if step is None:
            raise NotCommittedError(f"{self.root} holds no committed checkpoint (no global_step_N/{MANIFEST_NAME})")
        return self.load(step, state, **kwargs)

    def load(self, step: int, state: dict, **kwargs) -> LoadResult:
        """Load step `step` from `root`."""
        with self._root.loading(step):
            return self._ckpt.load(self.step_path(step), state, process_group=self._group, **kwargs)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Wait for what is in flight, give the owner lease back. Every rank calls it."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._root.release()
            self._loop.drop_warmed()

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
        """The exit hook's close (StepRoot.finish_at_exit): what is in flight finishes."""
        self.close()


# ---------------------------------------------------------------------- helpers
def manager_options(cls: str, root: str, options: ManagerOptions | None, memory: Any,
                    keywords: dict) -> ManagerOptions:
    """A plain manager's options: `options`, or its keywords (not both); the memory tier refused."""
    refuse_memory(cls, root, memory, {k: v for k, v in keywords.items() if k not in MANAGER_OPTIONS})
    if options is None:
        return ManagerOptions(**keywords)
    if keywords:
        raise TypeError(f"options=ManagerOptions(...) carries the manager's options; do not also pass "
                        f"{sorted(keywords)}")
    return options


def refuse_memory(cls: str, root: str, memory: Any, options: dict) -> None:
    """A plain manager given the memory tier (memory=, or its options): a TypeError naming the class
    that has one. The options used to be ignored, so that a forgotten memory= silently ran without
    the tier; memory= used to build the tiered manager from this class's constructor."""
    unknown = sorted(set(options) - MEMORY_OPTIONS)
    if unknown:
        raise TypeError(f"{cls}() got unexpected keyword argument(s) {unknown}")
    if memory is not None:
        raise TypeError(f"{cls}(memory={memory!r}): a {cls} has no memory tier; build "
                        f"TieredCheckpointManager(root, memory={memory!r}, ...) for one "
                        "(omnickpt.TieredCheckpointManager)")
    if options:
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
        raise TypeError(f"{cls}({str(root)!r}, {given}): {sorted(options)} are options of the memory tier, which is "
                        "off without memory=; build TieredCheckpointManager(root, memory='shm://JOB', ...) with them, "
                        "or drop them")


def _check_incremental(full_every: int | None, block_bytes: int | None) -> None:
    if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1):
        raise ValueError(f"full_every={full_every!r}: must be a positive int (a full save every that many saves)")
    if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
                                    or block_bytes < 1):
        raise ValueError(f"block_bytes={block_bytes!r}: must be a positive int (bytes of rows per hashed block)")


def save_at_failure(ckpt: Checkpointer, root: StepRoot, step: int, state: dict, group: Any, kwargs: dict) -> str:
    """The FailureGuard's save, for either manager: step `step` into root over `group`, synchronously,
    `latest` updated. Returns its path."""
    path = root.step_path(step)
    ckpt.save(path, state, process_group=group, on_commit=lambda _m: write_latest(root.storage, step), **kwargs).wait()
    return path


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "warn"):
        raise ValueError(f"on_error={on_error!r}: must be 'raise' or 'warn'")
