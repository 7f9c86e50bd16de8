"""omnickpt against PyTorch DCP (and ByteCheckpoint's figures when present), side by side.

    .venv/bin/python bench/compare.py            # full run: MLP 805 MB + GPT, DDP + FSDP2, 2 ranks
    .venv/bin/python bench/compare.py --quick    # smoke test with small models
    .venv/bin/python bench/compare.py --bcp      # also run bench/bytecheckpoint.sh first

Same torch, same process layout (2 gloo ranks on CPU, spawned), same state (seeded models after
one Adam step), same disk (one temporary directory). Every load is timed twice: cold (the checkpoint's files
evicted from the page cache first, fsync + POSIX_FADV_DONTNEED, as a restarted job finds them: one
library's save may leave its files cached and another's not) and warm (right after, cached). For
every workload x framework, each library gets three
launches: 2 ranks (async saves while training, async totals, durable sync saves, load at the same
layout), 1 rank (2->1 resharded load, then a 1-rank save), 2 ranks (1->2 resharded load), and
`--first-launches` more 2-rank launches of the training loop with async saves alone (a process has one
first save: its figure is the median over launches). Each figure is the slowest rank's time, median
over the repetitions. The stall is the save() call; "stall + next step's excess" adds how much longer
the training step after the save took than the loop's other steps, which is where a lazy snapshot's
copy holds the optimizer step (omnickpt) and a background save competes with training (both): what
training loses to a save. Results: a table on stdout and
bench/out/results[-quick].json. See BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import scenario  # noqa: E402
from libs import LIBS  # noqa: E402
from ranks import run_ranks  # noqa: E402

# (figure key, label, unit, lower is better)
FIGURES = [
    ("sync_save", "sync save, durable", "s"),
    ("stall_steady", "async stall, steady state", "s"),
    ("stall_first", "async stall, first save", "s"),
    ("lost_steady", "training lost, steady save", "s"),
    ("lost_first", "training lost, first save", "s"),
    ("async_total", "async total, until committed", "s"),
    ("load", "load, same layout, cold", "s"),
    ("load_2to1", "load, resharded 2->1, cold", "s"),
    ("load_1to2", "load, resharded 1->2, cold", "s"),
    ("load_warm", "load, same layout, warm", "s"),
    ("load_2to1_warm", "load, resharded 2->1, warm", "s"),
    ("load_1to2_warm", "load, resharded 1->2, warm", "s"),
    ("rss_async", "peak RSS during async saves", "MB"),
    ("rss_load", "peak RSS during load", "MB"),
]


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per repetition, the slowest rank's time."""
    return [max(vals) for vals in zip(*per_rank)]


def median(xs):
    return statistics.median(xs) if xs else None


