"""Planning at scale: the pure global planner for 8192 simulated ranks, manifests of 10^6 boxes.

    .venv/bin/python bench/plan_scale.py            # 8192 ranks x 500 tensors, 10^6 and 4 x 10^6 boxes
    .venv/bin/python bench/plan_scale.py --quick    # 512 ranks, 10^5 and 4 x 10^5 boxes

Reports: the global plan (median of --runs), the bytes each rank sends to the coordinator and
the coordinator receives (pickles of the records, as the gather sends them), the manifest's
encode and decode and its size, and one rank's part of a 4x larger manifest: decoding only the
tensors it loads (`Manifest.decode(names=)`) and planning its reads (`plan_reads`).

No processes, no I/O: ShardRecords are built directly, the way the coordinator receives them.
The simulated job is FSDP-like: each of the 500 tensors per rank is a row slab of a global
tensor (rank r holds rows [r*k, (r+1)*k)), except `--replicated` of them (norm weights, biases,
scalars) that every rank holds whole, so the planner must deduplicate them (one writer each,
spread across the ranks by bytes). Timings are medians of --runs; results go to
bench/out/plan_scale[-quick].json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import statistics
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def make_records(ranks: int, tensors: int, replicated: int):
    from omnickpt.layout import Box
    from omnickpt.planner import ShardRecord
    rows_per_rank, cols = 4, 1024
    sharded = tensors - replicated
    # Names, shapes and the replicated boxes are shared objects, as they would be after unpickling
    # one rank's list; each rank's slab box is its own.
    names = [f"model/layers.{i // 4}.w{i % 4}" for i in range(sharded)]
    shape = (ranks * rows_per_rank, cols)
    rep_names = [f"model/norms.{i}.weight" for i in range(replicated)]
    rep_shapes = [(cols * (1 + i % 4),) for i in range(replicated)]
    rep_records = [ShardRecord(n, s, "float32", 4, Box.full(s)) for n, s in zip(rep_names, rep_shapes)]
    lengths = (rows_per_rank, cols)
    records = []
    for r in range(ranks):
        box = Box((r * rows_per_rank, 0), lengths)
        recs = [ShardRecord(n, shape, "float32", 4, box) for n in names]
        recs.extend(rep_records)
        records.append(recs)
    return records


def bench_planner(ranks: int, tensors: int, replicated: int, runs: int, keep: dict | None = None) -> dict:
    """`keep`: a dict that receives the last plan ("plan") and the records of ranks 0 and 1
    ("records_0", "records_1") for callers that go on from them (bench/scale_sim.py)."""
    from omnickpt.planner import RecordBatch, build_global_plan
    t0 = time.perf_counter()
    lists = make_records(ranks, tensors, replicated)
    build_s = time.perf_counter() - t0
    # What travels: each rank turns its records into a RecordBatch (timed on one rank), and ranks
    # whose tensor table a lower rank sends leave it out (here: all but rank 0).
    t0 = time.perf_counter()
    records = [RecordBatch.from_records(r) for r in lists]
    batch_s = (time.perf_counter() - t0) / ranks
    sent_full = len(pickle.dumps(records[0]))
    sent_lean = len(pickle.dumps(records[1].without_table()))
    sent_objects = len(pickle.dumps(lists[1]))     # what a rank sent before (a list of ShardRecord)
    if keep is not None:
        keep["records_0"], keep["records_1"] = lists[0], lists[1]
        keep["batch_1"] = records[1]
    records = [records[0]] + [b.without_table() for b in records[1:]]
    del lists
    times, cpu = [], []
    plan = None
    for _ in range(runs):
        plan = None
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        plan = build_global_plan(records)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    per_rank = plan.bytes_per_rank()
    writes = sum(len(w) for w in plan.writes)
    # Every sharded box is written once; every replicated tensor once in all.
    expect = ranks * (tensors - replicated) + replicated
    assert writes == expect, f"plan has {writes} writes, expected {expect}"
    # What the coordinator scatters back: each rank's part of the plan, as saving._global_plan sends it.
    scattered = [len(pickle.dumps((plan.write_arrays(r), plan.tensor_bytes[r], None))) for r in range(ranks)]
    if keep is not None:
        keep["plan"] = plan
    return {"scatter_bytes_per_rank_max": max(scattered), "coordinator_scattered_bytes": sum(scattered),
            "total_planned_bytes": sum(per_rank),
            "simulated_tensor_bytes": ranks * (tensors - replicated) * 4 * 1024 * 4
            + sum(4 * 1024 * (1 + i % 4) for i in range(replicated)),
            "ranks": ranks, "tensors_per_rank": tensors, "replicated_per_rank": replicated,
            "records": ranks * tensors, "writes": writes, "seconds_median": statistics.median(times),
            "seconds_all": times, "cpu_seconds_median": statistics.median(cpu), "make_records_s": build_s,
            "bytes_per_rank_min": min(per_rank), "bytes_per_rank_max": max(per_rank),
            "record_batch_s_per_rank": batch_s, "sent_bytes_rank0": sent_full, "sent_bytes_other_rank": sent_lean,
            "coordinator_received_bytes": sent_full + (ranks - 1) * sent_lean,
            "sent_bytes_per_rank_as_objects": sent_objects,
            "coordinator_received_bytes_as_objects": ranks * sent_objects}


def make_manifest(boxes: int, ranks: int, per_tensor: int = 1000):
    """Tensors of `per_tensor` row slabs (4 x 1024 float32 each: one CRC), spread over `ranks`
    files; built as columns, as a save builds it (no object per box)."""
    import numpy as np
    from omnickpt.format import ColumnTable, FileEntry, Manifest
    n_tensors = boxes // per_tensor
    n = n_tensors * per_tensor
    rows, nbytes = 4, 4 * 1024 * 4
    i = np.arange(n, dtype=np.int64)
    b = i % per_tensor
    file = i % ranks
    offset = (i // ranks) * nbytes
    table = ColumnTable(offsets=np.stack([b * rows, np.zeros(n, dtype=np.int64)], 1),
                        lengths=np.tile(np.array([[rows, 1024]], dtype=np.int64), (n, 1)), file=file, offset=offset,
                        nbytes=np.full(n, nbytes, dtype=np.int64), sums_start=np.arange(n + 1, dtype=np.int64),
                        crcs=((i * 2654435761) & 0xFFFFFFFF).astype(np.uint32))
    files = [FileEntry(f"data/0123456789abcdef-r{r:05d}.bin", r, (n // ranks + 1) * nbytes) for r in range(ranks)]
    tensors = {f"model/layers.{t}.mlp.fc1.weight": table.entry((per_tensor * rows, 1024), "float32",
                                                                t * per_tensor, (t + 1) * per_tensor)
               for t in range(n_tensors)}
    return Manifest(save_id="0123456789abcdef", world_size=ranks, files=files, tensors=tensors, objects={},
                    layout={"world_size": ranks}, tool_version="bench", created=time.time())


def bench_manifest(boxes: int, ranks: int, runs: int) -> dict:
    from omnickpt.format import Manifest
    t0 = time.perf_counter()
    m = make_manifest(boxes, ranks)
    build_s = time.perf_counter() - t0
    enc, dec, enc_cpu, dec_cpu = [], [], [], []
    data = b""
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        data = m.encode()
        enc.append(time.perf_counter() - t0)
        enc_cpu.append(time.process_time() - c0)
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        back = Manifest.decode(data)
        dec.append(time.perf_counter() - t0)
        dec_cpu.append(time.process_time() - c0)
        assert sum(len(t.columns) for t in back.tensors.values()) == boxes
        del back
    return {"boxes": boxes, "files": ranks, "tensors": len(m.tensors), "bytes": len(data),
            "bytes_zlib1": len(zlib.compress(data, 1)), "encode_s_median": statistics.median(enc),
            "decode_s_median": statistics.median(dec), "encode_s_all": enc, "decode_s_all": dec,
            "encode_cpu_s_median": statistics.median(enc_cpu), "decode_cpu_s_median": statistics.median(dec_cpu),
            "make_manifest_s": build_s}


def time_slice(data: bytes, names: list[str], box_of, runs: int) -> dict:
    """One rank's load planning, timed `runs` times: decode only `names` from the encoded manifest
    `data`, then plan_reads of box_of(name, global shape) for each. Returns the runs' times (decode,
    plan_reads, both) and the read items' count."""
    from omnickpt.engine.staging import gc_paused
    from omnickpt.format import Manifest
    from omnickpt.planner import plan_reads
    decode, plan, total, items = [], [], [], []
    for _ in range(runs):
        gc.collect()
        # A load decodes and plans with the cyclic collector paused (Checkpointer._plan_load):
        # measured the same way, or collections walking the heap would be most of the figure.
        with gc_paused():
            t0 = time.perf_counter()
            m = Manifest.decode(data, names=names)
            t1 = time.perf_counter()
            items = plan_reads(m, [(name, box_of(name, m.tensors[name].shape)) for name in names])
            t2 = time.perf_counter()
        decode.append(t1 - t0)
        plan.append(t2 - t1)
        total.append(t2 - t0)
        del m
    return {"decode": decode, "plan": plan, "total": total, "read_items": len(items)}


