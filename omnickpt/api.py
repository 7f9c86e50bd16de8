"""The public API: save(), load() and the Checkpointer that owns thread pools, staging memory and
the plan cache. Module-level save()/load() use one default Checkpointer per process."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable, Sequence

import torch

from omnickpt.version import __version__
from omnickpt import commit
from omnickpt.adapters import check_framework, collect_load, collect_save
from omnickpt.comm import Comm
from omnickpt.engine import RankResult, StagingPool, build_manifest, collect_garbage, persist, read_objects, snapshot
from omnickpt.engine.load import LANDING_BYTES, check_file_sizes, forward_replicas, land_tensors
from omnickpt.engine.incremental import BLOCK_BYTES, Base, WriteMeta
from omnickpt.engine.save import Incremental, data_file_name, stage_layout
from omnickpt.engine.staging import gc_paused
from omnickpt.fence import SnapshotFence, optimizers_in, step_stable_storages
from omnickpt.errors import (CheckpointError, CheckpointTimeoutError, MismatchError, NotCommittedError, PlanError,
                             UnsafeCheckpointError, UnsupportedError, rebuild_error)
from omnickpt.format import DATA_DIR, MANIFEST_NAME, Manifest, checksum, dtype_name, encode_object
from omnickpt.format.codec import check_codec
from omnickpt.format.quant import check_scheme, is_moment, quantizable
from omnickpt.formats import bind_keys, read_manifest  # read_manifest: part of omnickpt's API
from omnickpt.steps import References, step_dir, write_latest
from omnickpt.lease import acquire
from omnickpt.layout import Box
from omnickpt.monitor import PhaseTimer, summarize
from omnickpt.planner import RecordBatch, ShardRecord, build_global_plan, plan_reads, structure_digest, write_items
from omnickpt.planner.load_plan import assign_readers, item_key
from omnickpt.planner.match import LoadMatch, Selection, match_targets
from omnickpt.storage import Storage, storage_for
from omnickpt.storage.linked import LinkedStorage, check_sibling_name, sibling_path, split_reference, with_siblings

REPORT_NAME = "report.json"
log = logging.getLogger("omnickpt")
_PLAN_CACHE_SIZE = 4


def _bind_foreign(manifest: Manifest, state: dict) -> Manifest:
    """A Hugging Face folder holds one module's tensors, read under the key "model"; a DCP folder
    with no state keys of its own (a flat model state dict, Megatron torch_dist) names the keys
    its reader chose in layout["implied_keys"]. Each loads into the state's only module (or
    optimizer) whatever its key."""
    implied = ["model"] if manifest.layout.get("format") == "hf" else manifest.layout.get("implied_keys") or []
    moves = {}
    for key, kind in (("model", torch.nn.Module), ("optimizer", torch.optim.Optimizer)):
        found = [k for k, v in state.items() if isinstance(v, kind)]
        if key in implied and key not in state and len(found) == 1:
            moves[key] = found[0]
    return bind_keys(manifest, moves) if moves else manifest


def is_committed(path: str) -> bool:
    try:
        return storage_for(path).exists(MANIFEST_NAME)
    except CheckpointError:
        return False


@dataclasses.dataclass
class LoadResult:
    """What load() returns: the differences it skipped (strict=False) and the timing report."""
    differences: list[str]
    report: dict


class SaveHandle:
    """A save in progress (or done). wait() returns the report once the checkpoint is committed."""

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
                    report = self._await_commit(limit)
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


class Checkpointer:
    """Owns the I/O threads, the staging pools and the plan cache. Create one per training job (or
    use the module-level save/load), call close() when done."""

    def __init__(self, *, process_group: Any = None, io_workers: int = 4, timeout: float = 600.0,
                 staging_slots: int = 2, landing_bytes: int = LANDING_BYTES, staging_budget: int | None = None,
                 release_staging: bool = False):
        """staging_budget: the most bytes of host memory the staging pool holds (snapshots, the
        packing of sync saves' small tensors, load landing buffers); a rank's state larger than it
        is staged in part and the rest written from the tensors' own memory while the snapshot's
        fence holds (the stall or the held optimizer step grows; the cap holds).
        release_staging: free the staging memory after each save instead of keeping it warm."""
        self._group = process_group
        self._pool = StagingPool(staging_slots, staging_budget)
        self.landing_bytes = landing_bytes if staging_budget is None else min(landing_bytes, self._pool.largest)
        self.release_staging = release_staging
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="omnickpt-io")
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-persist")
        self._copier: ThreadPoolExecutor | None = None   # made by the first lazy snapshot (_snapshot_thread)
        self._fences: list[SnapshotFence] = []   # lazy snapshots whose hooks the training thread has to remove
        self._plans: dict[int, dict[tuple, tuple]] = {}
        self._comms: dict[int, Comm] = {}
        self._inflight: dict[str, SaveHandle] = {}
        # The last checkpoint committed per process group: the default base of an incremental save.
        self._committed: dict[int, str] = {}
        self.timeout = timeout
        # This job's id in the owner records of the paths it saves to (the coordinator's counts).
        self._job = f"omnickpt-{uuid.uuid4().hex[:12]}"
        _finish_saves_at_exit(self)

    def pending(self) -> list[SaveHandle]:
        """Async saves started here whose outcome nobody has seen yet (still running, or finished
        but never waited for)."""
        return [h for h in self._inflight.values() if not h.reported]

    def comm(self, process_group: Any = None) -> Comm:
        group = process_group if process_group is not None else self._group
        key = id(group)
        if key not in self._comms:
            self._comms[key] = Comm(group, timeout=self.timeout)
        return self._comms[key]

    def close(self) -> None:
        """Wait for every async save still in flight, then free the threads and staging memory. A
        save that failed without anyone having waited for it is logged as an error."""
        for h in self.pending():
            try:
                h.wait()
            except CheckpointError as e:
                log.error("omnickpt: async save to %s failed and was never waited for: %s", h.path, e)
        self._await_snapshots()
        self._persist.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._pool.close()

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
    def save(self, path: str, state: dict, *, async_save: bool = False, process_group: Any = None,
             allow_pickle: bool = False, durable: bool = True, check_replicas: bool = False, role: str | None = None,
             metadata: dict | None = None, on_commit: Callable[[Manifest], None] | None = None,
             compression: str | None = None, snapshot: str | None = None, incremental: bool = False,
             base: str | None = None, full_every: int | None = None, block_bytes: int | None = None,
             quantize_optimizer: str | None = None) -> SaveHandle:
        """Every rank. See omnickpt.save. Phases: collect (adapters, records, objects encoded),
        settle (one all-gather: digests, save id, paths, errors), plan (a gather and a scatter
        when the plan is not cached), snapshot (the stall ends here; a lazy one leaves the copy
        of parameters and optimizer state to a background thread, behind a SnapshotFence), then
        persist and commit (a gather and a broadcast for a sync save; through storage for an
        async one). Waits first for any lazy snapshot of an earlier save here."""
        t_start = time.perf_counter()
        check_codec(compression)
        if snapshot not in (None, "lazy", "eager"):
            raise ValueError(f"snapshot={snapshot!r}: expected 'lazy' (the default of async saves) or 'eager'")
        lazy = async_save and snapshot != "eager"
        _check_incremental(incremental, base, full_every, compression, block_bytes)
        check_scheme(quantize_optimizer)
        if quantize_optimizer is not None and incremental:
            raise UnsupportedError(f"incremental=True with quantize_optimizer={quantize_optimizer!r}: an incremental "
                                   "save writes raw blocks; use one or the other")
        self._await_snapshots()
        path = str(path)
        comm = self.comm(process_group)
        storage = storage_for(path)
        timer = PhaseTimer()
        _reset_peak_rss(timer)

        def on_commit(manifest, _then=on_commit, _group=id(comm)):   # coordinator, after the commit
            self._committed[_group] = path
            if held is not None:
                # Committed: the manifest now names what this save references, so the records that
                # protected it go before the caller's retention runs (which would keep their folders whole).
                held.release()
            if _then is not None:
                _then(manifest)
        prev = self._inflight.get(storage.describe())
        if prev is not None and not prev.done():
            raise CheckpointError(f"a save to {path} is still in progress; wait() for it before saving there again")

        # held: the reference records of an incremental save on the folders it may reference (coordinator)
        collected, error, chain, held = _Collected(), None, None, None
        try:
            collected = _collect(state, comm, timer, allow_pickle, check_replicas, role, metadata)
            if incremental and comm.is_coordinator:
                with timer.phase("plan"):
                    chain, held = _chain_base(path, base, full_every, block_bytes or BLOCK_BYTES,
                                              self._committed.get(id(comm)), holder=self._job)
        except Exception as e:  # every rank must learn of it, or the others hang in the exchange
            error = e
        with timer.phase("exchange"):   # also absorbs any lag between the ranks arriving here
            gathered = comm.settle(f"save to {path}, step plan", error,
                                   (collected.digest, uuid.uuid4().hex[:16], storage.describe(), collected.replicas,
                                    collected.batch.table_digest if collected.batch is not None else None, chain))
        if check_replicas:
            _check_replicas([g[3] for g in gathered], path)
        # Each rank would write its file where it was told and the manifest would name files that
        # are not there: refuse before writing anything.
        _same_path([g[2] for g in gathered], "save")
        save_id = gathered[0][1]
        with timer.phase("plan"):
            writes, tensor_region, plan = self._global_plan(comm, tuple(g[0] for g in gathered), collected.batch,
                                                            path, tables=[g[4] for g in gathered])
        stable = step_stable_storages(state) if lazy else frozenset()
        snap, blocking = self._snapshot(collected, writes, tensor_region, timer, async_save, stable)
        fence = None
        if snap.deferred is not None or snap.references:
            # Lazy: every optimizer's step waits for the copy. Over the staging budget, the tensors
            # written from their own memory stay fenced until written (save() itself waits when
            # training could change them otherwise than by a step).
            fence = SnapshotFence(optimizers_in(state) if lazy else [], f"save to {path}")
            snap.release, snap.blocking = fence.release, blocking
            self._fences.append(fence)
            if snap.deferred is not None:
                self._snapshot_thread().submit(snap.finish, timer)
        if not snap.blocking:
            timer.add("stall", time.perf_counter() - t_start)

        # Only a save that encodes its chunks needs each write's tensor (not on every save's way out).
        shards = [collected.shards[w.index] for w in writes] if compression or quantize_optimizer else []
        codecs = _quantized_writes(state, shards, quantize_optimizer)
        job = functools.partial(self._persist_and_commit, storage, snap, comm, plan, save_id, collected.layout,
                                durable, timer, t_start, on_commit, async_save,
                                compression=compression or ("none" if quantize_optimizer else None),
                                itemsizes=[s.local.element_size() for s in shards],
                                codecs=codecs, dtypes=[dtype_name(s.dtype) for s in shards] if codecs else (),
                                incremental=_incremental_job(gathered[0][5], collected, writes, path) if incremental
                                else None)
        if held is not None:
            job = _releasing(job, held)   # a failed save gives its reference records back too
        if not async_save:
            report = job()
            return SaveHandle(path, save_id, storage, None, report, comm.is_coordinator, self.timeout)
        future = self._persist.submit(_logging_failures, job, path, comm.rank)
        handle = SaveHandle(path, save_id, storage, future, None, comm.is_coordinator, self.timeout)
        handle._fence = fence
        # Handles whose outcome was seen are dropped: a manager saves every step to a new path.
        self._inflight = {k: h for k, h in self._inflight.items() if not h.reported}
        self._inflight[storage.describe()] = handle
        if snap.blocking:
            fence.wait(self.timeout)   # the background job added the stall, up to here, to the timer
        return handle

    def _global_plan(self, comm: Comm, digests: tuple, batch: RecordBatch, path: str, tables=None) -> tuple:
        """Every rank: (this rank's writes, the size of its file's tensor region, the global plan
        (coordinator only)). A cached plan costs no collective; otherwise the coordinator plans
        from every rank's records (a gather) and hands each rank its part (a scatter).

        One LRU per process group: every member makes the same saves on it in the same order, so
        all members hold the same entries and hit or miss together (saves on other groups must not
        evict entries here)."""
        plans = self._plans.setdefault(id(comm), {})
        cached = plans.get(digests)
        if cached is not None:
            plans[digests] = plans.pop(digests)   # most recently used last
            return cached
        # Records travel as arrays. With every rank's table digest (RecordBatch.table_digest, from
        # an all-gather already made), a rank whose tensor table (names, shapes, dtypes) a lower
        # rank also holds leaves it out: the coordinator receives each table once (FSDP: one in all).
        if tables is not None and list(tables).index(batch.table_digest) != comm.rank:
            batch = batch.without_table()
        all_batches = comm.gather_object(batch, step=f"save to {path}, step plan")
        parts, plan = None, None
        if comm.is_coordinator:
            try:
                plan = build_global_plan(all_batches)
                parts = [(plan.write_arrays(r), plan.tensor_bytes[r], None) for r in range(comm.world_size)]
            except CheckpointError as e:
                parts = [(None, 0, (type(e).__name__, str(e)))] * comm.world_size
        arrays, tensor_region, err = comm.scatter_object(parts, step=f"save to {path}, step plan")
        if err is not None:
            raise rebuild_error(err[0], f"planning the save to {path} failed: {err[1]}")
        writes = write_items(*arrays)
        if len(plans) >= _PLAN_CACHE_SIZE:   # a few structures stay cached (e.g. model-only and full saves)
            plans.pop(next(iter(plans)))
        plans[digests] = (writes, tensor_region, plan)
        return writes, tensor_region, plan

    @gc_paused()
    def _snapshot(self, collected: "_Collected", writes, tensor_region: int, timer: PhaseTimer, async_save: bool,
                  stable: set[int] | frozenset = frozenset()):
        """Every rank, no collective: the part of the save training waits for. Async: copy into a
        staging buffer (pinned when the source is on a GPU), the writes of `stable` storages later
        (lazy: Snapshot.deferred), at most the staging budget (the rest is written from the tensors'
        own memory); sync: reference the tensors, small ones packed into a pool buffer (given back
        after persisting). Returns (snapshot, whether save() must wait for the fence: a tensor
        training may change at any time is written from its own memory)."""
        staging, layout = None, None
        on_gpu = torch.cuda.is_available() and any(s.local.is_cuda for s in collected.shards)
        if async_save:
            with timer.phase("snapshot"):
                layout = stage_layout(collected.shards, writes, tensor_region, collected.blobs, stable=stable,
                                      room=self._pool.largest)
            staging = self._pool.acquire(layout.size, pin=on_gpu)
        room = self._pool.largest

        def pack(nbytes: int) -> torch.Tensor:   # past the budget: memory of its own, freed with the save
            fits = room is None or nbytes <= room
            return self._pool.acquire(nbytes) if fits else torch.empty(max(nbytes, 1), dtype=torch.uint8)
        try:
            # A sync save packs its small tensors into a pool buffer (warm pages, given back after persisting).
            snap = snapshot(collected.shards, writes, tensor_region, collected.blobs, staging, timer, cuda=on_gpu,
                            pack=None if async_save else pack, layout=layout)
            return snap, layout is not None and layout.blocking
        except BaseException:
            if staging is not None:
                self._pool.release(staging)
            raise

    def _persist_and_commit(self, storage, snap, comm, plan, save_id, layout, durable, timer, t_start,
                            on_commit, background, compression=None, itemsizes=(), incremental=None, codecs=(),
                            dtypes=()):
        """Every rank, after the snapshot (in the background for an async save). The coordinator
        holds the checkpoint path's lease from before any byte is written until after the commit
        and garbage collection, so that a second live job writing the same path is refused instead
        of deleting this job's files (the lease is taken here, not on the stall path)."""
        lease, locked = None, None
        if comm.is_coordinator:
            try:
                lease = acquire(storage, self._job, what="checkpoint")
            except CheckpointError as e:
                locked = e
        try:
            return self._persist_and_commit_owned(storage, snap, comm, plan, save_id, layout, durable, timer,
                                                  t_start, on_commit, background, lease, locked, compression,
                                                  itemsizes, incremental, codecs, dtypes)
        finally:
            if lease is not None:
                lease.release()

    def _persist_and_commit_owned(self, storage, snap, comm, plan, save_id, layout, durable, timer, t_start,
                                  on_commit, background, lease, locked, compression=None, itemsizes=(),
                                  incremental=None, codecs=(), dtypes=()):
        """`incremental`: (this rank's engine.save.Incremental, the manifest's incremental header)."""
        header = None
        try:
            if locked is not None:
                raise locked
            snap.finish(timer)   # a lazy snapshot's copies (made on the copier thread: waited for here)
            rank_inc = None
            if incremental is not None:
                rank_inc, header = incremental() if callable(incremental) else incremental
            result = persist(storage, snap, comm.rank, save_id, self._io, durable=durable, timer=timer,
                             compression=compression, itemsizes=itemsizes, incremental=rank_inc, codecs=codecs,
                             dtypes=dtypes)
        except Exception as e:
            result = RankResult(comm.rank, None, 0, [], error=f"rank {comm.rank}: {type(e).__name__}: {e}",
                                error_class=type(e).__name__)
            _discard_own_file(storage, save_id, comm.rank)   # the space comes back now
        finally:
            if snap.staging is not None:
                self._pool.release(snap.staging, keep=not self.release_staging)
            _count_peak_rss(timer)
            if snap.blocking:   # save() returns when the fence opens, just below
                timer.add("stall", time.perf_counter() - t_start)
            timings = timer.as_dict()
            snap.settle()   # after the timings: a blocked save() goes on and the training thread uses the timer
        result.timings = timings
        if background:
            # Background commits talk through storage, not collectives: a collective from this
            # thread could interleave with the training loop's own collectives.
            try:
                commit.post_record(storage, save_id, comm.rank, dataclasses.asdict(result))
            except Exception as e:
                # Report the first failure (the data write), not the record that could not follow it.
                _discard_own_file(storage, save_id, comm.rank)
                if result.error:
                    raise rebuild_error(result.error_class, result.error) from e
                raise CheckpointError(f"rank {comm.rank}: could not report to the coordinator: {e}") from e
            if not comm.is_coordinator:
                if result.error:
                    raise rebuild_error(result.error_class, result.error)
                return None
            results = self._await_results(storage, save_id, comm.world_size)
            outcome, report = self._commit(storage, plan, results, save_id, layout, t_start, on_commit, lease,
                                           header)
            if outcome is not None:
                raise rebuild_error(*outcome)
            return report
        results = comm.gather_object(result, step=f"save to {storage.describe()}, step commit")
        outcome, report = (None, None)
        if comm.is_coordinator:
            outcome, report = self._commit(storage, plan, results, save_id, layout, t_start, on_commit, lease,
                                           header)
        outcome, report = comm.broadcast_object((outcome, report), step=f"save to {storage.describe()}, step commit")
        if outcome is not None:
            _discard_own_file(storage, save_id, comm.rank)   # node-local storage: the coordinator cannot
            raise rebuild_error(*outcome)
        return report

    def _await_results(self, storage, save_id, world_size) -> list[RankResult]:
        """Coordinator of an async save: every rank's record (commit.await_records). A failure
        record, or ranks missing at the timeout, fail the save at once: its files go (ranks still
        writing leave theirs to the next save's garbage collection) and the error is raised."""
        try:
            records = commit.await_records(storage, save_id, world_size, self.timeout, f"save to {storage.describe()}")
        except CheckpointError as e:   # the status is set already
            self._fail(storage, save_id, type(e).__name__, str(e), status=False)
            raise
        return [RankResult(**d) for d in records]

    def _commit(self, storage, plan, results, save_id, layout, t_start, on_commit, lease=None, incremental=None):
        """Coordinator only. Returns (None or (error class name, message), report). A failed save's
        data files are removed (the previous checkpoint's are never touched: their names carry
        another save id); a committed one is never removed, even if a step after it failed."""
        failed = [r for r in results if r.error]
        if failed:
            msg = "; ".join(r.error for r in failed) + " (nothing was committed; the previous checkpoint is untouched)"
            return self._fail(storage, save_id, failed[0].error_class, msg), None
        lost = lease.lost() if lease is not None else None
        if lost:
            return self._fail(storage, save_id, "CheckpointLockedError",
                              f"{lost}; this save was not committed (the previous checkpoint is untouched)"), None
        committed = False
        try:
            t0 = time.perf_counter()
            manifest = build_manifest(plan, results, save_id=save_id, layout=layout, tool_version=__version__,
                                      incremental=incremental)
            storage.commit(MANIFEST_NAME, manifest.encode())
            committed = True
            commit_seconds = time.perf_counter() - t0
            results[0].timings["seconds"]["commit"] = commit_seconds
            rank0 = results[0].timings
            if "t0" in rank0:   # the commit on rank 0's timeline (its timer is not at hand here)
                rank0.setdefault("events", []).append(["commit", time.time() - rank0["t0"] - commit_seconds,
                                                       commit_seconds])
            report = summarize("save", [r.timings for r in results], total_seconds=time.perf_counter() - t_start)
            report["path"] = storage.describe()
            report["save_id"] = save_id
            peaks = [r.timings.get("bytes", {}).get("peak_rss") for r in results]
            if all(p is not None for p in peaks):
                report["peak_rss_mb"] = [p / 2**20 for p in peaks]
            if incremental is not None:
                report["incremental"] = {
                    "base": incremental["base"], "chain": incremental["chain"],
                    "written_bytes": sum(r.bytes for r in results),
                    "referenced_bytes": sum(r.timings.get("bytes", {}).get("referenced", 0) for r in results)}
            _put_json(storage, REPORT_NAME, report)
            commit.set_status(storage, save_id)
            collect_garbage(storage, manifest)
            if on_commit is not None:
                on_commit(manifest)
            return None, report
        except Exception as e:
            if committed:
                msg = (f"the checkpoint was committed, but rank 0 failed after the commit: {type(e).__name__}: {e}")
                commit.set_status(storage, save_id, (type(e).__name__, msg))
                return (type(e).__name__, msg), None
            msg = (f"commit by rank 0 failed: {type(e).__name__}: {e} (nothing was committed; the previous checkpoint "
                   "is untouched)")
            return self._fail(storage, save_id, type(e).__name__, msg), None

    @staticmethod
    def _fail(storage: Storage, save_id: str, error_class: str, msg: str, status: bool = True) -> tuple[str, str]:
        """Coordinator: mark the save failed and remove its data files (all ranks' where the storage
        is shared), so that a full disk gets its space back and the next save can succeed."""
        if status:
            commit.set_status(storage, save_id, (error_class, msg))
        try:
            for rel in storage.list(DATA_DIR):
                if rel.rsplit("/", 1)[-1].startswith(f"{save_id}-"):
                    storage.delete(rel)
        except Exception as e:   # the storage may be what failed; the save's own error matters more
            log.warning("omnickpt: could not remove the files of the failed save in %s: %s", storage.describe(), e)
        return error_class, msg

    # ------------------------------------------------------------------ load
    @gc_paused()   # whole phases make objects by the thousand (engine.staging.gc_paused)
    def load(self, path: str, state: dict, *, strict: bool = True, allow_pickle: bool = False,
             process_group: Any = None, verify: bool = True, dedup_reads: bool = False,
             transforms: Sequence[Any] = (), cast: bool = False, include: Sequence[str] = (),
             exclude: Sequence[str] = ()) -> LoadResult:
        """Every rank. See omnickpt.load. Three phases, each ended by one all-gather that settles
        every rank's outcome (a failure on one rank is raised on all, as the same class): plan
        (match, plan reads, read objects; differences and paths compared), read (land and verify
        every byte: nothing is installed unless every rank's bytes are sound), install."""
        t_start = time.perf_counter()
        self._await_snapshots()   # a lazy snapshot still copying would copy the loaded values
        path = str(path)
        comm = self.comm(process_group)
        job = _LoadJob(path, storage_for(path), state, PhaseTimer())
        job.raw_manifest = _shared_manifest(job, comm)
        error = None
        try:
            with job.timer.phase("plan"):
                self._plan_load(job, comm, transforms, Selection(include, exclude), cast, strict)
            if not (strict and job.differences):
                self._check_objects(job, comm, allow_pickle, strict)
        except Exception as e:
            error = e
        dedup = dedup_reads and comm.world_size > 1
        wants = [(item_key(it), it.nbytes) for it in job.items] if dedup and error is None else []
        where = _where(job)
        gathered = comm.settle(f"load from {path}, step plan", error,
                               (sorted(job.unexpected), sorted(set(job.differences))[:20], wants, where))
        _same_path([g[3] for g in gathered], "load")
        differences = _agree_on_differences(job, gathered, strict)

        forward, mine, landing = None, list(range(len(job.items))), None
        try:
            if dedup:
                with job.timer.phase("plan"):
                    forward = assign_readers([g[2] for g in gathered])
                    readers = {key: reader for key, reader, _ in forward}
                    mine = [i for i, it in enumerate(job.items) if readers.get(item_key(it), comm.rank) == comm.rank]
            landing = land_tensors(job.storage, job.manifest, [job.items[i] for i in mine], job.boxes,
                                   job.match.dests, self._io, verify=verify, timer=job.timer,
                                   budget=self.landing_bytes, pool=self._pool)
        except Exception as e:
            error = e
        # Every rank learns whether every rank read sound bytes before anything is installed (and
        # a reader that failed never leaves its peers waiting for forwarded bytes).
        try:
            comm.settle(f"load from {path}, step read", error)
        except BaseException:
            if landing is not None:
                landing.discard()
            raise

        try:
            self._install(job, comm, landing, forward, mine)
        except Exception as e:
            error = e
        timings = comm.settle(f"load from {path}, step install", error, job.timer.as_dict())
        report = summarize("load", timings, total_seconds=time.perf_counter() - t_start)
        report["path"] = job.storage.describe()
        if job.manifest is not None and job.manifest.quantized:
            # Lossy: the loaded values of these tensors differ from the saved ones by up to max_error.
            loaded = {it.name for it in job.items}
            report["quantized"] = {n: q for n, q in job.manifest.quantized.items() if n in loaded}
        return LoadResult(differences, report)

    @staticmethod
    @gc_paused()
    def _plan_load(job: "_LoadJob", comm: Comm, transforms: Sequence[Any], select: Selection, cast: bool,
                   strict: bool) -> None:
        """Every rank, no collective: read the manifest, prepare and match the targets, plan the
        reads and check that the files hold the bytes planned."""
        manifest = _bind_foreign(read_manifest(job.storage, job.raw_manifest), job.state)
        # An incremental checkpoint's unchanged blocks lie in files of checkpoints next to it.
        job.storage = with_siblings(job.storage, job.path, manifest.files)
        for transform in transforms:   # rewrite the manifest into the target's naming and fusing (pure)
            manifest = transform.apply(manifest)
        job.manifest = manifest
        job.targets = [(k, t) for k, t in collect_load(job.state) if select.entry(k)]
        for _, t in job.targets:
            if t.prepare is not None:
                job.differences += t.prepare(manifest) or []
        job.match = match_targets(manifest, job.targets, select, cast=cast)
        job.differences += job.match.differences
        job.unexpected = job.match.unexpected
        if strict and job.differences:
            return   # the load fails at the exchange, listing them: plan nothing
        job.items = plan_reads(manifest, job.match.wanted)
        # Sizes first: a truncated file fails the load before anything is read.
        check_file_sizes(job.storage, manifest, job.items,
                         [(k, manifest.object_for_rank(k, comm.rank)) for k in job.match.object_keys]
                         + [(k, e) for k in job.match.all_rank_keys for e in manifest.objects[k]])

    @staticmethod
    def _check_objects(job: "_LoadJob", comm: Comm, allow_pickle: bool, strict: bool) -> None:
        """Every rank, no collective. Objects are small: read and checked before the exchange, so
        that one that is corrupt, needs pickle or does not fit its target fails the load on every
        rank before any tensor is read."""
        job.objects = read_objects(job.storage, job.manifest, job.match.object_keys, comm.rank,
                                   allow_pickle=allow_pickle, timer=job.timer, all_ranks=job.match.all_rank_keys)
        found = [d for _, t in job.targets if t.check is not None for d in t.check(job.objects)]
        job.differences += found
        if strict and found:
            job.items = []

    @staticmethod
    @gc_paused()
    def _install(job: "_LoadJob", comm: Comm, landing, forward, mine: list[int]) -> None:
        """Every rank: copy the verified bytes into the targets, forward replicas (point-to-point
        with the ranks that wanted the same bytes), convert cast tensors, let each target finish
        (load_state_dict, plain values written back)."""
        filled = landing.install(compacts=forward is not None)
        if forward is not None:
            forward_replicas(job.items, dict(zip(mine, filled)), forward, job.boxes, job.match.dests, comm.rank,
                             comm.group, job.timer)
        with torch.no_grad():
            for target, landed in job.match.casts:
                target.detach().copy_(landed)
        with job.timer.phase("install"):
            for _, t in job.targets:
                t.finish(job.objects)


def _shared_manifest(job: "_LoadJob", comm: Comm) -> bytes | None:
    """Every rank (one broadcast with several ranks): the manifest's bytes, read from storage by
    the coordinator alone, so that a restart of N ranks reads it once, not N times (8192 ranks each
    reading a 200 MB manifest from one store is 1.6 TB). None where the coordinator could not read
    ours (a foreign format, nothing committed, a storage error): every rank then reads for itself
    in the plan phase and meets the error there, where it is settled."""
    raw = None
    if comm.is_coordinator:
        try:
            raw = job.storage.read_bytes(MANIFEST_NAME)
            job.timer.count("metadata", len(raw))
        except Exception:
            raw = None
    if comm.world_size == 1:
        return raw
    where, raw = comm.broadcast_object((_where(job), raw), step=f"load from {job.path}, step metadata")
    # A rank given another path reads its own (the plan phase then refuses the differing paths).
    return raw if where == _where(job) else None


def _where(job: "_LoadJob") -> str:
    """The checkpoint a load reads, comparable across ranks: shm:// is per machine, so the same URL
    is the same checkpoint whatever $OMNICKPT_SHM_DIR is."""
    return job.path if job.path.startswith("shm://") else job.storage.describe()


@dataclasses.dataclass
class _LoadJob:
    """One load on one rank, as its phases fill it in."""
    path: str
    storage: Storage
    state: dict
    timer: PhaseTimer
    manifest: Manifest | None = None
    targets: list = dataclasses.field(default_factory=list)
    match: LoadMatch = dataclasses.field(default_factory=LoadMatch)
    items: list = dataclasses.field(default_factory=list)
    objects: dict = dataclasses.field(default_factory=dict)
    differences: list[str] = dataclasses.field(default_factory=list)
    unexpected: set[str] = dataclasses.field(default_factory=set)
    raw_manifest: bytes | None = None    # read by the coordinator, shared with every rank

    @property
    def boxes(self) -> list[Box]:
        return [b for _, b in self.match.wanted]


def _agree_on_differences(job: _LoadJob, gathered: list, strict: bool) -> list[str]:
    """Every rank, from the plan exchange: the differences of the whole job. A checkpoint tensor is
    unexpected only if no rank wants it (pipeline stages each hold different modules). With
    strict=True any difference on any rank fails the load on every rank, listing them."""
    unwanted = set.intersection(*(set(g[0]) for g in gathered))
    differences = sorted(set(job.differences) | {f"{n}: in the checkpoint but not in the target state"
                                                  for n in unwanted})
    if strict and differences:
        raise MismatchError(
            f"checkpoint {job.path} does not match the state to load ({len(differences)} difference(s); pass "
            "strict=False to load what matches):\n  " + "\n  ".join(differences), differences)
    if strict and any(g[1] for g in gathered):
        theirs = [f"rank {r}: {d}" for r, g in enumerate(gathered) for d in g[1]]
        raise MismatchError(f"checkpoint {job.path} does not match the state to load on other ranks; pass "
                            "strict=False to load what matches:\n  " + "\n  ".join(theirs), theirs)
    return differences


@dataclasses.dataclass
class _Collected:
    """A rank's state as the save sees it: shards, their records and digest, encoded objects, the
    layout recorded in the manifest, and (check_replicas) every box's checksum."""
    shards: list = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)
    digest: str = ""
    blobs: dict = dataclasses.field(default_factory=dict)
    layout: dict = dataclasses.field(default_factory=dict)
    replicas: list = dataclasses.field(default_factory=list)
    batch: Any = None             # the records as arrays (planner.RecordBatch), sent to the coordinator


