"""The one helper that runs a function on N real gloo ranks (separate processes, CPU).

    results = run_ranks(4, my_module_level_fn, arg1, arg2)

`fn(rank, world_size, *args)` runs inside an initialised process group; whatever it returns
(picklable) comes back in rank order. A failure on any rank raises with that rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue, env, cwd, path):
    import sys

    import torch
    import torch.distributed as dist
    # The forkserver started with the test process's environment of that moment: the ranks get
    # the environment, folder and import path of the test calling run_ranks.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # plain pickle: tensors travel by value, not as shared-memory handles that die with us
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0, may_die: frozenset = frozenset()) -> list:
    """`may_die`: ranks that may end without a result (a test of rank death); theirs is None."""
    import sys
    # forkserver, with torch and omnickpt imported once in the server: a rank starts in tens of
    # milliseconds instead of the seconds of a spawned interpreter importing torch (most of the
    # suite's time on two cores), and still from a clean single-threaded process, not a fork of pytest.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "omnickpt", "dist"])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, dict(os.environ), os.getcwd(),
                                              list(sys.path)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    failures: list[str] = []
    import queue as _q
    try:
        needed = set(range(world_size)) - set(may_die)
        while not needed <= set(results):
            try:
                rank, ok, out = queue.get(timeout=timeout)
            except _q.Empty:
                failures.append(f"timed out after {timeout:.0f} s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(results))}")
                break
            if ok:
                results[rank] = pickle.loads(out)
            else:
                failures.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    missing = set(range(world_size)) - set(results) - set(may_die)
    if missing:
        raise AssertionError(f"ranks {sorted(missing)} returned no result")
    return [results.get(r) for r in range(world_size)]
