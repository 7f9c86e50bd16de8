"""Where the host memory of async saves goes: bench/scenario.py's phase 1 (a training loop that saves
asynchronously every few steps, waiting for the previous save first) on 2 gloo ranks, with the RSS
and the peak RSS (VmHWM) read at each point of the loop, for omnickpt and DCP side by side.

    .venv/bin/python bench/memory_probe.py --workload mlp --framework fsdp2 --libs omnickpt,dcp

Memory figures do not depend on CPU load, so this needs no benchmark lock. Peak RSS here is the
process's since the loop began: the probe never resets VmHWM itself, but an omnickpt save resets it
at its start (saving._reset_peak_rss), so the probe also samples RSS from a thread every few ms
and reports the highest sample ("sampled peak"), the figure that is comparable across libraries.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) / 1024
    try:   # what glibc holds free for reuse (omnickpt.engine.staging.free_heap_bytes)
        from omnickpt.engine.staging import free_heap_bytes
        out["HeapFree"] = free_heap_bytes() / 2**20
    except ImportError:
        pass
    return out


class Sampler:
    """The highest RSS seen by a thread reading /proc/self/statm every `period` seconds, and where
    in the loop (the probe's current label) it was seen."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self.where, self.label = period, 0.0, "", "start"
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with open("/proc/self/statm") as f:
            while not self._stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * self._page / 2**20
                if rss > self.peak:
                    self.peak, self.where = rss, self.label
                time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class _NoSave:
    """Training only: the loop's memory without any checkpoint, the floor both libraries sit on."""
    name = "none"

    def async_save(self, path, model, opt, module):
        return None

    def wait(self, handle):
        return None


def _make(name: str, libs: dict):
    """A library of bench/libs.py by name; "none" saves nothing; "omnickpt:key=value,..." passes
    Checkpointer keywords (ints or True/False), e.g. omnickpt:release_staging=True."""
    if name == "none":
        return _NoSave()
    base, _, kw = name.partition(":")
    lib = libs[base]()
    if kw:
        import omnickpt
        args = {k: {"True": True, "False": False}.get(v, v) for k, v in (x.split("=") for x in kw.split(";"))}
        args = {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in args.items()}
        lib._ckpt.close()
        lib._ckpt = omnickpt.Checkpointer(**args)
    return lib


def probe(rank: int, world: int, lib_name: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from libs import LIBS
    from scenario import reset_peak_rss
    from workloads import build, state_bytes, train_step

    root = cfg["root"]
    points: list[tuple[str, dict]] = []

    def mark(label: str):
        points.append((label, _status()))
        sampler.label = label

    with Sampler() as sampler:
        mark("start")
        lib = _make(lib_name, LIBS)
        model, opt, module, gen = build(cfg["workload"], cfg["framework"], quick=False)
        mark("built")
        reset_peak_rss()
        prev, prev_path = None, None
        step_times, stalls = [], []
        for i in range(cfg["saves"]):
            for _ in range(cfg["steps"]):
                t0 = time.perf_counter()
                train_step(model, module, opt, gen)
                step_times.append(time.perf_counter() - t0)
            mark(f"{i}:trained")
            if prev is not None:
                lib.wait(prev)
                mark(f"{i}:waited")
                if cfg.get("trim"):   # what giving the allocator's free memory back after each save would do
                    import ctypes
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
            dist.barrier()
            if prev_path and rank == 0:
                shutil.rmtree(prev_path, ignore_errors=True)
            dist.barrier()
            path = os.path.join(root, f"async-{i}")
            t0 = time.perf_counter()
            prev = lib.async_save(path, model, opt, module)
            stalls.append(time.perf_counter() - t0)
            mark(f"{i}:saved")
            prev_path = path
        lib.wait(prev)
        mark("end")
        totals = []   # bench/scenario.py's phase 2: from the call until committed, nothing else running
        for i in range(cfg["totals"]):
            dist.barrier()
            t0 = time.perf_counter()
            lib.wait(lib.async_save(os.path.join(root, f"total-{i}"), model, opt, module))
            totals.append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(root, f"total-{i}"), ignore_errors=True)
        pool = getattr(getattr(lib, "_ckpt", None), "_pool", None)
        pool_info = {"held": pool.held / 2**20, "peak": pool.peak / 2**20} if pool is not None else None
        close = getattr(lib, "close", None)
        if close:
            close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(prev_path, ignore_errors=True)
    return {"rank": rank, "points": points, "sampled_peak": sampler.peak, "sampled_where": sampler.where,
            "pool": pool_info, "step_s": sorted(step_times)[len(step_times) // 2],
            "stalls": stalls, "totals": totals, "state_mb_per_rank": state_bytes(module) / world / 2**20}


def main():
    from ranks import run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--framework", default="fsdp2")
    ap.add_argument("--libs", default="omnickpt,dcp", help="comma-separated: omnickpt, dcp, none, "
                    "omnickpt:release_staging=True;staging_slots=1")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--totals", type=int, default=0, help="async totals timed after the loop (timing: take the lock)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each wait (an experiment)")
    ap.add_argument("--verbose", action="store_true", help="every point of the loop, not only the summary")
    args = ap.parse_args()
    for lib in args.libs.split(","):
        root = tempfile.mkdtemp(prefix="omnickpt-memprobe-")
        try:
            cfg = dict(root=root, workload=args.workload, framework=args.framework, saves=args.saves,
                       steps=args.steps, trim=args.trim, totals=args.totals)
            t0 = time.time()
            res = run_ranks(2, probe, lib, cfg)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for r in res:
            pts = dict(r["points"])
            built = pts["built"]["VmRSS"]
            hwm = pts["end"]["VmHWM"]
            print(f"{lib:10s} {args.workload}/{args.framework} rank {r['rank']}: state/rank "
                  f"{r['state_mb_per_rank']:.0f} MB, RSS built {built:.0f}, end {pts['end']['VmRSS']:.0f}, "
                  f"VmHWM at end {hwm:.0f}, sampled peak {r['sampled_peak']:.0f} (at {r['sampled_where']}), "
                  f"pool {r['pool']}, median step {r['step_s']:.3f} s ({time.time() - t0:.0f} s)")
            print("    RSS along the loop: " + " ".join(f"{label}={st['VmRSS']:.0f}" for label, st in r["points"]
                                                     if label.endswith(("trained", "saved"))))
            print("    allocator's free memory: " + " ".join(f"{label}={st.get('HeapFree', 0):.0f}"
                                                          for label, st in r["points"] if label.endswith("trained")))
            if r["stalls"]:
                steady = sorted(r["stalls"][1:])
                print(f"    stall first {r['stalls'][0]:.3f} s, steady median {steady[len(steady) // 2]:.3f} s; "
                      f"async totals {' '.join(f'{t:.2f}' for t in r['totals'])} s")
            if args.verbose:
                for label, st in r["points"]:
                    print(f"    {label:12s} " + " ".join(f"{k} {v:.0f}" for k, v in st.items()))


if __name__ == "__main__":
    main()
