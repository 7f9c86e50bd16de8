"""Lossless compression of checkpoint chunks on a trained model: ratio and speed of "zstd" and
"bytesplit-zstd" (omnickpt/format/codec.py) on weights and Adam moments, in float32 and bfloat16.

    .venv/bin/python bench/compression.py                 # train 200 steps, 1 MiB chunks
    .venv/bin/python bench/compression.py --steps 50 --level 1

Not random data: a small GPT (vocab 2048, dim 256, 4 layers, ~4.2 M parameters) is trained with
Adam on a synthetic corpus with structure (a fixed random bigram table), so that weights and moments
have the distributions training gives them. Each tensor kind (weights, exp_avg, exp_avg_sq) is cut
into 1 MiB chunks as a save cuts stored boxes, each chunk compressed on its own on one core. Reports
the ratio (raw / stored bytes) and MB/s of raw bytes for compression and decompression, medians of
--runs passes. Then the whole path: omnickpt.save(..., compression=codec) of the trained model and
its Adam state (float32, and the model alone cast to bfloat16), and a load of it: bytes on disk,
save and load seconds (sync, durable, medians of --runs). Results to bench/out/compression.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CHUNK = 1 << 20


def _train(steps: int):
    import torch

    from workloads import GPT
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = GPT(vocab=2048, dim=256, heads=4, layers=4, block=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    # a corpus with structure: each token's successor drawn from 8 candidates fixed per token
    succ = torch.randint(0, 2048, (2048, 8), generator=gen)
    for _ in range(steps):
        start = torch.randint(0, 2048, (16,), generator=gen)
        seq = [start]
        for _ in range(32):
            pick = torch.randint(0, 8, (16,), generator=gen)
            seq.append(succ[seq[-1], pick])
        idx = torch.stack(seq, 1)
        out = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    kinds = {"weights": [p.detach() for p in model.parameters()],
             "exp_avg": [opt.state[p]["exp_avg"] for p in model.parameters()],
             "exp_avg_sq": [opt.state[p]["exp_avg_sq"] for p in model.parameters()]}
    return kinds, loss.item(), model, opt


def _save_load(model, opt, runs: int) -> dict:
    """Save and load through omnickpt with each codec: bytes on disk, seconds (medians)."""
    import copy
    import shutil
    import tempfile

    import torch

    import omnickpt
    states = {"float32 model+adam": lambda: {"model": model, "optimizer": opt},
              "bfloat16 model": lambda: {"model": copy.deepcopy(model).to(torch.bfloat16)}}
    out = {}
    root = tempfile.mkdtemp(prefix="omnickpt-bench-compression-")
    try:
        for label, make in states.items():
            state = make()
            for codec in (None, "zstd", "bytesplit-zstd"):
                saves, loads, size = [], [], 0
                for run in range(runs):
                    path = os.path.join(root, f"{label.split()[0]}-{codec}-{run}")
                    t = time.perf_counter()
                    omnickpt.save(path, state, compression=codec)
                    saves.append(time.perf_counter() - t)
                    size = sum(os.path.getsize(os.path.join(path, "data", f)) for f in os.listdir(os.path.join(path, "data")))
                    t = time.perf_counter()
                    omnickpt.load(path, state)
                    loads.append(time.perf_counter() - t)
                    shutil.rmtree(path)
                row = {"bytes_on_disk": size, "save_s": statistics.median(saves), "load_s": statistics.median(loads)}
                out[f"{label}/{codec}"] = row
                print(f"{label:<19} {str(codec):<15} {size / 1e6:>9.2f} {row['save_s']:>7.3f} {row['load_s']:>7.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _chunks(tensors, dtype) -> tuple[list[memoryview], int]:
    import torch
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    raw = memoryview(flat.view(torch.uint8).numpy())
    return [raw[i:i + CHUNK] for i in range(0, len(raw), CHUNK)], flat.element_size()


def main(argv=None) -> int:
    import torch

    from omnickpt.format.codec import CODECS, compress, decompress_into
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    kinds, loss, model, opt = _train(args.steps)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s (loss {loss:.2f}); level {args.level}")
    torch.set_num_threads(1)
    doc = {"steps": args.steps, "level": args.level, "runs": args.runs, "loss": loss, "results": {}}
    print(f"{'dtype':<9} {'tensors':<11} {'codec':<15} {'ratio':>6} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        for kind, tensors in kinds.items():
            chunks, itemsize = _chunks(tensors, dtype)
            raw_bytes = sum(len(c) for c in chunks)
            for codec in CODECS:
                ct, dt, stored = [], [], None
                for _ in range(args.runs):
                    t = time.perf_counter()
                    stored = [compress(c, codec, itemsize, args.level) for c in chunks]
                    ct.append(time.perf_counter() - t)
                    out = bytearray(CHUNK)
                    t = time.perf_counter()
                    for c, s in zip(chunks, stored):
                        decompress_into(s, codec, itemsize, memoryview(out)[:len(c)], "bench")
                    dt.append(time.perf_counter() - t)
                for c, s in zip(chunks, stored):   # lossless, checked
                    back = bytearray(len(c))
                    decompress_into(s, codec, itemsize, memoryview(back), "bench")
                    assert back == bytes(c)
                ratio = raw_bytes / sum(len(s) for s in stored)
                row = {"raw_mb": raw_bytes / 1e6, "ratio": ratio, "compress_mb_s": raw_bytes / statistics.median(ct) / 1e6,
                       "decompress_mb_s": raw_bytes / statistics.median(dt) / 1e6}
                doc["results"][f"{str(dtype).split('.')[-1]}/{kind}/{codec}"] = row
                print(f"{str(dtype).split('.')[-1]:<9} {kind:<11} {codec:<15} {ratio:>6.2f} {row['compress_mb_s']:>10.0f} "
                      f"{row['decompress_mb_s']:>12.0f}")
    torch.set_num_threads(2)
    print(f"\n{'state':<19} {'codec':<15} {'MB on disk':>9} {'save s':>7} {'load s':>7}")
    doc["save_load"] = _save_load(model, opt, args.runs)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "compression.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
