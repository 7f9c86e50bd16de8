"""The save flow: the options of a save (SaveOptions, validated once) and the save job (_SaveJob),
one save on one rank in named phases: collect, agree, plan, snapshot, persist, commit. The
Checkpointer (omnickpt.api) owns the resources a job uses (threads, staging pool, plan cache,
communicators) and turns a job into a SaveHandle; the load side is omnickpt.loading."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from omnickpt import commit
from omnickpt.version import __version__
from omnickpt.adapters import ADAPTERS, SaveMemo, as_registry, collect_save, collect_save_reusing
from omnickpt.chain import choose_base, incremental_job
from omnickpt.comm import Comm
from omnickpt.engine import RankResult, build_manifest, collect_garbage, persist, snapshot
from omnickpt.engine.incremental import BLOCK_BYTES
from omnickpt.engine.save import Encoding, data_file_name, stage_layout, staging_size
from omnickpt.engine.staging import gc_paused
from omnickpt.fence import SnapshotFence, optimizers_in, step_stable_storages
from omnickpt.errors import CheckpointError, PlanError, UnsupportedError, rebuild_error
from omnickpt.format import DATA_DIR, MANIFEST_NAME, Manifest, checksum, dtype_name, encode_object
from omnickpt.format.codec import check_codec
from omnickpt.format.quant import check_scheme, is_moment, quantizable
from omnickpt.steps import References
from omnickpt.lease import acquire
from omnickpt.monitor import PhaseTimer, summarize
from omnickpt.planner import RecordBatch, build_global_plan, write_items
from omnickpt.storage import Storage, storage_for

if TYPE_CHECKING:
    from omnickpt.api import Checkpointer

REPORT_NAME = "report.json"
log = logging.getLogger("omnickpt")
_PLAN_CACHE_SIZE = 4
# Every rank's RecordBatch, as each rank receives them all with the agreement of a save whose plan
# is not cached (_inline_batch): past this, the coordinator gathers them and scatters the plan.
INLINE_PLAN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """Everything a save may vary, checked once here whatever path built it (omnickpt.save,
    Checkpointer.save, the managers). See omnickpt.save for what each does. Adding an option: a
    field here (with its check in __post_init__) and the one phase of _SaveJob that uses it."""
    async_save: bool = False
    process_group: Any = dataclasses.field(default=None, compare=False)
    allow_pickle: bool = False
    durable: bool = True
    check_replicas: bool = False
    role: str | None = None
    metadata: dict | None = None          # checked (JSON) in the collect phase, where every rank learns of it
    on_commit: Callable[[Manifest], None] | None = dataclasses.field(default=None, compare=False)
    compression: str | None = None
    snapshot: str | None = None           # "lazy" (the default of async saves) or "eager"
    incremental: bool = False
    base: str | None = None
    full_every: int | None = None
    block_bytes: int | None = None
    quantize_optimizer: str | None = None
    # The adapter registry the state goes through (omnickpt.adapters.ADAPTERS when None); omnickpt.dcp
    # passes (GenericAdapter(replicated=True),) to save a state dict as DCP would.
    adapters: Sequence[Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.adapters is not None:
            object.__setattr__(self, "adapters", as_registry(self.adapters))
        check_codec(self.compression)
        if self.snapshot not in (None, "lazy", "eager"):
            raise ValueError(f"snapshot={self.snapshot!r}: expected 'lazy' (the default of async saves) or 'eager'")
        self._check_incremental()
        check_scheme(self.quantize_optimizer)
        if self.quantize_optimizer is not None and self.incremental:
            raise UnsupportedError(f"incremental=True with quantize_optimizer={self.quantize_optimizer!r}: an "
                                   "incremental save writes raw blocks; use one or the other")

    def _check_incremental(self) -> None:
        base, full_every, block_bytes = self.base, self.full_every, self.block_bytes
        if not self.incremental and (base is not None or full_every is not None or block_bytes is not None):
            raise ValueError("base=, full_every= and block_bytes= are options of incremental saves: pass "
                             "incremental=True")
        if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
                                        or block_bytes < 1):
            raise ValueError(f"block_bytes={block_bytes!r}: must be a positive int (bytes of rows per hashed block)")
        if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int)
                                       or full_every < 1):
            raise ValueError(f"full_every={full_every!r}: must be a positive int (a full save every that many saves)")
        if self.incremental and self.compression is not None:
            raise UnsupportedError(f"incremental=True with compression={self.compression!r}: an incremental save "
                                   "writes raw blocks; use one or the other")

    @classmethod
    def of(cls, options: SaveOptions | None, keywords: Mapping[str, Any]) -> SaveOptions:
        """`options` with `keywords` (today's keywords of save()) replacing its fields; an unknown
        keyword is a TypeError naming it."""
        if options is None:
            return cls(**keywords)
        return dataclasses.replace(options, **keywords) if keywords else options

    @property
    def lazy(self) -> bool:
        """An async save copies parameters and optimizer state in the background unless snapshot="eager"."""
        return self.async_save and self.snapshot != "eager"

    @property
    def codec(self) -> str | None:
        """The codec of the data file's chunks: quantized chunks need the chunked layout ("none" elsewhere)."""
        return self.compression or ("none" if self.quantize_optimizer else None)


class _SaveJob:
    """One save on one rank, as its phases fill it in (the save side of loading._LoadJob). The
    Checkpointer calls, on every rank: collect, agree, plan, snapshot on the training thread (the
    stall), then run() (persist, then commit) there for a sync save or on its persist thread for an
    async one."""

    def __init__(self, ckpt: Checkpointer, path: str, state: dict, options: SaveOptions, t_start: float):
        self.t_start = t_start   # when save() was called: the stall counts from here
        self.ckpt, self.path, self.state, self.options = ckpt, path, state, options
        self.comm = ckpt.comm(options.process_group)
        self.storage = storage_for(path)
        self.timer = PhaseTimer()
        _sample_rss(self.timer)
        self.collected = _Collected()
        self.chain: tuple | None = None          # incremental (coordinator): the base, as chain.choose_base found it
        self.held: References | None = None      # incremental (coordinator): reference records on its base folders
        self.gathered: list = []
        self.save_id = ""
        self.writes, self.tensor_region, self.global_plan = None, 0, None
        self.snap = None
        self.fence: SnapshotFence | None = None
        self.encoding = Encoding()               # how persist encodes this rank's writes
        self.incremental: Callable[[], tuple] | None = None
        # What the last save of this Checkpointer on this group left for this one to reuse.
        self.reuse: _Reuse = ckpt._reuse.setdefault(id(self.comm), _Reuse())

    @property
    def where(self) -> str:
        return self.storage.describe()

    # -------------------------------------------------------------- on the training thread
    def collect(self) -> Exception | None:
        """Every rank, no collective: adapters, records, objects encoded; the coordinator of an
        incremental save finds its base. Returns the error, settled by agree()."""
        try:
            self.collected = _collect(self.state, self.comm, self.timer, self.options, self.reuse)
            o = self.options
            if o.incremental and self.comm.is_coordinator:
                with self.timer.phase("plan"):
                    self.chain, self.held = choose_base(self.path, o.base, o.full_every, o.block_bytes or BLOCK_BYTES,
                                                        self.ckpt._committed.get(id(self.comm)), holder=self.ckpt._job)
        except Exception as e:  # every rank must learn of it, or the others hang in the exchange
            return e
        return None

    def agree(self, error: Exception | None) -> None:
        """Every rank, one all-gather (comm.settle): digests, the save id, paths, replica sums,
        table digests, the base, the records of a small job whose plan is not cached
        (_inline_batch); any rank's error raised on every rank."""
        c = self.collected
        inline = _inline_batch(self.ckpt._plans.get(id(self.comm), {}), c, self.comm)
        with self.timer.phase("exchange"):   # also absorbs any lag between the ranks arriving here
            self.gathered = self.comm.settle(f"save to {self.path}, step plan", error,
                                             (c.digest, uuid.uuid4().hex[:16], self.where, c.replicas,
                                              c.batch.table_digest if c.batch is not None else None, self.chain,
                                              inline))
        if self.options.check_replicas:
            _check_replicas([g[3] for g in self.gathered], self.path)
        # Each rank would write its file where it was told and the manifest would name files that
        # are not there: refuse before writing anything.
        _same_path([g[2] for g in self.gathered], "save")
        self.save_id = self.gathered[0][1]

    def plan(self) -> None:
        """Every rank: this rank's writes (cached; planned from every rank's records sent with the
        agreement; else a gather and a scatter: _global_plan), then how each write is encoded
        (compression, quantized moments, incremental blocks)."""
        with self.timer.phase("plan"):
            self.writes, self.tensor_region, self.global_plan = _global_plan(
                self.ckpt._plans.setdefault(id(self.comm), {}), self.comm, tuple(g[0] for g in self.gathered),
                self.collected.batch, self.path, tables=[g[4] for g in self.gathered],
                inline=[g[6] for g in self.gathered])
        o = self.options
        # Only a save that encodes its chunks needs each write's tensor (not on every save's way out).
        shards = [self.collected.shards[w.index] for w in self.writes] if o.compression or o.quantize_optimizer else []
        codecs = _quantized_writes(self.state, shards, o.quantize_optimizer)
        self.encoding = Encoding(o.codec, [s.local.element_size() for s in shards], codecs,
                                 [dtype_name(s.dtype) for s in shards] if codecs else ())
        if o.incremental:
            self.incremental = incremental_job(self.gathered[0][5], self.collected.shards, self.writes, self.path)

    def snapshot(self) -> bool:
        """Every rank, no collective: the part of the save training waits for (the stall ends
        here). A lazy snapshot leaves the copy of parameters and optimizer state to a background
        thread, behind a SnapshotFence. Returns whether save() must wait for the fence."""
        o = self.options
        lazy = o.lazy
        # compressed, quantized and incremental files are laid out by their writers, from the spans:
        # a sync save's staging copy would be one copy more
        plain = not (o.compression or o.quantize_optimizer or o.incremental)
        snap, blocking = _snapshot(self.ckpt._pool, self.collected, self.writes, self.tensor_region, self.timer,
                                   o.async_save, (lambda: step_stable_storages(self.state)) if lazy else None,
                                   self.reuse, stage_sync=plain)
        if snap.deferred is not None or snap.references:
            # Lazy: every optimizer's step waits for the copy. Over the staging budget, the tensors
            # written from their own memory stay fenced until written (save() itself waits when
            # training could change them otherwise than by a step).
            # The fence's callback holds the timer, not this job: the Checkpointer keeps the fence
            # until its next save or load, and a fence -> job -> fence cycle would keep the job's
            # snapshot, and through it the staging buffer, alive until the cyclic collector ran
            # (paused during loads): a load that swapped the pool's buffer for a larger one then
            # held both (+384 MB per rank on MLP/FSDP2).
            timer = self.timer
            self.fence = SnapshotFence(optimizers_in(self.state) if self.options.lazy else [], f"save to {self.path}",
                                       on_held=lambda seconds, start: timer.add("held", seconds, start=start))
            snap.release, snap.blocking = self.fence.release, blocking
            self.ckpt._fences.append(self.fence)
            if snap.deferred is not None:
                self.ckpt._snapshot_thread().submit(snap.finish, self.timer)
        if not snap.blocking:
            self.timer.add("stall", time.perf_counter() - self.t_start)
        self.snap = snap
        return snap.blocking

    # -------------------------------------------------------------- after the snapshot
    def run(self) -> dict | None:
        """Every rank, after the snapshot (in the background for an async save): persist, then
        commit; the report (None on a rank other than the coordinator of an async save). The
        coordinator holds the checkpoint path's lease from before any byte is written until after
        the commit and garbage collection, so that a second live job writing the same path is
        refused instead of deleting this job's files (the lease is taken here, not on the stall
        path). A failed save gives its reference records back too."""
        try:
            lease, locked = None, None
            if self.comm.is_coordinator:
                try:
                    lease = acquire(self.storage, self.ckpt._job, what="checkpoint")
                except CheckpointError as e:
                    locked = e
            try:
                result, header = self.persist(locked)
                return self.commit(result, header, lease)
            finally:
                if lease is not None:
                    lease.release()
        finally:
            self.give_back()

    def give_back(self) -> None:
        """The reference records this save holds on its base folders (incremental, coordinator), given
        back once the save committed or failed, so that retention may remove those folders again.
        Idempotent."""
        if self.held is not None:
            self.held.release()

    def persist(self, locked: CheckpointError | None = None) -> tuple[RankResult, dict | None]:
        """Every rank, no collective: finish a lazy snapshot's copies, write and checksum this
        rank's data file. A failure becomes the rank's result (its file removed). Returns (the
        result, the manifest's incremental header or None)."""
        o, snap, timer, rank = self.options, self.snap, self.timer, self.comm.rank
        header = None
        try:
            if locked is not None:
                raise locked
            snap.finish(timer)   # a lazy snapshot's copies (made on the copier thread: waited for here)
            _sample_rss(timer)   # the staging filled
            rank_inc = None
            if self.incremental is not None:
                rank_inc, header = self.incremental()
            result = persist(self.storage, snap, rank, self.save_id, self.ckpt._io, durable=o.durable, timer=timer,
                             encoding=self.encoding, incremental=rank_inc)
        except Exception as e:
            result = RankResult(rank, None, 0, [], error=f"rank {rank}: {type(e).__name__}: {e}",
                                error_class=type(e).__name__)
            _discard_own_file(self.storage, self.save_id, rank)   # the space comes back now
        finally:
            snap.cancel()   # a failure before finish(): its lazy copies must not land after the release
            if snap.staging is not None:
                self.ckpt._pool.release(snap.staging, keep=not self.ckpt.release_staging)
            _sample_rss(timer)
            if snap.blocking:   # save() returns when the fence opens, just below
                timer.add("stall", time.perf_counter() - self.t_start)
                timings = timer.as_dict()
                snap.settle()   # after the timings: a blocked save() goes on and the training thread uses the timer
            else:
                snap.settle()   # before: an optimizer step held until the write is counted ("held")
                timings = timer.as_dict()
            # Nothing of the staging buffer outlives its release: a failed save's job stays reachable
            # (from its handle's error) while the pool may free or reuse that memory.
            snap.drop()
        result.timings = timings
        return result, header

    def commit(self, result: RankResult, header: dict | None, lease) -> dict | None:
        """Every rank: hand this rank's result to the coordinator, which commits (writes the
        manifest) or fails the save; the coordinator's verdict raised on every rank. Sync: a gather
        and a broadcast. Async: the commit choreography through storage (commit.run_round), never
        a collective from the background thread (it could interleave with the training loop's)."""
        comm, storage, save_id = self.comm, self.storage, self.save_id
        if self.options.async_save:
            round = commit.Round(storage, save_id, comm.rank, comm.world_size, self.ckpt.timeout,
                                 f"save to {self.where}")
            done = commit.run_round(round, lambda: dataclasses.asdict(result),
                                    lambda records: self._commit([RankResult(**d) for d in records], lease, header),
                                    after=self._after_commit, wait=False, on_failure=self._failed_async)
            return None if done is None else done[1]
        results = comm.gather_object(result, step=f"save to {self.where}, step commit")
        verdict = self._commit_sync(results, lease, header) if comm.is_coordinator else None
        outcome, report, committed = comm.broadcast_object(verdict, step=f"save to {self.where}, step commit")
        if outcome is not None:
            if not committed:   # node-local storage: the coordinator cannot remove this rank's file
                _discard_own_file(storage, save_id, comm.rank)
            raise rebuild_error(*outcome)
        return report

    def _failed_async(self, error: BaseException, records: list[dict] | None) -> None:
        """An async save that failed before its commit, seen on this rank: its own file goes; the
        coordinator, when the ranks' records never all came, removes every file of the save it can
        see (ranks still writing leave theirs to the next save's garbage collection). A failed
        commit (records came) removed its files itself, or committed and keeps them."""
        if records is not None:
            return
        _discard_own_file(self.storage, self.save_id, self.comm.rank)
        if self.comm.is_coordinator:
            _remove_files(self.storage, self.save_id)

    def _committed(self, manifest: Manifest) -> None:
        """Coordinator, after the commit: the default base of this process group's next
        incremental save, the reference records given back, then the caller's on_commit."""
        self.ckpt._committed[id(self.comm)] = self.path
        if self.held is not None:
            # Committed: the manifest now names what this save references, so the records that
            # protected it go before the caller's retention runs (which would keep their folders whole).
            self.held.release()
        if self.options.on_commit is not None:
            self.options.on_commit(manifest)

    def _commit_sync(self, results: list[RankResult], lease, header: dict | None) -> tuple:
        """Coordinator of a sync save: the commit and its status, as (outcome, report) to broadcast
        (outcome None, or (error class name, message)), and whether the checkpoint was committed."""
        try:
            done = self._commit(results, lease, header)
            commit.set_status(self.storage, self.save_id)
            self._after_commit(done)
            return None, done[1], True
        except commit.Verdict as v:
            commit.set_status(self.storage, self.save_id, v.outcome)
            return v.outcome, None, v.committed

    def _commit(self, results: list[RankResult], lease=None, incremental: dict | None = None) -> tuple:
        """Coordinator only: the manifest, then the report; returns (manifest, report). The
        caller sets the status. A failure is a commit.Verdict ((error class name, message)) and
        removes the save's data files (the previous checkpoint's are never touched: their names
        carry another save id)."""
        storage, save_id = self.storage, self.save_id
        failed = [r for r in results if r.error]
        if failed:
            msg = "; ".join(r.error for r in failed) + " (nothing was committed; the previous checkpoint is untouched)"
            raise commit.Verdict(_fail(storage, save_id, failed[0].error_class, msg))
        lost = lease.lost() if lease is not None else None
        if lost:
            raise commit.Verdict(_fail(storage, save_id, "CheckpointLockedError",
                                       f"{lost}; this save was not committed (the previous checkpoint is untouched)"))
        committed = False
        try:
            t0 = time.perf_counter()
            manifest = build_manifest(self.global_plan, results, save_id=save_id, layout=self.collected.layout,
                                      tool_version=__version__, incremental=incremental)
            storage.commit(MANIFEST_NAME, manifest.encode())
            committed = True
            commit_seconds = time.perf_counter() - t0
            results[0].timings["seconds"]["commit"] = commit_seconds
            rank0 = results[0].timings
            if "t0" in rank0:   # the commit on rank 0's timeline (its timer is not at hand here)
                rank0.setdefault("events", []).append(["commit", time.time() - rank0["t0"] - commit_seconds,
                                                       commit_seconds])
            report = _report(storage, save_id, results, time.perf_counter() - self.t_start, incremental)
            _put_json(storage, REPORT_NAME, report)
            return manifest, report
        except Exception as e:
            if committed:
                raise _failed_after_commit(e) from e
            msg = (f"commit by rank 0 failed: {type(e).__name__}: {e} (nothing was committed; the previous checkpoint "
                   "is untouched)")
            raise commit.Verdict(_fail(storage, save_id, type(e).__name__, msg)) from e

    def _after_commit(self, done: tuple) -> None:
        """Coordinator, once the status says committed: garbage collection, then _committed. A
        committed checkpoint is never removed, even if what follows its commit fails."""
        try:
            collect_garbage(self.storage, done[0])
            self._committed(done[0])
        except Exception as e:
            raise _failed_after_commit(e) from e


def _failed_after_commit(e: BaseException) -> commit.Verdict:
    return commit.Verdict((type(e).__name__, "the checkpoint was committed, but rank 0 failed after the commit: "
                                             f"{type(e).__name__}: {e}"), committed=True)


def _report(storage: Storage, save_id: str, results: list[RankResult], total_seconds: float,
            incremental: dict | None) -> dict:
    """Coordinator, at the commit: the save's report (report.json, what wait() returns)."""
    report = summarize("save", [r.timings for r in results], total_seconds=total_seconds)
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
    return report


def _fail(storage: Storage, save_id: str, error_class: str, msg: str) -> tuple[str, str]:
    """Coordinator: remove a failed save's data files; returns its outcome (class name, message)."""
    _remove_files(storage, save_id)
    return error_class, msg


def _remove_files(storage: Storage, save_id: str) -> None:
    """Coordinator: remove the data files of save `save_id` (all ranks' where the storage is
    shared), so that a full disk gets its space back and the next save can succeed."""
    try:
        for rel in storage.list(DATA_DIR):
            if rel.rsplit("/", 1)[-1].startswith(f"{save_id}-"):
                storage.delete(rel)
    except Exception as e:   # the storage may be what failed; the save's own error matters more
        log.warning("omnickpt: could not remove the files of the failed save in %s: %s", storage.describe(), e)


def _inline_batch(plans: dict, collected: _Collected, comm: Comm) -> RecordBatch | None:
    """What a rank sends with the agreement's all-gather for the plan step: its RecordBatch when no
    cached plan can match (none holds this rank's digest at its place: a first save, a new layout)
    and every rank's batches together stay under INLINE_PLAN_BYTES; else None. When every rank sent
    one, each plans from them itself (_global_plan), with no gather or scatter on the stall path."""
    b = collected.batch
    if b is None or comm.world_size == 1:
        return None
    if any(len(key) == comm.world_size and key[comm.rank] == collected.digest for key in plans):
        return None   # checked first: a steady save stops here, before the size (a pass over every name)
    return b if comm.world_size * b.wire_bytes() <= INLINE_PLAN_BYTES else None


def _global_plan(plans: dict, comm: Comm, digests: tuple, batch: RecordBatch, path: str, tables=None,
                 inline=None) -> tuple:
    """Every rank: (this rank's writes, the size of its file's tensor region, the global plan
    (coordinator only)). A cached plan costs no collective. When every rank sent its records with
    the agreement (`inline`, see _inline_batch), every rank plans from them: build_global_plan is a
    pure function of the batches, so all ranks find the same plan (or raise the same error) and no
    collective is made. Otherwise the coordinator plans from every rank's records (a gather) and
    hands each rank its part (a scatter).

    `plans`: the Checkpointer's LRU of this process group: every member makes the same saves on it
    in the same order, so all members hold the same entries and hit or miss together (saves on other
    groups must not evict entries here)."""
    cached = plans.get(digests)
    if cached is not None:
        plans[digests] = plans.pop(digests)   # most recently used last
        return cached
    if inline is not None and all(b is not None for b in inline):
        try:
            plan = build_global_plan(list(inline))
        except CheckpointError as e:
            raise rebuild_error(type(e).__name__, f"planning the save to {path} failed: {e}") from None
        writes, tensor_region = write_items(*plan.write_arrays(comm.rank)), plan.tensor_bytes[comm.rank]
        return _cache_plan(plans, digests, writes, tensor_region, plan if comm.is_coordinator else None)
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
    return _cache_plan(plans, digests, write_items(*arrays), tensor_region, plan)


def _cache_plan(plans: dict, digests: tuple, writes, tensor_region: int, plan) -> tuple:
    if len(plans) >= _PLAN_CACHE_SIZE:   # a few structures stay cached (e.g. model-only and full saves)
        plans.pop(next(iter(plans)))
    plans[digests] = (writes, tensor_region, plan)
    return writes, tensor_region, plan


@gc_paused()
def _snapshot(pool, collected: _Collected, writes, tensor_region: int, timer: PhaseTimer, async_save: bool,
              stable: Callable[[], set[int]] | None = None, reuse: _Reuse | None = None, *, stage_sync: bool = True):
    """Every rank, no collective: the part of the save training waits for. Async: copy into a
    staging buffer of `pool` (pinned when the source is on a GPU), the writes of the `stable()`
    storages later (lazy snapshots: Snapshot.deferred), at most the staging budget (the rest is
    written from the tensors' own memory); sync: copied whole into an idle host buffer of `pool`
    that holds the file, when there is one and `stage_sync` (a plain file), else reference the
    tensors, small ones packed into a pool buffer (given back after persisting). Returns (snapshot,
    whether save() must wait for the fence: a tensor training may change at any time is written
    from its own memory). The staging layout of the last async save is reused (`reuse`) when its
    shards, writes and sizes are the same."""
    staging, layout = None, None
    on_gpu = torch.cuda.is_available() and any(s.local.is_cuda for s in collected.shards)
    if async_save:
        with timer.phase("snapshot"):
            layout = _stage_layout(collected, writes, tensor_region, stable, pool.largest, reuse)
        staging = pool.acquire(layout.size, pin=on_gpu)
        # pinned staging is not warmed ahead (Checkpointer.warm_staging): only host staging is expected
        pool.expected = None if on_gpu else layout.size
    else:
        pool.drop_speculative()   # warmed after a load for an async save that has not come: not kept for it
        if stage_sync and not on_gpu and pool.idle_largest() >= staging_size(tensor_region, collected.blobs):
            # A sync save stages too when an idle host buffer holds its whole file (kept warm by the
            # job's async saves, or landed in by a load): one copy at memory speed, then one aligned
            # write to the device, instead of buffered writes from the tensors' own memory that the
            # fsync then waits for (bench/sync_save.py, 2 ranks: mlp/fsdp2 0.70 -> 0.52 s, gpt/fsdp2
            # 0.52 -> 0.43 s). No memory is taken for it: a job that only saves synchronously keeps
            # writing from the tensors. Everything is copied now (an eager layout, kept beside the
            # lazy one for the next such save).
            with timer.phase("snapshot"):
                layout = _stage_layout(collected, writes, tensor_region, None, pool.largest, reuse)
            staging = pool.acquire(layout.size)
    room = pool.largest

    def pack(nbytes: int) -> torch.Tensor:   # past the budget: memory of its own, freed with the save
        fits = room is None or nbytes <= room
        return pool.acquire(nbytes) if fits else torch.empty(max(nbytes, 1), dtype=torch.uint8)
    try:
        # A sync save packs its small tensors into a pool buffer (warm pages, given back after persisting).
        snap = snapshot(collected.shards, writes, tensor_region, collected.blobs, staging, timer, cuda=on_gpu,
                        pack=None if async_save else pack, layout=layout)
        return snap, layout is not None and layout.blocking
    except BaseException:
        if staging is not None:
            pool.release(staging)
        raise


def _stage_layout(collected: _Collected, writes, tensor_region: int, stable: Callable[[], set[int]] | None,
                  room: int | None, reuse: _Reuse | None):
    """engine.save.stage_layout, or the last one of its kind (lazy, or eager: snapshot="eager" and a
    sync save that stages) when nothing it depends on changed: the same shard list (reused whole by
    the collect: same tensors, shapes, dtypes, addresses), the same writes (the cached plan's own
    list), the same file size and staging room. The step-stable storages are worked out only when a
    layout is planned anew: a reused collect holds the same parameters and optimizer state, so the
    same storages."""
    key = (collected.shards, writes, staging_size(tensor_region, collected.blobs), room, stable is None)
    prev = reuse.stage.get(stable is None) if reuse is not None else None
    if prev is not None and all(a is b if i < 2 else a == b for i, (a, b) in enumerate(zip(prev[0], key))):
        return prev[1]
    layout = stage_layout(collected.shards, writes, tensor_region, collected.blobs,
                          stable=stable() if stable is not None else frozenset(), room=room)
    if reuse is not None:
        reuse.stage[stable is None] = (key, layout)
    return layout


@dataclasses.dataclass
class _Reuse:
    """What a Checkpointer keeps of its last save on a process group for the next one, used only
    while the state's layout is unchanged: each module's and optimizer's SaveItems (the adapters'
    SaveMemo checks their fingerprints), what the collect derived from the shards (the record batch
    sent to plan and its digest), and the async snapshot's staging layout. With the plan cache, an
    unchanged 18k-tensor state's save then does no per-tensor work but the fingerprint and the
    copies."""
    entries: SaveMemo = dataclasses.field(default_factory=SaveMemo)
    collected: tuple | None = None   # ([(state key, shard list)], _Collected those lists made)
    # {eager: (what stage_layout depended on, the StageLayout)}: a lazy layout and an eager one (sync
    # saves that stage, snapshot="eager"), so that a job alternating them keeps both
    stage: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Collected:
    """A rank's state as the save sees it: shards, their records (as a batch) and digest, encoded
    objects, the layout recorded in the manifest, and (check_replicas) every box's checksum."""
    shards: list = dataclasses.field(default_factory=list)
    digest: str = ""
    blobs: dict = dataclasses.field(default_factory=dict)
    layout: dict = dataclasses.field(default_factory=dict)
    replicas: list = dataclasses.field(default_factory=list)
    batch: Any = None             # the records as arrays (planner.RecordBatch), sent to the coordinator


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


@gc_paused()   # adapters make records by the thousand: see engine.staging.gc_paused
def _collect(state: dict, comm: Comm, timer: PhaseTimer, options: SaveOptions, reuse: _Reuse | None = None
             ) -> _Collected:
    """Every rank, no collective: adapters turn the state into shards and objects (no copies).
    With `reuse`, entries whose layout did not change since the last save are not collected again,
    and when that holds for every entry holding tensors, neither are the records, digest and batch
    made from their shards."""
    role, metadata, check_replicas = options.role, options.metadata, options.check_replicas
    out = _Collected()
    with timer.phase("plan"):
        adapters = options.adapters or ADAPTERS
        if reuse is None:
            collected, reused = collect_save(state, adapters), False
        else:
            collected, reused = collect_save_reusing(state, reuse.entries, adapters)
        lists = [(k, items.shards) for k, items in collected if items.shards]
        prev = reuse.collected if reuse is not None else None
        if reused and prev is not None and len(prev[0]) == len(lists) and all(
                a[0] == b[0] and a[1] is b[1] for a, b in zip(prev[0], lists)):
            base = prev[1]
        else:
            base = _from_shards(collected)
            if reuse is not None:
                reuse.collected = (lists, base)
        out.shards, out.digest, out.batch = base.shards, base.digest, base.batch
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
        out.blobs = {k: encode_object(v, allow_pickle=options.allow_pickle, where=k)
                     for _, items in collected for k, v in items.objects.items()}
    return out


def _from_shards(collected: list) -> _Collected:
    """The shards of what the adapters collected, their records, digest and batch (the rest of
    _Collected is the save's own)."""
    out = _Collected()
    # Empty local boxes (uneven shards) plan nothing; a tensor with no elements at all keeps
    # its one empty box, so that the manifest records it and a strict load finds it.
    out.shards = [s for _, items in collected for s in items.shards if s.box.numel or math.prod(s.shape) == 0]
    kinds = {d: (dtype_name(d), d.itemsize) for d in {s.dtype for s in out.shards}}   # per dtype, not per shard
    dtypes = [kinds[s.dtype] for s in out.shards]
    # columns, not a ShardRecord per shard: this runs on a first save's stall
    out.batch = RecordBatch.from_columns([s.name for s in out.shards], [s.shape for s in out.shards],
                                         [d[0] for d in dtypes], [d[1] for d in dtypes],
                                         [s.box for s in out.shards])
    out.digest = out.batch.structure_digest()
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


def _sample_rss(timer: PhaseTimer) -> None:
    """The save's peak RSS so far: this process's RSS now (Linux VmRSS), kept in bytes "peak_rss"
    of `timer` when higher. Sampled where a save's memory is highest (its start, the staging
    filled, the file written) rather than read from the process's peak counter: resetting that
    (/proc/self/clear_refs) to give each save a window of its own rewrote the user's VmHWM, and made
    any peak measured around several saves cover only the time since the last one began."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    timer.bytes["peak_rss"] = max(timer.bytes.get("peak_rss", 0), rss)
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