def _check_incremental(incremental: bool, base: str | None, full_every: int | None, compression: str | None,
                       block_bytes: int | None = None) -> None:
    if not incremental and (base is not None or full_every is not None or block_bytes is not None):
        raise ValueError("base=, full_every= and block_bytes= are options of incremental saves: pass incremental=True")
    if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
                                    or block_bytes < 1):
        raise ValueError(f"block_bytes={block_bytes!r}: must be a positive int (bytes of rows per hashed block)")
    if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1):
        raise ValueError(f"full_every={full_every!r}: must be a positive int (a full save every that many saves)")
    if incremental and compression is not None:
        raise UnsupportedError(f"incremental=True with compression={compression!r}: an incremental save writes "
                               "raw blocks; use one or the other")


def _quantized_writes(state: dict, shards: list, scheme: str | None) -> list[str | None]:
    """Per write: the quantization scheme of its chunks or None. Only the moments of the state's
    optimizers (format/quant.py MOMENTS: exp_avg, exp_avg_sq, momentum buffers, ...), never their step
    counts, any weight, nor optimizer state that stands for weights or never fades (ASGD's ax,
    Rprop's step sizes, Adagrad's sum, NAdam's mu_product): the docs promise moments only."""
    if scheme is None:
        return []
    keys = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    out = [scheme if any(is_moment(s.name, k) for k in keys) and quantizable(dtype_name(s.dtype))
           and s.local.numel() > 0 else None for s in shards]
    if keys and not any(out):
        log.info("omnickpt: quantize_optimizer=%r: the optimizers hold no moments to quantize", scheme)
    return out


