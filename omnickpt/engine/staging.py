"""Staging pools: host memory allocated once and reused, so a snapshot is a plain memory copy.

Two buffers alternate: the next save copies into one while the previous one drains from the
other; a third save waits only if both are still persisting.

Also the bulk byte work on such buffers that the save and the load share: copies of many small
tensors (`copy_bytes`) and checksums of many small spans (`checksums`), where a torch call or a
thread-pool task per item would cost more than the item's bytes.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from concurrent.futures import Executor
from typing import Sequence

import torch

from omnickpt.format import checksum

# A checksum task covers at least this many bytes: a task costs ~20 us of scheduling, a small
# span's CRC a fraction of that.
TASK_BYTES = 4 << 20
# Below this many bytes in all, checksumming on the calling thread beats handing work to the pool.
PARALLEL_BYTES = 8 << 20


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector for a bulk phase of a save or load, and resume it
    after. Such a phase makes objects by the hundred thousand (records, boxes, read items, a
    decoded manifest), none of them cyclic garbage, and each batch of them triggers collections
    that walk the whole heap: with a training state of 10^4 tensors in it, that was most of a
    load's time (measured: 18k tensors, load 11-15 s with the collector on, 1.3-1.8 s off).
    Only the caller that found the collector on turns it back on, so nested and concurrent
    phases (a background persist during a load) leave it as they found it, and a program that
    disabled it keeps it disabled."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plain_bytes(t: torch.Tensor) -> bool:
    """Whether `t`'s memory holds its values as they read, back to back (a CPU tensor, contiguous,
    with no lazy conjugation or negation), so its bytes can be copied raw."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """memmove between two host addresses the caller has bounds-checked; releases the GIL. For
    small tensors it is ~1 us against ~20 us for slicing, viewing and copy_ in torch."""
    ctypes.memmove(dst, src, nbytes)


def checksums(spans: Sequence[memoryview], executor: Executor | None) -> list[int]:
    """CRC32C of each span, in order: spans are grouped into tasks of at least TASK_BYTES (and
    about 4 per thread when there are many), so thousands of small spans cost a few tasks."""
    total = sum(len(s) for s in spans)
    if executor is None or len(spans) <= 1 or total < PARALLEL_BYTES:
        return [checksum(s) for s in spans]
    target = max(TASK_BYTES, total // 64)
    groups, cur, size = [], [], 0
    for s in spans:
        cur.append(s)
        size += len(s)
        if size >= target:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    if len(groups) == 1:
        return [checksum(s) for s in spans]
    return [c for part in executor.map(_checksum_all, groups) for c in part]


def _checksum_all(spans: Sequence[memoryview]) -> list[int]:
    return [checksum(s) for s in spans]

# Durable writes go straight from staging to the device (O_DIRECT, omnickpt/storage/local.py),
# which needs the buffer's address aligned like the file offsets: a page.
_PAGE = 4096


def _page_aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 buffer of `nbytes` whose first byte is page-aligned (the allocator gives 64 bytes)."""
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % _PAGE
    return raw[shift:shift + nbytes]


# warm() faults a buffer in by pieces of this size, checking between them whether a save wants it.
WARM_CHUNK = 4 << 20
# What a buffer warmed ahead of a save holds beyond the size expected: the next save's objects (a step
# count, a data loader's position) may take a page more.
WARM_SLACK = 1 << 20


