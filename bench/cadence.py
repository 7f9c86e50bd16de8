"""every="auto" checked by a stopwatch outside the manager: the overhead the cadence reports beside the
overhead the loop really pays, on a noisy machine.

    .venv/bin/python bench/cadence.py                      # mlp/ddp, gpt/fsdp2, wide/ddp; 3 runs each
    .venv/bin/python bench/cadence.py --workloads mlp/ddp --runs 1 --pairs 2   # one quick look

2 real gloo ranks (one compute thread each) train the workload. Each run, in one launch:

1. warm-up: save() at every step with every="auto" (max_overhead 0.05) until the cadence has
   profiled its baseline, the ranks agreed on an interval and `--warmup-saves` saves were made (at
   most `--warmup-max` steps). The cadence keeps a process's first save (3-10x a steady one: staging
   faulted in, plans made) out of its cost itself; `--warmup-saves 17` fills its window of 16 saves
   with later ones, as in a long job;
2. `--pairs` pairs of rounds: a round of n steps with no save() call (the baseline, measured now,
   beside the round it is compared with: the machine's speed drifts between rounds more than the
   target) and a round of n steps calling save(step, state, async_save=True) at every step, the
   baseline first in even pairs and second in odd ones (a drift within a run weighs on both kinds
   alike); n is a whole number of intervals (the interval in force at the round's start, at least
   `--min-steps`), so a with-round holds the saves the cadence would make in n steps, and the round
   runs on until its last save is durable and one more step ran (its whole cost inside the round);
   the outside overhead of a pair = (the with-round's seconds - its steps x the baseline's seconds
   per step) / (n x the baseline's seconds per step);
3. a positive control, the same alternation with a manager saving every `--control-every` steps, in
   rounds as long as the cadence's: the stopwatch must see its cost, or it could not see anything.

Per run: the median over pairs of the outside overhead, and the median of the report's
`overhead` taken at the start of each with-round (the figure the manager claims for the interval
it used). The interval moves within a round as each save is measured (9 -> 8 steps: a round of
18 steps then holds 3 saves, not 2), so beside it "for the round": the report's cost per save at
the round's end x the saves the round made / (n x its baseline), the report's claim for exactly
the saves the stopwatch timed. Each step's seconds (the save() call included) are kept in
bench/out/cadence.json ("trace_with", "trace_without"). Per workload: medians over `--runs` runs, and
where the saves' cost landed (each with-round step by its place after a save, against the round
without saves) beside how far the cadence's baseline sat above that round.
mlp's save is in flight longer than a step. Results: bench/out/cadence.json (`--out` for another file).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (workload of bench/workloads.py, framework); "wide" is mlp at half the depth: a shorter save
WORKLOADS = {"mlp/ddp": ("mlp", "ddp", {}), "gpt/fsdp2": ("gpt", "fsdp2", {}),
             "wide/ddp": ("mlp", "ddp", {"layers": 4})}


def _build(name: str):
    import workloads as W
    workload, framework, override = WORKLOADS[name]
    if override:   # a variant of a bench workload: its class with other sizes
        cls, full, small = W.WORKLOADS[workload]
        W.WORKLOADS = {**W.WORKLOADS, workload: (cls, {**full, **override}, small)}
    return W.build(workload, framework, quick=False)


def quiet_first(pair: int) -> bool:
    """Whether a pair's round without saves runs first: the order alternates (without-with, with-without,
    ...), so that a machine drifting slower or faster through a run weighs on both kinds of round alike
    (always timing the round with saves second counted a slowing machine as the saves' cost)."""
    return pair % 2 == 0


def pair_overhead(quiet_s: float, quiet_steps: int, busy_s: float, busy_steps: int, n: int) -> float:
    """The with-round's time beyond as many steps at the round without saves' pace, against the n steps
    its saves cover (the with-round may run a few steps past n, until its last save is durable)."""
    base = quiet_s / quiet_steps
    return (busy_s - busy_steps * base) / (n * base)


def by_position(pairs: list[dict]) -> dict[int, float]:
    """Where the saves' cost lands: each with-round step's time against its pair's round without saves,
    by the step's place after the last save started (0: the step whose save() call started it), as the
    mean ratio less 1; the steps before a round's first save are left out. The cadence's baseline is its
    quiet steps, the ones after a save's flight and settling step: when those are still slower than the
    round without saves, the report is below the stopwatch by that much a step."""
    at: dict[int, list[float]] = {}
    for p in pairs:
        k = None
        for seconds, saved in p["trace_with"]:
            k = 0 if saved else (None if k is None else k + 1)
            if k is not None:
                at.setdefault(k, []).append(seconds / p["without_s_per_step"])
    return {k: statistics.fmean(v) - 1 for k, v in sorted(at.items())}


def baseline_bias(pairs: list[dict]) -> float | None:
    """The cadence's baseline at each with-round's end against the pair's round without saves (the median
    over pairs of the ratio, less 1): above 0, the report counts that part of every step as no save's."""
    ratios = [p["report_step_s"] / p["without_s_per_step"] for p in pairs if p["report_step_s"]]
    return statistics.median(ratios) - 1 if ratios else None


def _worker(rank: int, world: int, root: str, name: str, max_overhead: float, pairs: int, min_steps: int,
            control_every: int, warmup_max: int, warmup_saves: int = 2):
    import torch.distributed as dist

    import omnickpt
    from workloads import train_step
    model, opt, module, gen = _build(name)
    state = {"model": model, "optimizer": opt}
    step = 0
    trace: list[tuple[float, bool]] = []   # the last round's steps (run_round)

    def run_round(n: int, mgr=None) -> tuple[float, int, int]:
        """n steps; with mgr, save() called at each, and then on until the round's last save is durable
        and one more step ran, so that the round holds the whole cost of its saves (save() is still
        called then by "auto", whose measurements need every step; a fixed cadence would start new
        saves and is not called). Returns (seconds, steps, saves); `trace` holds each step's seconds
        on this rank (the save() call included) and whether it started a save."""
        nonlocal step
        trace.clear()
        dist.barrier()
        t0, done, saves, handle, durable_at = time.perf_counter(), 0, 0, None, None
        calls_after = mgr is not None and mgr.cadence_report()["mode"] == "auto"
        while True:
            if mgr is not None and handle is not None and durable_at is None and handle.done():
                durable_at = done
            # every rank stops at the same step (rank 0's view of its last save): DDP's and FSDP's steps
            # are collectives, a rank that stopped early would hang the others
            if done >= n and (mgr is None or dist_all(handle is None or (durable_at is not None
                                                                       and done > durable_at))[0]):
                break
            t_step = time.perf_counter()
            train_step(model, module, opt, gen)
            step, done = step + 1, done + 1
            saved = False
            if mgr is not None and (done <= n or calls_after):
                h = mgr.save(step, state, async_save=True)
                if h is not None:
                    handle, durable_at, saves, saved = h, None, saves + 1, True
            trace.append((time.perf_counter() - t_step, saved))
        seconds = time.perf_counter() - t0
        # the ranks run in lockstep (DDP's all-reduce, FSDP's gathers): the slowest rank's time
        return max(dist_all(seconds)), done, saves

    def dist_all(x):
        out = [None] * world
        dist.all_gather_object(out, x)
        return out

    def alternate(mgr, n_of) -> list[dict]:
        out = []
        for k in range(pairs):
            n = dist_all(n_of())[0]     # rank 0's: every rank runs the same steps
            rep = mgr.cadence_report()
            rounds = {}
            for saving in ((False, True) if quiet_first(k) else (True, False)):
                rounds[saving] = (run_round(n, mgr if saving else None), list(trace))
            (quiet_s, quiet_n, _), quiet_trace = rounds[False]
            (busy_s, busy_n, saves), busy_trace = rounds[True]
            end = mgr.cadence_report()
            base = quiet_s / quiet_n
            out.append({"n": n, "without_first": quiet_first(k), "without_s_per_step": base, "with_s": busy_s,
                        "with_steps": busy_n, "saves": saves,
                        "outside": pair_overhead(quiet_s, quiet_n, busy_s, busy_n, n), "reported": rep["overhead"],
                        "interval": rep["interval"], "interval_after": end["interval"],
                        # what the report says this round's saves cost: its cost per save x the saves
                        "reported_round": (end["cost_s"] * saves / (n * end["step_s"])
                                           if end["cost_s"] is not None and end["step_s"] else None),
                        "report_step_s": end["step_s"], "report_cost_s": end["cost_s"],
                        "trace_without": [t for t, _ in quiet_trace], "trace_with": busy_trace})
        return out

    result = {}
    with omnickpt.CheckpointManager(os.path.join(root, "auto"), keep_last=2, every="auto",
                                    max_overhead=max_overhead) as mgr:
        warm = 0
        # every rank decides alike (rank 0's view): a rank that left the loop early would hang the others
        saves = 0
        while warm < warmup_max and dist_all(mgr.cadence_report()["interval"] is None or saves < warmup_saves)[0]:
            train_step(model, module, opt, gen)
            step, warm = step + 1, warm + 1
            saves += mgr.save(step, state, async_save=True) is not None
        # the warm-up ends right after a save started: the first round without saves must not run
        # beside its flight (its steps are the baseline the first pair is measured against)
        mgr.wait()
        result["warmup_steps"], result["warmup_saves"] = warm, saves

        def n_auto() -> int:
            k = mgr.cadence_report()["interval"] or 1
            return k * max(1, math.ceil(min_steps / k))
        result["auto"] = alternate(mgr, n_auto)
        mgr.wait()
        result["report"] = mgr.cadence_report()
    with omnickpt.CheckpointManager(os.path.join(root, "control"), keep_last=2, every=control_every) as mgr:
        # rounds as long as the cadence's: a shorter round's mean step is noisier than the saves it times
        result["control"] = alternate(mgr, lambda: control_every * max(2, math.ceil(min_steps / control_every)))
        mgr.wait()
        result["control_report"] = mgr.cadence_report()
    return result


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--min-steps", type=int, default=24)
    ap.add_argument("--control-every", type=int, default=2)
    ap.add_argument("--max-overhead", type=float, default=0.05)
    ap.add_argument("--warmup-max", type=int, default=60, help="most steps of the warm-up")
    ap.add_argument("--warmup-saves", type=int, default=2,
                    help="saves made before the rounds (17: the first save has left the cadence's window)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "cadence.json"),
                    help="where the results and every step's trace go (one file per invocation)")
    args = ap.parse_args(argv)
    doc = {"max_overhead": args.max_overhead, "runs": args.runs, "pairs": args.pairs, "warmup_saves": args.warmup_saves,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": os.getloadavg(), "results": {}}
    med = statistics.median
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"   # noqa: E731
    print(f"every='auto', max_overhead={args.max_overhead}: outside = stopwatch, seconds per step with saves "
          f"against without (alternating rounds); reported = cadence_report()['overhead'] at a round's start; "
          f"for the round = its cost per save x the saves the round made (the interval moves within a round)")
    print(f"{'workload':<10} {'run':>3} {'interval':>8} {'step s':>7} {'stall s':>7} {'durable s':>9} "
          f"{'cost s':>7} {'reported':>8} {'for the round':>13} {'outside':>8}  "
          f"{'control (every ' + str(args.control_every) + ')':>20}")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name in args.workloads.split(","):
        runs = []
        for r in range(args.runs):
            root = tempfile.mkdtemp(prefix="omnickpt-cadence-", dir=os.path.join(HERE, "out"))
            try:
                res = run_ranks(2, _worker, root, name, args.max_overhead, args.pairs, args.min_steps,
                                args.control_every, args.warmup_max, args.warmup_saves, timeout=3600)[0]
            finally:
                shutil.rmtree(root, ignore_errors=True)
            res["outside"] = med(p["outside"] for p in res["auto"])
            reported = [p["reported"] for p in res["auto"] if p["reported"] is not None]
            res["reported"] = med(reported) if reported else None
            rounds = [p["reported_round"] for p in res["auto"] if p["reported_round"] is not None]
            res["reported_round"] = med(rounds) if rounds else None
            res["control_outside"] = med(p["outside"] for p in res["control"])
            runs.append(res)
            rep = res["report"]
            f = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"   # noqa: E731
            print(f"{name:<10} {r:>3} {rep['interval']!s:>8} {f(rep['step_s']):>7} {f(rep['stall_s']):>7} "
                  f"{f(rep['background_s']):>9} {f(rep['cost_s']):>7} {pct(res['reported']):>8} "
                  f"{pct(res['reported_round']):>13} {pct(res['outside']):>8}  {pct(res['control_outside']):>20}",
                  flush=True)
        def med_of(key):
            vals = [r[key] for r in runs if r[key] is not None]
            return med(vals) if vals else None
        summary = {"outside": med(r["outside"] for r in runs), "reported": med_of("reported"),
                   "reported_round": med_of("reported_round"),
                   "control_outside": med(r["control_outside"] for r in runs)}
        print(f"{name:<10} median of {len(runs)}: reported {pct(summary['reported'])} (for the rounds "
              f"{pct(summary['reported_round'])}), outside {pct(summary['outside'])}, control "
              f"{pct(summary['control_outside'])}", flush=True)
        pos = by_position([p for r in runs for p in r["auto"]])
        bias = [b for b in (baseline_bias(r["auto"]) for r in runs) if b is not None]
        summary["by_position"], summary["baseline_bias"] = pos, (med(bias) if bias else None)
        print(f"{name:<10} steps after a save against the rounds without saves: "
              + ", ".join(f"{k}: {pct(v)}" for k, v in list(pos.items())[:8])
              + f"; the cadence's baseline {pct(summary['baseline_bias'])}", flush=True)
        doc["results"][name] = {"runs": runs, "median": summary}
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
