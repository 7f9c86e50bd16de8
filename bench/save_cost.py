"""What one async save costs training, measured without the cadence, beside what every="auto" measures.

    .venv/bin/python bench/save_cost.py --workloads wide/ddp --interval 4 --cycles 40 --auto-steps 300

2 real gloo ranks (one compute thread each) train a workload of bench/cadence.py. In one launch:

1. **Fixed cycles**: `--cycles` pairs of cycles of `--interval` steps each, alternating: a cycle whose
   first step ends with save(async_save=True) (a CheckpointManager with every=1, called only there),
   then a cycle of as many steps with no save. A cycle runs from a barrier to a barrier (so both ranks
   time the slowest one), and each of its steps is timed on its own (no barrier between steps: DDP's
   and FSDP's collectives keep the ranks in lockstep, as in training).
   A save's cost is the time of its cycle less the time of the quiet cycle beside it: everything the
   save did to training (its stall, the slowdown of the steps its background work overlapped, and any
   tail after it became durable), against steps of the same minute. The mean over the pairs, with its
   standard error; per position in the cycle, the mean step time with and without the save, which
   shows how many steps a save affects.
2. **every="auto"**: `--auto-steps` steps calling save() at every step; the cadence's own cost per
   save (`cadence_report()["cost_s"]`), interval and baseline every 20 steps. Its window holds the 16
   newest saves: the first one (3-5x a steady one) leaves it after 16 more.

The two figures measure the same thing two ways: the cadence's cost should be near the fixed cycles'
(above it is safe: a longer interval; below it, the overhead seen from outside exceeds the report).
Results: bench/out/save_cost.json.
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


def _worker(rank: int, world: int, root: str, name: str, interval: int, cycles: int, auto_steps: int) -> dict:
    import torch.distributed as dist

    import omnickpt
    from cadence import _build
    from workloads import train_step
    model, opt, module, gen = _build(name)
    state = {"model": model, "optimizer": opt}
    for _ in range(3):   # first steps allocate the optimizer's state
        train_step(model, module, opt, gen)
    step, steps, cycle_s = 3, [], []   # steps: (cycle, "save" | "quiet", position, seconds)
    with omnickpt.CheckpointManager(os.path.join(root, "fixed"), keep_last=2, every=1) as mgr:
        for c in range(cycles):
            for kind in ("save", "quiet"):
                dist.barrier()
                start = time.perf_counter()
                for pos in range(interval):   # no barrier per step: DDP's and FSDP's collectives keep the lockstep
                    t0 = time.perf_counter()
                    train_step(model, module, opt, gen)
                    step += 1
                    if kind == "save" and pos == 0:
                        mgr.save(step, state, async_save=True)
                    steps.append((c, kind, pos, time.perf_counter() - t0))
                dist.barrier()   # the cycle ends when the slowest rank's does: one figure for both ranks
                cycle_s.append((c, kind, time.perf_counter() - start))
                if kind == "save":
                    mgr.wait()   # durable before its quiet cycle: normally long since (see the positions)
    auto = []
    with omnickpt.CheckpointManager(os.path.join(root, "auto"), keep_last=2, every="auto",
                                    max_overhead=0.05) as mgr:
        saves, t0 = 0, time.perf_counter()
        for s in range(1, auto_steps + 1):
            train_step(model, module, opt, gen)
            step += 1
            saves += mgr.save(step, state, async_save=True) is not None
            if s % 20 == 0:
                r = mgr.cadence_report()
                auto.append({"steps": s, "saves": saves, "seconds": time.perf_counter() - t0,
                             "interval": r["interval"], "cost_s": r["cost_s"], "step_s": r["step_s"],
                             "overhead": r["overhead"]})
        mgr.wait()
    return {"steps": steps, "cycles": cycle_s, "auto": auto}


def summarize(steps: list, cycle_s: list, interval: int, cycles: int) -> dict:
    """The fixed cycles' figures (pure): cost per save (mean and standard error over the pairs, the
    first pair left out: the first save of the process), and this rank's mean step time per position."""
    by = {(c, k): s for c, k, s in cycle_s}
    costs = [by[c, "save"] - by[c, "quiet"] for c in range(1, cycles)]
    per_pos = {k: [statistics.fmean(s for c, kk, p, s in steps if kk == k and p == pos and c > 0)
                   for pos in range(interval)] for k in ("save", "quiet")}
    quiet = statistics.fmean(s for c, k, _, s in steps if k == "quiet" and c > 0)
    return {"cost_s": statistics.fmean(costs), "cost_se_s": statistics.stdev(costs) / len(costs) ** 0.5,
            "first_cost_s": by[0, "save"] - by[0, "quiet"], "step_s": quiet, "positions": per_pos}


def main(argv=None) -> int:
    from cadence import WORKLOADS
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="wide/ddp", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--interval", type=int, default=4, help="steps per cycle (a save every 2 cycles)")
    ap.add_argument("--cycles", type=int, default=40, help="pairs of cycles (with a save, without)")
    ap.add_argument("--auto-steps", type=int, default=300, help='steps of every="auto" after the cycles (0: none)')
    args = ap.parse_args(argv)
    if args.interval < 2 or args.cycles < 3:
        ap.error("--interval must be at least 2 and --cycles at least 3")
    doc = {"interval": args.interval, "cycles": args.cycles, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "load_avg": os.getloadavg(), "results": {}}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    for name in args.workloads.split(","):
        root = tempfile.mkdtemp(prefix="omnickpt-save-cost-", dir=os.path.join(HERE, "out"))
        try:
            res = run_ranks(2, _worker, root, name, args.interval, args.cycles, args.auto_steps, timeout=3600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        fixed = [summarize(r["steps"], r["cycles"], args.interval, args.cycles) for r in res]
        print(f"{name}: fixed cycles of {args.interval} steps, {args.cycles - 1} pairs (the first left out)")
        for rank, f in enumerate(fixed):
            print(f"  rank {rank}: cost per save {f['cost_s']:.3f} s (se {f['cost_se_s']:.3f}), the first "
                  f"{f['first_cost_s']:.3f} s; step {f['step_s']:.3f} s")
            for k in ("save", "quiet"):
                print(f"    {k:<5} by position: " + " ".join(f"{v:.3f}" for v in f["positions"][k]))
        if res[0]["auto"]:
            print('  every="auto" (rank 0\'s report): steps saves interval cost_s step_s overhead')
            for a in res[0]["auto"]:
                g = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"   # noqa: E731
                print(f"    {a['steps']:>5} {a['saves']:>5} {a['interval']!s:>8} {g(a['cost_s']):>6} "
                      f"{g(a['step_s']):>6} {g(a['overhead']):>8}")
        doc["results"][name] = {"fixed": fixed, "auto": res[0]["auto"]}
        with open(os.path.join(HERE, "out", "save_cost.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
