"""CheckpointManager: step directories, a `latest` pointer, retention, and async saves that the
next save waits for; optionally a memory tier in host shared memory in front of the durable root,
with peer replicas and persist-on-failure (see docs/memory_tier.md)."""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from omnickpt import __version__
from omnickpt.api import Checkpointer, LoadResult, SaveHandle, default_checkpointer
from omnickpt.errors import CheckpointError, MismatchError, NotCommittedError, UnsafeCheckpointError
from omnickpt.format import MANIFEST_NAME
from omnickpt.storage import storage_for
from omnickpt.tiers import (RESTORE, MemoryTier, NodeLayout, await_records, await_status, choose_restore,
                            commit_durable, persist_rank, put_status, report_failure, step_dir)

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_ON_CLOSE = ("remove", "keep_latest")


class TieredSave:
    """A save to the memory tier. wait_memory() returns once the step is committed in shared memory
    (its report: the stall and the snapshot timings); wait() also waits for the step's durable copy
    when this step is one that is persisted (report["durable"] is then the durable manifest's save id)."""

    def __init__(self, step: int, memory: Future):
        self.step = step
        self._memory = memory

    def done(self) -> bool:
        if not self._memory.done():
            return False
        if self._memory.exception() is not None:
            return True
        durable = self._memory.result()[1]
        return durable is None or durable.done()

    def wait_memory(self, timeout: float | None = None) -> dict:
        return self._memory.result(timeout)[0]

    def wait(self, timeout: float | None = None) -> dict:
        report, durable = self._memory.result(timeout)
        report = dict(report)
        if durable is not None:
            report["durable"] = durable.result(timeout)
        return report


