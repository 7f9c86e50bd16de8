"""Memory tier benchmark: the stall of a save to shared memory, and the restore time after kill -9
from shared memory against a load from disk (warm page cache and cold).

    .venv/bin/python bench/memory_tier.py [--mb 805] [--reps 5] [--steps 6] [--out result.json]

One process, a model of --mb megabytes (fp32 Linear(4096, 4096) layers). The trainer process saves
steps to TieredCheckpointManager(root, memory="shm://JOB", persist_every=1) with async saves, waits for
each step's memory commit and durable copy outside the timed call (steady state: training is
slower than persisting), is then killed with SIGKILL; each restore runs in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.environ.get("OMNICKPT_REPO") or (_HERE if os.path.isdir(os.path.join(_HERE, "omnickpt")) else "/work/main")


def build(mb: int):
    import torch
    n = max(1, round(mb * 1e6 / (4096 * 4096 * 4 + 4096 * 4)))
    # skip_init + zero_: no slow random init, but every page touched (as after a real init)
    model = torch.nn.Sequential(*[torch.nn.utils.skip_init(torch.nn.Linear, 4096, 4096) for _ in range(n)])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def trainer(root: str, job: str, mb: int, steps: int) -> None:
    import torch
    import omnickpt
    model = build(mb)
    mgr = omnickpt.TieredCheckpointManager(root, memory=f"shm://{job}", persist_every=1, keep_last=2)
    disk = omnickpt.CheckpointManager(root + "-plain", keep_last=1)
    out = {"memory_stall": [], "memory_commit": [], "durable_copy": [], "disk_async_stall": [], "disk_sync": []}
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state = {"model": model, "extra": {"step": step}}
        t0 = time.perf_counter()
        h = mgr.save(step, state, async_save=True)
        out["memory_stall"].append(time.perf_counter() - t0)
        h.wait_memory()
        out["memory_commit"].append(time.perf_counter() - t0)
        h.wait()
        out["durable_copy"].append(time.perf_counter() - t0)
        # the same state to disk, without a memory tier: async stall, then a synchronous save
        t0 = time.perf_counter()
        # a manager takes each step once: the async save as step 2N, the sync one as 2N + 1
        hd = disk.save(2 * step, state, async_save=True)
        out["disk_async_stall"].append(time.perf_counter() - t0)
        hd.wait()
        t0 = time.perf_counter()
        disk.save(2 * step + 1, state)
        out["disk_sync"].append(time.perf_counter() - t0)
    print(json.dumps(out), flush=True)
    print(f"committed {steps}", flush=True)
    while True:
        time.sleep(1)


def restore(root: str, job: str, mb: int, how: str) -> None:
    t_start = time.perf_counter()
    import torch
    import omnickpt
    # omnickpt's adapters import these lazily on the first save/load (about 2 s on this machine);
    # imported here so that load_s is the load itself. process_s includes them.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    model = build(mb)
    state = {"model": model, "extra": {}}
    if how == "cold":
        # Drop the durable files from the page cache (clean pages after fsync): a cold read.
        for dirpath, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    t0 = time.perf_counter()
    if how == "memory":
        mgr = omnickpt.TieredCheckpointManager(root, memory=f"shm://{job}", persist_on_failure=False,
                                               on_close="keep_latest")
        res = mgr.load_latest(state)
    else:
        res = omnickpt.CheckpointManager(root).load_latest(state)
    took = time.perf_counter() - t0
    first = next(model.parameters()).flatten()[0].item()
    assert first == 1.0 * int(state["extra"]["step"]), first
    print(json.dumps({"how": how, "tier": res.report.get("tier", "durable"), "step": state["extra"]["step"],
                      "load_s": took, "process_s": time.perf_counter() - t_start, "check": first}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=805)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", default="main")
    ap.add_argument("--root")
    ap.add_argument("--job")
    ap.add_argument("--how")
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    if a.role == "trainer":
        return trainer(a.root, a.job, a.mb, a.steps)
    if a.role == "restore":
        return restore(a.root, a.job, a.mb, a.how)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.mkdtemp(prefix="omnickpt-memtier-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    root = os.path.join(tmp, "durable")
    me = [sys.executable, os.path.abspath(__file__), "--mb", str(a.mb), "--root", root, "--job", job]
    env = dict(os.environ, PYTHONPATH=REPO)
    child = subprocess.Popen(me + ["--role", "trainer", "--steps", str(a.steps)], stdout=subprocess.PIPE, text=True, env=env)
    timings = json.loads(child.stdout.readline())
    assert child.stdout.readline().startswith("committed")
    child.send_signal(signal.SIGKILL)
    child.wait()
    runs = {"memory": [], "warm": [], "cold": []}
    for _ in range(a.reps):
        for how in runs:
            out = subprocess.run(me + ["--role", "restore", "--how", how], capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(out.stderr)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert r["step"] == a.steps and (r["tier"] == "memory") == (how == "memory"), r
            runs[how].append(r)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    steady = slice(2, None)   # the first two saves allocate staging memory and fault pages in
    result = {
        "state_mb": a.mb, "steps": a.steps,
        "save": {k: {"median_steady": med(v[steady]), "all": v} for k, v in timings.items()},
        "restore_after_kill9": {how: {"load_median_s": med([r["load_s"] for r in rs]),
                                      "process_median_s": med([r["process_s"] for r in rs]),
                                      "all_load_s": [r["load_s"] for r in rs]} for how, rs in runs.items()},
    }
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    from omnickpt.storage.shm import clear_memory
    clear_memory(job)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
