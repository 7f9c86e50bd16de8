"""Chaos: a 2-rank job saving every step to the memory tier (and every 2nd step to a durable root)
is killed with SIGKILL at a random moment, N times; every restart must resume from the newest step
that was committed before the kill, with exact values. Not part of the test suite (it takes a
minute or more); run it from the repository root:

    .venv/bin/python bench/chaos.py [--iterations 10] [--seed 0] [--kill-one] [--lose-memory 0.3]

`--kill-one` kills one rank only (the other then fails its next collective within the timeout, or
is killed by the parent when it hangs past the deadline). `--lose-memory P` also wipes the shared
memory after a kill with probability P (a machine that rebooted): the restart must then resume from
the newest step committed to the durable root. Prints one line per iteration and a
summary: restores from memory, from durable storage, and lost checkpoints (must be 0); exits 1 if
any was lost or any restored value was wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STEP_SECONDS = 0.02   # a training step's compute, so kills land at every phase of the saves


def worker(rank: int, world: int, port: int, root: str, job: str, log: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import omnickpt
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    state = {"model": model, "extra": {"step": 0}}
    ckpt = omnickpt.Checkpointer(timeout=20)
    manager = omnickpt.TieredCheckpointManager(root, memory=f"shm://{job}", persist_every=2, keep_last=2,
                                               checkpointer=ckpt)
    start, tier = 0, "none"
    if manager.latest_step() is not None:
        manager.load_latest(state)
        start = state["extra"]["step"]
        tier = manager.restored[0]
        # Values are a function of the step: exact equality or the restore is wrong.
        exact = all(bool((p == float(start)).all()) for p in model.parameters())
        with open(log, "a") as f:
            f.write(json.dumps({"rank": rank, "restored": start, "tier": tier, "exact": exact}) + "\n")
    for step in range(start + 1, start + 10_000):
        time.sleep(STEP_SECONDS)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        state["extra"]["step"] = step
        manager.save(step, state)          # committed in memory when it returns (sync to memory)
        with open(log, "a") as f:
            f.write(json.dumps({"rank": rank, "committed": step}) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: str, job: str, log: str) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port), "--root", root,
                              "--job", job, "--log", log], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for r in range(2)]


def _events(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-one", action="store_true")
    ap.add_argument("--lose-memory", type=float, default=0.0)
    ap.add_argument("--worker", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--root")
    ap.add_argument("--job")
    ap.add_argument("--log")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, 2, args.port, args.root, args.job, args.log)
        return 0
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="omnickpt-chaos-")
    os.environ["OMNICKPT_SHM_DIR"] = os.path.join(base, "shm")   # a tmpfs-like folder of our own
    root, job, log = os.path.join(base, "durable"), f"chaos{os.getpid()}", os.path.join(base, "events.jsonl")
    counts = {"memory": 0, "durable": 0, "lost": 0, "wrong": 0, "early": 0}
    newest_before = 0
    try:
        for it in range(args.iterations + 1):
            seen = len(_events(log))
            procs = _launch(root, job, log)
            # Start-up takes seconds (more on a loaded machine): wait until this launch restored or
            # committed something, then kill at a random moment of its saving; one kill in five lands
            # at a random moment of the start-up and restore instead.
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0.5, 3.0))
            else:
                up = time.monotonic() + 90
                while len(_events(log)) == seen and time.monotonic() < up:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 2.0))
            victims = [rng.choice(procs)] if args.kill_one else procs
            for p in victims:
                p.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 40
            for p in procs:
                while p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                if p.poll() is None:
                    p.kill()   # a survivor that did not fail by itself in time
                p.wait()
            events = _events(log)[seen:]
            restored = [e for e in events if "restored" in e]
            if it > 0:
                if not restored:
                    # Killed before its restore finished (nothing saved either): the next start retries.
                    counts["early"] += 1
                    print(f"iteration {it}: killed before the restore finished; the next start retries")
                else:
                    step = min(e["restored"] for e in restored)
                    tier = restored[0]["tier"]
                    counts[tier] = counts.get(tier, 0) + 1
                    lost = step < newest_before
                    wrong = not all(e["exact"] for e in restored)
                    counts["lost"] += lost
                    counts["wrong"] += wrong
                    print(f"iteration {it}: restored step {step} from {tier} (newest committed before the kill: "
                          f"{newest_before}){' LOST' if lost else ''}{' WRONG VALUES' if wrong else ''}")
            # A step is committed in memory when every rank's save returned: the newest such step of
            # this launch (earlier launches' steps may have been in a memory wiped since).
            launch = _events(log)[seen:]
            committed = [e["committed"] for e in launch if "committed" in e]
            per_rank = {r: max([e["committed"] for e in launch if e.get("rank") == r and "committed" in e],
                               default=0) for r in (0, 1)}
            newest_before = max(newest_before, min(per_rank.values())) if committed else newest_before
            if rng.random() < args.lose_memory:
                shutil.rmtree(os.environ["OMNICKPT_SHM_DIR"], ignore_errors=True)
                try:   # only what reached the durable root survives a lost machine
                    with open(os.path.join(root, "latest")) as f:
                        newest_before = int(f.read())
                except FileNotFoundError:
                    newest_before = 0
                print(f"  (shared memory wiped: the newest durable step is {newest_before})")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.iterations} kills: {counts['memory']} restores from memory, {counts['durable']} from durable "
          f"storage, {counts['early']} killed before their restore finished, {counts['lost']} lost checkpoints, "
          f"{counts['wrong']} restores with wrong values")
    return 1 if counts["lost"] or counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
