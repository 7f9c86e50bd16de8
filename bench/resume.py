"""A restarted job's first save: what training loses to it, in a process that loaded its checkpoint
first, beside one that starts from scratch.

    .venv/bin/python bench/resume.py                                   # 4 workloads, 3 launches of each kind
    .venv/bin/python bench/resume.py --workloads mlp/ddp --launches 2  # one quick look

A lazy snapshot returns from save() after a few milliseconds and copies in the background; the next
optimizer step waits for that copy. The first copy of a process goes into staging memory it never
touched, and faulting those pages in is what the step waits for (bench/compare.py, "training lost,
first save"). After a load, omnickpt warms a staging buffer of the size the rank wrote into the loaded
checkpoint in the background (loading._warm_staging), so that a restarted job's first save copies
into warm memory.

Per workload (2 gloo ranks, bench/workloads.py): one launch saves a checkpoint; then `--launches`
pairs of fresh launches, alternating: "scratch" runs the training loop with async saves (bench/
scenario.py async_loop: `--steps` steps, then a save, `--saves` times) from the built state;
"resumed" first loads that checkpoint (its files evicted from the page cache: a restarted job's cold
read), then the same loop. Both kinds run `--warm-steps` timed training steps before the loop (the
lead-in: in "resumed" the staging warms in the background meanwhile). Per save: the slowest rank's
stall, the excess of the step after it over the loop's other steps (scenario.after_save_excess), and
the report's "held" (the optimizer step waiting at the fence). The lead-in's excess (its steps' time
less as many of the loop's steps, slowest rank) shows what the warm after the load costs the steps it
overlaps: "resumed" less "scratch" is the warm's cost and the load's aftermath, an upper bound on
what the first save's saving moved rather than removed. Figures: medians over launches (the first
save, the lead-in) and over the later saves of every launch (steady). Results: bench/out/resume.json.
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

import scenario  # noqa: E402
from libs import LIBS  # noqa: E402
from ranks import evict, run_ranks  # noqa: E402
from workloads import build, train_step  # noqa: E402


def _save_base(rank: int, world: int, workload: str, framework: str, path: str) -> None:
    lib = LIBS["omnickpt"]()
    model, opt, module, _ = build(workload, framework, quick=False)
    lib.save(path, model, opt, module)
    lib.close()


def _launch(rank: int, world: int, workload: str, framework: str, base: str | None, cfg: dict) -> dict:
    """One fresh 2-rank launch: optionally the load of `base`, a few timed steps, then the async loop."""
    lib = LIBS["omnickpt"]()
    model, opt, module, gen = build(workload, framework, quick=False, seed=1)
    step = lambda: train_step(model, module, opt, gen)  # noqa: E731
    load_s = None
    if base is not None:
        t0 = time.perf_counter()
        lib.load(base, model, opt, module)
        load_s = time.perf_counter() - t0
    lead_in = []
    for _ in range(cfg["warm_steps"]):
        t0 = time.perf_counter()
        step()
        lead_in.append(time.perf_counter() - t0)
    stalls, _, reports, rounds = scenario.async_loop(lib, (model, opt, module), step, rank, cfg["root"], cfg)
    lib.close()
    held = [max(r["seconds"].get("held", 0.0) for r in rep["per_rank"]) if rep else None for rep in reports]
    return {"async_stalls": stalls, "async_after": scenario.after_save_excess(rounds), "held": held,
            "load_s": load_s, "lead_in_excess": lead_in_excess(lead_in, rounds)}


def lead_in_excess(lead_in: list[float], rounds: list[list[float]]) -> float:
    """The lead-in steps' time less as many of the loop's steps (pure): the median of every round's
    steps but its first (the one after a save), as after_save_excess takes its baseline."""
    base = statistics.median(t for r in rounds for t in r[1:])
    return sum(lead_in) - len(lead_in) * base


def summarize(kind_launches: list[list[dict]]) -> dict:
    """A kind's launches -> first and steady figures (medians; pure)."""
    lost = [scenario.lost_per_save(launch) for launch in kind_launches]
    stall = [[max(v) for v in zip(*[r["async_stalls"] for r in launch])] for launch in kind_launches]
    held = [launch[0]["held"][:-1] for launch in kind_launches]   # the saves `lost` covers
    med = statistics.median
    lead = [max(r["lead_in_excess"] for r in launch) for launch in kind_launches]
    return {"lead_in_excess": med(lead), "lead_in_per_launch": lead,
            "lost_first": med([x[0] for x in lost]), "lost_steady": med([v for x in lost for v in x[1:]]),
            "stall_first": med([x[0] for x in stall]), "stall_steady": med([v for x in stall for v in x[1:]]),
            "held_first": med([h[0] for h in held]), "held_steady": med([v for h in held for v in h[1:]]),
            "lost_per_launch": lost}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp/ddp,mlp/fsdp2,gpt/ddp,gpt/fsdp2")
    ap.add_argument("--launches", type=int, default=3, help="launches of each kind (scratch, resumed)")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="training steps between two saves")
    ap.add_argument("--warm-steps", type=int, default=3, help="timed steps before the loop (after the load)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "resume.json"))
    args = ap.parse_args(argv)
    if args.saves < 3 or args.steps < 2:
        ap.error("--saves 3 or more (a first save, a steady one, and a last that no step follows) and --steps 2 "
                 "or more (the step after a save is compared with the others)")
    root = tempfile.mkdtemp(prefix="omnickpt-resume-")
    doc: dict = {"command": " ".join(["bench/resume.py"] + (argv if argv is not None else sys.argv[1:])),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": {}}
    try:
        for name in args.workloads.split(","):
            workload, framework = name.split("/")
            base = os.path.join(root, "base")
            run_ranks(2, _save_base, workload, framework, base)
            cfg = {"root": os.path.join(root, "loop"), "async_saves": args.saves, "steps": args.steps,
                   "warm_steps": args.warm_steps}
            os.makedirs(cfg["root"], exist_ok=True)
            kinds: dict[str, list] = {"scratch": [], "resumed": []}
            for _ in range(args.launches):
                kinds["scratch"].append(run_ranks(2, _launch, workload, framework, None, cfg))
                evict(base)
                kinds["resumed"].append(run_ranks(2, _launch, workload, framework, base, cfg))
            res = {k: summarize(v) for k, v in kinds.items()}
            doc["results"][name] = res
            for k, r in res.items():
                print(f"{name:<10} {k:<8} lead-in steps' excess {r['lead_in_excess']:.3f} s; training lost, first "
                      f"save {r['lost_first']:.3f} s (held {r['held_first']:.3f}, stall {r['stall_first']:.3f}); "
                      f"steady {r['lost_steady']:.3f} s (held {r['held_steady']:.3f}, stall {r['stall_steady']:.3f})",
                      flush=True)
            shutil.rmtree(base, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
