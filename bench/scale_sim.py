"""The design at 10,000 GPUs, by simulation: planning, metadata, commit fan-in, S3 request rates and a
model of save/load time at 1,024 machines (docs/scale.md).

    .venv/bin/python bench/scale_sim.py            # 8192 and 16384 ranks (~4-5 min, ~4.7 GB peak RSS)
    .venv/bin/python bench/scale_sim.py --quick    # 256 and 512 ranks (~15-25 s)
    .venv/bin/python bench/scale_sim.py --from-json bench/out/scale_sim.json [model options]   # the model only

One process, no process group: what a job of N ranks would send, receive, write and read is built
with the library's own functions and measured, as bench/plan_scale.py does for the planner.

1. Per N (--ranks): the pure global planner on N ranks x --tensors records (plan_scale.bench_planner:
   FSDP-like row slabs plus --replicated tensors every rank holds); the bytes each exchange moves
   (the all-gather every save makes in `SaveJob.agree`, the plan's gather and scatter on a cache miss,
   the commit records); the coordinator's `build_manifest` from N simulated RankResults and the
   manifest's encode / decode / size; one rank's load planning against it (`Manifest.decode(names=)`
   + `plan_reads` of its row slab of every tensor).
2. Commit fan-in, from the real code: one real save and one load of a small state (one process) to
   `s3://` through S3Storage against moto (tests/s3server.py) behind a proxy that logs every request by
   operation and key
   (the keys' save id and rank made generic): which objects a save writes per rank and per save. Then
   the coordinator's `commit.await_records` on N record files, timed on local disk (the records are
   the JSON a real async save posts, its checksums those of this rank's simulated writes) and counted
   on moto through the proxy (LIST pages and GETs) up to --s3-ranks ranks, by the same rule above.
3. The S3 request count of one save of --params parameters x --bytes-per-param bytes from --machines
   x --gpus ranks (multipart parts of S3Storage's part size) and the rate it asks of a key prefix if
   the save takes the modelled time, against --prefix-put-limit PUT/s per partitioned prefix.
4. A save/load time model at --machines machines: per-machine bytes at the per-machine throughputs
   measured on this machine (--machine-write-gbs / --machine-read-gbs: bench/write_path.py and
   bench/cold_load_probe.py), against an aggregate storage bandwidth (--fs-gbs) or S3's per-prefix
   request limit, plus the planning/exchange/commit overheads measured in 1 (links at --link-gbs,
   small S3 requests at --s3-latency-ms). Every assumption is a command-line option and is printed.

Results: bench/out/scale_sim[-quick].json (the model's inputs included).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))   # s3server: moto and the proxy

import plan_scale  # noqa: E402


# ---------------------------------------------------------------------------------------------- S3 requests
def _operation(method: str, path: str) -> tuple[str, str]:
    """(S3 operation, key) of a path-style request as S3Storage's boto3 client sends it."""
    from urllib.parse import parse_qs, unquote
    raw, _, query = path.partition("?")
    parts = unquote(raw).lstrip("/").split("/", 1)
    key = parts[1] if len(parts) > 1 else ""
    q = parse_qs(query, keep_blank_values=True)
    if method == "GET" and (not key or "list-type" in q):
        return "ListObjectsV2", q.get("prefix", [""])[0]
    if method == "POST":
        return ("CreateMultipartUpload" if "uploads" in q else "CompleteMultipartUpload" if "uploadId" in q
                else "DeleteObjects" if "delete" in q else "Post"), key
    if method == "PUT":
        return ("UploadPart" if "partNumber" in q else "PutObject"), key
    if method == "DELETE":
        return ("AbortMultipartUpload" if "uploadId" in q else "DeleteObject"), key
    return {"GET": "GetObject", "HEAD": "HeadObject"}.get(method, method), key


