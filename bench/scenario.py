"""What runs on each rank: the timed scenarios, the same for every library.

A library is an object with
    name: str
    save(path, model, opt, module) -> report | None          synchronous, durable
    async_save(path, model, opt, module) -> handle           returns once training may go on
    wait(handle) -> report | None                            returns once the checkpoint is committed
    load(path, model, opt, module) -> report | None          in place, any layout
(`report` is omnickpt's per-phase report; other libraries return None). This module imports
neither omnickpt nor DCP, so bench/bcp_driver.py runs it under ByteCheckpoint's torch 2.5.

Timing: every timed call starts after a barrier, each rank times itself, the parent takes the
slowest rank per repetition (the training loop moves at the slowest rank's pace) and the median
over repetitions.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from workloads import build, fingerprint, perturb, same_fingerprint, state_bytes, train_step


# ---------------------------------------------------------------------------- memory
def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) / 1024 if m else None
    except OSError:
        return None


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float | None:
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """Peak RSS since the last reset_peak_rss() (or since the start when resetting is impossible)."""
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakRSS:
    """Peak RSS (MB) over a `with` block, and the RSS at its start."""

    def __enter__(self):
        self.exact = reset_peak_rss()
        self.start = rss_mb()
        return self

    def __exit__(self, *exc):
        self.peak = peak_rss_mb()
        return False

    def as_dict(self) -> dict:
        return {"start_mb": self.start, "peak_mb": self.peak, "exact": self.exact}


# ---------------------------------------------------------------------------- helpers
def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def copy_floor(module, opt) -> float:
    """Seconds to copy every local tensor of the state (parameters + Adam moments, this rank's
    shards) into one pre-faulted, reused buffer: the floor of any snapshot."""
    from workloads import _local
    tensors = []
    for p in module.parameters():
        tensors.append(_local(p.detach())[0])
        tensors += [_local(v)[0] for k, v in opt.state.get(p, {}).items() if k in ("exp_avg", "exp_avg_sq")]
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8)
    buf.zero_()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).copy_(t.reshape(-1))
            off += n
        best = min(best, time.perf_counter() - t0)
    del buf
    return best


def _fp_path(root: str, tag: str) -> str:
    return os.path.join(root, f"fingerprint-{tag}.json")


def evict(path: str) -> None:
    """Drop every file under `path` from the page cache, as a restarted job finds them: fsync first
    (a save that did not fsync left dirty pages, which DONTNEED cannot drop), then
    POSIX_FADV_DONTNEED. No root needed (unlike drop_caches)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_loads(lib, path: str, model, opt, module, runs: int, rank: int, saved_fp: dict, sync) -> tuple:
    """`runs` pairs of loads of `path`: cold (rank 0 evicted its files from the page cache first),
    then warm (right after, the pages cached). Returns (cold times, warm times, reports, whether the
    first load gave the saved values). `sync()` is a barrier with several ranks."""
    cold, warm, reports, verified = [], [], [], None
    for i in range(runs):
        if rank == 0:
            evict(path)
        sync()
        t0 = time.perf_counter()
        reports.append(lib.load(path, model, opt, module))
        cold.append(time.perf_counter() - t0)
        if i == 0:
            verified = same_fingerprint(fingerprint(module, opt), saved_fp)
        sync()
        t0 = time.perf_counter()
        lib.load(path, model, opt, module)
        warm.append(time.perf_counter() - t0)
    return cold, warm, reports, verified


def _write_fp(root: str, tag: str, fp: dict) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(_fp_path(root, tag), "w") as f:
            json.dump(fp, f)


def _read_fp(root: str, tag: str) -> dict:
    with open(_fp_path(root, tag)) as f:
        return json.load(f)


def code_digest() -> str | None:
    """A digest of the omnickpt sources this process imported, so that a run during which someone
    changed the code shows it (None where omnickpt is not importable, e.g. ByteCheckpoint's venv)."""
    import hashlib
    try:
        import omnickpt
    except ImportError:
        return None
    root = os.path.dirname(omnickpt.__file__)
    h = hashlib.blake2b(digest_size=8)
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


def _close(lib) -> None:
    close = getattr(lib, "close", None)
    if close:
        close()


