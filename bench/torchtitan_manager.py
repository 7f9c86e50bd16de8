"""omnickpt's torchtitan checkpointer against torchtitan's own DCP CheckpointManager, on the same job.

    .venv/bin/python bench/torchtitan_manager.py [--dim 512 --layers 8 --vocab 8192 --saves 3]

2 gloo ranks on CPU, torchtitan's llama3 decoder under FSDP2 with its OptimizersContainer (AdamW),
LRSchedulersContainer and ParallelAwareDataloader, built as the tests build them
(tests/torchtitan_helpers.py: torchtitan's Trainer itself needs CUDA-only pieces on this machine).
Both managers with async_mode="async" and a save at every step; per save: the stall (save() returning),
the time until the checkpoint is durable (maybe_wait_for_staging + maybe_wait_for_saving), then loads
of the last step into a fresh job, its files dropped from the page cache first (--warm: kept). Each
figure: the slowest rank, median over the saves (loads).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))   # torchtitan_helpers: the tests' torchtitan job

import torch  # noqa: E402

from ranks import evict, run_ranks  # noqa: E402


def body(rank, world, root, kind, saves, dims, warm):
    import torchtitan_helpers as H
    H.DIM, H.LAYERS, H.VOCAB = dims
    from torchtitan.components.checkpointer import CheckpointManager
    from omnickpt.integrations.torchtitan import OmnickptCheckpointManager
    cls = OmnickptCheckpointManager if kind == "omnickpt" else CheckpointManager
    cfg = cls.Config(enable=True, folder="ckpt", interval=1, async_mode="async", keep_latest_k=0,
                     last_save_model_only=False)
    job = H.Job(cfg, f"{root}/{kind}", steps=100)
    it = iter(job.dataloader)
    stalls, durable = [], []
    for step in range(1, saves + 1):
        job.optimizers.zero_grad()
        x, y = next(it)
        torch.nn.functional.cross_entropy(job.model(x).flatten(0, 1).float(), y.flatten()).backward()
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        torch.distributed.barrier()
        t = time.perf_counter()
        job.checkpointer.save(step)
        stalls.append(time.perf_counter() - t)
        job.checkpointer.maybe_wait_for_staging()
        job.checkpointer.maybe_wait_for_saving()
        torch.distributed.barrier()
        durable.append(time.perf_counter() - t)
    nbytes = sum(p.numel() * p.element_size() * 3 for p in job.model.parameters()) / world
    job.close()
    loads = []
    for _ in range(saves):
        fresh = H.Job(cfg, f"{root}/{kind}", seed=1, steps=100)
        if not warm:
            evict(f"{root}/{kind}")
        torch.distributed.barrier()
        t = time.perf_counter()
        fresh.checkpointer.load(step=saves)
        loads.append(time.perf_counter() - t)
        fresh.close()
    return stalls, durable, loads, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--managers", default="dcp,omnickpt")
    ap.add_argument("--warm", action="store_true", help="load with the checkpoint in the page cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for kind in args.managers.split(","):
            out = run_ranks(2, body, d, kind, args.saves, (args.dim, args.layers, args.vocab), args.warm, timeout=1200)

            def med(i):
                return statistics.median(max(r[i][k] for r in out) for k in range(len(out[0][i])))
            print(f"{kind:9s} state/rank {out[0][3] / 2**20:.0f} MiB  stall {med(0):.3f} s  durable {med(1):.3f} s  "
                  f"load {med(2):.3f} s  (medians of {args.saves}, slowest rank)", flush=True)


if __name__ == "__main__":
    main()
