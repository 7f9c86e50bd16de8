"""Save and load across simulated machines: 2 machines x 2 ranks (tests/nodes.py: network namespaces
with their own addresses, /dev/shm and disk, a shared folder and an S3 server on a storage network),
torchrun --nnodes 2, FSDP2 over the 4 ranks.

    .venv/bin/python bench/multinode.py [--mb 200] [--runs 3] [--stores shared,s3]

Per store: a sync save and a load into the same layout, --runs times each; per call the slowest
rank's time (median reported) and the bytes each machine sent to the other machine (fabric, eth0)
and to the S3 server (storage, eth1). Needs root (namespaces). Results: bench/out/multinode.json.
The shared folder is a host folder: its bytes do not cross a simulated link; S3's do.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="parameters in MB, in 67 MB layers (Adam adds twice that)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stores", default="shared,s3")
    a = ap.parse_args()
    from nodes import Cluster, available
    why = available()
    if why:
        sys.exit(f"bench/multinode.py: {why}")
    stores = a.stores.split(",")
    with tempfile.TemporaryDirectory() as work, Cluster(2, work) as c:
        out = os.path.join(work, "out")
        if "s3" in stores:
            c.start_s3()
            import boto3
            boto3.client("s3", endpoint_url=c.s3_endpoint, aws_access_key_id="testing",
                         aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="bench")
        args = {"out": out, "shared": c.shared, "s3": "s3://bench/job", "mb": a.mb, "runs": a.runs,
                "stores": stores, "pg_timeout": 600}
        t = time.time()
        host_before = [c.counters(k) for k in (0, 1)]
        procs = c.torchrun(os.path.join(REPO, "tests", "nodes_worker.py"), ["bench", json.dumps(args)], nproc=2)
        codes = c.wait(procs, 3600)
        # From outside the machines: the host ends of their links, over the whole job (start-up included).
        host = [{net: {way: after[net][way] - before[net][way] for way in after[net]} for net in after}
                for before, after in zip(host_before, (c.counters(k) for k in (0, 1)))]
        if codes != [0, 0]:
            sys.exit(c.logs(procs))
        nodes = [json.load(open(os.path.join(out, f"bench-node{k}.json"))) for k in (0, 1)]
    state = nodes[0].pop("state_bytes")
    nodes[1].pop("state_bytes")
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)), "load_average": os.getloadavg(),
              "state_bytes": state, "runs": a.runs, "calls": {}}
    print(f"state: {state / 1e6:.0f} MB (parameters and Adam's two moments), FSDP2 over 2 machines x 2 ranks")
    print(f"{'call':<12} {'median s':>9} {'runs':>24}   per machine, MB: to the other machine, to S3, from S3")
    for call in nodes[0]:
        secs = nodes[0][call]["seconds"]
        sent = [{d: statistics.median(s[d] for s in n[call]["sent"]) for d in ("eth0", "eth1", "eth1_in")}
                for n in nodes]
        result["calls"][call] = {"median_seconds": statistics.median(secs), "seconds": secs, "bytes_median": sent}
        print(f"{call:<12} {statistics.median(secs):>9.3f} {str([round(x, 3) for x in secs]):>24}   "
              + "   ".join(f"m{k}: {b['eth0'] / 1e6:.2f} / {b['eth1'] / 1e6:.2f} / {b['eth1_in'] / 1e6:.2f}"
                         for k, b in enumerate(sent)))
    result["host_counters"] = host
    for k in (0, 1):
        inside = sum(result["calls"][call]["bytes_median"][k]["eth1"] for call in result["calls"]) * a.runs
        print(f"machine {k}, seen from the host over the whole job: {host[k]['storage']['sent'] / 1e6:.1f} MB to "
              f"storage, {host[k]['fabric']['sent'] / 1e6:.2f} MB to the fabric (the calls' own counters: "
              f"~{inside / 1e6:.1f} MB to storage)")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "multinode.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
