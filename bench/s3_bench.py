"""Save and load throughput to S3 (a local S3-compatible server): omnickpt against PyTorch DCP's
fsspec writer/reader, on the same server and the same state.

    # s3fs (for DCP and for fsspec+s3://) in its own folder: its aiobotocore pins an older botocore
    # than the project's boto3, so it must not go into the project's venv
    .venv/bin/pip install --target /tmp/s3fs-site s3fs boto3
    PYTHONPATH=/tmp/s3fs-site .venv/bin/python bench/s3_bench.py            # ~250 MB, 1 and 2 ranks
    PYTHONPATH=/tmp/s3fs-site .venv/bin/python bench/s3_bench.py --quick    # smoke test, ~8 MB

Systems (each a row):
  omnickpt s3://          the built-in boto3 backend (parallel multipart upload, parallel ranged GETs)
  omnickpt s3:// p16      the same with 16 MiB multipart parts (OMNICKPT_S3_PART_SIZE) instead of 64
  omnickpt fsspec+s3://   the fsspec backend over s3fs (one upload stream per file)
  DCP fsspec tN           torch.distributed.checkpoint FsspecWriter/FsspecReader over s3fs, as users
                          call it (get_state_dict -> dcp.save/load -> set_state_dict), N write threads
The server is moto's standalone server (tests/s3server.py) on 127.0.0.1, in its own process; it
keeps objects in memory, so the figures measure the clients' S3 paths and moto, not a network.
State: workloads.MLPStack (--hidden, --layers; default 21 M parameters) after one Adam step:
parameters + exp_avg + exp_avg_sq, float32. 1 rank: a plain module; 2 ranks: FSDP2 (each rank
writes and reads its half). Every save is synchronous (returns once committed); every load goes
into a perturbed state and is checked (sums of every tensor) against what was saved. Each figure
is the slowest rank's seconds (barrier, operation, barrier), median of --reps runs, the systems
interleaved run by run; the checkpoint is deleted (untimed) after each run.
A system that fails is reported with its error (first line) instead of figures.
Request counts (per save / load, all ranks together) come from moto's request log: uploads are
PUT/POST requests, ranged GETs the 206 answers (the data reads of a load). moto answers a ranged
GET by reading the whole object (about 1.2 ms per MB of object here), so on moto a load's time
grows with (ranged GETs x object size); on S3 a ranged GET costs its latency plus its own bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import re
import traceback
import urllib.parse
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the test tree's moto server helper (tests/s3server.py, which imports tests/dist.py)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))


def _system_names(dcp_threads: list[int], part_sizes: list[int], have_s3fs: bool) -> list[str]:
    names = ["omnickpt s3://"] + [f"omnickpt s3:// p{mib}" for mib in part_sizes]
    if have_s3fs:
        names.append("omnickpt fsspec+s3://")
    names += [f"DCP fsspec t{t}" for t in dcp_threads]
    return names


def _url(system: str, bucket: str, prefix: str) -> str:
    if system == "omnickpt fsspec+s3://":
        return f"fsspec+s3://{bucket}/{prefix}"
    return f"s3://{bucket}/{prefix}"


def _save(system: str, url: str, model, opt) -> None:
    if system.startswith("omnickpt"):
        import omnickpt
        # "p16": multipart parts of 16 MiB instead of the default 64 (read when the backend is made)
        os.environ.pop("OMNICKPT_S3_PART_SIZE", None)
        if " p" in system:
            os.environ["OMNICKPT_S3_PART_SIZE"] = str(int(system.rsplit(" p", 1)[1]) << 20)
        omnickpt.save(url, {"model": model, "optimizer": opt}).wait()
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    threads = int(system.rsplit("t", 1)[1])
    dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(url, thread_count=threads))


def _load(system: str, url: str, model, opt) -> None:
    if system.startswith("omnickpt"):
        import omnickpt
        omnickpt.load(url, {"model": model, "optimizer": opt})
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=FsspecReader(url))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _timed(fn) -> float:
    """Seconds of `fn` on the slowest rank: every rank starts together and waits for the last."""
    import torch.distributed as dist
    from scenario import barrier
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    mine = time.perf_counter() - t0
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return max(every)
    return mine


def _agree_on_error(error: str | None) -> str | None:
    """The first rank's error, known to every rank (so that they all skip the system together)."""
    import torch.distributed as dist
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(every) if e), None)


def _scenario(rank, world_size, systems, bucket, reps, hidden, layers):
    import torch
    from scenario import barrier
    from workloads import MLPStack, fingerprint, perturb, same_fingerprint, state_bytes, train_step
    framework = "plain" if world_size == 1 else "fsdp2"
    torch.manual_seed(0)
    module = MLPStack(hidden=hidden, layers=layers)
    if framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for unit in module.fsdp_units():
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    train_step(module, module, opt, torch.Generator().manual_seed(1000))
    expected = fingerprint(module, opt)
    saved = [t.clone() for t in _local_tensors(module, opt)]   # to undo a failed load
    out = {"bytes": state_bytes(module), "framework": framework,
           "systems": {s: {"save": [], "load": [], "error": None} for s in systems}}
    for rep in range(reps):
        for system in systems:
            rec = out["systems"][system]
            if rec["error"]:
                continue
            # the same path on every rank (the bucket is new for each benchmark run)
            prefix = f"s{systems.index(system)}/w{world_size}/rep{rep}"
            url = _url(system, bucket, prefix)
            error = None
            try:
                save_s = _timed(lambda: _save(system, url, module, opt))
                perturb(module, opt)
                load_s = _timed(lambda: _load(system, url, module, opt))
                if not same_fingerprint(fingerprint(module, opt), expected):
                    error = "the loaded state differs from the saved one"
            except BaseException as e:  # noqa: BLE001 - recorded, reported in the table (DCP's
                # CheckpointException derives from BaseException)
                if isinstance(e, KeyboardInterrupt):
                    raise
                # the last line: DCP's CheckpointException puts the rank's underlying error there
                lines = [ln for ln in str(e).splitlines() if ln.strip()]
                error = f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"
                if rank == 0:
                    traceback.print_exc()
            error = _agree_on_error(error)
            if error:
                rec["error"] = error
                with torch.no_grad():   # the next system starts from the saved values again
                    for t, v in zip(_local_tensors(module, opt), saved):
                        t.copy_(v)
            else:
                rec["save"].append(save_s)
                rec["load"].append(load_s)
            barrier()
            if rank == 0:
                from omnickpt.storage.s3 import S3Storage
                S3Storage(f"s3://{bucket}/{prefix}").delete_tree("")
            barrier()
    return out


