"""ByteCheckpoint's column: the scenarios of bench/compare.py run with ByteCheckpoint 0.0.2.

Run through bench/bytecheckpoint.sh, which builds its venv (bench/.venv-bcp, torch 2.5.0): this
file runs under that torch, not the project's, and never imports omnickpt. Same workloads, same
process layout (2 gloo ranks on CPU), same disk, same timing rules as compare.py.
Writes bench/out/bcp[-quick].json, which compare.py prints as an extra column.

ByteCheckpoint as its README uses it: bytecheckpoint.save(path, {"model": m, "optimizer": o},
framework="ddp"|"fsdp2", fast_saving=..., global_steps=N) and bytecheckpoint.load(path, state,
framework=..., fast_loading=True). Its data files are fsynced (store engine sync_files=True) and
`global_steps` makes rank 0 write the tracker file (latest_checkpointed_iteration.txt) once every
rank has written its files: that file is its commit, so "until committed" waits for it.
FSDP2 is skipped on CPU: torch 2.5's fully_shard needs CUDA streams, and ByteCheckpoint refuses
torch >= 2.6. ByteCheckpoint's checkpointers are framework-specific (the DDP one keeps DDP's "module." names),
so its 1-rank side of the resharded loads uses the same framework on a 1-rank group, not a plain
module.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TRACKER = "latest_checkpointed_iteration.txt"


class BCPLib:
    name = "bytecheckpoint"

    def __init__(self, framework: str):
        import bytecheckpoint
        self._bcp = bytecheckpoint
        self._framework = framework
        self._step = 0

    def _save(self, path, model, opt, fast):
        self._step += 1
        self._bcp.save(path, {"model": model, "optimizer": opt}, framework=self._framework, fast_saving=fast,
                       global_steps=self._step, ignore_append_global_steps_to_folder=True)
        return path

    def save(self, path, model, opt, module):
        self.wait(self._save(path, model, opt, False))
        return None

    def async_save(self, path, model, opt, module):
        return self._save(path, model, opt, True)

    def wait(self, path, timeout: float = 1800.0):
        deadline, delay = time.monotonic() + timeout, 0.001
        while not os.path.exists(os.path.join(path, TRACKER)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ByteCheckpoint save to {path} did not commit within {timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return None

    def load(self, path, model, opt, module):
        self._bcp.load(path, {"model": model, "optimizer": opt}, framework=self._framework, fast_loading=True)
        return None


class BCPDDP(BCPLib):
    def __init__(self):
        super().__init__("ddp")


class BCPFSDP2(BCPLib):
    def __init__(self):
        super().__init__("fsdp2")


LIB_FOR = {"ddp": BCPDDP, "fsdp2": BCPFSDP2}


def main(argv=None) -> int:
    import torch

    import scenario
    from compare import summarize_lib
    from ranks import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--async-saves", type=int)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workloads", default="mlp,gpt")
    ap.add_argument("--frameworks", default="ddp,fsdp2")
    ap.add_argument("--dir")
    args = ap.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 3)
    args.async_saves = args.async_saves or (3 if args.quick else 8)
    root = args.dir or tempfile.mkdtemp(prefix="bcp-bench-")
    doc = {"environment": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "bytecheckpoint": "0.0.2", "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
           "settings": {"runs": args.runs, "async_saves": args.async_saves, "steps_between_saves": args.steps,
                        "quick": args.quick}, "results": {}, "errors": {}, "skipped": {}}
    t_start = time.time()
    try:
        for workload in args.workloads.split(","):
            for framework in args.frameworks.split(","):
                key = f"{workload}/{framework}"
                if framework == "fsdp2" and not torch.cuda.is_available():
                    # torch 2.5's fully_shard raises "FSDP requires CUDA for streams" at the first
                    # forward on CPU (CPU support came in torch 2.6, which ByteCheckpoint refuses).
                    doc["skipped"][key] = ("torch 2.5 FSDP2 needs CUDA ('FSDP requires CUDA for streams'); "
                                           "ByteCheckpoint 0.0.2 refuses torch >= 2.6")
                    print(f"  [{key}/bytecheckpoint] skipped: {doc['skipped'][key]}", flush=True)
                    continue
                lib_root = os.path.join(root, f"{workload}-{framework}")
                os.makedirs(lib_root, exist_ok=True)
                cfg = dict(workload=workload, framework=framework, quick=args.quick, runs=args.runs,
                           async_saves=args.async_saves, steps=args.steps, root=lib_root,
                           one_rank_framework=framework)
                lib = LIB_FOR[framework]
                t0 = time.time()
                try:
                    a = run_ranks(2, scenario.main_layout, lib, cfg)
                    b = run_ranks(1, scenario.one_rank, lib, cfg)
                    c = run_ranks(2, scenario.scale_up, lib, cfg)
                    res = summarize_lib(a, b, c)
                    res["wall_s"] = time.time() - t0
                    doc["results"][key] = {"bytecheckpoint": res}
                    print(f"  [{key}/bytecheckpoint] {time.time() - t0:.0f} s: " + ", ".join(
                        f"{k}={v:.3f}" for k, v in res["figures"].items() if v is not None), flush=True)
                except Exception as e:   # one failing configuration must not hide the others
                    doc["errors"][key] = str(e)[-4000:]
                    print(f"  [{key}/bytecheckpoint] FAILED after {time.time() - t0:.0f} s:\n{str(e)[-2000:]}",
                          flush=True)
                finally:
                    shutil.rmtree(lib_root, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    doc["environment"]["loadavg_end"] = os.getloadavg()
    doc["environment"]["wall_s"] = time.time() - t_start
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    out = os.path.join(HERE, "out", f"bcp{'-quick' if args.quick else ''}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"ByteCheckpoint results in {os.path.relpath(out)} ({doc['environment']['wall_s']:.0f} s)")
    return 0 if doc["results"] else 1


if __name__ == "__main__":
    sys.exit(main())
