"""Run a module-level function on N real gloo ranks (separate spawned processes, CPU).

The benchmark's copy of tests/dist.py (bench/ must not depend on the test tree, and the
ByteCheckpoint driver runs it under another torch). `fn(rank, world_size, *args)` runs inside an
initialised process group; its picklable results come back in rank order.
"""
from __future__ import annotations

import os
import pickle
import queue as _queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, threads, fn, args, results):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # One compute thread per rank: 2 ranks on a 2-core machine, as in the tests.
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(world_size: int, fn, *args, timeout: float = 1800.0, threads: int = 1) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: ByteCheckpoint starts a helper process from rank 0, which daemonic processes
    # may not do. Stragglers are killed below.
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except _queue.Empty:
                failures.append(f"timed out after {timeout:.0f} s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(got))}")
                break
            if ok:
                got[rank] = pickle.loads(out)
            else:
                failures.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not failures else 1)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [got[r] for r in range(world_size)]


def evict(root: str) -> None:
    """Drop every file under `root` from the page cache, so that the next read comes from the
    device, as a restarted job's does: fsync first (DONTNEED cannot drop dirty pages), then
    POSIX_FADV_DONTNEED. No root privileges needed."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