def bench_slice(boxes: int, ranks: int, runs: int, stages: int = 8, dp: int = 64) -> dict:
    """One rank of a job of `stages` pipeline stages x `dp` FSDP ranks loads a manifest of
    `boxes` boxes: it decodes only its stage's tensors and plans reads of its row slab of each."""
    from omnickpt.format import Manifest
    from omnickpt.layout import Box
    data = make_manifest(boxes, ranks).encode()
    index = Manifest.decode(data, names=[])     # the tensor names and shapes come from the header
    del index
    names = [f"model/layers.{t}.mlp.fc1.weight" for t in range(boxes // 1000)]
    mine = names[:len(names) // stages]

    def box_of(name, shape):   # FSDP rank 3 of its stage
        rows, cols = shape
        k = rows // dp
        return Box((3 * k, 0), (k, cols))
    t = time_slice(data, mine, box_of, runs)
    return {"boxes": boxes, "manifest_bytes": len(data), "tensors_loaded": len(mine), "read_items": t["read_items"],
            "decode_s_median": statistics.median(t["decode"]), "plan_reads_s_median": statistics.median(t["plan"]),
            "total_s_median": statistics.median(t["total"]), "total_s_all": t["total"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--replicated", type=int, default=20, help="of the tensors per rank, how many every rank holds")
    ap.add_argument("--boxes", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="plan,manifest,slice", help="which of plan, manifest, slice to run")
    args = ap.parse_args(argv)
    cases = set(args.cases.split(","))
    ranks = args.ranks or (512 if args.quick else 8192)
    boxes = args.boxes or (100_000 if args.quick else 1_000_000)

    plan = man = sl = None
    if "plan" in cases:
        plan = bench_planner(ranks, args.tensors, args.replicated, args.runs)
        print(f"global plan: {plan['ranks']} ranks x {plan['tensors_per_rank']} tensors ({plan['records']:,} records, "
              f"{plan['replicated_per_rank']} replicated per rank) -> {plan['writes']:,} writes in "
              f"{plan['seconds_median']:.2f} s wall, {plan['cpu_seconds_median']:.2f} s CPU (median of {args.runs}; "
              f"building the records took "
              f"{plan['make_records_s']:.1f} s); bytes per rank {plan['bytes_per_rank_min']:,}..{plan['bytes_per_rank_max']:,}",
              flush=True)
        print(f"records sent: rank 0 {plan['sent_bytes_rank0']:,} bytes (with the tensor table), every other rank "
              f"{plan['sent_bytes_other_rank']:,} bytes; the coordinator receives {plan['coordinator_received_bytes']:,} "
              f"bytes (as ShardRecord lists: {plan['sent_bytes_per_rank_as_objects']:,} per rank, "
              f"{plan['coordinator_received_bytes_as_objects']:,} in all); the plan's parts scattered back: "
              f"{plan['coordinator_scattered_bytes']:,} bytes "
              f"(at most {plan['scatter_bytes_per_rank_max']:,} per rank)",
              flush=True)
    if "manifest" in cases:
        man = bench_manifest(boxes, min(ranks, 8192), args.runs)
        print(f"manifest: {man['boxes']:,} boxes in {man['tensors']:,} tensors, {man['files']:,} files -> "
              f"{man['bytes'] / 1e6:.1f} MB ({man['bytes_zlib1'] / 1e6:.1f} MB deflated); encode "
              f"{man['encode_s_median']:.2f} s ({man['encode_cpu_s_median']:.2f} s CPU), decode {man['decode_s_median']:.2f} s "
              f"({man['decode_cpu_s_median']:.2f} s CPU) (medians of {args.runs})", flush=True)
    if "slice" in cases:
        sl = bench_slice(4 * boxes, min(ranks, 8192), args.runs)
        print(f"one rank's slice: {sl['tensors_loaded']:,} of {sl['boxes'] // 1000:,} tensors of a {sl['boxes']:,}-box "
              f"manifest ({sl['manifest_bytes'] / 1e6:.1f} MB) -> {sl['read_items']:,} read items: decode "
              f"{sl['decode_s_median']:.3f} s + plan_reads {sl['plan_reads_s_median']:.3f} s = {sl['total_s_median']:.3f} s "
              f"(medians of {args.runs})")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MB; load average {os.getloadavg()}")
    out = {"plan": plan, "manifest": man, "slice": sl, "peak_rss_mb": peak, "loadavg": os.getloadavg(),
           "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    # A run of some cases only leaves the full run's results alone.
    part = "" if cases >= {"plan", "manifest", "slice"} else "-" + "-".join(sorted(cases))
    with open(os.path.join(HERE, "out", f"plan_scale{'-quick' if args.quick else ''}{part}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
