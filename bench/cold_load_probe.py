"""One process, cold page cache: omnickpt.load against torch.load of the same state.

    .venv/bin/python bench/cold_load_probe.py [--width 2048 --layers 6 --runs 3]

The state of 6 x Linear(2048) + AdamW (300 MB) saved by omnickpt.save and by torch.save, both files
dropped from the page cache before every load (bench/ranks.py evict); omnickpt's load phases printed
beside (its report). One compute thread, as a rank of the 2-rank benchmarks has.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import omnickpt  # noqa: E402
from ranks import evict  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as d:
        omnickpt.save(f"{d}/omnickpt", {"model": model, "optimizer": opt}).wait()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{d}/state.pt")
        os.sync()
        for _ in range(args.runs):
            evict(d)
            t = time.perf_counter()
            result = omnickpt.load(f"{d}/omnickpt", {"model": model, "optimizer": opt})
            ours.append(time.perf_counter() - t)
            evict(d)
            t = time.perf_counter()
            sd = torch.load(f"{d}/state.pt")
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            theirs.append(time.perf_counter() - t)
            phases = {k: round(v["max"], 3) for k, v in result.report["phases"].items()}
            print(f"omnickpt.load {ours[-1]:.3f} s  torch.load + load_state_dict {theirs[-1]:.3f} s  phases {phases}")
    print(f"medians of {args.runs}: omnickpt.load {statistics.median(ours):.3f} s, torch.load "
          f"{statistics.median(theirs):.3f} s")


if __name__ == "__main__":
    main()
