"""Staging pools: host memory allocated once and reused, so a snapshot is a plain memory copy.

Two buffers alternate: the next save copies into one while the previous one drains from the
other; a third save waits only if both are still persisting.
"""
from __future__ import annotations

import threading

import torch


class StagingPool:
    def __init__(self, slots: int = 2):
        self._free: list[torch.Tensor | None] = [None] * slots
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes`, waiting while every slot is in use."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            # Prefer a slot already big enough: its pages are faulted in, so the copy runs at memcpy speed.
            fits = [i for i, b in enumerate(self._free) if b is not None and b.numel() >= nbytes
                    and b.is_pinned() == pin]
            buf = self._free.pop(fits[0] if fits else 0)
        if buf is None or buf.numel() < nbytes or buf.is_pinned() != pin:
            buf = None  # drop the old one before allocating the new one
            # Not zero-filled: the first snapshot's copy faults the pages in (one pass over the
            # memory instead of two), and every later save reuses them at memcpy speed.
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._free = [None] * len(self._free)