# ---------------------------------------------------------------------------- scenarios
def async_loop(lib, state: tuple, step, rank: int, root: str, cfg: dict) -> tuple[list, list, list, list]:
    """A training loop that saves every `steps` steps; before each save it waits for the previous
    one, as training loops do. The first save is the first of the process (cold: plans, staging
    allocation); the rest are the steady state. `state`: (model, opt, module). Returns (stalls,
    waits for the previous save, reports, each round's step seconds), each rank timing itself after
    a barrier. Round i holds the steps before save i, so the first step of round i + 1 is the one
    after save i: a lazy snapshot's copy still running holds its optimizer step, and a background
    save competes with it (what training loses besides the stall; `after_save_excess`)."""
    stalls, waits, reports, rounds = [], [], [], []
    prev, prev_path = None, None
    for i in range(cfg["async_saves"]):
        times = []
        for _ in range(cfg["steps"]):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rounds.append(times)
        t0 = time.perf_counter()
        if prev is not None:
            rep = lib.wait(prev)
            waits.append(time.perf_counter() - t0)
            reports.append(rep)
        barrier()
        if prev_path and rank == 0:
            rmtree(prev_path)
        barrier()
        path = os.path.join(root, f"async-{i}")
        t0 = time.perf_counter()
        prev = lib.async_save(path, *state)
        stalls.append(time.perf_counter() - t0)
        prev_path = path
    reports.append(lib.wait(prev))
    barrier()
    if rank == 0:
        rmtree(prev_path)
    return stalls, waits, reports, rounds


def after_save_excess(rounds: list[list[float]]) -> list[float]:
    """Per save but the last (pure): how much longer the first step after it took than the loop's
    other steps (their median: every round's steps but its first; the loop's very first step, the
    process's coldest, is no baseline either). Signed: noise makes some excesses negative, and
    clamping them would bias the median upwards. Empty with fewer than 2 steps a round (no step
    to compare with)."""
    if not rounds or min(len(r) for r in rounds) < 2:
        return []
    base = statistics.median(t for r in rounds for t in r[1:])
    return [r[0] - base for r in rounds[1:]]


def lost_per_save(launch: list[dict]) -> list[float]:
    """Per save but the last (pure), over the ranks of one launch (each with "async_stalls" and
    "async_after"): the slowest rank's stall plus the excess of the step after the save, what
    training lost to it."""
    return [max(vals) for vals in zip(*[[s + x for s, x in zip(r["async_stalls"], r["async_after"])]
                                        for r in launch])]


def main_layout(rank: int, world: int, make_lib, cfg: dict) -> dict:
    """2 ranks in the workload's layout: async saves while training, async totals, sync saves,
    load at the same layout. Leaves the last sync save at <root>/ckpt-2r for the 2->1 load."""
    root, runs = cfg["root"], cfg["runs"]
    lib = make_lib()
    model, opt, module, gen = build(cfg["workload"], cfg["framework"], quick=cfg["quick"])
    out: dict = {"rank": rank, "code": code_digest(), "state_bytes": state_bytes(module),
                 "copy_floor_s": copy_floor(module, opt)}
    reports: dict[str, list] = {"async": [], "async_total": [], "sync": [], "load": []}
    step = lambda: train_step(model, module, opt, gen)  # noqa: E731

    if not cfg.get("loads_only"):   # libraries measured for their loads only skip 1. and 2.
        # 1. A training loop that saves every `steps` steps (async_loop).
        with PeakRSS() as mem_async:
            stalls, waits, reports["async"], rounds = async_loop(lib, (model, opt, module), step, rank, root, cfg)
        out.update(async_stalls=stalls, async_waits=waits, async_after=after_save_excess(rounds),
                   rss_async=mem_async.as_dict())

        # 2. Async total: from the call until committed (nothing else running).
        totals = []
        for i in range(runs):
            path = os.path.join(root, f"async-total-{i}")
            barrier()
            t0 = time.perf_counter()
            h = lib.async_save(path, model, opt, module)
            reports["async_total"].append(lib.wait(h))
            totals.append(time.perf_counter() - t0)
            barrier()
            if rank == 0:
                rmtree(path)
        out["async_totals"] = totals
    if cfg.get("async_only"):
        out["reports"] = reports if rank == 0 else {}
        _close(lib)
        return out

    # 3. Durable synchronous saves; the last one stays for the loads.
    syncs = []
    with PeakRSS() as mem_sync:
        for i in range(runs):
            path = os.path.join(root, f"sync-{i}")
            barrier()
            t0 = time.perf_counter()
            reports["sync"].append(lib.save(path, model, opt, module))
            syncs.append(time.perf_counter() - t0)
            barrier()
            if rank == 0 and i < runs - 1:
                rmtree(path)
    kept = os.path.join(root, f"sync-{runs - 1}")
    barrier()
    if rank == 0:
        os.replace(kept, os.path.join(root, "ckpt-2r"))
    barrier()
    kept = os.path.join(root, "ckpt-2r")
    saved_fp = fingerprint(module, opt)
    _write_fp(root, "2r", saved_fp)
    out["sync_saves"] = syncs
    out["rss_sync"] = mem_sync.as_dict()

    # 4. Load at the same layout, into a perturbed state (so a load that does nothing shows).
    perturb(module, opt)
    with PeakRSS() as mem_load:
        out["loads"], out["loads_warm"], reports["load"], out["load_verified"] = timed_loads(
            lib, kept, model, opt, module, runs, rank, saved_fp, barrier)
    out["rss_load"] = mem_load.as_dict()
    out["reports"] = reports if rank == 0 else {}
    _close(lib)
    return out


