"""A durable synchronous save, with and without an idle staging buffer in the Checkpointer's pool.

    .venv/bin/python bench/sync_save.py                                   # mlp and gpt, ddp and fsdp2
    .venv/bin/python bench/sync_save.py --workloads mlp/fsdp2 --rounds 6

A sync save copies the rank's file into an idle host buffer of the pool when one holds it (the job's
async saves keep one warm, or a load landed in one) and writes it with one aligned write; without one
it writes from the tensors' own memory. 2 real gloo ranks (one compute thread each) train a workload of
bench/workloads.py; in one launch, `--rounds` rounds, each one sync save of each variant, in alternating
order, one training step between saves:

- "staged": a Checkpointer that made one async save first (its pool keeps the buffer);
- "from tensors": a Checkpointer that only saves synchronously (no buffer in its pool).

Each save runs barrier to barrier, so a figure is the slowest rank's. Figures: the median over rounds,
and the report's write and fsync phases (slowest rank). Results: bench/out/sync_save.json.
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

VARIANTS = ("staged", "from tensors")


def _worker(rank: int, world: int, root: str, name: str, rounds: int) -> dict:
    import torch.distributed as dist

    import omnickpt
    from scenario import rmtree
    from workloads import build, train_step
    workload, framework = name.split("/")
    model, opt, module, gen = build(workload, framework, quick=False)
    state = {"model": model, "optimizer": opt}
    ckpts = {"staged": omnickpt.Checkpointer(), "from tensors": omnickpt.Checkpointer()}
    ckpts["staged"].save(os.path.join(root, "warm"), state, async_save=True).wait()   # the pool's buffer
    for c in ckpts.values():   # the process's first save of each: plans made, threads started
        c.save(os.path.join(root, "first"), state)
        dist.barrier()
        if rank == 0:
            rmtree(os.path.join(root, "first"))
    out = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for variant in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            path = os.path.join(root, f"{i}-{variant.replace(' ', '-')}")
            dist.barrier()
            t0 = time.perf_counter()
            report = ckpts[variant].save(path, state).wait()
            dist.barrier()
            seconds = time.perf_counter() - t0
            phases = (report or {}).get("phases", {})
            out[variant].append({"seconds": seconds, "held_bytes": ckpts[variant]._pool.held,
                                 **{k: phases.get(k, {}).get("max") for k in ("write", "fsync", "snapshot")}})
            if rank == 0:
                rmtree(path)
            train_step(model, module, opt, gen)
    for c in ckpts.values():
        c.close()
    return out


def summarize(rounds: dict) -> dict:
    """Per variant (pure): medians over rounds of the save's time and its report's phases."""
    med = statistics.median
    out = {}
    for variant, rs in rounds.items():
        out[variant] = {"seconds": med(r["seconds"] for r in rs), "all": [r["seconds"] for r in rs],
                        "pool_mb": max(r["held_bytes"] for r in rs) / 2**20,
                        **{f"{k}_s": med(r[k] for r in rs) if all(r[k] is not None for r in rs) else None
                           for k in ("write", "fsync", "snapshot")}}
    return out


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp/ddp,mlp/fsdp2,gpt/ddp,gpt/fsdp2",
                    help="workload/framework of bench/workloads.py")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the two variants")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    doc = {"rounds": args.rounds, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": os.getloadavg(),
           "results": {}}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    for name in args.workloads.split(","):
        root = tempfile.mkdtemp(prefix="omnickpt-sync-save-", dir=os.path.join(HERE, "out"))
        try:
            res = run_ranks(2, _worker, root, name, args.rounds, timeout=3600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        fig = summarize(res[0])
        doc["results"][name] = {"summary": fig, "rounds": res[0]}
        print(f"{name}, 2 ranks, {args.rounds} rounds; medians (slowest rank)")
        g = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
        for v in VARIANTS:
            f = fig[v]
            print(f"  {v:<13} {f['seconds']:.3f} s  (write {g(f['write_s'])}, fsync {g(f['fsync_s'])}, copy "
                  f"{g(f['snapshot_s'])}; pool {f['pool_mb']:.0f} MB)  " + " ".join(f"{s:.2f}" for s in f["all"]))
        with open(os.path.join(HERE, "out", "sync_save.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