def _next_to(path: str, other: str) -> str | None:
    """The folder name of checkpoint `other` if it lies next to `path` (the storage layer's
    sibling_path of its name is the same location), "" if it is `path` itself, else None."""
    where = storage_for(other).describe()
    if where == storage_for(path).describe():
        return ""
    name = str(other).rstrip("/").rpartition("/")[2]
    try:
        return name if storage_for(sibling_path(path, name)).describe() == where else None
    except ValueError:   # no parent folder to go up from, or not a folder name
        return None


def _chain_base(path: str, base: str | None, full_every: int | None, block_bytes: int = BLOCK_BYTES,
                previous: str | None = None, holder: str = "omnickpt"
                ) -> tuple[tuple[bytes | None, str | None, int, int], References | None]:
    """Coordinator of an incremental save: ((the base's manifest, the base's folder name (None: the
    checkpoint at `path` itself), this save's place in the chain: 0 for a full save, the block
    size), the reference records it holds or None). Without `base`: the checkpoint at `path` if
    there is one, else `previous` (the last one this Checkpointer committed) if it lies next to
    `path`. A full save when there is no base yet, the base holds no block hashes (an ordinary
    save) or hashes of another block size, or the chain has reached full_every; a base given but
    absent, damaged, hidden or not next to `path` is an error (nothing is written).

    Before the base's manifest is read, a reference record (steps.References, of job `holder`) goes
    into the base's folder, then into every folder next to it whose files the manifest names, so
    that no save, garbage collection or retention removes what this save is about to reference
    (given back once it ends; each rank then checks the files it references: Base.drop_unreadable)."""
    full = (None, None, 0, block_bytes)
    if base is None and previous is not None and not storage_for(path).exists(MANIFEST_NAME):
        found = _next_to(path, previous)
        if found and _base_name(found) and storage_for(previous).exists(MANIFEST_NAME):
            base = previous
    where = path if base is None else str(base)
    name = None
    if base is not None:
        found = _next_to(path, where)
        if found is None:
            raise ValueError(f"base={base!r}: an incremental checkpoint references data of a checkpoint folder next "
                             f"to it; {path} and {base} are not in the same folder")
        if found and not _base_name(found):
            raise UnsafeCheckpointError(
                f"base={base!r}: {storage_for(where).describe()} is not a folder a checkpoint may reference (a hidden "
                f"folder, or a name with ':' or '\\'); the base of an incremental save must be a committed omnickpt "
                f"checkpoint folder next to {path}")
        name = found or None   # "": the checkpoint this save replaces
    store = storage_for(where)
    if not store.exists(MANIFEST_NAME):
        if base is not None and name is not None:
            raise NotCommittedError(f"base={base!r}: no checkpoint there ({store.describe(MANIFEST_NAME)} is missing); "
                                    f"the base of an incremental save must be a committed checkpoint folder next to "
                                    f"{path}")
        return full, None
    held = References(holder, f"incremental save to {path}")
    try:
        if name is not None and not _hold(held, store, path):
            return full, None
        try:
            data = store.read_bytes(MANIFEST_NAME)   # after the record (the protocol of omnickpt/steps.py)
        except FileNotFoundError:   # retired since: no base after all
            if base is not None and name is not None:
                raise NotCommittedError(f"base={base!r}: its checkpoint was removed as this save started "
                                        f"({store.describe(MANIFEST_NAME)} is gone)") from None
            held.release()
            return full, None
        try:
            head = Manifest.decode(data, store.describe(MANIFEST_NAME), names=set())
            folders = _base_folders(head, name)
        except CheckpointError as e:
            if base is not None and name is not None:
                raise
            # The checkpoint this save replaces is damaged: nothing of it can be trusted, so all is written.
            log.warning("omnickpt: incremental save over %s: its manifest cannot be used (%s); saving in full", path, e)
            held.release()
            return full, None
        if (head.block_bytes != block_bytes or head.compression
                or (full_every is not None and head.chain + 1 >= full_every)):
            held.release()
            return full, None
        for other in sorted(folders - {name, _folder_name(path)}):
            if not _hold(held, storage_for(sibling_path(path, other)), path):
                return full, None
        return (data, name, head.chain + 1, block_bytes), held
    except BaseException:
        held.release()
        raise


