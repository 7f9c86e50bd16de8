"""What a save costs training when its staging is freed after each save (release_staging=True), with and
without the staging warmed ahead of it (Checkpointer.warm_staging, which CheckpointManager(every=...) calls
itself a few steps before each save it makes), beside staging kept between saves (the default).

    .venv/bin/python bench/warm_ahead.py                                   # mlp/ddp and mlp/fsdp2
    .venv/bin/python bench/warm_ahead.py --workloads gpt/fsdp2 --pairs 4   # one quick look
    .venv/bin/python bench/warm_ahead.py --workloads mlp/plain --ranks 1    # a core left to background work

2 real gloo ranks (one compute thread each) train a workload of bench/workloads.py (`--ranks 1`: one
process, a plain module, which leaves this 2-core machine a core that training does not use, as a GPU
host's CPUs mostly are). In one launch, after a
first save (the process's: plans made, threads started), `--pairs` rounds; each round runs the three
variants one after the other, and each variant is a triple of cycles of `--cycle` steps:

1. a clean cycle (no save, nothing warming): the baseline of this minute;
2. a lead-in cycle: with "warmed", Checkpointer.warm_staging() is called warm_lead steps before its end
   (omnickpt/cadence.py: the steps faulting the last save's staging in takes at the rate the last warm
   measured, 0.4 GB/s before one has, plus one), the call the manager makes, at the cycle's start
   when the lead is longer than the cycle; the other variants do nothing in it;
3. a save cycle: save(async_save=True) at the end of its first step, and its end waits for the save.

A variant's cost per save = lead-in + save cycle - 2 x its clean cycle: what the save and the warm
before it took from training (the stall, the optimizer step held by the lazy copy, the steps slowed by
background work). Each cycle runs barrier to barrier, so both ranks time the slowest one. Variants:
"kept" (a Checkpointer keeping its staging), "released" (release_staging=True), "warmed"
(release_staging=True and warm_staging() ahead). Figures: the median over rounds, with each rank's
"held" (the optimizer step waiting for the copy) and "snapshot_lazy" (the copy). Results:
bench/out/warm_ahead.json.
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

VARIANTS = ("kept", "released", "warmed")


def _worker(rank: int, world: int, root: str, name: str, cycle: int, pairs: int) -> dict:
    import torch.distributed as dist

    import omnickpt
    from omnickpt.cadence import warm_lead
    from scenario import rmtree
    from workloads import build, train_step
    workload, framework = name.split("/")
    model, opt, module, gen = build(workload, framework, quick=False)
    state = {"model": model, "optimizer": opt}
    ckpts = {"kept": omnickpt.Checkpointer(), "released": omnickpt.Checkpointer(release_staging=True)}
    ckpts["warmed"] = ckpts["released"]
    out = {v: [] for v in VARIANTS}
    saves = 0

    def save(variant: str) -> dict | None:
        nonlocal saves
        path = os.path.join(root, f"s{saves}")
        saves += 1
        return ckpts[variant].save(path, state, async_save=True)

    def run(n: int, *, save_variant: str | None = None, warm_at: int | None = None) -> tuple[float, dict | None]:
        dist.barrier()
        t0, handle = time.perf_counter(), None
        for pos in range(n):
            if warm_at is not None and pos == warm_at:
                ckpts["warmed"].warm_staging()
            train_step(model, module, opt, gen)
            if save_variant is not None and pos == 0:
                handle = save(save_variant)
        report = handle.wait() if handle is not None else None
        dist.barrier()
        return time.perf_counter() - t0, report

    for variant in ("kept", "released"):   # each Checkpointer's first save: its plan, threads, first staging
        run(2, save_variant=variant)
    for _ in range(pairs):
        for variant in VARIANTS:
            clean, _ = run(cycle)
            step_s = clean / cycle
            pool = ckpts["released"]._pool
            lead = warm_lead(pool.expected or 0, step_s, pool.warm_rate)
            warm_at = max(cycle - lead, 0) if variant == "warmed" else None
            lead_in, _ = run(cycle, warm_at=warm_at)
            busy, report = run(cycle, save_variant=variant)
            mine = None
            if report is not None:
                mine = {k: max(r["seconds"].get(k, 0.0) for r in report["per_rank"])
                        for k in ("held", "snapshot_lazy", "stall")}
            out[variant].append({"clean": clean, "lead_in": lead_in, "busy": busy, "lead": lead, "report": mine})
        if rank == 0:   # the round's checkpoints: only the timings matter
            for entry in os.listdir(root):
                rmtree(os.path.join(root, entry))
        dist.barrier()
    for c in {id(c): c for c in ckpts.values()}.values():
        c.close()
    return out


def summarize(rounds: dict) -> dict:
    """Per variant (pure): medians over rounds of the cost per save (lead-in + save cycle - 2 x the clean
    cycle of the same round), the clean cycle, the lead, and the report's held / copy / stall (slowest
    rank)."""
    med = statistics.median
    out = {}
    for variant, rs in rounds.items():
        reps = [r["report"] for r in rs if r["report"]]
        costs = [r["lead_in"] + r["busy"] - 2 * r["clean"] for r in rs]
        out[variant] = {"cost_s": med(costs), "costs": costs,
                        "clean_s": med(r["clean"] for r in rs), "lead": med(r["lead"] for r in rs),
                        **{f"{k}_s": med(r[k] for r in reps) if reps else None
                           for k in ("held", "snapshot_lazy", "stall")}}
    return out


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp/ddp,mlp/fsdp2", help="workload/framework of bench/workloads.py")
    ap.add_argument("--cycle", type=int, default=8, help="steps per cycle (a lead longer than it is cut to it)")
    ap.add_argument("--pairs", type=int, default=6, help="rounds of the three variants")
    ap.add_argument("--ranks", type=int, default=2, help="training processes (1: use the plain framework)")
    args = ap.parse_args(argv)
    if args.cycle < 2 or args.pairs < 1:
        ap.error("--cycle must be at least 2 and --pairs at least 1")
    doc = {"cycle": args.cycle, "pairs": args.pairs, "ranks": args.ranks, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "load_avg": os.getloadavg(), "results": {}}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    for name in args.workloads.split(","):
        root = tempfile.mkdtemp(prefix="omnickpt-warm-ahead-", dir=os.path.join(HERE, "out"))
        try:
            res = run_ranks(args.ranks, _worker, root, name, args.cycle, args.pairs, timeout=3600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        fig = summarize(res[0])
        doc["results"][name] = {"summary": fig, "rounds": res[0]}
        print(f"{name}, {args.ranks} rank(s): cycles of {args.cycle} steps, {args.pairs} rounds; medians (rank "
              "0's cycles, the slowest rank's report)")
        print(f"  {'variant':<9} {'cost/save':>9} {'held':>7} {'copy':>7} {'stall':>7} {'clean cycle':>11} "
              f"{'lead':>4}  costs")
        g = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
        for v in VARIANTS:
            f = fig[v]
            print(f"  {v:<9} {f['cost_s']:>9.3f} {g(f['held_s']):>7} {g(f['snapshot_lazy_s']):>7} "
                  f"{g(f['stall_s']):>7} {f['clean_s']:>11.3f} {f['lead']:>4}  "
                  + " ".join(f"{c:.2f}" for c in f["costs"]))
        with open(os.path.join(HERE, "out", "warm_ahead.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