def _local_tensors(module, opt) -> list:
    """This rank's pieces of every parameter and Adam moment."""
    from workloads import _local
    out = []
    for p in module.parameters():
        out.append(_local(p.detach())[0])
        out += [_local(v)[0] for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    return out


_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[0-9.]+(?:\x1b\[[0-9;]*m)*" (\d{3})')
_RUN = re.compile(r"/s(\d+)/w(\d+)/rep(\d+)(?:/|$)")


def count_requests(log: str) -> dict[tuple[int, int], dict[str, int]]:
    """From moto's request log: per (system index, world size), over all runs, the uploads
    (PUT/POST), the ranged GETs (206: the data reads of a load) and all requests."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    for method, target, status in _REQUEST.findall(log):
        m = _RUN.search(urllib.parse.unquote(target))
        if not m:
            continue
        c = out.setdefault((int(m[1]), int(m[2])), {"requests": 0, "uploads": 0, "ranged_gets": 0})
        c["requests"] += 1
        c["uploads"] += method in ("PUT", "POST")
        c["ranged_gets"] += status == "206"
    return out


def _table(results: dict[int, dict]) -> str:
    lines = ["| ranks | layout | state MB | system | save s | save MB/s | load s | load MB/s "
             "| uploads / save | ranged GETs / load | requests / save+load |",
             "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for world, res in sorted(results.items()):
        mb = res["bytes"] / 1e6
        for system, rec in res["systems"].items():
            head = f"| {world} | {res['framework']} | {mb:.0f} | {system} |"
            if rec["error"]:
                lines.append(f"{head} failed: {rec['error'][:160]} | | | | | | |")
                continue
            s, ld = statistics.median(rec["save"]), statistics.median(rec["load"])
            c = rec.get("counts") or {}
            per = {k: f"{v / len(rec['save']):.0f}" for k, v in c.items()} or {"uploads": "?", "ranged_gets": "?",
                                                                           "requests": "?"}
            lines.append(f"{head} {s:.2f} | {mb / s:.0f} | {ld:.2f} | {mb / ld:.0f} | {per['uploads']} | "
                         f"{per['ranged_gets']} | {per['requests']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=10, help="Linear(h,4h)+Linear(4h,h) pairs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--dcp-threads", default="1,4", help="DCP FsspecWriter thread_count values, one row each")
    ap.add_argument("--part-sizes", default="16", help="extra omnickpt s3:// rows with these multipart part "
                    "sizes (MiB; the default row uses 64)")
    ap.add_argument("--quick", action="store_true", help="a small state and one run: a smoke test")
    ap.add_argument("--json", default=None, help="also write the raw timings here")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.reps = 128, 2, 1

    import importlib.util
    import boto3
    from ranks import run_ranks
    from s3server import AWS_ENV_TO_CLEAR, MotoServer, aws_env
    have_s3fs = importlib.util.find_spec("s3fs") is not None
    systems = _system_names([int(t) for t in args.dcp_threads.split(",") if t],
                            [int(p) for p in args.part_sizes.split(",") if p], have_s3fs)
    if not have_s3fs:
        print("s3fs is not importable: DCP's fsspec writer and fsspec+s3:// cannot run "
              "(see the docstring for how to install it beside the venv)", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("DCP")]

    results: dict[int, dict] = {}
    with MotoServer() as server:
        for k in AWS_ENV_TO_CLEAR:
            os.environ.pop(k, None)
        os.environ.update(aws_env(server.endpoint))    # inherited by the spawned ranks
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.session.Session().client("s3", endpoint_url=server.endpoint,
                                       region_name="us-east-1").create_bucket(Bucket=bucket)
        for world in [int(w) for w in args.ranks.split(",")]:
            t0 = time.perf_counter()
            results[world] = run_ranks(world, _scenario, systems, bucket, args.reps, args.hidden, args.layers)[0]
            print(f"[{world} rank(s): {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
        # MotoServer sends moto's request log (one line per request) to this file
        server._log.seek(0)
        counts = count_requests(server._log.read().decode(errors="replace"))
    for world, res in results.items():
        for i, system in enumerate(systems):
            res["systems"][system]["counts"] = counts.get((i, world))

    import fsspec
    import torch
    versions = {"torch": torch.__version__, "fsspec": fsspec.__version__, "boto3": boto3.__version__}
    if have_s3fs:
        import s3fs
        versions["s3fs"] = s3fs.__version__
    print(f"S3 save/load, moto server on 127.0.0.1, median of {args.reps}; {versions}")
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "reps": args.reps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