def _hold(held: References, storage: Storage, path: str) -> bool:
    """Put a reference record of the save to `path` into the folder of `storage`; if that fails (a
    read-only or vanished folder), give back every record held and say False: data that nothing
    protects is not referenced, the save writes it in full (and still succeeds)."""
    try:
        held.hold(storage)
        return True
    except (CheckpointError, OSError) as e:
        log.warning("omnickpt: incremental save to %s: cannot record in %s that it references data there (%s: %s); "
                    "saving in full", path, storage.describe(), type(e).__name__, e)
        held.release()
        return False


def _folder_name(path: str) -> str:
    return str(path).rstrip("/").rpartition("/")[2]


def _base_name(name: str) -> bool:
    """Whether a reference may name the folder `name` (storage.linked.check_sibling_name: not hidden)."""
    try:
        check_sibling_name(name, name)
        return True
    except UnsafeCheckpointError:
        return False


def _base_folders(head: Manifest, name: str | None) -> set[str]:
    """The folders next to the new checkpoint whose data files a base's manifest (untrusted) names,
    as the new checkpoint will reference them; UnsafeCheckpointError for a file a reference may not
    name (storage.linked.split_reference: not a data file, a hidden folder)."""
    folders = set()
    for f in head.files:
        rel = f.path if name is None or f.path.startswith("../") else f"../{name}/{f.path}"
        found = split_reference(rel)
        if found is not None:
            folders.add(found[0])
    return folders


