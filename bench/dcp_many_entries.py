"""omnickpt.dcp.load of a state dict with many top-level entries (a model's state dict saved flat, as
torchtitan saves it): the cost of matching entries against the checkpoint's names.

    .venv/bin/python bench/dcp_many_entries.py [N]     # N top-level tensors of 4 floats (default 5000)

One process; prints the median of 3 loads. Before the review mend of issue 19 the matching scanned every
checkpoint tensor per entry (quadratic); run it against an older tree with PYTHONPATH=<tree> to compare.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from omnickpt import dcp


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    with tempfile.TemporaryDirectory() as d:
        saved = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(n)}
        dcp.save(saved, checkpoint_id=f"{d}/c")
        times = []
        for _ in range(3):
            target = {k: torch.zeros(4) for k in saved}
            t = time.perf_counter()
            dcp.load(target, checkpoint_id=f"{d}/c")
            times.append(time.perf_counter() - t)
            assert all(torch.equal(target[k], saved[k]) for k in saved)
    print(f"{n} top-level tensors: omnickpt.dcp.load median {statistics.median(times):.2f} s "
          f"({', '.join(f'{x:.2f}' for x in times)})")


if __name__ == "__main__":
    main()