def summarize_lib(a: list[dict], b: list[dict] | None, c: list[dict] | None,
                  firsts: list[list[dict]] = ()) -> dict:
    """Figures of one library from its three launches, and `firsts`: launches of the training loop
    alone (scenario.first_saves), so that the first save's stall is the median over launches (one
    sample each). Async-only libraries have no b and c and no sync/load keys; loads-only ones have
    no async keys."""
    has_async, full = "async_stalls" in a[0], "sync_saves" in a[0]

    def med(key, rs=a):
        return median(slowest([r[key] for r in rs])) if rs and key in rs[0] else None

    stalls = slowest([r["async_stalls"] for r in a]) if has_async else []
    # every launch's loop, the main one first: the slowest rank's stall of each save
    loops = [stalls] + [slowest([r["async_stalls"] for r in f]) for f in firsts] if has_async else []
    # what training loses to each save but the last: its stall and the extra time of the step after
    # it (a lazy copy not done holds that step's optimizer step; a background save competes with it)
    lost = [scenario.lost_per_save(launch) for launch in [a, *firsts]] if has_async and "async_after" in a[0] else []
    fig = {
        "sync_save": med("sync_saves"),
        "stall_first": median([loop[0] for loop in loops]) if loops else None,
        "stall_steady": median([x for loop in loops for x in loop[1:]]),
        "lost_first": median([loop[0] for loop in lost if loop]) if lost else None,
        "lost_steady": median([x for loop in lost for x in loop[1:]]) if lost else None,
        "async_total": med("async_totals"),
        "load": med("loads"),
        "load_2to1": med("loads", b),
        "load_1to2": med("loads", c),
        "load_warm": med("loads_warm"),
        "load_2to1_warm": med("loads_warm", b),
        "load_1to2_warm": med("loads_warm", c),
        "rss_async": max(r["rss_async"]["peak_mb"] for r in a) if has_async else None,
        # After no async phase the process holds less retained memory: not comparable, left out.
        "rss_load": max(r["rss_load"]["peak_mb"] for r in a) if full and has_async else None,
    }
    verified = {}
    if full:
        verified["load"] = all(r["load_verified"] for r in a)
    if b:
        verified["load_2to1"] = b[0]["load_verified"]
    if c:
        verified["load_1to2"] = all(r["load_verified"] for r in c)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "reports"} for r in rs or []]  # noqa: E731
    extra = {
        "state_bytes": a[0]["state_bytes"],
        "copy_floor_s": max(r["copy_floor_s"] for r in a),
        "stalls_all": stalls,
        "stalls_first_launches": [loop[0] for loop in loops],
        "lost_per_save": lost,
        "wait_for_previous_save": med("async_waits"),
        "rss_async_increase_mb": (max(r["rss_async"]["peak_mb"] - r["rss_async"]["start_mb"] for r in a)
                                  if has_async else None),
        "rss_load_increase_mb": (max(r["rss_load"]["peak_mb"] - r["rss_load"]["start_mb"] for r in a)
                                 if full else None),
        "sync_save_1rank": b[0]["sync_save_1rank"] if b else None,
        "verified": verified,
        "code": sorted({r.get("code") for launch in (a, b, c) for r in launch or [] if r.get("code")}),
        "raw": {"main": strip(a), "one_rank": strip(b), "scale_up": strip(c)},
    }
    reports = {}
    for launch in (a, b, c):
        if launch:
            reports.update(launch[0].get("reports", {}))
    return {"figures": fig, "extra": extra, "reports": reports}


def phase_table(reports: dict) -> dict:
    """omnickpt's reports -> {kind: {phase: median over repetitions of the slowest rank's seconds}}."""
    out = {}
    for kind, reps in reports.items():
        reps = [r for r in reps if r]
        if kind == "async":
            reps = reps[1:]   # steady state only
        if not reps:
            continue
        phases = sorted({p for r in reps for p in r.get("phases", {})})
        out[kind] = {p: median([r["phases"][p]["max"] for r in reps if p in r["phases"]]) for p in phases}
        out[kind]["(total)"] = median([r["seconds"] for r in reps if "seconds" in r])
    return out


def run_config(workload: str, framework: str, libs: list[str], args, root: str) -> dict:
    cfg_base = dict(workload=workload, framework=framework, quick=args.quick, runs=args.runs,
                    async_saves=args.async_saves, steps=args.steps)
    results = {}
    for lib in libs:
        lib_root = os.path.join(root, f"{workload}-{framework}-{lib}")
        os.makedirs(lib_root, exist_ok=True)
        cfg = dict(cfg_base, root=lib_root)
        t0 = time.time()
        async_only = getattr(LIBS[lib], "async_only", False)
        cfg["async_only"] = async_only
        cfg["loads_only"] = getattr(LIBS[lib], "loads_only", False)
        a = run_ranks(2, scenario.main_layout, LIBS[lib], cfg)
        b = None if async_only else run_ranks(1, scenario.one_rank, LIBS[lib], cfg)
        c = None if async_only else run_ranks(2, scenario.scale_up, LIBS[lib], cfg)
        firsts = [] if cfg["loads_only"] else [run_ranks(2, scenario.first_saves, LIBS[lib], cfg)
                                               for _ in range(args.first_launches)]
        results[lib] = summarize_lib(a, b, c, firsts)
        results[lib]["wall_s"] = time.time() - t0
        shutil.rmtree(lib_root, ignore_errors=True)
        f = results[lib]["figures"]
        print(f"  [{workload}/{framework}/{lib}] {time.time() - t0:.0f} s: "
              + ", ".join(f"{k}={v:.3f}" for k, v in f.items() if v is not None), flush=True)
    return results


def fmt(v, unit):
    if v is None:
        return "-"
    return f"{v:.0f}" if unit == "MB" else f"{v:.3f}"