def _releasing(job: Callable[[], Any], held: References) -> Callable[[], Any]:
    """`job`, then the reference records `held` given back, whatever its outcome."""
    def run():
        try:
            return job()
        finally:
            held.release()
    return run


def _incremental_job(chain: tuple, collected: "_Collected", writes, path: str) -> Callable[[], tuple]:
    """This rank's part of an incremental save, made in the background persist (the base's
    manifest is decoded there, for the tensors this rank writes only, not on the stall path)."""
    data, name, depth, block_bytes = chain

    def make() -> tuple:
        metas = [WriteMeta(s.name, tuple(s.shape), dtype_name(s.dtype), tuple(s.box.offsets), tuple(s.box.lengths),
                           s.dtype.itemsize) for s in (collected.shards[w.index] for w in writes)]
        base = None
        if data is not None:
            manifest = Manifest.decode(data, f"base {name or 'checkpoint'} manifest", names={m.name for m in metas})
            # Reads the sizes of the base files this rank references (through the folders next to `path`).
            base = Base(manifest, name, LinkedStorage(storage_for(path), path), own=_folder_name(path))
        return (Incremental(metas, base, block_bytes),
                {"block_bytes": block_bytes, "base": name if data is not None else None, "chain": depth})
    return make


@gc_paused()   # adapters make records by the thousand: see engine.staging.gc_paused
def _collect(state: dict, comm: Comm, timer: PhaseTimer, allow_pickle: bool, check_replicas: bool,
             role: str | None, metadata: dict | None) -> _Collected:
    """Every rank, no collective: adapters turn the state into shards and objects (no copies)."""
    out = _Collected()
    with timer.phase("plan"):
        collected = collect_save(state)
        # Empty local boxes (uneven shards) plan nothing; a tensor with no elements at all keeps
        # its one empty box, so that the manifest records it and a strict load finds it.
        out.shards = [s for _, items in collected for s in items.shards if s.box.numel or math.prod(s.shape) == 0]
        kinds = {d: (dtype_name(d), d.itemsize) for d in {s.dtype for s in out.shards}}   # per dtype, not per shard
        out.records = [ShardRecord(s.name, s.shape, *kinds[s.dtype], s.box) for s in out.shards]
        out.digest = structure_digest(out.records)
        out.batch = RecordBatch.from_records(out.records)
        out.layout = {"world_size": comm.world_size,
                      "frameworks": {k: it.framework for k, it in collected if it.framework}}
        meshes = {k: it.layout for k, it in collected if it.layout}
        if meshes:
            out.layout["meshes"] = meshes
        if role is not None:
            out.layout["role"] = str(role)
        if metadata is not None:
            out.layout["metadata"] = _json_metadata(metadata)
        out.replicas = _replica_sums(out.shards) if check_replicas else []
    with timer.phase("serialize"):
        out.blobs = {k: encode_object(v, allow_pickle=allow_pickle, where=k)
                     for _, items in collected for k, v in items.objects.items()}
    return out