class S3Requests:
    """A real S3-compatible server (moto, tests/s3server.py) behind a forwarding proxy that logs every
    request S3Storage sends through it, by operation and key (a LIST page is one ListObjectsV2). Inside
    `with`, the AWS_* environment points boto3 at the proxy; `direct` is a client of the server
    itself, for seeding and reading objects without counting them."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self._moto = self._proxy = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "S3Requests":
        import boto3
        from s3server import AWS_ENV_TO_CLEAR, FaultProxy, MotoServer, aws_env
        self._moto = MotoServer().start()
        # No faults: lose_when only sees each request go by (and never loses one).
        self._proxy = FaultProxy(self._moto.port, lose_when=lambda m, p: self.log.append(_operation(m, p)) or False)
        self._proxy.start()
        env = aws_env(self._proxy.endpoint)
        for k in list(env) + list(AWS_ENV_TO_CLEAR):
            self._saved[k] = os.environ.pop(k, None)
        os.environ.update(env)
        self.direct = boto3.client("s3", endpoint_url=self._moto.endpoint, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")
        self.direct.create_bucket(Bucket="bench")
        return self

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._proxy.stop()
        self._moto.stop()

    def counts(self, since: int = 0) -> dict[str, dict[str, int]]:
        """{operation: {generic key: requests}} of the requests after the first `since`."""
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for op, key in self.log[since:]:
            out[op][_generic(key)] += 1
        return {op: dict(c) for op, c in sorted(out.items())}

    def keys(self, prefix: str) -> dict[str, int]:
        """{key: size} under `prefix`, read from the server directly (not counted)."""
        pages = self.direct.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


_SAVE_ID = re.compile(r"[0-9a-f]{16,32}")
_RANK = re.compile(r"r\d{5}")


def _generic(key: str) -> str:
    return _RANK.sub("r<rank>", _SAVE_ID.sub("<id>", key))


# ---------------------------------------------------------------------------------------------- 1. exchanges
def settle_payload_bytes(records: list, batch) -> int:
    """The pickled (outcome, payload) one rank contributes to the all-gather of SaveJob.agree
    (saving.py): (structure digest, save id, path, replica sums (empty unless check_replicas), table
    digest, base chain); every rank receives world_size of them."""
    from omnickpt.planner import structure_digest
    payload = (structure_digest(records), uuid.uuid4().hex[:16], "s3://my-bucket/runs/llama-70b/global_step_100000",
               [], batch.table_digest, None)
    return len(pickle.dumps((None, payload)))


def simulated_results(plan, save_id: str, timings: dict) -> list:
    """Every rank's RankResult as persist returns it for this plan: one file, one CRC32C per
    CHUNK_BYTES chunk of each write (values made up), this rank's real `timings` dict."""
    from omnickpt.engine.persist import RankResult, data_file_name
    from omnickpt.format import CHUNK_BYTES
    per_rank = plan.bytes_per_rank()
    out = []
    for r in range(len(per_rank)):
        a, b = int(plan.write_start[r]), int(plan.write_start[r + 1])
        # CRC32C values spread over 32 bits as real ones are (their JSON length is what a record's size is made of)
        sums = [[((r * 1_000_003 + j) * 2654435761) & 0xFFFFFFFF] * max(1, -(-int(n) // CHUNK_BYTES))
                for j, n in enumerate(plan.write_nbytes[a:b])]
        out.append(RankResult(r, data_file_name(save_id, r), int(plan.tensor_bytes[r]), sums, [], timings))
    return out


def bench_commit_side(plan, runs: int, timings: dict) -> tuple[dict, bytes, list]:
    """The coordinator's commit: build_manifest from every rank's result, encode, decode; sizes of one
    rank's commit record (async: JSON through storage; sync: a pickle in a gather)."""
    from omnickpt import __version__
    from omnickpt.engine.manifest import build_manifest
    from omnickpt.format import Manifest
    save_id = uuid.uuid4().hex[:16]
    results = simulated_results(plan, save_id, timings)
    ranks = len(results)
    rec = dataclasses.asdict(results[1])
    json_bytes = len(json.dumps(dict(rec, rank=1), default=str).encode())
    pickled = len(pickle.dumps(results[1]))
    build, enc, dec = [], [], []
    data = b""
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        m = build_manifest(plan, results, save_id=save_id, layout={"world_size": ranks}, tool_version=__version__)
        t1 = time.perf_counter()
        data = m.encode()
        t2 = time.perf_counter()
        del m
        gc.collect()
        t3 = time.perf_counter()
        back = Manifest.decode(data)
        t4 = time.perf_counter()
        boxes = sum(len(t.columns) for t in back.tensors.values())
        del back
        build.append(t1 - t0)
        enc.append(t2 - t1)
        dec.append(t4 - t3)
    return ({"record_json_bytes": json_bytes, "record_pickle_bytes": pickled, "records_json_total": ranks * json_bytes,
             "manifest_boxes": boxes, "manifest_files": ranks, "manifest_bytes": len(data),
             "build_manifest_s_median": statistics.median(build), "encode_s_median": statistics.median(enc),
             "decode_s_median": statistics.median(dec), "build_manifest_s_all": build},
            data, [dict(dataclasses.asdict(results[r]), rank=r) for r in (0, 1)])


def bench_load_slice(data: bytes, names: list[str], ranks: int, runs: int, rank: int = 3) -> dict:
    """One rank of the same layout loads its row slab of every tensor: it decodes only the tensors it
    loads (all of them here: every rank holds a slab of each) and plans its reads."""
    from omnickpt.layout import Box

    def box_of(name, shape):   # its slab of a sharded tensor, a replicated one whole
        return Box((rank * 4, 0), (4, shape[1])) if len(shape) == 2 and shape[0] == ranks * 4 else Box.full(shape)
    t = plan_scale.time_slice(data, list(names), box_of, runs)
    dec, plan = statistics.median(t["decode"]), statistics.median(t["plan"])
    return {"tensors_loaded": len(names), "read_items": t["read_items"], "decode_s_median": dec,
            "plan_reads_s_median": plan, "total_s_median": dec + plan}


def real_save_counts(part_mb: int, s3: S3Requests) -> dict:
    """One real async save, one sync save and one load of a small state (one process) to s3:// through
    S3Storage, against moto: requests by operation and generic key. Also returns the record the
    async save posted (read back from the server: its timings are a real rank's)."""
    import torch

    import omnickpt
    old_part = os.environ.get("OMNICKPT_S3_PART_SIZE")
    os.environ["OMNICKPT_S3_PART_SIZE"] = str(part_mb << 20)
    try:
        torch.manual_seed(0)
        # 8 tensors of 1.5 MiB + one of 3 MiB (15 MiB) and a few objects; with 5 MiB parts the data file
        # goes up as a multipart upload of 3 parts.
        state = {"model": {f"layer{i}.weight": torch.randn(384, 1024) for i in range(8)},
                 "big": torch.randn(768, 1024), "extra": {"step": 100, "lr": 1e-4}}
        out = {"state_bytes": sum(t.numel() * 4 for t in state["model"].values()) + state["big"].numel() * 4}
        for kind, kw in (("async_save", {"async_save": True}), ("sync_save", {})):
            mark = len(s3.log)
            omnickpt.save(f"s3://bench/run/{kind}", state, **kw).wait()
            out[kind] = s3.counts(mark)
        mark = len(s3.log)
        target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                  "big": torch.empty_like(state["big"]), "extra": {}}
        omnickpt.load("s3://bench/run/sync_save", target)
        out["load"] = s3.counts(mark)
        assert torch.equal(target["big"], state["big"])
        objects = s3.keys("run/")
        out["data_object_bytes"] = {_generic(k): n for k, n in objects.items() if "/data/" in k}
        posted = [k for k in objects if k.startswith("run/async_save/.omnickpt/") and k.endswith("/r00000.json")]
        out["record"] = (json.loads(s3.direct.get_object(Bucket="bench", Key=posted[0])["Body"].read())
                         if posted else None)
        out["part_size"] = part_mb << 20
    finally:
        if old_part is None:
            os.environ.pop("OMNICKPT_S3_PART_SIZE", None)
        else:
            os.environ["OMNICKPT_S3_PART_SIZE"] = old_part
    return out


def bench_await_records(records: list[dict], ranks: int, work_dir: str, s3: S3Requests, s3_ranks: int) -> dict:
    """The coordinator's commit.await_records on `ranks` record files already posted: on local disk
    (timed) and on the counting S3 (requests counted). records: those of ranks 0 and 1 (rank r >= 1
    posts rank 1's record with its own rank number: the same size)."""
    import omnickpt.commit as commit_mod
    from omnickpt.storage import LocalStorage
    from omnickpt.storage.s3 import S3Storage
    save_id = uuid.uuid4().hex[:16]
    blobs = [json.dumps(dict(records[min(r, 1)], rank=r), default=str).encode() for r in range(ranks)]
    # Local disk: the files as post_record writes them (storage.commit's temp + fsync + rename is the
    # posting ranks' cost, paid in parallel on N machines; here they are written plainly).
    root = tempfile.mkdtemp(prefix="scale_sim_", dir=work_dir)
    try:
        local = LocalStorage(root)
        folder = os.path.join(root, os.path.dirname(commit_mod.record_path(save_id, 0)))
        os.makedirs(folder)
        for r, b in enumerate(blobs):
            with open(os.path.join(root, commit_mod.record_path(save_id, r)), "wb") as f:
                f.write(b)
        os.sync()
        gc.collect()
        t0 = time.perf_counter()
        got = commit_mod.await_records(local, save_id, ranks, 600, "scale_sim")
        local_s = time.perf_counter() - t0
        assert len(got) == ranks
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"ranks": ranks, "record_bytes_total": sum(map(len, blobs)), "local_disk_s": local_s}
    if s3_ranks and ranks <= s3_ranks:
        # The same records on the S3 server (seeded directly, not counted), then the coordinator's wait
        # through S3Storage and the logging proxy. Above s3_ranks the counts follow the same rule (one
        # LIST page per 1,000 keys, one GET per record): seeding 16,384 objects into moto takes minutes.
        store = S3Storage("s3://bench/fanin")
        for r, b in enumerate(blobs):
            s3.direct.put_object(Bucket="bench", Key=store._key(commit_mod.record_path(save_id, r)), Body=b)
        mark = len(s3.log)
        t0 = time.perf_counter()
        got = commit_mod.await_records(store, save_id, ranks, 600, "scale_sim")
        out["s3_seconds_moto"] = time.perf_counter() - t0
        assert [g["rank"] for g in got] == list(range(ranks)), "a record came back for the wrong rank"
        out["s3_requests"] = dict(collections.Counter(op for op, _ in s3.log[mark:]))
        out["s3_counted"] = True
    else:
        out["s3_requests"] = {"ListObjectsV2": math.ceil(ranks / 1000), "GetObject": ranks}
        out["s3_counted"] = False
    return out


