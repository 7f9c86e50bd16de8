"""The public API: save(), load() and the Checkpointer that owns thread pools, staging memory and
the plan cache. Module-level save()/load() use one default Checkpointer per process. The flows
themselves live in omnickpt/saving.py (SaveOptions, the save job) and omnickpt/loading.py."""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from omnickpt import commit, loading
from omnickpt.adapters import check_framework
from omnickpt.comm import Comm, current_world
from omnickpt.engine import StagingPool
from omnickpt.engine.load import LANDING_BYTES
from omnickpt.engine.priority import background
from omnickpt.engine.staging import WARM_SLACK, gc_paused
from omnickpt.fence import SnapshotFence
from omnickpt.errors import CheckpointError, CheckpointTimeoutError
from omnickpt.format import MANIFEST_NAME
from omnickpt.formats import read_manifest  # noqa: F401  (part of omnickpt's API)
from omnickpt.loading import LoadOptions, LoadResult
from omnickpt.saving import REPORT_NAME, SaveOptions, _logging_failures, _SaveJob
from omnickpt.steps import step_dir, write_latest
from omnickpt.storage import Storage, storage_for

log = logging.getLogger("omnickpt")


def is_committed(path: str) -> bool:
    try:
        return storage_for(path).exists(MANIFEST_NAME)
    except CheckpointError:
        return False


@runtime_checkable
class SaveHandleProtocol(Protocol):
    """What every save handle offers, whoever returned it (save(), Checkpointer.save(),
    CheckpointManager.save(), TieredCheckpointManager.save()), so that a training loop handles them
    alike:

    - done(): True once the save has finished, committed or failed (never blocks).
    - wait(timeout=None): the training thread waits for the save to commit and gets its report
      (a dict); the save's failure is raised here. Implies fence().
    - fence(): the training thread waits until the save's snapshot is complete; after it the state
      may change (an optimizer step) without reaching the checkpoint. Raises nothing about the
      save itself: wait() does.
    - staged(): never blocks: whether that snapshot is complete (fence() would not wait).
    """

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> dict: ...

    def fence(self) -> None: ...

    def staged(self) -> bool: ...


class SaveHandle:
    """A save in progress (or done), as SaveHandleProtocol describes. wait() returns the report once
    the checkpoint is committed."""

    def __init__(self, path: str, save_id: str, storage: Storage, future: Future | None, report: dict | None,
                 coordinator: bool, timeout: float):
        self.path, self.save_id = path, save_id
        self._storage, self._future, self._report = storage, future, report
        self._coordinator, self._timeout = coordinator, timeout
        self._lock = threading.Lock()
        # True once wait() handed the outcome (report or error) to the caller: the exit hook then
        # has nothing left to report about this save.
        self.reported = report is not None
        self._fence: SnapshotFence | None = None   # a lazy snapshot's, until the training thread removes it
        self._training_thread = threading.get_ident()   # the one that called save()

    def fence(self) -> None:
        """The training thread: wait until this save's snapshot is complete (a lazy snapshot copies
        in the background), and take its step hooks off the optimizers. After it, the state may be
        changed in any way without reaching the checkpoint. wait(), and the Checkpointer's next
        save() or load(), call it too. Raises nothing about the save itself: wait() does."""
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.remove(self._timeout)

    def staged(self) -> bool:
        """Never blocks: whether this save's snapshot is complete (a sync or eager save: once save()
        returned; a lazy snapshot: once its background copy is done). From then on the state may
        change without reaching the checkpoint, as after fence(), which still takes the optimizers'
        step hooks off (the next optimizer step does so too). torchtitan's `staging_completion`."""
        fence = self._fence
        return fence is None or fence.released

    def done(self) -> bool:
        if self._report is not None:
            return True
        if self._future is not None and not self._future.done():
            return False
        if self._coordinator:
            return True
        return self._status() is not None

    def wait(self, timeout: float | None = None) -> dict:
        if threading.get_ident() == self._training_thread:
            self.fence()
        elif self._fence is not None:   # another thread (a manager's lane, the exit hook) leaves the hooks alone
            self._fence.wait(self._timeout)
        with self._lock:
            if self._report is not None:
                return self._report
            limit = self._timeout if timeout is None else timeout
            try:
                # The background job bounds its own waits for the other ranks by the Checkpointer's
                # timeout and says which ranks did not come; by default its error is the one to see.
                job_limit = None if timeout is None else timeout
                report = self._future.result(timeout=job_limit) if self._future is not None else None
                if not self._coordinator:
                    # By default past the coordinator's own wait for the records (commit.Round.verdict):
                    # its verdict names a missing rank; our own timeout could only say that it is late.
                    report = self._await_commit(limit if timeout is not None else commit.VERDICT_WAIT * limit)
            except CheckpointError:
                self.reported = True
                raise
            except FutureTimeoutError:
                raise CheckpointTimeoutError(f"save to {self.path}: not finished within {limit:.0f} s") from None
            self._report, self.reported = report, True
            return report

    def _status(self) -> dict | None:
        return commit.read_status(self._storage, self.save_id)

    def _await_commit(self, limit: float) -> dict:
        """A rank other than the coordinator: the coordinator's verdict (its error class raised),
        then the save's report."""
        commit.await_status(self._storage, self.save_id, limit, f"save to {self.path}")
        try:
            return json.loads(self._storage.read_bytes(REPORT_NAME))
        except FileNotFoundError:
            return {}


