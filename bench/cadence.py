"""The save interval every="auto" chooses on the benchmark workloads (CheckFreq's rule, omnickpt/cadence.py).

    .venv/bin/python bench/cadence.py                          # mlp and gpt, ddp and fsdp2, 40 steps
    .venv/bin/python bench/cadence.py --workloads mlp --frameworks ddp --steps 60 --max-overhead 0.05

2 real gloo ranks train the workload and call `CheckpointManager.save(step, state, async_save=True)`
at every step with every="auto"; the manager measures the step time, the stall, the time until a
save is durable and the slowdown of steps with a save in flight, and picks the interval. Reports,
per workload, rank 0's cadence_report() at the end and the steps that were saved. Results to
bench/out/cadence.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _worker(rank: int, world: int, root: str, workload: str, framework: str, steps: int, max_overhead: float):
    import omnickpt
    from workloads import build, train_step
    model, opt, module, gen = build(workload, framework, quick=False)
    saved = []
    with omnickpt.CheckpointManager(root, keep_last=2, every="auto", max_overhead=max_overhead) as mgr:
        for step in range(steps):
            train_step(model, module, opt, gen)
            if mgr.save(step, {"model": model, "optimizer": opt}, async_save=True) is not None:
                saved.append(step)
        mgr.wait()
        return saved, mgr.cadence_report()


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp,gpt")
    ap.add_argument("--frameworks", default="ddp,fsdp2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-overhead", type=float, default=0.02)
    args = ap.parse_args(argv)
    doc = {"steps": args.steps, "max_overhead": args.max_overhead, "results": {}}
    print(f"every='auto', max_overhead={args.max_overhead}, {args.steps} steps, 2 ranks (rank 0's report)")
    print(f"{'workload':<12} {'interval':>8} {'step s':>7} {'stall s':>8} {'durable s':>9} {'interf. s':>9} "
          f"{'overhead':>8}  saved steps")
    for workload in args.workloads.split(","):
        for framework in args.frameworks.split(","):
            root = tempfile.mkdtemp(prefix="omnickpt-cadence-", dir=os.path.join(HERE, "out"))
            try:
                saved, rep = run_ranks(2, _worker, root, workload, framework, args.steps, args.max_overhead,
                                       timeout=3600)[0]
            finally:
                shutil.rmtree(root, ignore_errors=True)
            doc["results"][f"{workload}/{framework}"] = {"saved": saved, "report": rep}
            f = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"   # noqa: E731
            print(f"{workload + '/' + framework:<12} {rep['interval']:>8} {f(rep['step_s']):>7} {f(rep['stall_s']):>8} "
                  f"{f(rep['background_s']):>9} {f(rep['interference_s']):>9} {f(rep['overhead']):>8}  {saved}")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "cadence.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