# ---------------------------------------------------------------------------------------------- 3-4. model
def s3_requests_per_save(ranks: int, total_bytes: float, part_size: int, per_rank_small: int, per_save: int) -> dict:
    """S3Storage.write_file: a file up to one part is one PutObject; a larger one is
    CreateMultipartUpload + ceil(size / part) UploadPart + CompleteMultipartUpload (part size
    max(part_size, size / 10,000)). Plus the small objects each rank and the coordinator PUT."""
    size = total_bytes / ranks
    part = max(part_size, math.ceil(size / 10_000))
    data = 1 if size <= part else 2 + math.ceil(size / part)
    writes = ranks * (data + per_rank_small) + per_save
    return {"bytes_per_rank": size, "part_size": part, "requests_per_data_file": data, "write_requests": writes}


def model(args, sim: dict, fan: dict, counts: dict) -> dict:
    """Save and load time at args.machines machines; every input is in the returned dict."""
    ranks = args.machines * args.gpus
    total = args.params * args.bytes_per_param
    per_machine = total / args.machines
    near = min(sim, key=lambda n: abs(int(n) - ranks))       # the simulated N closest to this job
    s = sim[near]
    f = fan.get(near) or fan[max(fan, key=int)]
    link = args.link_gbs * 1e9
    lat = args.s3_latency_ms / 1e3
    w = per_machine / (args.machine_write_gbs * 1e9)
    r = per_machine / (args.machine_read_gbs * 1e9)
    fs = total / (args.fs_gbs * 1e9)
    # Small objects each rank writes per save (async: its record) and what the coordinator writes.
    per_rank_small, per_save = counts["per_rank_small_puts"], counts["per_save_puts"]
    from omnickpt.storage.s3 import DEFAULT_PART_SIZE
    req = s3_requests_per_save(ranks, total, args.part_size or DEFAULT_PART_SIZE, per_rank_small, per_save)
    limit = args.prefix_put_limit
    s3_floor_one = req["write_requests"] / limit
    # Overheads measured by the simulation (at N = near), scaled linearly to `ranks` where they grow with N.
    k = ranks / int(near)
    plan_miss = s["plan"]["seconds_median"] * k
    exch_every = s["exchange"]["settle_bytes_received_per_rank"] * k * k / link   # all-gather: per rank N x payload
    exch_miss = (s["plan"]["coordinator_received_bytes"] + s["plan"]["coordinator_scattered_bytes"]) * k / link
    commit_fs = s["commit"]["build_manifest_s_median"] * k + s["commit"]["encode_s_median"] * k \
        + f["local_disk_s"] * k + s["commit"]["manifest_bytes"] * k / link
    s3_reqs = f["s3_requests"]
    commit_s3 = s["commit"]["build_manifest_s_median"] * k + s["commit"]["encode_s_median"] * k \
        + (sum(s3_reqs.values()) * k) * lat + s["commit"]["manifest_bytes"] * k / link
    # The design answers, with the same inputs: records aggregated per node (one per --gpus ranks), read
    # by `--parallel-gets` threads instead of one after the other.
    commit_s3_node = commit_s3 - (sum(s3_reqs.values()) * k) * lat + (sum(s3_reqs.values()) * k / args.gpus) * lat
    commit_s3_par = commit_s3 - (sum(s3_reqs.values()) * k) * lat \
        + math.ceil(sum(s3_reqs.values()) * k / args.parallel_gets) * lat
    data = 1 if req["bytes_per_rank"] <= req["part_size"] else 2 + math.ceil(req["bytes_per_rank"] / req["part_size"])
    writes_node = ranks * data + math.ceil(ranks / args.gpus) * per_rank_small + per_save
    writes_one_put = ranks * (1 + per_rank_small) + per_save     # part size >= a rank's file: one PUT each
    data_fs = max(w, fs)
    save_fs = data_fs + exch_every + commit_fs
    data_s3_one = max(w, s3_floor_one)
    data_s3_spread = max(w, req["write_requests"] / (limit * args.prefixes))
    load_meta = s["commit"]["manifest_bytes"] * k / link + s["slice"]["total_s_median"] * k
    load_fs = max(r, fs * args.fs_gbs / args.fs_read_gbs) + load_meta
    return {"inputs": {"machines": args.machines, "gpus_per_machine": args.gpus, "ranks": ranks,
                       "params": args.params, "bytes_per_param": args.bytes_per_param, "total_bytes": total,
                       "machine_write_GBps": args.machine_write_gbs, "machine_read_GBps": args.machine_read_gbs,
                       "fs_aggregate_write_GBps": args.fs_gbs, "fs_aggregate_read_GBps": args.fs_read_gbs,
                       "link_GBps": args.link_gbs, "s3_small_request_latency_ms": args.s3_latency_ms,
                       "prefix_put_limit_per_s": limit, "spread_prefixes": args.prefixes,
                       "parallel_gets": args.parallel_gets,
                       "simulated_N_used": int(near), "scale_factor_from_simulated_N": k},
            "bytes_per_machine": per_machine, "bytes_per_rank": total / ranks,
            "write_at_machine_throughput_s": w, "read_at_machine_throughput_s": r,
            "fs_aggregate_write_s": fs,
            "overheads": {"plan_on_cache_miss_s": plan_miss, "settle_allgather_every_save_s": exch_every,
                          "plan_gather_scatter_on_miss_s": exch_miss, "commit_parallel_fs_s": commit_fs,
                          "commit_s3_s": commit_s3, "load_manifest_broadcast_and_plan_s": load_meta},
            "commit_s3_per_node_records_s": commit_s3_node, "commit_s3_parallel_gets_s": commit_s3_par,
            "s3": dict(req, prefix_floor_one_prefix_s=s3_floor_one,
                       write_requests_per_node_records=writes_node, prefix_floor_per_node_records_s=writes_node / limit,
                       write_requests_one_put_per_rank=writes_one_put,
                       prefix_floor_one_put_per_rank_s=writes_one_put / limit,
                       rate_if_data_time_per_s=req["write_requests"] / max(w, 1e-9),
                       prefix_floor_spread_s=req["write_requests"] / (limit * args.prefixes)),
            "save_parallel_fs_s": save_fs, "save_parallel_fs_first_s": save_fs + plan_miss + exch_miss,
            "save_s3_one_prefix_s": data_s3_one + exch_every + commit_s3,
            "save_s3_spread_s": data_s3_spread + exch_every + commit_s3,
            "load_parallel_fs_s": load_fs}


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 and 512 ranks, 1 run: a smoke test")
    ap.add_argument("--ranks", help="comma-separated rank counts (default 8192,16384)")
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--replicated", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work-dir", default=tempfile.gettempdir(), help="where record files are written for the fan-in")
    ap.add_argument("--s3-ranks", type=int, default=2048,
                    help="count the commit's S3 requests on the server up to this many ranks (rule above it)")
    m = ap.add_argument_group("model (every figure here is an assumption or a measurement given as input)")
    m.add_argument("--machines", type=int, default=1024)
    m.add_argument("--gpus", type=int, default=8)
    m.add_argument("--params", type=float, default=70e9)
    m.add_argument("--bytes-per-param", default="14,16",
                   help="comma-separated; 14 = bf16 weights 2 + fp32 master 4 + Adam exp_avg 4 + exp_avg_sq 4; "
                        "16 = the same with fp32 weights (fp32 master kept apart), ~1.1 TB at 70B")
    m.add_argument("--machine-write-gbs", type=float, default=None,
                   help="per-machine durable write GB/s (default: bench/out/write_path.json's O_DIRECT median, "
                        "measured on this machine by bench/write_path.py)")
    m.add_argument("--machine-read-gbs", type=float, default=None,
                   help="per-machine cold read GB/s (default 1.37: bench/cold_load_probe.py, 302 MB in 0.221 s, "
                        "2026-11-25 on this machine)")
    m.add_argument("--fs-gbs", type=float, default=1000.0, help="parallel FS aggregate write GB/s")
    m.add_argument("--fs-read-gbs", type=float, default=1000.0, help="parallel FS aggregate read GB/s")
    m.add_argument("--link-gbs", type=float, default=12.5, help="the coordinator's network link, GB/s")
    m.add_argument("--s3-latency-ms", type=float, default=20.0, help="one small S3 request (LIST page, GET)")
    m.add_argument("--prefix-put-limit", type=float, default=3500.0)
    m.add_argument("--parallel-gets", type=int, default=64, help="concurrent record GETs of the design answer")
    m.add_argument("--from-json", help="recompute only the model from this earlier output (no simulation)")
    m.add_argument("--part-size", type=int, default=None, help="S3 part size, bytes (default S3Storage's)")
    m.add_argument("--prefixes", type=int, default=256, help="prefixes a hash-spread key layout would use")
    args = ap.parse_args(argv)
    ranks_list = [int(x) for x in (args.ranks or ("256,512" if args.quick else "8192,16384")).split(",")]
    runs = 1 if args.quick else args.runs
    if args.machine_write_gbs is None:
        wp = os.path.join(HERE, "out", "write_path.json")
        try:
            with open(wp) as f:
                doc = json.load(f)
            args.machine_write_gbs = _o_direct_gbs(doc)
        except (OSError, ValueError, KeyError):
            args.machine_write_gbs = 0.62
    if args.machine_read_gbs is None:
        args.machine_read_gbs = 1.37
    t_start = time.time()
    load0 = os.getloadavg()
    if args.from_json:
        with open(args.from_json) as f:
            prev = json.load(f)
        for bpp in [float(x) for x in str(args.bytes_per_param).split(",")]:
            _print_model(model(argparse.Namespace(**dict(vars(args), bytes_per_param=bpp)), prev["sim"], prev["fan_in"],
                               prev["real_save_counts"]), args)
        return 0

    with S3Requests() as s3:
        return _simulate(args, s3, ranks_list, runs, t_start, load0)


