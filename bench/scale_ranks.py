"""Many ranks: a small model saved and loaded by 32 real gloo ranks on this machine, omnickpt and DCP.

    .venv/bin/python bench/scale_ranks.py                  # 32 ranks, 3 runs
    .venv/bin/python bench/scale_ranks.py --ranks 16 --runs 5

On 2 cores, 32 processes measure what grows with the rank count (planning, the gather/scatter of
records, the commit over 32 record files, the per-rank metadata reads), not bandwidth: the model is
small (a stack of Linear layers, ~8 MB with Adam state), FSDP2 over all ranks. Each figure is the
slowest rank's, timed between barriers; medians of --runs. The load goes into a fresh model at the
same world size. Results to bench/out/scale_ranks.json.
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


def _model(seed: int, mesh):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 0.01
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _timed(fn) -> float:
    """This rank's time between two barriers (the driver takes the slowest rank's)."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, root: str, libs: list[str], runs: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from libs import LIBS
    mesh = DeviceMesh("cpu", torch.arange(world))
    out: dict[str, dict[str, list[float]]] = {}
    for name in libs:
        lib = LIBS[name]()
        times: dict[str, list[float]] = {"sync_save": [], "async_stall": [], "async_total": [], "load": []}
        for run in range(runs):
            model, opt = _model(0, mesh)
            path = os.path.join(root, f"{name}-{run}")
            times["sync_save"].append(_timed(lambda: lib.save(path + "-sync", model, opt, model)))
            handle = {}
            dist.barrier()
            t0 = time.perf_counter()
            handle["h"] = lib.async_save(path + "-async", model, opt, model)
            stall = time.perf_counter() - t0
            lib.wait(handle["h"])
            dist.barrier()
            times["async_stall"].append(stall)
            times["async_total"].append(time.perf_counter() - t0)
            fresh, fresh_opt = _model(1, mesh)
            times["load"].append(_timed(lambda: lib.load(path + "-sync", fresh, fresh_opt, fresh)))
            for p, q in zip(model.parameters(), fresh.parameters()):
                if not torch.equal(p.to_local(), q.to_local()):
                    raise AssertionError(f"{name}: rank {rank}: the load did not restore the saved parameters")
            dist.barrier()
            if rank == 0:
                for suffix in ("-sync", "-async"):
                    shutil.rmtree(path + suffix, ignore_errors=True)
        lib.close()
        out[name] = times
    return out


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--libs", default="omnickpt,dcp")
    ap.add_argument("--root", default=None, help="where checkpoints go (default: a temporary folder)")
    args = ap.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="omnickpt-scale-ranks-")
    libs = args.libs.split(",")
    t0 = time.perf_counter()
    per_rank = run_ranks(args.ranks, _worker, root, libs, args.runs, timeout=1800)
    doc = {"ranks": args.ranks, "runs": args.runs, "wall_seconds": time.perf_counter() - t0, "results": {}}
    for name in libs:
        row = {}
        for metric in per_rank[0][name]:
            # slowest rank per run, then the median over runs
            slowest = [max(r[name][metric][i] for r in per_rank) for i in range(args.runs)]
            row[metric] = statistics.median(slowest)
        doc["results"][name] = row
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "scale_ranks.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{args.ranks} ranks, medians of {args.runs} (slowest rank per run), seconds")
    print(f"{'library':<10} {'sync save':>10} {'async stall':>12} {'async total':>12} {'load':>8}")
    for name, row in doc["results"].items():
        print(f"{name:<10} {row['sync_save']:>10.3f} {row['async_stall']:>12.3f} {row['async_total']:>12.3f} "
              f"{row['load']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
