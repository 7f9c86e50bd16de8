"""Hugging Face interop, omnickpt against DCP's HuggingFaceStorageReader / HuggingFaceStorageWriter.

A mid-size Llama (hidden 1024, 8 layers, vocab 32000, untied head, bf16: ~155 M parameters, ~310 MB)
saved by transformers' save_pretrained in several shards. Two gloo ranks on CPU, FSDP2 (a
fully_shard per decoder layer + the root):

- load: the Hugging Face folder into the FSDP2 model, in place.
    omnickpt  omnickpt.load(folder, {"model": model})                (4 I/O threads, its default)
    DCP       dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(folder, thread_count=4))
- export: a Hugging Face folder from the FSDP2 training state.
    omnickpt  omnickpt.save(ckpt, {"model": model}) on both ranks (fsynced, as DCP's shard files are), then
              export_hf(ckpt, dst, durable=False) on rank 0 (not fsynced, as DCP's consolidated files are not)
    DCP       dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(dst, save_distributed=True,
              enable_consolidation=True, thread_count=4, thread_count_consolidation=4)): every rank
              writes its shards to dst/sharded, the coordinator consolidates them into dst
  and export_hf alone, offline in one process, from the omnickpt checkpoint.

Every timed call starts after a barrier and after one untimed warm-up call per library; the time of a
repetition is its slowest rank's, the table shows the median over repetitions. Peak RSS is the largest
VmHWM over the ranks during the timed calls, and "above start" subtracts the RSS the rank had before
them (the model itself). Files are read from the page cache (the machine has the RAM for them), so this
compares CPU and memory work, not the disk.

Both libraries fsync what their save writes; omnickpt's export_hf also fsyncs the files it writes, DCP's
consolidation does not.

Run: .venv/bin/python bench/hf_bench.py [--repeats 5] [--hidden 1024] [--layers 8]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from ranks import run_ranks  # noqa: E402
from scenario import PeakRSS, barrier  # noqa: E402


def config(hidden: int, layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                       tie_word_embeddings=False)


def fsdp2_model(cfg):
    """An FSDP2 Llama in bf16 with uninitialised storage: the load fills it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    mesh = DeviceMesh("cpu", torch.arange(torch.distributed.get_world_size()))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")


def fingerprint(model) -> float:
    """Sum of this rank's local parameter values: equal across libraries when both loaded the same."""
    total = 0.0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += float(local.detach().double().sum())
    return total


def timed(repeats: int, fn, warmup: int = 1) -> tuple[list[float], dict]:
    """Seconds of each repetition on this rank, and the peak RSS over all of them. `warmup` untimed
    calls come first (first-touch page faults of the model's memory, lazy imports, plan caches)."""
    for i in range(warmup):
        barrier()
        fn(repeats + i)
    seconds = []
    with PeakRSS() as mem:
        for i in range(repeats):
            barrier()
            t = time.perf_counter()
            fn(i)
            seconds.append(time.perf_counter() - t)
        barrier()
    return seconds, mem.as_dict()


def load_worker(rank, world_size, lib, folder, cfg, repeats):
    import omnickpt
    model = fsdp2_model(cfg)
    if lib == "omnickpt":
        def run(_):
            omnickpt.load(folder, {"model": model})
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        def run(_):
            dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(folder, thread_count=4))
    seconds, mem = timed(repeats, run)
    return {"seconds": seconds, "rss": mem, "fingerprint": fingerprint(model)}


def export_worker(rank, world_size, lib, folder, cfg, repeats, scratch):
    import omnickpt
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    model = fsdp2_model(cfg)
    dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(folder))   # real weights, untimed

    def fresh(i: int) -> str:
        path = os.path.join(scratch, f"{lib}-{i}")
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        barrier()
        return path

    if lib == "omnickpt":
        from omnickpt.export import export_hf

        def run(i):
            path = fresh(i)
            omnickpt.save(f"{path}/ckpt", {"model": model}).wait()
            if rank == 0:
                export_hf(f"{path}/ckpt", f"{path}/hf", progress=False, durable=False)
    else:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        def run(i):
            path = fresh(i)
            dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
                f"{path}/hf", save_distributed=True, enable_consolidation=True, thread_count=4,
                thread_count_consolidation=4))
    seconds, mem = timed(repeats, run)
    return {"seconds": seconds, "rss": mem}


def export_alone_worker(rank, world_size, scratch, repeats):
    from omnickpt.export import export_hf
    src = os.path.join(scratch, "omnickpt-0", "ckpt")

    def run(i):
        dst = os.path.join(scratch, f"alone-{i}")
        shutil.rmtree(dst, ignore_errors=True)
        export_hf(src, dst, progress=False)
    seconds, mem = timed(repeats, run)
    return {"seconds": seconds, "rss": mem}


def row(what: str, per_rank: list[dict]) -> tuple:
    slowest = [max(r["seconds"][i] for r in per_rank) for i in range(len(per_rank[0]["seconds"]))]
    peak = max(r["rss"]["peak_mb"] for r in per_rank)
    above = max(r["rss"]["peak_mb"] - (r["rss"]["start_mb"] or 0) for r in per_rank)
    return what, statistics.median(slowest), min(slowest), max(slowest), peak, above


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-size", default="100MB", help="save_pretrained's max_shard_size for the source folder")
    args = ap.parse_args()
    cfg = config(args.hidden, args.layers)
    scratch = tempfile.mkdtemp(prefix="hf_bench-")
    try:
        from transformers import LlamaForCausalLM
        folder = os.path.join(scratch, "source")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size=args.shard_size)
        del model
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab 32000, untied, bf16: {params / 1e6:.0f} M "
              f"parameters, {size / 1e6:.0f} MB in {len(files)} safetensors files; 2 gloo ranks, FSDP2; "
              f"{args.repeats} repetitions", flush=True)
        rows = []
        loads = {}
        for lib in ("omnickpt", "DCP"):
            loads[lib] = run_ranks(2, load_worker, lib, folder, cfg, args.repeats)
            rows.append(row(f"load HF -> FSDP2, {lib}", loads[lib]))
        same = all(abs(a["fingerprint"] - b["fingerprint"]) <= 1e-6 * max(1.0, abs(a["fingerprint"]))
                   for a, b in zip(loads["omnickpt"], loads["DCP"]))
        for lib in ("omnickpt", "DCP"):
            label = "save + export_hf(durable=False)" if lib == "omnickpt" else "HuggingFaceStorageWriter + consolidation"
            rows.append(row(f"export FSDP2 -> HF, {lib}: {label}", run_ranks(
                2, export_worker, lib, folder, cfg, args.repeats, scratch)))
        rows.append(row("export_hf alone (1 process, from the omnickpt checkpoint)",
                        run_ranks(1, export_alone_worker, scratch, args.repeats)))
        width = max(len(r[0]) for r in rows)
        print(f"\n{'':{width}}  median s    min s    max s   peak RSS MB   above start MB")
        for what, med, lo, hi, peak, above in rows:
            print(f"{what:{width}}  {med:8.2f} {lo:8.2f} {hi:8.2f}   {peak:11.0f}   {above:14.0f}")
        print(f"\nboth loads gave the same parameters on every rank: {same}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