def _json_metadata(metadata: Any) -> dict:
    """save(metadata=...): a dict stored as JSON in the manifest (read by `inspect`,
    `omnickpt.open(...).layout` and `convert --to hf`, e.g. {"config": model.config.to_dict()}).
    What JSON changes comes back changed, as from any JSON file: integer keys become strings (a
    config's id2label), tuples lists. Values JSON cannot hold (tensors, NaN) are refused."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UnsupportedError(f"metadata cannot be stored as JSON ({e}); convert its values to dicts, lists, "
                               "strings, numbers, booleans and None") from None


def _logging_failures(job: Callable[[], Any], path: str, rank: int) -> Any:
    """Run an async save's background job; a failure is logged when it happens (and raised again
    to whoever waits for the save), not only recorded in the checkpoint's control files."""
    try:
        return job()
    except BaseException as e:
        log.error("omnickpt: async save to %s failed (seen on rank %d): %s", path, rank, e)
        raise


def _replica_sums(shards: Sequence[Any]) -> list[tuple[str, tuple, tuple, int]]:
    """(tensor, box offsets, box lengths, CRC32C of the box's values) of every box this rank holds."""
    out = []
    for s in shards:
        t = s.local.detach()
        t = t.cpu().contiguous() if t.is_cuda or not t.is_contiguous() else t
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        out.append((s.name, s.box.offsets, s.box.lengths, checksum(data)))
    return out