def first_saves(rank: int, world: int, make_lib, cfg: dict) -> dict:
    """2 ranks in the workload's layout, a fresh process: the training loop with async saves of
    main_layout's part 1 and nothing else. A process has one first save; bench/compare.py launches
    this a few times so that its first-save figure is a median over launches, not one sample."""
    lib = make_lib()
    model, opt, module, gen = build(cfg["workload"], cfg["framework"], quick=cfg["quick"])
    stalls, _, _, rounds = async_loop(lib, (model, opt, module), lambda: train_step(model, module, opt, gen), rank,
                                      cfg["root"], cfg)
    _close(lib)
    return {"rank": rank, "code": code_digest(), "async_stalls": stalls, "async_after": after_save_excess(rounds)}


def one_rank(rank: int, world: int, make_lib, cfg: dict) -> dict:
    """1 rank, plain module: the 2->1 resharded load of <root>/ckpt-2r, then a save at <root>/ckpt-1r
    for the 1->2 load."""
    root, runs = cfg["root"], cfg["runs"]
    lib = make_lib()
    # A plain module, except for libraries whose checkpoints are tied to their framework.
    model, opt, module, gen = build(cfg["workload"], cfg.get("one_rank_framework", "plain"), quick=cfg["quick"],
                                    seed=1)
    saved_fp = _read_fp(root, "2r")
    perturb(module, opt)
    out: dict = {"rank": rank, "code": code_digest()}
    with PeakRSS() as mem:
        loads, warm, reports, out["load_verified"] = timed_loads(lib, os.path.join(root, "ckpt-2r"), model, opt,
                                                                 module, runs, rank, saved_fp, lambda: None)
    out.update(loads=loads, loads_warm=warm, rss_load=mem.as_dict(), reports={"load_2to1": reports})
    # A distinct state for the 1->2 load: one more step.
    train_step(model, module, opt, gen)
    t0 = time.perf_counter()
    lib.save(os.path.join(root, "ckpt-1r"), model, opt, module)
    out["sync_save_1rank"] = time.perf_counter() - t0
    _write_fp(root, "1r", fingerprint(module, opt))
    _close(lib)
    return out


def scale_up(rank: int, world: int, make_lib, cfg: dict) -> dict:
    """2 ranks in the workload's layout: the 1->2 resharded load of <root>/ckpt-1r."""
    root, runs = cfg["root"], cfg["runs"]
    lib = make_lib()
    model, opt, module, gen = build(cfg["workload"], cfg["framework"], quick=cfg["quick"], seed=2)
    saved_fp = _read_fp(root, "1r")
    perturb(module, opt)
    out: dict = {"rank": rank, "code": code_digest()}
    with PeakRSS() as mem:
        loads, warm, reports, out["load_verified"] = timed_loads(lib, os.path.join(root, "ckpt-1r"), model, opt,
                                                                 module, runs, rank, saved_fp, barrier)
    out.update(loads=loads, loads_warm=warm, rss_load=mem.as_dict(), reports={"load_1to2": reports} if rank == 0 else {})
    _close(lib)
    return out
