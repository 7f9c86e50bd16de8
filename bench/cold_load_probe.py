"""Cold-cache loads, measured against the device: what a restarted job pays to read its checkpoint.

    .venv/bin/python bench/cold_load_probe.py [--width 2048 --layers 6 --runs 3]
    .venv/bin/python bench/cold_load_probe.py --ranks 2 --workload mlp --framework fsdp2 --libs omnickpt,dcp [--fresh]

One process (default): the state of 6 x Linear(2048) + AdamW (300 MB) saved by omnickpt.save and by
torch.save, both files dropped from the page cache before every load (bench/ranks.py evict);
omnickpt's load phases printed beside (its report). One compute thread, as a rank of the 2-rank
benchmarks has.

--ranks 2: bench/compare.py's load at the same layout alone (no training loop, no async saves, so
a figure takes seconds, not minutes): each library saves the workload once, then `runs` times
every rank loads it cold (files evicted) and then warm. Beside it, the device's own speed on the
same files: `dd` reading the checkpoint's files cold, one after another (one reader) and all at
once (one reader per file). Figures: the slowest rank per repetition, median over repetitions.
--fresh: every repetition loads in processes launched for it, as a restarted job does (its first
load finds no warm landing memory), instead of all repetitions in one launch.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import omnickpt  # noqa: E402
from ranks import evict, run_ranks  # noqa: E402


def one_process(args) -> None:
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()
    ours, theirs, warm, dd = [], [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        omnickpt.save(f"{d}/omnickpt", {"model": model, "optimizer": opt}).wait()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{d}/state.pt")
        os.sync()
        for _ in range(args.runs):
            dd.append(dd_seconds(f"{d}/omnickpt", parallel=False))
            evict(d)
            t = time.perf_counter()
            result = omnickpt.load(f"{d}/omnickpt", {"model": model, "optimizer": opt})
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            omnickpt.load(f"{d}/omnickpt", {"model": model, "optimizer": opt})
            warm.append(time.perf_counter() - t)
            evict(d)
            t = time.perf_counter()
            sd = torch.load(f"{d}/state.pt")
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            theirs.append(time.perf_counter() - t)
            phases = {k: round(v["max"], 3) for k, v in result.report["phases"].items()}
            print(f"omnickpt.load cold {ours[-1]:.3f} s warm {warm[-1]:.3f} s  torch.load + load_state_dict "
                  f"{theirs[-1]:.3f} s  dd {dd[-1]:.3f} s  phases {phases}", flush=True)
    print(f"medians of {args.runs}: omnickpt.load cold {statistics.median(ours):.3f} s warm "
          f"{statistics.median(warm):.3f} s, torch.load {statistics.median(theirs):.3f} s, dd of omnickpt's files "
          f"{statistics.median(dd):.3f} s")


def data_files(root: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(root):
        out += [os.path.join(folder, f) for f in files]
    return sorted(out)


def dd_seconds(root: str, *, parallel: bool) -> float:
    """Seconds for dd (1 MiB blocks) to read every file under `root` cold: one after another, or
    one dd per file all at once."""
    files = data_files(root)
    evict(root)
    cmds = [["dd", f"if={f}", "of=/dev/null", "bs=1M", "status=none"] for f in files]
    t = time.perf_counter()
    if parallel:
        for p in [subprocess.Popen(c) for c in cmds]:
            p.wait()
    else:
        for c in cmds:
            subprocess.run(c, check=True)
    return time.perf_counter() - t


def loads(rank: int, world: int, lib_name: str, cfg: dict) -> dict:
    """Every rank: save the workload once with the library (cfg["save"]), then `runs` x (cold load,
    warm load) (cfg["runs"], 0: none). A launch that only loads fingerprints what the saving launch
    left (both build the same seeded state)."""
    from libs import LIBS
    from scenario import barrier, fingerprint, perturb, same_fingerprint
    from workloads import build, state_bytes
    lib = LIBS[lib_name]()
    model, opt, module, _ = build(cfg["workload"], cfg["framework"], quick=cfg["quick"])
    path = os.path.join(cfg["root"], lib_name)
    if cfg["save"]:
        lib.save(path, model, opt, module)
    saved = fingerprint(module, opt)
    perturb(module, opt)
    barrier()
    out = {"cold": [], "warm": [], "dd": [], "dd_parallel": [], "phases": [], "bytes": state_bytes(module)}
    for _ in range(cfg["runs"]):
        if rank == 0:
            out["dd"].append(dd_seconds(path, parallel=False))
            out["dd_parallel"].append(dd_seconds(path, parallel=True))
            evict(path)
        barrier()
        t = time.perf_counter()
        report = lib.load(path, model, opt, module)
        out["cold"].append(time.perf_counter() - t)
        barrier()
        t = time.perf_counter()
        lib.load(path, model, opt, module)
        out["warm"].append(time.perf_counter() - t)
        out["phases"].append({k: round(v["max"], 3) for k, v in (report or {}).get("phases", {}).items()})
    out["verified"] = same_fingerprint(fingerprint(module, opt), saved) if cfg["runs"] else True
    out["file_bytes"] = sum(os.path.getsize(f) for f in data_files(path))
    barrier()
    lib.close()
    return out


def ranks(args) -> None:
    root = tempfile.mkdtemp(prefix="omnickpt-cold-", dir=args.dir)
    cfg = dict(workload=args.workload, framework=args.framework, quick=args.quick, runs=args.runs, root=root,
               save=True)
    try:
        for lib in args.libs.split(","):
            if args.fresh:   # one launch saves; each load in a launch of its own, as a restarted job's
                run_ranks(args.ranks, loads, lib, {**cfg, "runs": 0})
                runs = [run_ranks(args.ranks, loads, lib, {**cfg, "runs": 1, "save": False}) for _ in range(args.runs)]
                got = [{k: sum((run[r][k] for run in runs), []) if isinstance(runs[0][r][k], list) else runs[0][r][k]
                        for k in runs[0][r]} for r in range(args.ranks)]
                for r in range(args.ranks):
                    got[r]["verified"] = all(run[r]["verified"] for run in runs)
            else:
                got = run_ranks(args.ranks, loads, lib, cfg)
            shutil.rmtree(os.path.join(root, lib), ignore_errors=True)
            cold = [max(v) for v in zip(*(r["cold"] for r in got))]
            warm = [max(v) for v in zip(*(r["warm"] for r in got))]
            r0 = got[0]
            med = statistics.median
            print(f"{args.workload}/{args.framework}/{lib}{' (a fresh launch per load)' if args.fresh else ''}: "
                  f"{r0['file_bytes'] / 1e6:.0f} MB in files; cold "
                  f"{med(cold):.3f} s {[round(x, 3) for x in cold]}, warm {med(warm):.3f} s "
                  f"{[round(x, 3) for x in warm]}; dd of its files cold {med(r0['dd']):.3f} s (one reader), "
                  f"{med(r0['dd_parallel']):.3f} s (one per file); cold / dd {med(cold) / med(r0['dd']):.2f}; "
                  f"verified {all(r['verified'] for r in got)}", flush=True)
            if r0["phases"] and r0["phases"][0]:
                print(f"  rank 0 phases per cold load: {r0['phases']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="1: one process, omnickpt vs torch.load; 2: "
                                                         "bench/compare.py's same-layout load")
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--framework", default="fsdp2")
    ap.add_argument("--libs", default="omnickpt,dcp")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="with --ranks 2: every load in a launch of its own "
                                                         "(a restarted job's first load), not 3 in one launch")
    ap.add_argument("--dir", help="where the checkpoints go (default $TMPDIR)")
    args = ap.parse_args()
    if args.ranks == 1:
        one_process(args)
    else:
        ranks(args)


if __name__ == "__main__":
    main()
