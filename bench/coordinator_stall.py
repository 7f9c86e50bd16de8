"""Every rank's async-save stall, the coordinator's beside the others', while another library's save
is flushing to the same disk (issue 22: rank 0 stalled 0.08-0.18 s where rank 1 stalled 0.01 s).

    .venv/bin/python bench/coordinator_stall.py [--workload mlp] [--frameworks ddp,fsdp2] [--saves 6] [--alone]

2 gloo ranks train the workload (bench/workloads.py); per round: 2 training steps, a DCP async_save
(not waited for: its writes are in flight or flushing), a barrier, then omnickpt's async save,
timed on each rank (save() call to return), and its report's phases on that rank; then both are
waited for. The first round is left out of the medians (the first save of the process).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _worker(rank: int, world: int, root: str, workload: str, framework: str, saves: int, other_lib: bool):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import omnickpt
    from workloads import build, train_step
    model, opt, module, gen = build(workload, framework, quick=False)
    stalls, phases = [], []
    # DCP's async save makes collectives from its own thread: on a group of its own, or they would
    # interleave with omnickpt's on the default group
    dcp_group = dist.new_group(backend="gloo")
    with omnickpt.Checkpointer() as ckpt:
        for i in range(saves):
            for _ in range(2):
                train_step(model, module, opt, gen)
            other = None
            if other_lib:
                msd, osd = get_state_dict(model, opt)
                other = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-{i}"),
                                       process_group=dcp_group)
            dist.barrier()
            t0 = time.perf_counter()
            h = ckpt.save(os.path.join(root, f"omni-{i}"), {"model": model, "optimizer": opt}, async_save=True)
            stalls.append(time.perf_counter() - t0)
            rep = h.wait()
            if other is not None:
                other.result()
            phases.append(rep["phases"] if rep else None)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(root, f"dcp-{i}"), ignore_errors=True)
                shutil.rmtree(os.path.join(root, f"omni-{i}"), ignore_errors=True)
            dist.barrier()
    return stalls, phases


def main(argv=None) -> int:
    from ranks import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--frameworks", default="ddp,fsdp2")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--alone", action="store_true", help="no DCP save flushing beside omnickpt's")
    args = ap.parse_args(argv)
    for framework in args.frameworks.split(","):
        root = tempfile.mkdtemp(prefix="omnickpt-coord-", dir=os.path.join(HERE, "out"))
        try:
            out = run_ranks(2, _worker, root, args.workload, framework, args.saves, not args.alone,
                            timeout=1800)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for rank, (stalls, _) in enumerate(out):
            steady = stalls[1:]
            print(f"{args.workload}/{framework} rank {rank}: first {stalls[0]:.3f} s, steady median "
                  f"{statistics.median(steady):.3f} s, max {max(steady):.3f} s  ({' '.join(f'{s:.3f}' for s in stalls)})",
                  flush=True)
        rep = [p for p in out[0][1][1:] if p]
        if rep:
            names = [k for k in rep[0] if k in ("collect", "exchange", "plan", "snapshot", "stall")]
            print("  slowest rank of the stall per save:", [r["stall"]["slowest_rank"] for r in rep if "stall" in r])
            print("  rank 0's report, phases (median over ranks, max):",
                  ", ".join(f"{k} {statistics.median(r[k]['median'] for r in rep):.3f}/"
                            f"{statistics.median(r[k]['max'] for r in rep):.3f}" for k in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