def render(doc: dict, bcp: dict | None) -> str:
    """One table per workload/framework: each library's figure, then each other library's figure
    divided by omnickpt's (above 1: omnickpt is faster or smaller)."""
    lines = []
    short = {"dcp": "DCP", "dcp-reuse": "DCPr", "bytecheckpoint": "BCP", "omnickpt-dedup": "dedup"}
    for key, res in doc["results"].items():
        mb = next(iter(res.values()))["extra"]["state_bytes"] / 1e6
        cols = [lib for lib in ("dcp", "dcp-reuse", "omnickpt", "omnickpt-dedup") if lib in res]
        bres = (bcp or {}).get("results", {}).get(key, {}).get("bytecheckpoint")
        values = {c: dict(res[c]["figures"]) for c in cols}
        for c in cols:
            if getattr(LIBS.get(c), "loads_only", False):
                values[c]["rss_load"] = None   # see summarize_lib
        if bcp is not None:
            cols.append("bytecheckpoint")
            values["bytecheckpoint"] = (bres or {}).get("figures", {})
        others = [c for c in cols if c != "omnickpt"] if "omnickpt" in cols else []
        header = f"{'figure':<34}" + "".join(f"{c:>15}" for c in cols) + "".join(
            f"{short.get(c, c) + '/omni':>11}" for c in others)
        lines += ["", f"{key.replace('/', ' / ')}: {mb:.0f} MB of model+Adam state, 2 ranks", header, "-" * len(header)]
        for fk, label, unit in FIGURES:
            row = f"{label + ' (' + unit + ')':<34}" + "".join(f"{fmt(values[c].get(fk), unit):>15}" for c in cols)
            o = values["omnickpt"].get(fk) if "omnickpt" in values else None
            for c in others:
                v = values[c].get(fk)
                row += f"{(f'{v / o:.2f}x' if v and o else '-'):>11}"
            lines.append(row)
        if "omnickpt" in res:
            ex = res["omnickpt"]["extra"]
            lines.append(f"  copy floor: {ex['copy_floor_s']:.3f} s to copy all of a rank's local state into a "
                         "reused buffer, 1 thread")
        skipped = (bcp or {}).get("skipped", {}).get(key) or (bcp or {}).get("errors", {}).get(key)
        if skipped:
            lines.append(f"  bytecheckpoint: {skipped.strip().splitlines()[-1][:200]}")
        bad = [f"{lib}:{k}" for lib, r in list(res.items()) + ([("bytecheckpoint", bres)] if bres else [])
               for k, ok in r["extra"]["verified"].items() if not ok]
        if bad:
            lines.append(f"  NOT VERIFIED (loaded values differ from saved): {', '.join(bad)}")
    return "\n".join(lines)


def render_phases(doc: dict) -> str:
    lines = ["", "omnickpt: where the time goes (slowest rank's seconds per phase, median over repetitions)"]
    for key, res in doc["results"].items():
        if "omnickpt" not in res:
            continue
        for kind, phases in phase_table(res["omnickpt"]["reports"]).items():
            lines.append(f"  {key:<12} {kind:<12} " + "  ".join(f"{p}={v:.3f}" for p, v in phases.items()
                                                                if v is not None))
    return "\n".join(lines)


