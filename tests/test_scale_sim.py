"""bench/scale_sim.py, the simulation behind docs/scale.md, still measures what it says: a small run
(64 and 128 ranks, one process, a few seconds) whose JSON must add up."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_scale_sim_quick_adds_up(tmp_path):
    pytest.importorskip("boto3")   # the real save to s3:// goes through S3Storage (an optional extra)
    pytest.importorskip("moto")    # ... to a real S3-compatible server (tests/s3server.py)
    ranks = (64, 128)
    tensors, replicated = 40, 4
    proc = subprocess.run([sys.executable, "bench/scale_sim.py", "--quick", "--ranks", ",".join(map(str, ranks)),
                           "--tensors", str(tensors), "--replicated", str(replicated), "--work-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((ROOT / "bench" / "out" / "scale_sim-quick.json").read_text())
    for n in ranks:
        sim, fan = doc["sim"][str(n)], doc["fan_in"][str(n)]
        plan = sim["plan"]
        # the plan writes every byte of the simulated tensors once: each rank's slabs, each replica once
        assert plan["total_planned_bytes"] == plan["simulated_tensor_bytes"]
        assert plan["writes"] == n * (tensors - replicated) + replicated
        # the manifest the commit built holds every write as a box and one file per rank
        assert sim["commit"]["manifest_boxes"] == plan["writes"]
        assert sim["commit"]["manifest_files"] == n
        assert sim["exchange"]["settle_bytes_received_per_rank"] == n * sim["exchange"]["settle_payload_bytes"]
        # a rank of the same layout reads its own slab of every tensor
        assert sim["slice"]["tensors_loaded"] == tensors
        assert sim["slice"]["read_items"] == tensors
        # the coordinator's commit reads every record once, listing the control folder in pages of 1000
        assert fan["s3_requests"]["GetObject"] == n
        assert fan["s3_requests"]["ListObjectsV2"] == math.ceil(n / 1000)
    counts = doc["real_save_counts"]
    # a real async save PUTs one record per rank; a sync save none (its records travel in a gather)
    assert counts["async_save"]["PutObject"]["run/async_save/.omnickpt/<id>/r<rank>.json"] == 1
    assert not any("r<rank>.json" in k for k in counts["sync_save"].get("PutObject", {}))
    # the data file went up in parts of the part size
    size = counts["data_object_bytes"]["run/sync_save/data/<id>-r<rank>.bin"]
    parts = counts["sync_save"]["UploadPart"]["run/sync_save/data/<id>-r<rank>.bin"]
    assert parts == math.ceil(size / counts["part_size"]) > 1