def _check_replicas(per_rank: Sequence[Sequence[tuple[str, tuple, tuple, int]]], path: str) -> None:
    """Refuse a save whose replicas differ: the checkpoint would hold one rank's copy of each box,
    a mix nobody trained (typically a missed broadcast of initial weights)."""
    seen: dict[tuple, dict[int, list[int]]] = {}
    for rank, sums in enumerate(per_rank):
        for name, offsets, lengths, crc in sums:
            seen.setdefault((name, tuple(offsets), tuple(lengths)), {}).setdefault(crc, []).append(rank)
    differ = [(key, groups) for key, groups in seen.items() if len(groups) > 1]
    if differ:
        lines = [f"tensor {name!r} box offsets={list(o)} lengths={list(l)}: ranks "
                 + " vs ".join(str(sorted(r)) for r in groups.values()) + " hold different values"
                 for (name, o, l), groups in differ[:10]]
        raise PlanError(f"save to {path}: {len(differ)} replicated box(es) differ across the ranks that hold them "
                        "(a missing broadcast of initial weights, or a rank that skipped an update); nothing was "
                        "written:\n  " + "\n  ".join(lines) + (f"\n  and {len(differ) - 10} more" if len(differ) > 10 else ""))


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


def _reset_peak_rss(timer: PhaseTimer) -> None:
    """Start this save's peak-RSS window (Linux: "5" to /proc/self/clear_refs resets VmHWM to the
    current RSS). Where that is not permitted, the report leaves the peak out (VmHWM would be the
    whole process's peak, not the save's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return
    timer.bytes["peak_rss"] = 0


def _count_peak_rss(timer: PhaseTimer) -> None:
    """This process's peak RSS since _reset_peak_rss (VmHWM), as bytes "peak_rss" in `timer`."""
    if "peak_rss" not in timer.bytes:
        return
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    timer.bytes["peak_rss"] = int(line.split()[1]) * 1024
                    return
    except (OSError, ValueError, IndexError):
        pass


def _discard_own_file(storage: Storage, save_id: str, rank: int) -> None:
    """Best effort: remove this rank's data file of a save that failed."""
    try:
        storage.delete(data_file_name(save_id, rank))
    except Exception as e:   # often the very fault that failed the save (a vanished or read-only directory)
        log.debug("omnickpt: could not remove %s of a failed save: %s", storage.describe(data_file_name(save_id, rank)), e)


def _same_path(paths: Sequence[str], verb: str) -> None:
    if len(set(paths)) > 1:
        where = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise CheckpointError(f"the ranks were given different checkpoint paths ({where}); every rank must pass "
                              f"the same path to {verb}()")


def _put_json(storage: Storage, rel: str, doc: dict) -> None:
    storage.commit(rel, json.dumps(doc, default=str).encode())


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

    return ckpt.save(path, state, async_save=async_save, process_group=process_group, allow_pickle=allow_pickle,
                     durable=durable, check_replicas=check_replicas, role=role, metadata=metadata,
                     on_commit=on_commit if (global_steps is not None or callback is not None) else None,
                     compression=compression, snapshot=snapshot, incremental=incremental, base=base,
                     full_every=full_every, block_bytes=block_bytes, quantize_optimizer=quantize_optimizer)


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
