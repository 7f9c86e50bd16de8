"""omnickpt against DeepSpeed's own checkpointing, on the same engines (CPU, gloo, DS_ACCELERATOR=cpu).

    .venv/bin/python bench/deepspeed_bench.py reshard [--width 2048 --layers 6 --stage 3 --runs 3]
    .venv/bin/python bench/deepspeed_bench.py engine  [--width 2048 --layers 6 --stage 2 --runs 3]

`reshard`: a ZeRO checkpoint written by `engine.save_checkpoint` at 2 ranks is read into 1 rank, two ways:
  - DeepSpeed: `ds_to_universal` (its offline converter, a process of its own, 1 worker each way), then an
    engine at DP 1 with `load_universal` calls `load_checkpoint`;
  - omnickpt: `omnickpt.load(tag, {"model": m, "optimizer": adam})` into a plain module + AdamW at 1 rank (the same
    fp32 weights and Adam moments).
  Each step runs in a fresh process with the checkpoint's pages dropped from the cache first (a restarted
  job reads cold). Reported: seconds and peak RSS (the process's maximum resident set; for the converter,
  its largest process).
`engine`: a DeepSpeed engine at DP 2 saving through DeepSpeed's `save_checkpoint` (blocking) and through
  omnickpt (`omnickpt.integrations.deepspeed.engine_state`, sync and async with the lazy snapshot): the
  time the training loop waits per save (`stall`), until the save is durable (`save`), and a load back
  into the engine at DP 2 (`load`, cold cache), slowest rank, medians over `--saves` saves and `--runs` runs.
Model: `layers` Linear(width, width) with Adam (`16 * width^2 * layers` bytes of fp32 state and moments,
plus the module: about 400 MB at the defaults).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ranks import evict, run_ranks  # noqa: E402


def _model(width: int, layers: int):
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _config(stage: int, universal: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(width: int, layers: int, stage: int, universal: bool = False):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    m = _model(width, layers)
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, universal))
    return eng


def _step(eng, width: int) -> None:
    import torch
    x = torch.randn(2, width)
    loss = eng(x).pow(2).mean()
    eng.backward(loss)
    eng.step()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------- reshard
def _make(rank, world, root, width, layers, stage):
    eng = _engine(width, layers, stage)
    _step(eng, width)
    eng.save_checkpoint(root, tag="global_step1")


def _omnickpt_load(rank, world, tag, width, layers):
    import torch
    import omnickpt
    m = _model(width, layers)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    base = _rss_mb()
    t = time.perf_counter()
    omnickpt.load(tag, {"model": m, "optimizer": opt})
    return {"s": time.perf_counter() - t, "peak_mb": _rss_mb(), "base_mb": base}


def _universal_load(rank, world, folder, width, layers, stage):
    eng = _engine(width, layers, stage, universal=True)
    base = _rss_mb()
    t = time.perf_counter()
    eng.load_checkpoint(folder, tag="universal")
    return {"s": time.perf_counter() - t, "peak_mb": _rss_mb(), "base_mb": base}


def _convert(tag: str, out: str) -> dict:
    """ds_to_universal in a process of its own: its time and its largest process's peak RSS."""
    code = ("import resource, runpy, sys, time; t = time.perf_counter(); sys.argv = sys.argv[1:]\n"
            "try:\n    runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__')\n"
            "finally:\n    r = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "    print('BENCH', time.perf_counter() - t, r / 1024, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, "ds_to_universal", "--input_folder", tag, "--output_folder",
                           out, "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    line = [x for x in done.stderr.splitlines() if x.startswith("BENCH ")][-1].split()
    return {"s": float(line[1]), "peak_mb": float(line[2])}


def reshard(args) -> dict:
    rows = {"deepspeed: ds_to_universal": [], "deepspeed: universal load at DP 1": [], "deepspeed: total": [],
            "omnickpt: load at DP 1": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        ckpt = os.path.join(root, "ds")
        run_ranks(2, _make, ckpt, args.width, args.layers, args.stage)
        tag = os.path.join(ckpt, "global_step1")
        for _ in range(args.runs):
            folder = os.path.join(root, "u")
            shutil.rmtree(folder, ignore_errors=True)
            evict(ckpt)
            conv = _convert(tag, os.path.join(folder, "universal"))
            evict(folder)
            load = run_ranks(1, _universal_load, folder, args.width, args.layers, args.stage)[0]
            evict(ckpt)
            mine = run_ranks(1, _omnickpt_load, tag, args.width, args.layers)[0]
            rows["deepspeed: ds_to_universal"].append(conv)
            rows["deepspeed: universal load at DP 1"].append(load)
            rows["deepspeed: total"].append({"s": conv["s"] + load["s"], "peak_mb": max(conv["peak_mb"], load["peak_mb"])})
            rows["omnickpt: load at DP 1"].append(mine)
            print(json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
    return {k: {"s": statistics.median(r["s"] for r in v), "peak_mb": statistics.median(r["peak_mb"] for r in v)}
            for k, v in rows.items()}


# ---------------------------------------------------------------------- engine
def _engine_body(rank, world, root, width, layers, stage, saves, kind):
    import torch.distributed as dist
    import omnickpt
    from omnickpt.integrations.deepspeed import engine_state
    eng = _engine(width, layers, stage)
    _step(eng, width)
    stalls, durable = [], []
    handle = None
    for i in range(saves):
        path = os.path.join(root, kind, f"s{i}")
        dist.barrier()
        t = time.perf_counter()
        if kind == "deepspeed":
            eng.save_checkpoint(os.path.join(root, kind), tag=f"s{i}")
            stalls.append(time.perf_counter() - t)
        elif kind == "omnickpt":
            omnickpt.save(path, engine_state(eng))
            stalls.append(time.perf_counter() - t)
        else:
            handle = omnickpt.save(path, engine_state(eng), async_save=True)
            stalls.append(time.perf_counter() - t)
            _step(eng, width)       # training goes on while the save runs
            handle.wait()
        durable.append(time.perf_counter() - t)
        _step(eng, width)
    dist.barrier()
    if rank == 0:
        evict(os.path.join(root, kind))
    dist.barrier()
    t = time.perf_counter()
    if kind == "deepspeed":
        eng.load_checkpoint(os.path.join(root, kind), tag=f"s{saves - 1}")
    else:
        omnickpt.load(os.path.join(root, kind, f"s{saves - 1}"), engine_state(eng))
    load = time.perf_counter() - t
    return {"stall": statistics.median(stalls), "save": statistics.median(durable), "load": load}


def engine(args) -> dict:
    out = {}
    for kind in ("deepspeed", "omnickpt", "omnickpt-async"):
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                per_rank = run_ranks(2, _engine_body, root, args.width, args.layers, args.stage, args.saves, kind)
            runs.append({k: max(r[k] for r in per_rank) for k in ("stall", "save", "load")})
            print(kind, json.dumps(runs[-1]), flush=True)
        out[kind] = {k: statistics.median(r[k] for r in runs) for k in ("stall", "save", "load")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("reshard", "engine"))
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--stage", type=int, default=None, help="ZeRO stage (reshard: 3, engine: 2)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp dir)")
    args = ap.parse_args()
    if args.stage is None:
        args.stage = 3 if args.what == "reshard" else 2
    result = reshard(args) if args.what == "reshard" else engine(args)
    print(json.dumps({"what": args.what, "stage": args.stage, "width": args.width, "layers": args.layers,
                      "runs": args.runs, "medians": result}, indent=1))


if __name__ == "__main__":
    main()