def _simulate(args, s3: S3Requests, ranks_list: list[int], runs: int, t_start: float, load0) -> int:
    """main()'s simulation, with the S3 server and its request log up."""
    # 2a. the real code's objects per save (first: it captures a real rank's commit record)
    counts = real_save_counts(5, s3)
    record = counts["record"]
    per_rank_small = sum(n for op in ("PutObject",) for key, n in counts["async_save"].get(op, {}).items()
                         if "r<rank>" in key and "/data/" not in key)
    # Write-class requests (PUT, POST, DELETE: what S3's 3,500/s per prefix counts) made once per save.
    per_save = sum(n for op in ("PutObject", "DeleteObject", "DeleteObjects")
                   for key, n in counts["async_save"].get(op, {}).items() if "r<rank>" not in key)
    counts["per_rank_small_puts"], counts["per_save_puts"] = per_rank_small, per_save
    print(f"real async save of {counts['state_bytes'] / 2**20:.0f} MiB to s3:// (1 process, parts of "
          f"{counts['part_size'] >> 20} MiB): requests by operation and key:")
    for kind in ("async_save", "sync_save", "load"):
        print(f"  {kind}: " + "; ".join(f"{op} " + ", ".join(f"{k} x{n}" for k, n in keys.items())
                                         for op, keys in counts[kind].items()))
    timings = record["timings"] if record else {}

    sim, fan = {}, {}
    for n in ranks_list:
        keep: dict = {}
        plan = plan_scale.bench_planner(n, args.tensors, args.replicated, runs, keep=keep)
        settle = settle_payload_bytes(keep["records_1"], keep["batch_1"])
        del keep["records_0"], keep["records_1"], keep["batch_1"]
        print(f"[{n} ranks] plan {plan['seconds_median']:.2f} s ({plan['cpu_seconds_median']:.2f} s CPU) for "
              f"{plan['records']:,} records -> {plan['writes']:,} writes; planned {plan['total_planned_bytes']:,} "
              f"bytes = simulated {plan['simulated_tensor_bytes']:,}", flush=True)
        print(f"[{n} ranks] every save: all-gather of {settle} B per rank -> each rank receives {n * settle:,} B "
              f"(job total {n * n * settle / 1e9:.2f} GB); cache miss: coordinator receives "
              f"{plan['coordinator_received_bytes']:,} B, scatters {plan['coordinator_scattered_bytes']:,} B",
              flush=True)
        commit_side, data, recs = bench_commit_side(keep["plan"], runs, timings)
        names = list(keep["plan"].names)
        del keep
        gc.collect()
        print(f"[{n} ranks] commit: build_manifest {commit_side['build_manifest_s_median']:.2f} s, encode "
              f"{commit_side['encode_s_median']:.3f} s, decode {commit_side['decode_s_median']:.3f} s; manifest "
              f"{commit_side['manifest_bytes'] / 1e6:.1f} MB ({commit_side['manifest_boxes']:,} boxes, {n:,} files); "
              f"one record {commit_side['record_json_bytes']:,} B JSON ({commit_side['record_pickle_bytes']:,} B "
              f"pickled), {commit_side['records_json_total'] / 1e6:.1f} MB for all ranks", flush=True)
        sl = bench_load_slice(data, names, n, runs)
        del data
        gc.collect()
        print(f"[{n} ranks] one rank's load plan: decode {sl['tensors_loaded']} tensors {sl['decode_s_median']:.3f} s "
              f"+ plan_reads {sl['plan_reads_s_median']:.3f} s -> {sl['read_items']} read items", flush=True)
        fa = bench_await_records(recs, n, args.work_dir, s3, args.s3_ranks)
        print(f"[{n} ranks] commit fan-in: await_records on {n:,} record files "
              f"({fa['record_bytes_total'] / 1e6:.1f} MB): "
              f"local disk {fa['local_disk_s']:.2f} s; on S3: {fa['s3_requests']} requests", flush=True)
        sim[str(n)] = {"plan": plan, "exchange": {"settle_payload_bytes": settle,
                                                  "settle_bytes_received_per_rank": n * settle,
                                                  "settle_bytes_job_total": n * n * settle},
                       "commit": commit_side, "slice": sl}
        fan[str(n)] = fa
        fa["per_node_aggregation"] = {"ranks_per_node": args.gpus, "records": n // args.gpus,
                                      "s3_requests": {op: math.ceil(c / args.gpus)
                                                      for op, c in fa["s3_requests"].items()}}

    models = {}
    for bpp in [float(x) for x in str(args.bytes_per_param).split(",")]:
        mod = models[f"{bpp:g}"] = model(argparse.Namespace(**dict(vars(args), bytes_per_param=bpp)), sim, fan, counts)
        _print_model(mod, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"sim": sim, "fan_in": fan, "real_save_counts": counts, "model": models, "peak_rss_mb": peak,
           "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
           "date_start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
           "date_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"peak RSS {peak:.0f} MB; load average {load0} -> {os.getloadavg()}; {time.time() - t_start:.0f} s")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", f"scale_sim{'-quick' if args.quick else ''}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


def _print_model(mod: dict, args) -> None:
    print("model inputs: " + json.dumps(mod["inputs"]))
    print(f"model: {mod['bytes_per_machine'] / 1e9:.2f} GB per machine, write "
          f"{mod['write_at_machine_throughput_s']:.2f} s "
          f"at {args.machine_write_gbs} GB/s, aggregate FS {mod['fs_aggregate_write_s']:.2f} s; save on a parallel FS "
          f"{mod['save_parallel_fs_s']:.2f} s ({mod['save_parallel_fs_first_s']:.2f} s on a plan-cache miss); S3 "
          f"{mod['s3']['write_requests']:,} write requests per save: one prefix floor "
          f"{mod['s3']['prefix_floor_one_prefix_s']:.1f} s "
          f"-> save {mod['save_s3_one_prefix_s']:.1f} s; {args.prefixes} prefixes "
          f"{mod['save_s3_spread_s']:.1f} s; load "
          f"(parallel FS) {mod['load_parallel_fs_s']:.2f} s", flush=True)
    print("overheads: " + json.dumps({k: round(v, 3) for k, v in mod["overheads"].items()}))
    print(f"design answers: commit on S3 with per-node records {mod['commit_s3_per_node_records_s']:.1f} s, with "
          f"{args.parallel_gets} parallel GETs {mod['commit_s3_parallel_gets_s']:.1f} s; "
          "S3 write requests with per-node "
          f"records {mod['s3']['write_requests_per_node_records']:,} (one-prefix floor "
          f"{mod['s3']['prefix_floor_per_node_records_s']:.1f} s), with one PUT per rank file "
          f"{mod['s3']['write_requests_one_put_per_rank']:,} ({mod['s3']['prefix_floor_one_put_per_rank_s']:.1f} s)")


def _o_direct_gbs(doc: dict) -> float:
    """bench/write_path.py's O_DIRECT + fsync median, GB/s."""
    return float(doc["results"]["O_DIRECT + fsync"]["gb_per_s"])


if __name__ == "__main__":
    sys.exit(main())
