"""Background threads that yield to training: a lower CPU priority (nice) and the lowest I/O priority
of the best-effort class, per thread. Megatron's async checkpointing lowers its worker process the
same way; a thread is enough here, since Linux keeps nice and ioprio per thread (task).

The persist thread and the I/O workers of an async save, and the memory tier's lanes, run their
initializer `background(nice)`; the lazy snapshot's copier does not (the optimizer step waits for
it). Threads a lowered thread starts (S3 ranged-GET pools) inherit its priority."""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger("omnickpt")

# ioprio_set(2) / ioprio_get(2) syscall numbers; which = IOPRIO_WHO_PROCESS (a task id: this thread),
# prio = class << 13 | level.
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "arm64": (30, 31)}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_LOWEST_BE = (_IOPRIO_CLASS_BE << 13) | 7


def background(nice: int | None) -> None:
    """Lower the calling thread: nice `nice` (relative to the process's: os.nice semantics on the
    thread alone) and best-effort I/O level 7. None: leave it as it is. Best effort: where the
    system refuses or does not have it (not Linux, a container without the capability), the
    thread keeps its priority and a debug line says why."""
    if nice is None:
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except (AttributeError, OSError) as e:
        log.debug("omnickpt: background thread %d keeps its CPU priority: %s", tid, e)
    numbers = _IOPRIO_SYSCALLS.get(platform.machine())
    if numbers is None:
        return
    number = numbers[0]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, _IOPRIO_LOWEST_BE) != 0:
            log.debug("omnickpt: background thread %d keeps its I/O priority: errno %d", tid, ctypes.get_errno())
    except (AttributeError, OSError) as e:
        log.debug("omnickpt: background thread %d keeps its I/O priority: %s", tid, e)


def thread_priority(tid: int) -> tuple[int, int | None]:
    """(nice, ioprio) of thread `tid` (ioprio None where it cannot be read): what tests check."""
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    numbers = _IOPRIO_SYSCALLS.get(platform.machine())
    if numbers is None:
        return nice, None
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(numbers[1], _IOPRIO_WHO_PROCESS, tid)
    return nice, (got if got >= 0 else None)
