"""Cost per tensor and per box: many small tensors (MoE-like) and checkpoints cut into many boxes.

    .venv/bin/python bench/scale.py                    # MoE ~18k tensors + 80k boxes (~2 min)
    .venv/bin/python bench/scale.py --quick            # small sizes (smoke test)
    .venv/bin/python bench/scale.py --cases boxes --boxes 1000000    # 10^6 boxes
    .venv/bin/python bench/scale.py --cases moe --experts 30000      # ~10^5 tensors

moe: `--experts` small experts (a Linear each: weight + bias) under FSDP2 on 2 gloo ranks, after
one Adam step, so the state holds 3 x 2 x experts tensors (param, exp_avg, exp_avg_sq) of ~150 MB
by default. Timed per library: the async save's stall (steady state: first save left out), a
durable sync save, and a load into the same layout. DCP runs the same work (fewer runs: it is
slow on this state; --dcp-runs), through get_state_dict/set_state_dict as in bench/libs.py.

boxes: `--tensors` 2-D float32 tensors, each cut into a grid of `--boxes / --tensors` boxes (as
thousands-way TP x FSDP sharding cuts them), saved from one process as explicit ShardSpec boxes,
then loaded whole into one process and by rows into 2 ranks (every wanted box overlaps hundreds
of saved boxes). DCP cannot save many boxes of one tensor from one rank: omnickpt only.

Every timed call starts after a barrier; per repetition the slowest rank's time; medians over
--runs. Loads are checked (values equal what was saved). Results: bench/out/scale[-quick].json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from ranks import run_ranks  # noqa: E402


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed(fn):
    barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------------------- moe
class Experts(nn.Module):
    """`experts` small Linear(d, f) experts, all used by a step (only the tensor count matters)."""

    def __init__(self, experts: int, d: int, f: int):
        super().__init__()
        self.d = d
        self.experts = nn.ModuleList(nn.Linear(d, f) for _ in range(experts))

    def forward(self, x):
        return sum(e(x).sum() for e in self.experts)


def build_moe(cfg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    module = Experts(cfg["experts"], cfg["d"], cfg["f"])
    if dist.get_world_size() > 1:
        # One FSDP unit for the whole model: every parameter a DTensor sharded on dim 0.
        fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(2, cfg["d"], generator=torch.Generator().manual_seed(1))).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return module, opt


def _locals(module, opt):
    out = []
    for p in module.parameters():
        out.append(p.detach())
        out += [v for k, v in opt.state.get(p, {}).items() if k in ("exp_avg", "exp_avg_sq")]
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def moe_rank(rank, world, lib, cfg):
    module, opt = build_moe(cfg)
    tensors = _locals(module, opt)
    expect = [t.clone() for t in tensors]
    root = cfg["root"]
    out = {"tensors": 3 * len(list(module.parameters())),
           "bytes_local": sum(t.numel() * t.element_size() for t in tensors),
           "stalls": [], "async_totals": [], "sync_saves": [], "loads": [], "verified": True}
    if lib == "omnickpt":
        import omnickpt
        ckpt = omnickpt.Checkpointer()
        state = {"model": module, "optimizer": opt}
        save = lambda p: ckpt.save(p, state)   # noqa: E731
        asave = lambda p: ckpt.save(p, state, async_save=True)   # noqa: E731
        wait = lambda h: h.wait()   # noqa: E731
        load = lambda p: ckpt.load(p, state)   # noqa: E731
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        pg = dist.new_group(backend="gloo")

        def sd():
            m, o = get_state_dict(module, opt)
            return {"model": m, "optim": o}
        save = lambda p: dcp.save(sd(), checkpoint_id=p)   # noqa: E731
        asave = lambda p: dcp.async_save(sd(), checkpoint_id=p, process_group=pg)   # noqa: E731
        wait = lambda h: h.result()   # noqa: E731

        def load(p):
            s = sd()
            dcp.load(s, checkpoint_id=p)
            set_state_dict(module, opt, model_state_dict=s["model"], optim_state_dict=s["optim"])
    runs = cfg["runs"]
    for i in range(runs + 1):   # the first async save is left out of the stall (allocations)
        path = os.path.join(root, f"{lib}-async-{i % 2}")
        t0 = time.perf_counter()
        stall, h = timed(lambda: asave(path))
        wait(h)
        out["stalls"].append(stall)
        out["async_totals"].append(time.perf_counter() - t0)
    for i in range(runs):
        secs, res = timed(lambda: save(os.path.join(root, f"{lib}-sync")))
        out["sync_saves"].append(secs)
        if lib == "omnickpt":
            out["save_phases"] = {k: v["max"] for k, v in res.wait()["phases"].items()}
    for i in range(runs):
        with torch.no_grad():
            for t in tensors:
                t.fill_(0.5)
        secs, res = timed(lambda: load(os.path.join(root, f"{lib}-sync")))
        out["loads"].append(secs)
        if lib == "omnickpt":
            out["load_phases"] = {k: v["max"] for k, v in res.report["phases"].items()}
        out["verified"] &= all(torch.equal(a, b) for a, b in zip(tensors, expect))
    if lib == "omnickpt":
        ckpt.close()
    return out


# ---------------------------------------------------------------------------- boxes
def box_grid(cfg):
    """(tensor shape, box rows, box cols, grid rows, grid cols) for the boxes case."""
    per = max(1, cfg["boxes"] // cfg["tensors"])
    gc = max(1, int(math.sqrt(per / 2)))
    gr = max(1, per // gc)
    br, bc = cfg["box_rows"], cfg["box_cols"]
    return (gr * br, gc * bc), br, bc, gr, gc


def _value(shape, i):
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    return t + i * 0.5


def boxes_save(rank, world, cfg):
    import omnickpt
    shape, br, bc, gr, gc = box_grid(cfg)
    state = {}
    for i in range(cfg["tensors"]):
        full = _value(shape, i)
        for r in range(gr):
            for c in range(gc):
                local = full[r * br:(r + 1) * br, c * bc:(c + 1) * bc].clone()
                state[f"t{i}.{r}.{c}"] = omnickpt.ShardSpec(local, (r * br, c * bc), shape, name=f"t{i}")
    out = {"boxes": cfg["tensors"] * gr * gc, "shape": shape, "bytes": cfg["tensors"] * math.prod(shape) * 4,
           "saves": []}
    with omnickpt.Checkpointer() as ckpt:
        for _ in range(cfg["runs"]):
            out["saves"].append(timed(lambda: ckpt.save(cfg["path"], state))[0])
    return out


def boxes_load(rank, world, cfg):
    import omnickpt
    shape, *_ = box_grid(cfg)
    rows = shape[0] // world
    lo, hi = rank * rows, shape[0] if rank == world - 1 else (rank + 1) * rows
    dests = [torch.zeros(hi - lo, shape[1]) for _ in range(cfg["tensors"])]
    state = {f"t{i}": omnickpt.ShardSpec(d, (lo, 0), shape, name=f"t{i}") for i, d in enumerate(dests)}
    out = {"loads": [], "verified": True}
    with omnickpt.Checkpointer() as ckpt:
        for _ in range(cfg["runs"]):
            for d in dests:
                d.zero_()
            out["loads"].append(timed(lambda: ckpt.load(cfg["path"], state))[0])
    out["verified"] = all(torch.equal(d, _value(shape, i)[lo:hi]) for i, d in enumerate(dests))
    return out


# ---------------------------------------------------------------------------- driver
def median(xs):
    return statistics.median(xs) if xs else None


def slowest(per_rank, key):
    return [max(v) for v in zip(*(r[key] for r in per_rank))]


def run_moe(args, root) -> dict:
    cfg = dict(experts=args.experts, d=args.d, f=args.f, root=root)
    res = {}
    for lib in args.libs:
        cfg["runs"] = args.runs if lib == "omnickpt" else args.dcp_runs
        t0 = time.time()
        rs = run_ranks(args.ranks, moe_rank, lib, dict(cfg))
        stalls = slowest(rs, "stalls")
        res[lib] = {"tensors": rs[0]["tensors"], "bytes": sum(r["bytes_local"] for r in rs),
                    "stall": median(stalls[1:]), "stall_first": stalls[0],
                    "async_total": median(slowest(rs, "async_totals")[1:]),
                    "sync_save": median(slowest(rs, "sync_saves")), "load": median(slowest(rs, "loads")),
                    "verified": all(r["verified"] for r in rs), "raw": rs, "wall_s": time.time() - t0}
        f = res[lib]
        print(f"  moe/{lib}: {f['tensors']} tensors, {f['bytes'] / 1e6:.0f} MB: stall {f['stall']:.3f} s, "
              f"sync save {f['sync_save']:.3f} s, load {f['load']:.3f} s"
              + ("" if f["verified"] else "  NOT VERIFIED"), flush=True)
        for kind in ("save_phases", "load_phases"):
            if kind in rs[0]:
                print(f"    {kind.replace('_', ' ')} (rank 0, last run): "
                      + ", ".join(f"{k}={v:.3f}" for k, v in sorted(rs[0][kind].items())), flush=True)
        for name in os.listdir(root):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return res


def run_boxes(args, root) -> dict:
    cfg = dict(tensors=args.tensors, boxes=args.boxes, box_rows=args.box_rows, box_cols=args.box_cols,
               runs=args.runs, path=os.path.join(root, "boxes"))
    t0 = time.time()
    s = run_ranks(1, boxes_save, cfg)[0]
    one = run_ranks(1, boxes_load, cfg)
    two = run_ranks(2, boxes_load, cfg)
    res = {"boxes": s["boxes"], "shape": s["shape"], "bytes": s["bytes"], "save": median(s["saves"]),
           "load_1": median(slowest(one, "loads")), "load_2": median(slowest(two, "loads")),
           "verified": all(r["verified"] for r in one + two),
           "raw": {"saves": s["saves"], "load_1": one, "load_2": two}, "wall_s": time.time() - t0}
    print(f"  boxes: {res['boxes']} boxes in {args.tensors} tensors of {res['shape']}, {res['bytes'] / 1e6:.0f} MB: "
          f"save {res['save']:.3f} s, load into 1 process {res['load_1']:.3f} s, into 2 ranks {res['load_2']:.3f} s"
          + ("" if res["verified"] else "  NOT VERIFIED"), flush=True)
    shutil.rmtree(cfg["path"], ignore_errors=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--cases", default="moe,boxes")
    ap.add_argument("--runs", type=int, default=3, help="repetitions per omnickpt figure (median)")
    ap.add_argument("--dcp-runs", type=int, default=1, help="repetitions per DCP figure")
    ap.add_argument("--libs", default="omnickpt,dcp", help="libraries for the moe case")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the moe case")
    ap.add_argument("--experts", type=int, help="moe: experts (6 tensors each with Adam; default 3000)")
    ap.add_argument("--d", type=int, default=48, help="moe: expert input width")
    ap.add_argument("--f", type=int, default=80, help="moe: expert output width")
    ap.add_argument("--boxes", type=int, help="boxes: total saved boxes (default 80000)")
    ap.add_argument("--tensors", type=int, help="boxes: tensors they are cut from (default 100)")
    ap.add_argument("--box-rows", type=int, default=16)
    ap.add_argument("--box-cols", type=int, default=16)
    ap.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", help="JSON results (default bench/out/scale[-quick].json)")
    args = ap.parse_args(argv)
    args.experts = args.experts or (300 if args.quick else 3000)
    args.boxes = args.boxes or (8000 if args.quick else 80000)
    args.tensors = args.tensors or (10 if args.quick else 100)
    args.libs = [x for x in args.libs.split(",") if x]
    out_dir = os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)
    out_path = args.out or os.path.join(out_dir, f"scale{'-quick' if args.quick else ''}.json")
    root = args.dir or tempfile.mkdtemp(prefix="omnickpt-scale-")
    os.makedirs(root, exist_ok=True)
    doc = {"environment": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
           "settings": {k: v for k, v in vars(args).items() if k not in ("dir", "out")}, "results": {}}
    t0 = time.time()
    try:
        cases = args.cases.split(",")
        if "moe" in cases:
            doc["results"]["moe"] = run_moe(args, root)
        if "boxes" in cases:
            doc["results"]["boxes"] = run_boxes(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    doc["environment"].update(wall_s=time.time() - t0, loadavg_end=os.getloadavg())
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"{doc['environment']['command']}: {time.time() - t0:.0f} s; results in {os.path.relpath(out_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
