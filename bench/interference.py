"""Background interference: training step time with an async save in flight against without.

    .venv/bin/python bench/interference.py                         # mlp, ddp + fsdp2, omnickpt + dcp
    .venv/bin/python bench/interference.py --framework fsdp2 --rounds 5 --quick

The "steady-state slowdown" of asynchronous checkpointing: the save's stall is what the training
loop waits for, but its background work (copying, checksumming, writing, fsync) shares the
machine's cores and memory bandwidth with the steps that run meanwhile. On 2 real gloo ranks:
each round first times --steps training steps with nothing in flight (the baseline), then starts an
async save and keeps stepping until the save is durable, timing each step. Reports, per library,
the median baseline step, the median step with a save in flight, the slowdown, the steps that ran
while the save was in flight and how long it was in flight. Results to bench/out/interference.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _worker(rank: int, world: int, root: str, workload: str, framework: str, libs: list[str], rounds: int,
            steps: int, quick: bool) -> dict:
    import torch.distributed as dist

    from libs import LIBS
    from workloads import build, train_step
    model, opt, module, gen = build(workload, framework, quick=quick)
    out = {}
    for name in libs:
        lib = LIBS[name]()
        base, busy, flights, overlapped = [], [], [], []
        for r in range(rounds):
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, module, opt, gen)
                base.append(time.perf_counter() - t0)
            dist.barrier()
            t_save = time.perf_counter()
            handle = lib.async_save(os.path.join(root, f"{name}-{r}"), model, opt, module)
            n = 0
            # Step until the save is durable on every rank. The ranks agree on it before each step:
            # a DDP/FSDP step is a collective, and one rank stepping once more than the other hangs.
            while not _everyone(handle.done()):
                t0 = time.perf_counter()
                train_step(model, module, opt, gen)
                busy.append(time.perf_counter() - t0)
                n += 1
            lib.wait(handle)
            flights.append(time.perf_counter() - t_save)
            overlapped.append(n)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(root, f"{name}-{r}"), ignore_errors=True)
        lib.close()
        out[name] = {"base": base, "busy": busy, "flight": flights, "steps_in_flight": overlapped}
    return out


def _everyone(flag: bool) -> bool:
    """Every rank: whether `flag` holds on all of them (one all-reduce)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--framework", default="ddp,fsdp2")
    ap.add_argument("--libs", default="omnickpt,dcp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="baseline steps per round")
    ap.add_argument("--quick", action="store_true", help="the workload's small size")
    ap.add_argument("--root", default=None)
    args = ap.parse_args(argv)
    libs = args.libs.split(",")
    doc = {"workload": args.workload, "rounds": args.rounds, "quick": args.quick, "results": {}}
    for framework in args.framework.split(","):
        root = args.root or tempfile.mkdtemp(prefix="omnickpt-interference-", dir=os.path.join(HERE, "out"))
        per_rank = run_ranks(2, _worker, root, args.workload, framework, libs, args.rounds, args.steps, args.quick,
                             timeout=3600)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
        for name in libs:
            r0 = per_rank[0][name]
            base = statistics.median(r0["base"])
            busy = statistics.median(r0["busy"]) if r0["busy"] else None
            doc["results"][f"{framework}/{name}"] = {
                "step_s": base, "step_in_flight_s": busy,
                "slowdown": (busy / base - 1) if busy else None,
                "steps_in_flight": statistics.median(r0["steps_in_flight"]),
                "in_flight_s": statistics.median(r0["flight"])}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "interference.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{args.workload}, 2 ranks, medians over {args.rounds} rounds (rank 0)")
    print(f"{'layout/library':<18} {'step':>8} {'in flight':>10} {'slowdown':>9} {'steps':>6} {'flight s':>9}")
    for key, row in doc["results"].items():
        slow = f"{row['slowdown'] * 100:+.0f}%" if row["slowdown"] is not None else "-"
        busy = f"{row['step_in_flight_s']:.3f}" if row["step_in_flight_s"] else "-"
        print(f"{key:<18} {row['step_s']:>8.3f} {busy:>10} {slow:>9} {row['steps_in_flight']:>6.0f} "
              f"{row['in_flight_s']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