def environment(root: str) -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    import omnickpt
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "python": platform.python_version(), "torch": torch.__version__, "omnickpt": omnickpt.__version__,
        "cpus": os.cpu_count(), "platform": platform.platform(),
        "cpu_model": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"),
        "filesystem": sh(f"df -hT {root} | tail -1"),
        "git_commit": sh(f"git -C {HERE} rev-parse --short HEAD"),
        "git_dirty": bool(sh(f"git -C {HERE} status --porcelain -- ../omnickpt")),
        "loadavg_start": os.getloadavg(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models, fewer repetitions (smoke test)")
    ap.add_argument("--runs", type=int, help="repetitions per figure (default 3; --quick 2)")
    ap.add_argument("--async-saves", type=int, help="async saves in the training loop, the first one "
                                                    "included (default 8; --quick 3)")
    ap.add_argument("--steps", type=int, default=2, help="training steps between two saves (default 2)")
    ap.add_argument("--first-launches", type=int,
                    help="launches of the training loop alone beside the main one, so that the first save's "
                         "stall (one per process) is a median over launches (default 2; --quick 0)")
    ap.add_argument("--workloads", default="mlp,gpt")
    ap.add_argument("--frameworks", default="ddp,fsdp2")
    ap.add_argument("--libs", default="dcp,dcp-reuse,omnickpt,omnickpt-dedup",
                    help="libraries to compare (dcp-reuse: DCP async_save with a reused stager, async figures "
                         "only; omnickpt-dedup: omnickpt loading with dedup_reads=True, load figures only)")
    ap.add_argument("--dir", help="where checkpoints go (default: a new temporary directory under $TMPDIR)")
    ap.add_argument("--out", help="JSON results (default bench/out/results[-quick].json)")
    ap.add_argument("--bcp", action="store_true", help="run bench/bytecheckpoint.sh first (its own venv)")
    args = ap.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 3)
    args.async_saves = args.async_saves or (3 if args.quick else 8)
    args.first_launches = args.first_launches if args.first_launches is not None else (0 if args.quick else 2)
    suffix = "-quick" if args.quick else ""
    out_dir = os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)
    out_path = args.out or os.path.join(out_dir, f"results{suffix}.json")
    libs = [x for x in args.libs.split(",") if x]
    for lib in libs:
        if lib not in LIBS:
            ap.error(f"unknown library {lib!r}; choose from {', '.join(LIBS)}")

    if args.bcp:
        cmd = [os.path.join(HERE, "bytecheckpoint.sh"), "--runs", str(args.runs),
               "--workloads", args.workloads, "--frameworks", args.frameworks] + (["--quick"] if args.quick else [])
        print("running", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"bytecheckpoint.sh exited with {rc}; the ByteCheckpoint column is left out", flush=True)

    root = args.dir or tempfile.mkdtemp(prefix="omnickpt-bench-")
    os.makedirs(root, exist_ok=True)
    doc = {"environment": environment(root), "libs": libs,
           "settings": {"runs": args.runs, "async_saves": args.async_saves, "first_launches": args.first_launches,
                        "steps_between_saves": args.steps,
                        "quick": args.quick, "ranks": 2, "backend": "gloo", "threads_per_rank": 1,
                        "page_cache": "loads timed cold (files evicted: fsync + POSIX_FADV_DONTNEED) and warm (right after)"},
           "results": {}}
    print(f"checkpoints under {root} ({doc['environment']['filesystem']}); load average "
          f"{doc['environment']['loadavg_start']}", flush=True)
    t_start = time.time()
    try:
        i = 0
        for workload in args.workloads.split(","):
            for framework in args.frameworks.split(","):
                order = libs if i % 2 == 0 else list(reversed(libs))   # alternate who goes first
                i += 1
                doc["results"][f"{workload}/{framework}"] = run_config(workload, framework, order, args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    doc["environment"]["loadavg_end"] = os.getloadavg()
    # Only omnickpt's own figures depend on its sources (the others merely record them).
    codes = sorted({c for res in doc["results"].values() for lib, r in res.items() if lib.startswith("omnickpt")
                    for c in r["extra"]["code"]})
    doc["environment"]["omnickpt_code"] = codes
    doc["environment"]["wall_s"] = time.time() - t_start
    bcp = None
    bcp_path = os.path.join(out_dir, f"bcp{suffix}.json")
    if os.path.exists(bcp_path):
        with open(bcp_path) as f:
            bcp = json.load(f)
        doc["bytecheckpoint"] = bcp
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(render(doc, bcp))
    if bcp is not None:
        print(f"\n(ByteCheckpoint figures from {os.path.relpath(bcp_path)}, run {bcp['environment']['date']} "
              f"with torch {bcp['environment']['torch']})")
    print(render_phases(doc))
    env = doc["environment"]
    if len(codes) > 1:
        print(f"\nWARNING: omnickpt's sources changed during the run ({len(codes)} versions: {', '.join(codes)}); "
              "the figures mix versions (see extra.code per library in the JSON)")
    print(f"\n{env['command']}: {env['wall_s']:.0f} s; load average at start {env['loadavg_start']}, at end "
          f"{env['loadavg_end']}; results in {os.path.relpath(out_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