class CheckpointManager:
    """Saves `root/global_step_N` checkpoints; keeps the newest `keep_last` committed ones.

    A step directory without a committed manifest is never reported as latest. Retention runs on
    the coordinator right after a commit and never touches the step just written, a step this
    manager is loading, or any step newer than the newest committed one (it may be in flight).

    With `memory="shm://JOB"` every save goes first to host shared memory (the stall is a copy into
    staging memory), and every `persist_every`-th one is then copied to `root` in the background.
    load_latest() restores from memory when the memory holds the newest complete step (no read of
    `root`'s data), else from `root`. Options of the memory tier:

    - memory_keep: complete steps kept in memory per node (plus one still being copied to `root`).
    - persist_every: copy every N-th save to `root`. A save due for copying first waits for the
      previous copy (so at most one is in flight): pick N so that a copy finishes within N saves.
    - ranks_per_node: ranks per machine (default $LOCAL_WORLD_SIZE, else the whole group). Each
      node keeps a complete checkpoint of its own ranks, so a restore reads tensors from local
      memory only.
    - peer_replicas: also send each node's snapshot to the next node (rank r -> r + ranks_per_node),
      which keeps it in its memory; a node whose memory is lost restores from that peer.
    - persist_on_failure: on SIGTERM (handler installed here, the previous one restored by close())
      or an exception leaving `with manager:`, the newest memory step is copied to `root` first.
    - on_close: what a clean close() leaves in shared memory once `root` holds the newest step:
      "remove" (nothing) or "keep_latest" (the newest step, for a restart on the same machine).
      After a failure the newest step is always kept. omnickpt.storage.shm.clear_memory("JOB")
      (`omnickpt clear-memory JOB`) removes it all.

    Every rank of the process group must create the manager, save the same steps and call close()
    (a collective when there are several ranks).
    """

    def __init__(self, root: str, *, keep_last: int | None = None, checkpointer: Checkpointer | None = None,
                 process_group: Any = None, memory: str | None = None, memory_keep: int = 1,
                 persist_every: int = 1, ranks_per_node: int | None = None, peer_replicas: bool = False,
                 persist_on_failure: bool = True, on_close: str = "remove", flush_timeout: float = 120.0):
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self._ckpt = checkpointer or default_checkpointer()
        self._group = process_group
        self._storage = storage_for(self.root)
        self._pending: SaveHandle | None = None
        self._loading: int | None = None
        self._tier = None
        self._closed = False
        self.restored: tuple[str, int] | None = None   # ("memory" | "durable", step) after load_latest
        if memory is not None:
            self._setup_memory(memory, memory_keep, persist_every, ranks_per_node, peer_replicas,
                               persist_on_failure, on_close, flush_timeout)

    def step_path(self, step: int) -> str:
        return f"{self.root}/global_step_{int(step)}"

    def save(self, step: int, state: dict, *, async_save: bool = False, **kwargs):
        """Save step `step`; first waits for the previous async save to commit.

        With a memory tier it returns a TieredSave once the snapshot is taken (async_save=False:
        once it is committed in memory); copying to `root` is always in the background."""
        if self._tier is not None:
            return self._save_memory(int(step), state, async_save, kwargs)
        self.wait()
        handle = self._ckpt.save(self.step_path(step), state, async_save=async_save, process_group=self._group,
                                 on_commit=lambda _m, step=int(step): self._after_commit(step), **kwargs)
        self._pending = handle if async_save else None
        return handle

    def wait(self) -> dict | None:
        """Wait for the in-flight async save, if any (with a memory tier: its commit in memory and
        its durable copy); returns its report. A background failure is raised here, once."""
        if self._tier is not None:
            return self._wait_memory_tier()
        handle, self._pending = self._pending, None
        return handle.wait() if handle is not None else None

    def steps(self) -> list[int]:
        """Committed steps in `root`, oldest first."""
        out = []
        for name in self._storage.children(""):
            m = _STEP_DIR.match(name)
            if m and self._storage.exists(f"{name}/{MANIFEST_NAME}"):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def memory_steps(self) -> list[int]:
        """Steps complete in this node's shared memory, oldest first ([] without a memory tier)."""
        return self._tier.committed_steps() if self._tier is not None else []

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        """Load the newest committed step. With a memory tier: from shared memory when every node
        holds that step complete (itself or through its peer's replica) and `root` holds nothing
        newer, else from `root`. report["tier"] says which; `self.restored` too."""
        if self._tier is not None:
            return self._load_latest_tiered(state, kwargs)
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

    def _after_commit(self, step: int) -> None:
        self._storage.commit("latest", f"{step}\n".encode())
        if self.keep_last is None:
            return
        committed = self.steps()
        keep = set(committed[-self.keep_last:]) | {step}
        if self._loading is not None:
            keep.add(self._loading)
        newest = max(committed) if committed else step
        for name in self._storage.children(""):
            m = _STEP_DIR.match(name)
            if not m:
                continue
            s = int(m.group(1))
            if s in keep or s > newest:
                continue
            # Manifest first: from that moment the step is no longer a checkpoint, so a crash
            # halfway through deleting never leaves something that looks loadable but is not.
            self._storage.delete(f"{name}/{MANIFEST_NAME}")
            self._storage.delete_tree(name)

    def close(self) -> None:
        """Wait for what is in flight. With a memory tier also: copy the newest memory step to
        `root` if it is not there yet, give shared memory back per `on_close`, restore the signal
        handlers. Every rank calls it."""
        if self._tier is None:
            self.wait()
            return
        self._close_tiered(clean=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._tier is None:
            self.wait()
            return False
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self.close()
            return False
        if self._persist_on_failure:
            self._flush_noting(f"{exc_type.__name__} leaving the training loop")
        self._close_tiered(clean=False)
        return False

    # ================================================================== memory tier
    def _setup_memory(self, memory, memory_keep, persist_every, ranks_per_node, peer_replicas, persist_on_failure,
                      on_close, flush_timeout):
        if not str(memory).startswith("shm://"):
            raise ValueError(f"memory={memory!r}: the memory tier is host shared memory, give it as shm://JOBNAME")
        if memory_keep < 1 or persist_every < 1:
            raise ValueError("memory_keep and persist_every must be at least 1")
        if on_close not in _ON_CLOSE:
            raise ValueError(f"on_close={on_close!r}: must be one of {_ON_CLOSE}")
        comm = self._ckpt.comm(self._group)
        self._comm = comm
        world = comm.world_size
        rpn = ranks_per_node or _local_world_size(world)
        layout = NodeLayout(world, rpn, comm.rank)
        if peer_replicas and layout.nodes < 2:
            raise ValueError(f"peer_replicas needs at least two nodes; the group has {world} rank(s) with "
                             f"ranks_per_node={rpn}")
        self._global_ranks = _global_ranks(self._group, world)
        self._node_group = self._group if layout.nodes == 1 else _new_group(
            self._global_ranks[layout.node * rpn:(layout.node + 1) * rpn], self._group, world)
        # Peer transfers run on a background thread: a group of their own, so they never
        # interleave with the training loop's collectives.
        self._side = _new_group(self._global_ranks, self._group, world, backend="gloo") if peer_replicas else None
        self._tier = MemoryTier(memory, layout, self._storage.describe())
        if layout.local == 0:
            self._tier.prepare()
        # One id for this run's durable copies (their control records); the gather also makes
        # every node leader's prepare() finish before any rank looks at its memory.
        self._run_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
        self._memory_keep, self._persist_every = memory_keep, persist_every
        self._persist_on_failure, self._on_close, self._flush_timeout = persist_on_failure, on_close, flush_timeout
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-memory")
        self._durable_lane = ThreadPoolExecutor(1, thread_name_prefix="omnickpt-durable")
        self._copy_io = ThreadPoolExecutor(4, thread_name_prefix="omnickpt-copy")
        # Re-entrant: the SIGTERM handler runs on the main thread, which may hold it when interrupted.
        self._lock = threading.RLock()
        self._mem_future: Future | None = None
        self._durable_future: Future | None = None
        self._pinned: set[int] = set()     # memory steps the durable lane still reads
        self._attempted: set[int] = set()  # steps this run has copied (or tried to copy) to root
        self._durable_done: int | None = None
        self._memory_step: int | None = None   # newest step committed in memory, as this process knows
        self._saves = 0
        self._signals: dict[int, Any] = {}
        if persist_on_failure:
            self._install_signals((signal.SIGTERM,))

    # ------------------------------------------------------------------ saving
    def _save_memory(self, step: int, state: dict, async_save: bool, kwargs: dict) -> TieredSave:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
        # The previous save's memory commit (and peer copy) first: a failure there surfaces here,
        # once. The future is dropped only after it finished, so that a flush from a signal
        # handler that interrupts this wait still waits for that step.
        if self._mem_future is not None:
            try:
                self._mem_future.result()
            finally:
                self._mem_future = None
        due = (self._saves + 1) % self._persist_every == 0
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
        tiered = TieredSave(step, fut)
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
            if isinstance(e, CheckpointError):
                if self._tier.layout.local == 0:
                    # Shared memory is scarce: the failed step's partial files go now (every rank
                    # of the node is done with them: the commit's failure comes after their records).
                    self._tier.storage.delete_tree(step_dir(step))
                raise CheckpointError(f"step {step} was not saved to shared memory ({self._tier.step_url(step)}): {e}; "
                                      f"the previous memory step and {self.root} are untouched") from e
            raise
        if self._side is not None:
            got = self._tier.send_replica(step, self._side, self._global_ranks)
            _barrier(self._side)   # every holder rank has its part: the replica manifest goes last
            self._tier.commit_replica(step, got)
        with self._lock:
            self._memory_step = step
        durable = None
        if due:
            durable = self._durable_lane.submit(self._durable_job, step, True)
            self._durable_future = durable
        if self._tier.layout.local == 0:
            with self._lock:
                pinned = set(self._pinned)
            self._tier.retain(self._memory_keep, pinned)
        return report, durable

    def _durable_job(self, step: int, wait_commit: bool, timeout: float | None = None) -> str:
        """Copy memory step `step` to root: every rank its file, the coordinator the manifest last."""
        attempt = f"{self._run_id}-s{step}"
        timeout = self._ckpt.timeout if timeout is None else timeout
        with self._lock:
            self._attempted.add(step)
        try:
            durable = storage_for(self.step_path(step))
            try:
                persist_rank(self._tier, step, durable, attempt, self._tier.layout.rank, self._copy_io)
            except Exception as e:
                # Tell the coordinator now rather than let it wait for this rank until its timeout.
                report_failure(durable, attempt, self._tier.layout.rank, f"rank {self._tier.layout.rank}: "
                               f"copying memory step {step} to {self.step_path(step)} failed: {type(e).__name__}: {e}")
                raise
            if self._comm.is_coordinator:
                try:
                    records = await_records(durable, attempt, self._tier.layout.world_size, timeout)
                    commit_durable(durable, attempt, records, self._tier.layout.ranks_per_node, __version__)
                except Exception as e:   # the other ranks wait for a status: give them this one
                    put_status(durable, attempt, {"state": "failed", "error": f"rank 0: {type(e).__name__}: {e}"})
                    raise
                self._after_commit(step)
            elif wait_commit:
                # Wait for the commit so that retention knows every rank has copied this step.
                await_status(durable, attempt, timeout)
            with self._lock:
                self._durable_done = max(step, self._durable_done or step)
            return attempt
        finally:
            with self._lock:
                self._pinned.discard(step)

    def _wait_memory_tier(self) -> dict | None:
        report = None
        for lane in ("_mem_future", "_durable_future"):
            fut = getattr(self, lane)
            if fut is None:
                continue
            try:
                out = fut.result()
            finally:
                setattr(self, lane, None)
            if lane == "_mem_future":
                report = out[0]
        return report

    # ------------------------------------------------------------------ flushing and closing
    def flush(self, timeout: float | None = None, *, wait_commit: bool = True) -> int | None:
        """Copy the newest memory step to root now, unless this run already did; returns that step
        (None when there was nothing to copy). Every rank calls it. wait_commit=False: ranks other
        than 0 return once their own copy is done (a process that is leaving)."""
        # The memory lane first: it may still hand a durable copy to the durable lane.
        for lane in ("_mem_future", "_durable_future"):
            fut = getattr(self, lane)
            if fut is not None:
                try:
                    fut.result(timeout)
                except Exception:   # a failed save leaves the previous memory step, which we flush
                    pass
        with self._lock:
            step = self._memory_step
            if step is None or step in self._attempted or (self._durable_done or -1) >= step:
                return None
        self._durable_job(step, wait_commit, timeout)
        return step

    def _flush_noting(self, why: str) -> None:
        t0 = time.perf_counter()
        try:
            step = self.flush(self._flush_timeout, wait_commit=False)
        except BaseException as e:
            print(f"omnickpt: {why}: could not copy the newest memory step to {self.root}: {type(e).__name__}: {e}; "
                  f"it stays in shared memory ({self._tier.node_url})", file=sys.stderr, flush=True)
            return
        if step is not None:
            print(f"omnickpt: {why}: copied memory step {step} to {self.root} in {time.perf_counter() - t0:.2f} s",
                  file=sys.stderr, flush=True)

    def _close_tiered(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            if clean:
                # Errors are kept for the end: every rank must reach the exchange below.
                for part in (self._wait_memory_tier, self.flush):
                    try:
                        part()
                    except Exception as e:
                        error = error or e
                mine = self._memory_step is None or (self._durable_done or -1) >= self._memory_step
                # Rank 0's answer means "committed"; the exchange also makes sure nobody still
                # reads this node's memory (a peer copy, a durable copy) when it goes.
                safe = all(self._comm.all_gather_object(mine))
                if self._tier.layout.local == 0:
                    if self._on_close == "remove" and safe:
                        self._tier.remove()
                    else:
                        if self._on_close == "remove":
                            warnings.warn(f"omnickpt: {self.root} does not hold memory step {self._memory_step}; "
                                          f"it is kept in {self._tier.node_url}", RuntimeWarning, stacklevel=3)
                        self._tier.retain(1)
            else:
                for lane in ("_mem_future", "_durable_future"):
                    fut = getattr(self, lane)
                    if fut is not None:
                        try:
                            fut.result(self._flush_timeout)
                        except Exception:
                            pass
        finally:
            self._restore_signals()
            for pool in (self._lane, self._durable_lane, self._copy_io):
                pool.shutdown(wait=clean)
        if error is not None:
            raise error

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
    def _load_latest_tiered(self, state: dict, kwargs: dict) -> LoadResult:
        lay, comm = self._tier.layout, self._comm
        self.wait()
        view = self._tier.view() if lay.local == 0 else None
        durable_step, durable_error = None, None
        if comm.is_coordinator:
            try:   # a listing only: no checkpoint data is read from root to decide
                durable_step = self.latest_step()
            except (CheckpointError, OSError) as e:
                durable_error = f"{type(e).__name__}: {e}"
        gathered = comm.all_gather_object((view, durable_step, durable_error))
        durable_step, durable_error = gathered[0][1], gathered[0][2]
        views = [gathered[k * lay.ranks_per_node][0] for k in range(lay.nodes)]
        step, broken = choose_restore(views, durable_step, self._side is not None)
        if step is not None:
            result, failed = self._restore_from_memory(step, broken, state, kwargs)
            if not failed:
                if lay.local == 0:
                    self._tier.purge_newer(step)
                with self._lock:
                    self._memory_step = step
                self.restored = ("memory", step)
                result.report.update(tier="memory", step=step, repaired_nodes=broken)
                return result
            warnings.warn(f"omnickpt: restoring step {step} from shared memory failed ({'; '.join(failed)}); "
                          f"loading from {self.root} instead", RuntimeWarning, stacklevel=3)
        if durable_step is None:
            where = f"{self.root} ({durable_error})" if durable_error else self.root
            raise NotCommittedError(f"nothing to restore: no complete step in shared memory ({self._tier.url}) "
                                    f"and no committed checkpoint in {where}")
        if lay.local == 0:
            self._tier.purge_newer(None)   # older than root (stale) or incomplete on some node
        result = self.load(durable_step, state, **kwargs)
        self.restored = ("durable", durable_step)
        result.report.update(tier="durable", step=durable_step)
        return result

    def _restore_from_memory(self, step: int, broken: list[int], state: dict, kwargs: dict):
        """Every rank: load `step` from this node's memory (after a repair from peers). Phases end
        with an exchange of errors, so that all ranks fail together and fall back together.
        Returns (LoadResult or None, the failures of all ranks)."""
        lay, comm = self._tier.layout, self._comm
        kwargs = dict(kwargs, dedup_reads=False)   # each node's view is its own: no cross-node forwarding
        error, objects, result = None, None, None

        def failures():
            gathered = comm.all_gather_object(None if error is None else f"rank {comm.rank}: {type(error).__name__}: {error}")
            return [g for g in gathered if g is not None]

        try:
            if broken:
                self._tier.repair(step, broken, self._side, self._global_ranks, lambda: _barrier(self._side))
            if lay.nodes > 1 and lay.local == 0:
                objects = self._tier.node_objects(step)
        except Exception as e:
            error = e
        url, group = self._tier.step_url(step), self._node_group
        if lay.nodes > 1:
            # A node's checkpoint holds its own ranks' objects only; state that needs every rank's
            # value (a dataloader position) gets them through this exchange and a world view.
            gathered = comm.all_gather_object((objects, None if error is None else f"rank {comm.rank}: {error}"))
            failed = [g[1] for g in gathered if g[1] is not None]
            if failed:
                return None, failed
            try:
                if lay.local == 0:
                    self._tier.world_view(step, [o for g in gathered if g[0] for o in g[0]])
            except Exception as e:
                error = e
            failed = failures()   # also: every node's view is written before any rank reads one
            if failed:
                if lay.local == 0:
                    self._tier.drop_world_view()
                return None, failed
            url, group = f"{self._tier.node_url}/{RESTORE}/{step_dir(step)}", self._group
        try:
            result = self._ckpt.load(url, state, process_group=group, **kwargs)
        except Exception as e:
            error = e
        failed = failures()
        if lay.nodes > 1 and lay.local == 0:
            self._tier.drop_world_view()
        # The state does not fit the checkpoint, or the checkpoint asks for pickle: the durable
        # copy would not do better, so every rank raises instead of falling back.
        fatal = [f for f in failed if any(f"{t.__name__}:" in f for t in (MismatchError, UnsafeCheckpointError))]
        if fatal:
            if error is not None:
                raise error
            raise CheckpointError(f"another rank failed: {fatal[0]}")
        return result, failed


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