class StagingPool:
    """Reusable page-aligned host buffers: `slots` of them at most, and with a `budget` never more
    than `budget` bytes held in all (idle buffers are dropped to make room; a request waits while
    buffers in use fill the budget)."""

    def __init__(self, slots: int = 2, budget: int | None = None):
        if budget is not None and budget < 2 * _PAGE:
            raise ValueError(f"staging_budget={budget} bytes is too small: give at least {2 * _PAGE} bytes")
        self.budget = budget
        self._free: list[torch.Tensor | None] = [None] * slots
        self._held = 0          # bytes of every buffer handed out or idle, as allocated
        self.peak = 0           # the most bytes held at any time (the budget's check)
        self._out: set[int] = set()   # addresses of the buffers handed out
        self._cond = threading.Condition()
        # Set while warm() faults a buffer in; acquire() sets the event to have it handed over.
        self._warming: threading.Event | None = None
        self._no_warm = False   # stop_warming(): the pool's owner is closing
        self._making = 0        # buffers reserved by acquire() and being allocated (not in _out yet)
        self._asking = 0        # acquire() calls under way: a warm() does not start beside them
        self._speculative: int | None = None   # address of the idle buffer warm() made, until used
        # Bytes of host staging the last async save asked for: what the next one is expected to ask
        # for (set by the save; Checkpointer.warm_staging warms that much ahead of a save).
        self.expected: int | None = None
        # Bytes per second the last warm() faulted in, as far as it went (None before one ran): how
        # long warming ahead of a save takes on this machine (cadence.warm_lead).
        self.warm_rate: float | None = None

    @property
    def largest(self) -> int | None:
        """The largest request the budget allows (None: no budget)."""
        return None if self.budget is None else self.budget - _PAGE

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def idle_largest(self) -> int:
        """Bytes of the largest idle buffer (its pages faulted in by an earlier use), 0 if none."""
        with self._cond:
            return max((b.numel() for b in self._free if b is not None and not b.is_pinned()), default=0)

    def cold(self) -> int:
        """Bytes the next async save is expected to stage (`expected`) when no idle host buffer
        holds that many warm, else 0 (nothing to warm: kept from the last save, or warmed already)."""
        n = self.expected
        return n if n and self.idle_largest() < n else 0

    def acquire(self, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes`, waiting while every slot is in use (or, with a
        budget, while the buffers in use leave no room for it). A request larger than the budget
        (a load landing one box bigger than it; snapshots never ask for more than `largest`) gets
        memory of its own, outside the pool, freed when the caller drops it."""
        nbytes = max(nbytes, 1)
        if self.largest is not None and nbytes > self.largest:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        with self._cond:
            self._asking += 1
            try:
                if self._warming is not None:
                    # a buffer being warmed for this request: taken as far as it is warm (warm() stops
                    # at the end of its chunk and puts it back), rather than fresh memory beside it
                    self._warming.set()
                    while self._warming is not None:
                        self._cond.wait()
                buf = self._reuse_or_reserve(nbytes, pin)
            finally:
                self._asking -= 1
            if buf is not None:
                if buf.data_ptr() == self._speculative:
                    self._speculative = None
                return buf
        # Not zero-filled: the first snapshot's copy faults the pages in (one pass over the
        # memory instead of two), and every later save reuses them at memcpy speed.
        try:
            buf = _page_aligned(nbytes, pin)
        except BaseException:
            with self._cond:
                self._making -= 1
            self._forget(nbytes + _PAGE)
            raise
        with self._cond:
            self._making -= 1
            self._out.add(buf.data_ptr())
        return buf

    def _reuse_or_reserve(self, nbytes: int, pin: bool) -> torch.Tensor | None:
        """Holding the lock: an idle buffer big enough (handed out), or None once a slot and the
        budget's room for a new buffer of `nbytes` are reserved; waits while neither is possible."""
        while True:
            while not self._free:
                self._cond.wait()
            # Prefer a slot already big enough: its pages are faulted in, so the copy runs at memcpy speed.
            fits = [i for i, b in enumerate(self._free) if b is not None and b.numel() >= nbytes
                    and b.is_pinned() == pin]
            if fits:
                buf = self._free.pop(fits[0])
                self._out.add(buf.data_ptr())
                return buf
            # A new buffer: drop the idle ones first (their memory goes back before the new is taken).
            for i, b in enumerate(self._free):
                if b is not None:
                    self._held -= _footprint(b)
                    self._free[i] = None
            self._speculative = None
            if self.budget is None or self._held + nbytes + _PAGE <= self.budget:
                self._free.pop()
                self._held += nbytes + _PAGE
                self.peak = max(self.peak, self._held)
                self._making += 1
                return None
            self._cond.wait()

    def warm(self, nbytes: int, slack: int = 0, chunk: int = WARM_CHUNK) -> bool:
        """A background thread: have an idle buffer of at least `nbytes` ready, its pages faulted
        in, for the next acquire(). A buffer's first use faults every page in, and a lazy
        snapshot's copy into it is what the next optimizer step waits for: warmed ahead (a
        restarted job's first save, after its load), that copy runs at memcpy speed. The buffer
        made holds `slack` bytes more than `nbytes` (an estimate's margin), or as many of them as
        the budget allows. Gives way: an acquire() meanwhile gets the buffer as far as it is warm,
        at the end of the current `chunk`. Nothing is done when an idle buffer of `nbytes` exists,
        a buffer is in use (its save or load has its memory), the budget has no room, or another
        warm() runs. Returns whether a buffer was warmed; each sets `warm_rate`, as far as it went."""
        if self.largest is not None:
            if nbytes > self.largest:
                return False
            # a save staging up to the budget asks for no more than `largest`: the margin is cut, not the warm
            slack = max(0, min(slack, self.largest - nbytes))
        with self._cond:
            if (self._no_warm or self._warming is not None or self._out or self._making or self._asking
                    or not self._free
                    or any(b is not None and b.numel() >= nbytes and not b.is_pinned() for b in self._free)):
                return False
            nbytes = max(nbytes + slack, 1)
            idle = sum(_footprint(b) for b in self._free if b is not None)
            if self.budget is not None and self._held - idle + nbytes + _PAGE > self.budget:
                return False
            for i, b in enumerate(self._free):   # the smaller idle ones go, as acquire() would drop them
                if b is not None:
                    self._held -= _footprint(b)
                    self._free[i] = None
            self._free.pop()
            self._held += nbytes + _PAGE
            self.peak = max(self.peak, self._held)
            wanted = self._warming = threading.Event()
        buf = None
        try:
            t0, done = time.perf_counter(), 0
            buf = _page_aligned(nbytes, False)
            addr = buf.data_ptr()
            for off in range(0, nbytes, chunk):
                if wanted.is_set():
                    break
                # one thread, the GIL released (a ctypes call), not torch's intra-op pool, which
                # would fault at the training threads' priority
                ctypes.memset(addr + off, 0, min(chunk, nbytes - off))
                done = min(off + chunk, nbytes)
            if done:   # a warm cut short by a save measures too: a lead too short is how it gets cut
                self.warm_rate = done / max(time.perf_counter() - t0, 1e-6)
        finally:
            with self._cond:
                self._warming = None
                if buf is None:
                    self._held -= nbytes + _PAGE
                    self._free.append(None)
                else:
                    self._free.append(buf)
                    self._speculative = buf.data_ptr()
                self._cond.notify_all()
        return True

    def drop_speculative(self) -> None:
        """Free the buffer warm() made if no acquire() has used it yet: the save it was made for
        turned out not to need staging (a sync save), and a job that saves that way would keep it
        for nothing."""
        with self._cond:
            for i, b in enumerate(self._free):
                if b is not None and b.data_ptr() == self._speculative:
                    self._held -= _footprint(b)
                    self._free[i] = None
            self._speculative = None

    def stop_warming(self) -> None:
        """No more warm(): one under way stops at the end of its chunk (its owner is closing, and a
        buffer nobody will save into is not worth the wait)."""
        with self._cond:
            self._no_warm = True
            if self._warming is not None:
                self._warming.set()

    def release(self, buf: torch.Tensor, *, keep: bool = True) -> None:
        """Give `buf` back; keep=False frees its memory now instead of keeping it for the next save.
        A buffer this pool did not hand out is left alone (dropped with its last reference)."""
        with self._cond:
            if buf.data_ptr() not in self._out:
                return
            self._out.discard(buf.data_ptr())
            if keep:
                self._free.append(buf)
            else:
                self._held -= _footprint(buf)
                self._free.append(None)
            self._cond.notify_all()

    def _forget(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            self._free.append(None)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._held -= sum(_footprint(b) for b in self._free if b is not None)
            self._free = [None] * len(self._free)
            self._speculative = None


def _footprint(buf: torch.Tensor) -> int:
    """Bytes a buffer from _page_aligned holds (its view plus the alignment slack)."""
    return buf.numel() + _PAGE
