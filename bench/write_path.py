"""Durable write of one large data file: the page cache + fsync against O_DIRECT (LocalStorage's two
write paths), from a page-aligned staging buffer, as a save's persist writes it.

    .venv/bin/python bench/write_path.py                 # 800 MB, 5 runs each, interleaved
    .venv/bin/python bench/write_path.py --mb 200 --runs 3 --dir /mnt/disk

Each run writes a fresh file (4 I/O threads, 64 MiB pieces, one fsync) and removes it. The two
paths alternate run by run so that a change in the device's state hits both. Reports the median
seconds and GB/s, and the spread (min-max), to bench/out/write_path.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    import torch

    from omnickpt.engine.staging import StagingPool
    from omnickpt.storage.base import Segment
    from omnickpt.storage.local import LocalStorage
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=800)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: under the repository)")
    args = ap.parse_args(argv)
    n = args.mb << 20
    buf = StagingPool().acquire(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))   # incompressible, pages faulted in
    view = memoryview(buf.numpy())
    root = tempfile.mkdtemp(prefix="write-path-", dir=args.dir or os.path.join(HERE, "out"))
    paths = {"page cache + fsync": LocalStorage(root, direct_io=False), "O_DIRECT + fsync": LocalStorage(root, direct_io=True)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    with ThreadPoolExecutor(4) as io:
        for i in range(args.runs):
            for name, store in paths.items():
                t0 = time.perf_counter()
                store.write_file(f"f{i}.bin", n, [Segment(0, view)], io, durable=True)
                times[name].append(time.perf_counter() - t0)
                store.delete(f"f{i}.bin")
    os.rmdir(root)
    doc = {"mb": args.mb, "runs": args.runs, "results": {}}
    print(f"{args.mb} MB durable write, medians of {args.runs}")
    for name, ts in times.items():
        med = statistics.median(ts)
        doc["results"][name] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "gb_per_s": n / med / 1e9}
        print(f"{name:<20} {med:7.3f} s  {n / med / 1e9:5.2f} GB/s  (min {min(ts):.3f}, max {max(ts):.3f})")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "write_path.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