BACKGROUND_NICE = 10   # Checkpointer(background_nice=): how much nicer background threads run


class Checkpointer:
    """Owns the I/O threads, the staging pools and the plan cache. Create one per training job (or
    use the module-level save/load), call close() when done."""

    def __init__(self, *, process_group: Any = None, io_workers: int = 4, timeout: float = 600.0,
                 staging_slots: int = 2, landing_bytes: int = LANDING_BYTES, staging_budget: int | None = None,
                 release_staging: bool = False, background_nice: int | None = BACKGROUND_NICE):
        """staging_budget: the most bytes of host memory the staging pool holds (snapshots, the
        packing of sync saves' small tensors, load landing buffers); a rank's state larger than it
        is staged in part and the rest written from the tensors' own memory while the snapshot's
        fence holds (the stall or the held optimizer step grows; the cap holds).
        release_staging: free the staging memory after each save instead of keeping it warm.
        background_nice: the persist thread and I/O workers (writing, checksumming, reading) run
        this much nicer than the process, at the lowest best-effort I/O priority, so that training
        steps overlapping a save win the cores and the disk (None: the training thread's
        priority). The lazy snapshot's copier keeps the training thread's: a step may wait for it."""
        # What __init__ was given, to make this Checkpointer anew in a forked child (_own_process).
        self._settings = dict(process_group=process_group, io_workers=io_workers, timeout=timeout,
                              staging_slots=staging_slots, landing_bytes=landing_bytes, staging_budget=staging_budget,
                              release_staging=release_staging, background_nice=background_nice)
        self._pid = os.getpid()
        self._group = process_group
        self._pool = StagingPool(staging_slots, staging_budget)
        self.landing_bytes = landing_bytes if staging_budget is None else min(landing_bytes, self._pool.largest)
        self.release_staging = release_staging
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="omnickpt-io", initializer=background,
                                      initargs=(background_nice,))
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-persist", initializer=background,
                                           initargs=(background_nice,))
        self.background_nice = background_nice
        self._copier: ThreadPoolExecutor | None = None   # the lazy snapshots' thread (_snapshot_thread)
        # Started now: an executor starts its thread at the first submit, which would be inside the
        # first async save's stall (a few ms per thread).
        for pool in (self._persist, self._snapshot_thread()):
            pool.submit(int)
        self._fences: list[SnapshotFence] = []   # lazy snapshots whose hooks the training thread has to remove
        self._plans: dict[int, dict[tuple, tuple]] = {}
        # Per process group, what the last save collected, for the next save of an unchanged layout
        # (saving._Reuse); it holds references to the state's tensors, dropped by close().
        self._reuse: dict[int, Any] = {}
        self._comms: dict[int, Comm] = {}
        self._world: Any = current_world()   # the default process group the cached Comms belong to
        self._inflight: dict[str, SaveHandle] = {}
        # The last checkpoint committed per process group: the default base of an incremental save.
        self._committed: dict[int, str] = {}
        self.timeout = timeout
        # This job's id in the owner records of the paths it saves to (the coordinator's counts).
        self._job = f"omnickpt-{uuid.uuid4().hex[:12]}"
        _finish_saves_at_exit(self)

    def _own_process(self) -> None:
        """Every entry point: a Checkpointer used in a process forked after it was made (a worker
        started with fork, Lightning's ddp_fork, the module-level one of a parent that saved or
        loaded before forking) is made anew, empty. The child has none of its threads (a save would
        wait forever for a persist thread that is not there), may hold its locks as a parent's
        thread held them at the fork, and would share the parent's job id in owner records. The
        parent's saves in flight stay the parent's."""
        if self._pid != os.getpid():
            self.__init__(**self._settings)

    def pending(self) -> list[SaveHandle]:
        """Async saves started here whose outcome nobody has seen yet (still running, or finished
        but never waited for)."""
        self._own_process()
        return [h for h in self._inflight.values() if not h.reported]

    def comm(self, process_group: Any = None) -> Comm:
        world = current_world()
        if world is not self._world:
            # The job's process group was created, destroyed or made anew (an in-process restart,
            # omnickpt.load before init_process_group) since these were cached: their groups are
            # gone, and a Comm made before init would save each rank as if it were alone. What is
            # keyed by a Comm goes too (ids of freed Comms are reused).
            self._world = world
            for cache in (self._comms, self._plans, self._reuse, self._committed):
                cache.clear()
        group = process_group if process_group is not None else self._group
        key = id(group)
        if key not in self._comms:
            self._comms[key] = Comm(group, timeout=self.timeout)
        return self._comms[key]

    def close(self) -> None:
        """Wait for every async save still in flight, then free the threads and staging memory. A
        save that failed without anyone having waited for it is logged as an error."""
        for h in self.pending():   # pending() makes a Checkpointer used in a forked child its own first
            try:
                h.wait()
            except CheckpointError as e:
                log.error("omnickpt: async save to %s failed and was never waited for: %s", h.path, e)
        self._await_snapshots()
        self._pool.stop_warming()   # a staging buffer warmed after a load, for a save that will not come
        self._persist.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._pool.close()
        self._reuse.clear()

    def warm_staging(self) -> bool:
        """Fault in, in the background, the host staging memory the next async save will copy into
        (as much as the last async save's), unless a buffer that size is idle already. With
        release_staging=True each save frees its staging, and the next save's lazy copy faults
        fresh memory in while the optimizer step after it waits: 1.9 s for the 806 MB MLP in one
        process on this machine against 0.1 s into warm memory (bench/warm_ahead.py). Called a few
        steps before a save, that copy runs at memcpy speed; CheckpointManager(every=...) does it
        itself ahead of each save it makes. The warm runs on the persist thread (niced, behind a
        save still persisting) and gives way to a save that wants the buffer first. Faulting
        memory in is CPU work: where training leaves no core idle (CPU training on every core) it
        slows the steps before the save about as much as it would have held the step after it.
        Returns whether a warm was queued: not before an async save has been made, for a state on
        a GPU (pinned staging is not warmed), or when an idle buffer that size is there
        (release_staging=False keeps it between saves); a queued warm does nothing if a buffer is
        in use when it runs. drop_warmed_staging() frees a warmed buffer no save used."""
        self._own_process()
        nbytes = self._pool.cold()
        return bool(nbytes) and self._behind_persist(self._pool.warm, nbytes, WARM_SLACK)

    def drop_warmed_staging(self) -> None:
        """Free a staging buffer warm_staging() (or a load) warmed that no save has used, once a
        warm under way is done (queued behind it on the persist thread): a manager that closes
        before the save it warmed for."""
        self._behind_persist(self._pool.drop_speculative)

    def _behind_persist(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue `fn(*args)` on the persist thread (niced, after a save still persisting); False
        once closed (its threads are gone, close() freed the pool, and no save will come)."""
        try:
            self._persist.submit(fn, *args)
        except RuntimeError:
            return False
        return True

    def _snapshot_thread(self) -> ThreadPoolExecutor:
        """Where lazy copies run as soon as save() returns, not behind an earlier save's persist on
        the persist thread: the optimizer step waits for them."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-snapshot")
        return self._copier

    def _await_snapshots(self) -> None:
        """The training thread, before a save or load: every lazy snapshot still copying finishes
        (a load would overwrite tensors not yet copied, a save reuses their staging), and its step
        hooks come off the optimizers."""
        fences, self._fences = self._fences, []
        for f in fences:
            f.remove(self.timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ save
    @gc_paused()   # whole phases make objects by the thousand (engine.staging.gc_paused)
    def save(self, path: str, state: dict, *, options: SaveOptions | None = None, **keywords: Any) -> SaveHandle:
        """Every rank. See omnickpt.save; `options` (a SaveOptions) or its fields as keywords (which
        replace the fields of `options`). Phases (saving._SaveJob): collect (adapters, records,
        objects encoded), agree (one all-gather: digests, save id, paths, errors; a small job's
        records when its plan is not cached), plan (from the cache; from those records on every
        rank; else a gather and a scatter), snapshot (the stall ends here; a lazy one
        leaves the copy of parameters and optimizer state to a background thread, behind a
        SnapshotFence), then persist and commit (a gather and a broadcast for a sync save; through
        storage for an async one). Waits first for any lazy snapshot of an earlier save here."""
        t_start = time.perf_counter()
        self._own_process()
        options = SaveOptions.of(options, keywords)
        self._await_snapshots()
        job = _SaveJob(self, str(path), state, options, t_start)
        prev = self._inflight.get(job.where)
        if prev is not None and not prev.done():
            raise CheckpointError(f"a save to {job.path} is still in progress; wait() for it before saving there again")
        try:
            job.agree(job.collect())
            job.plan()
            blocking = job.snapshot()
        except BaseException:
            job.give_back()   # a save that fails before it runs holds no reference records on its base
            raise
        if not options.async_save:
            return SaveHandle(job.path, job.save_id, job.storage, None, job.run(), job.comm.is_coordinator,
                              self.timeout)
        return self._in_background(job, blocking)

    def _in_background(self, job: _SaveJob, blocking: bool) -> SaveHandle:
        """The training thread, after an async save's snapshot: its persist and commit go to the
        persist thread; the handle is returned once the fence opens if the snapshot must block."""
        future = self._persist.submit(_logging_failures, job.run, job.path, job.comm.rank)
        handle = SaveHandle(job.path, job.save_id, job.storage, future, None, job.comm.is_coordinator, self.timeout)
        handle._fence = job.fence
        # Handles whose outcome was seen are dropped: a manager saves every step to a new path.
        self._inflight = {k: h for k, h in self._inflight.items() if not h.reported}
        self._inflight[job.where] = handle
        if blocking:
            job.fence.wait(self.timeout)   # the background job added the stall, up to here, to the timer
        return handle

    # ------------------------------------------------------------------ load
    @gc_paused()   # whole phases make objects by the thousand (engine.staging.gc_paused)
    def load(self, path: str, state: dict, *, options: LoadOptions | None = None, **keywords: Any) -> LoadResult:
        """Every rank. See omnickpt.load; `options` (a LoadOptions) or its fields as keywords (which
        replace the fields of `options`). Three phases (loading.load), each ended by one
        all-gather that settles every rank's outcome (a failure on one rank is raised on all, as
        the same class): plan (match, plan reads, read objects; differences and paths compared),
        read (land and verify every byte: nothing is installed unless every rank's bytes are
        sound), install."""
        self._own_process()
        return loading.load(self, str(path), state, LoadOptions.of(options, keywords))


def _finish_saves_at_exit(ckpt: Checkpointer) -> None:
    """Make interpreter exit wait for `ckpt`'s async saves.

    Registered with threading's exit hooks, which run at interpreter shutdown before the
    concurrent.futures workers are told to stop (a plain atexit hook runs after that, when the
    background job can no longer submit its writes: "cannot schedule new futures after interpreter
    shutdown", and the save was lost with exit status 0). If a save cannot be committed, the error
    goes to stderr and the process exits with status 1. A weak reference: the hook never keeps a
    Checkpointer alive.
    """
    ref = weakref.ref(ckpt)

    def finish() -> None:
        c = ref()
        if c is None:
            return
        failed = False
        for h in c.pending():
            try:
                h.wait()
            except BaseException as e:
                failed = True
                print(f"omnickpt: ERROR: the async save to {h.path} in flight at exit could not be committed: {e}",
                      file=sys.stderr, flush=True)
        if failed:
            sys.stdout.flush()
            os._exit(1)

    at_shutdown(finish)


def at_shutdown(fn: Callable[[], None]) -> None:
    """Run `fn` at interpreter shutdown while background threads can still submit work: threading's
    exit hooks run before concurrent.futures stops its executors; a plain atexit hook runs after
    (used only where CPython's hook does not exist)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
        else:
            import atexit
            atexit.register(fn)
    except RuntimeError:   # already shutting down: nothing can be in flight from this one yet
        pass


# ---------------------------------------------------------------------- module-level API
@functools.lru_cache(maxsize=1)
def default_checkpointer() -> Checkpointer:
    """The Checkpointer behind omnickpt.save/load (created on first use, one per process)."""
    return Checkpointer()


def save(path, state: dict, *, async_save: bool = False, process_group: Any = None, allow_pickle: bool = False,
         durable: bool = True, check_replicas: bool = False, framework: str | None = None,
         fast_saving: bool | None = None, global_steps: int | None = None, callback: Callable[[], None] | None = None,
         role: str | None = None, metadata: dict | None = None, checkpointer: Checkpointer | None = None,
         compression: str | None = None, snapshot: str | None = None, incremental: bool = False,
         base: str | None = None, full_every: int | None = None, block_bytes: int | None = None,
         quantize_optimizer: str | None = None) -> SaveHandle:
    """Save `state` (a dict of modules, optimizers, stateful objects, tensors, plain values) to `path`.

    Every rank of the process group calls it. With async_save=True it returns once the state is
    planned and what training can change at any time is copied to host memory; parameters and
    optimizer state are copied in the background (snapshot="lazy", the default of async saves)
    while every optimizer's step() waits for that copy, so they must not be edited in place
    outside an optimizer step before `handle.fence()` (or save with snapshot="eager", which copies
    everything before returning). SaveHandle.wait() returns once the checkpoint is committed. The
    ByteCheckpoint call shape works too: framework= (checked), fast_saving= (async),
    global_steps=N (saves to PATH/global_step_N and updates PATH/latest), callback= (called with
    no arguments on rank 0 once the checkpoint is committed), role= (recorded in the manifest's
    layout). Any other keyword is a TypeError. check_replicas=True compares every replicated box
    across the ranks that hold it and refuses to save replicas that differ (a forgotten broadcast).
    compression="zstd" or "bytesplit-zstd" compresses each 1 MiB chunk of tensor data in the
    background persist (docs/format.md); loads, verify and the readers decompress transparently.
    incremental=True writes only the blocks (rows, ~64 KiB each) whose content changed since
    `base` (a checkpoint folder next to `path`; default: the checkpoint at `path` itself, which
    is then replaced, else the last checkpoint this process committed next to `path`) and
    references the base's bytes for the others; a full save when there is
    no base with block hashes yet, or every `full_every` saves. `block_bytes` (default 64 KiB) sets
    the block: smaller blocks write fewer bytes where scattered rows change, but cut the checkpoint
    into more boxes (runs of rows), each costing the load a little. Loading is unchanged; retention of
    a CheckpointManager keeps referenced data (CheckpointManager(incremental=True) does all this).
    quantize_optimizer="int8" or "fp8" (lossy, opt-in) stores the moments of every
    torch.optim.Optimizer in `state` quantized, one scale per 256 elements (3.9x smaller in fp32):
    the state keys exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer, square_avg, grad_avg,
    acc_delta, exp_inf and variance (format/quant.py MOMENTS). Everything else stays exact: weights,
    step counts and the optimizer state that does not fade (Adagrad's sum, ASGD's ax / eta / mu,
    NAdam's mu_product, Rprop's prev / step_size). A chunk holding a value the scheme cannot
    represent (nan, inf, float64 beyond float32's range, a non-zero value that would read back as 0
    or a finite one as inf) is stored exactly, raw. The manifest records per quantized tensor the
    scheme and the largest error measured (`omnickpt.open(path).manifest.quantized`); a load's report
    lists them.
    """
    check_framework(state, framework)
    if fast_saving is not None:
        async_save = bool(fast_saving)
    ckpt = checkpointer or default_checkpointer()
    root = str(path)
    if global_steps is not None:
        step = step_number(global_steps)
        path = f"{root.rstrip('/')}/{step_dir(step)}"

    def on_commit(_manifest):
        if global_steps is not None:
            write_latest(storage_for(root), step)
        if callback is not None:
            callback()

    options = SaveOptions(async_save=async_save, process_group=process_group, allow_pickle=allow_pickle,
                          durable=durable, check_replicas=check_replicas, role=role, metadata=metadata,
                          on_commit=on_commit if (global_steps is not None or callback is not None) else None,
                          compression=compression, snapshot=snapshot, incremental=incremental, base=base,
                          full_every=full_every, block_bytes=block_bytes, quantize_optimizer=quantize_optimizer)
    return ckpt.save(path, state, options=options)


def load(path, state: dict, *, strict: bool = True, allow_pickle: bool = False, process_group: Any = None,
         framework: str | None = None, fast_loading: bool | None = None, verify: bool = True,
         dedup_reads: bool = False, transforms: Sequence[Any] = (), cast: bool = False,
         include: Sequence[str] = (), exclude: Sequence[str] = (), role: str | None = None,
         checkpointer: Checkpointer | None = None) -> LoadResult:
    """Load the checkpoint at `path` into `state`, resharding to this process group's layout.

    Modules, optimizers and stateful objects are loaded in place; plain values are written back
    into `state`. strict=False loads what matches and returns the rest in `.differences`.
    `cast=True` converts tensors saved in another dtype (an fp32 checkpoint into a bf16 model)
    instead of reporting the difference. `include=` / `exclude=` glob patterns over state keys and
    tensor names load part of a state (`include=["model"]`: not the optimizer). `fast_loading`
    and `role` are accepted for ByteCheckpoint compatibility (loading is always parallel). Any
    other keyword is a TypeError. Also reads Hugging Face safetensors folders and PyTorch DCP
    checkpoints (docs/interop.md).
    """
    check_framework(state, framework)
    ckpt = checkpointer or default_checkpointer()
    return ckpt.load(path, state, strict=strict, allow_pickle=allow_pickle, process_group=process_group,
                     verify=verify, dedup_reads=dedup_reads, transforms=transforms, cast=cast, include=include,
                     exclude=exclude)


def step_number(step: Any) -> int:
    """A step number: a non-negative integer (numpy integers too), never a bool, float or string."""
    import numbers
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step {step!r} must be an integer, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step {step} must not be negative")
    return int(step)
