"""Coordination over torch.distributed: the few object collectives the planner and the commit need.

Works without a process group too (one process = rank 0 of 1). Every collective is counted, so
tests can prove that a cached plan skips the planning exchange.
"""
from __future__ import annotations

import pickle
import re
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from omnickpt.errors import CheckpointError, CheckpointTimeoutError, rebuild_error


class _Solo:
    """A process group of this process alone, whatever torch.distributed holds (no collective is
    ever made): a save by one rank of a job whose other ranks are gone (checkpoint at failure,
    omnickpt/manager.py), while the job's own process group is broken."""

    def __repr__(self) -> str:
        return "omnickpt.comm.SOLO"


SOLO = _Solo()


def current_world() -> Any:
    """The default process group object now (None before init_process_group or after
    destroy_process_group). A re-initialized job has a new one, and every group made from the old
    one is gone with it: whoever caches Comms compares this to know when to drop them."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


# all_gather_object on a gloo group: every rank's pickle rides in a fixed slot of one all_gather
# (with its length) when it fits, instead of torch's two collectives (the sizes, then the bytes).
# Latency, not bytes, is the cost of the small exchanges a save makes in its stall (2 ranks here,
# each exchange after a monitored barrier, medians of 45: 74 bytes 1.1 -> 0.7 ms, 8.8 KB 1.5 ->
# 1.1 ms; BENCHMARKS.md). The slots of all ranks together stay within SLOTS_BYTES, so at scale the
# first round is as small as torch's sizes round; a rank whose pickle does not fit makes a second round.
SLOTS_BYTES = 64 << 10
SLOT_MAX = 32 << 10
SLOT_MIN = 64
_LENGTH = 8   # a slot's first bytes: the pickle's length (little-endian)


def slot_bytes(world_size: int) -> int:
    """Bytes of one rank's slot in the first round of a gather of `world_size` ranks (pure)."""
    return max(SLOT_MIN, min(SLOT_MAX, SLOTS_BYTES // max(world_size, 1))) // 8 * 8


class Comm:
    """`timeout`: seconds every rank waits for the others at each collective. On gloo process
    groups each collective is preceded by `dist.monitored_barrier`, so a rank that died or never
    called (a save on rank 0 only) fails the others within `timeout` with a CheckpointTimeoutError
    naming the missing ranks, instead of hanging for the process group's own timeout (30 min)."""

    def __init__(self, group: Any = None, timeout: float | None = None):
        self.distributed = dist.is_available() and dist.is_initialized() and group is not SOLO
        self.group = group if group is not None and group is not SOLO else (dist.group.WORLD if self.distributed
                                                                               else None)
        if self.distributed:
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the process group it was given")
        else:
            self.rank, self.world_size = 0, 1
        self.collectives = 0
        self.timeout = timeout
        gloo = self.world_size > 1 and dist.get_backend(self.group) == dist.Backend.GLOO
        self._monitored = timeout is not None and gloo
        self._slot = slot_bytes(self.world_size) if gloo else 0   # NCCL: torch's path (device tensors)
        self._world = current_world()   # every group of the job goes with this one

    def _alive(self, step: str) -> None:
        """Fail at once, naming `step`, when the job's process groups were destroyed since this Comm
        was made (torch would raise about a group "not initialized in the world group map")."""
        if self.distributed and current_world() is not self._world:
            raise CheckpointError(
                f"{step or 'checkpoint collective'}: the process group this was made with is gone "
                "(destroy_process_group ran since, and perhaps init_process_group again). Make the "
                "CheckpointManager (or the process group passed as process_group=) anew after init_process_group")

    def arrivals(self, step: str) -> None:
        """Every rank, before each collective: wait (at most `timeout`) until every rank of the
        group is here; else raise CheckpointTimeoutError naming `step` and the ranks that did not
        come. A Comm whose process group is gone fails at once (_alive)."""
        self._alive(step)
        if not self._monitored:
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)
        except RuntimeError as e:
            text = str(e)
            m = re.search(r"Ranks? ([\d, ]+) failed to pass", text)
            if m:
                who = f"rank(s) {m.group(1).strip()} did not answer within {self.timeout:g} s"
            elif self.rank != 0:
                who = (f"the coordinator (rank 0) did not answer within {self.timeout:g} s: a rank is dead or never "
                       "made this call (rank 0's error names it)")
            else:
                who = "a rank did not answer"
            raise CheckpointTimeoutError(
                f"{step or 'checkpoint collective'}: {who} ({text.strip().splitlines()[0][:300]}); nothing was "
                "committed, and the previous checkpoint is untouched") from None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any, step: str = "") -> list[Any]:
        if self.world_size == 1:
            return [obj]
        self.arrivals(step)
        self.collectives += 1
        if self._slot:
            return self._all_gather_pickled(obj)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _all_gather_pickled(self, obj: Any) -> list[Any]:
        """all_gather_object in one gloo all_gather when every rank's pickle fits its slot (see
        SLOTS_BYTES), else a second all_gather of every rank's bytes padded to the longest."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) <= self._slot
        first = self._all_gather_bytes(len(data).to_bytes(_LENGTH, "little") + (data if fits else b""),
                                       _LENGTH + self._slot)
        lengths = [int.from_bytes(g[:_LENGTH].tobytes(), "little") for g in first]
        if max(lengths) <= self._slot:
            return [pickle.loads(g[_LENGTH:_LENGTH + n]) for g, n in zip(first, lengths)]
        second = self._all_gather_bytes(data, max(lengths))
        return [pickle.loads(g[:n]) for g, n in zip(second, lengths)]

    def _all_gather_bytes(self, data: bytes, size: int) -> list[Any]:
        """Every rank's `data` (at most `size` bytes), each padded with zeros to `size`, as numpy
        uint8 arrays (pickle reads slices of them in place)."""
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(got, mine, group=self.group)
        return [g.numpy() for g in got]

    def gather_object(self, obj: Any, step: str = "") -> list[Any] | None:
        """Every rank's `obj` at the coordinator (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        self.arrivals(step)
        self.collectives += 1
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def scatter_object(self, objs: list[Any] | None, step: str = "") -> Any:
        """The coordinator's objs[r] on rank r."""
        if self.world_size == 1:
            return objs[0]
        self.arrivals(step)
        self.collectives += 1
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, group=self.group, group_src=0)
        return out[0]

    def broadcast_object(self, obj: Any, step: str = "") -> Any:
        if self.world_size == 1:
            return obj
        self.arrivals(step)
        self.collectives += 1
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            self._alive("barrier")
            self.collectives += 1
            dist.barrier(group=self.group)

    def settle(self, step: str, error: BaseException | None, payload: Any = None) -> list[Any]:
        """Every rank, after a local step that may have failed (`error`): exchange every rank's
        outcome and `payload` (one all-gather). If any rank failed, raise: this rank its own error,
        the others the same omnickpt error class, naming `step` and every failing rank (as DCP's
        _DistWrapper does). Returns every rank's payload, in rank order."""
        gathered = self.all_gather_object((outcome_of(error, self.rank), payload), step=step)
        raise_gathered(error, [g[0] for g in gathered], step)
        return [g[1] for g in gathered]

    def run_step(self, step: str, local: Callable[[], Any], *,
                 on_failure: Callable[[BaseException], None] | None = None) -> list[Any]:
        """Every rank: run the local step `local`, then settle its outcome (one all-gather): every
        rank's return value, in rank order. When any rank failed, `on_failure(error)` undoes this
        rank's part first and the failure is raised on every rank, so call sites carry no
        try/except/settle of their own (the shape of DCP's _DistWrapper.all_gather(step, map_fun))."""
        error, value = None, None
        try:
            value = local()
        except Exception as e:   # every rank must learn of it, or the others hang in the exchange
            error = e
        try:
            return self.settle(step, error, value)
        except BaseException as e:
            if on_failure is not None:
                on_failure(e)
            raise


def outcome_of(error: BaseException | None, rank: int) -> tuple[str, str] | None:
    """What a rank tells the others about its step: None, or (error class name, message)."""
    if error is None:
        return None
    return type(error).__name__, f"rank {rank}: {type(error).__name__}: {error}"


def raise_gathered(own: BaseException | None, outcomes: Sequence[tuple[str, str] | None], step: str) -> None:
    """Fail on every rank when any rank failed: this rank raises its own error; the others raise the
    same omnickpt error class (CorruptCheckpointError on rank 0 is CorruptCheckpointError on
    rank 1), with a message naming every failing rank."""
    if own is not None:
        raise own
    failed = [o for o in outcomes if o is not None]
    if failed:
        raise rebuild_error(failed[0][0], f"{step} failed on another rank: " + "; ".join(m for _, m in failed))
