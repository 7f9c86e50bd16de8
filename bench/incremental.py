"""Incremental checkpoints (omnickpt/engine/incremental.py) on a recommendation-style model: bytes
written, save and load seconds of incremental saves against a full one, as the fraction of embedding
rows changed between saves grows, for uniform and Zipf (hot-row) access; then CheckpointManager(
incremental=True) over steps, with full_every and keep_last.

    .venv/bin/python bench/incremental.py                        # 1,000,000 x 128 fp32 table (512 MB)
    .venv/bin/python bench/incremental.py --rows 200000 --fractions 0.01 --runs 1 --steps 2 --mgr-steps 4

The model: an nn.Embedding table (--rows x --dim float32, sparse gradients) whose rows are looked
up in bags of 32 and averaged, followed by a dense MLP (dim -> 1024 -> 1024 -> 1, 4.7 MB), trained with
plain SGD (no momentum, no weight decay). That is Check-N-Run's setting: a training step touches only
the rows it looked up, so only those rows of the table change, while the dense MLP changes entirely.
(The table's rows take per-sample steps, the MLP batch-mean ones: see _train_step.)
The optimizer holds no per-parameter state, so the checkpoint is weights only. (Adam's moments would
change everywhere each step, since they decay even where the gradient is zero; SparseAdam with a
sparse embedding would change the same rows as the weights, doubling the table's bytes both ways.
SGD keeps the measurement to the table.)

One training step between saves makes n = f * rows lookups (f in --fractions), drawn by pattern:
  uniform  n distinct rows, uniformly at random: exactly a fraction f of the rows changes;
  zipf     n draws of a row with P(rank k) ~ k^-1.1 (k = 1..rows, ranks mapped to rows by a fixed
           random permutation, so hot rows are scattered over the table as hashed ids are): many
           draws hit the same few hot rows, so far fewer than f * rows distinct rows change.
The changed rows and 64 KiB blocks are measured against a copy of the table taken at the previous
save. Theory: a block is --dim*4-byte rows, 65536 // (dim*4) of them (128 for dim 128); under uniform
change P(block unchanged) = (1-f)^(rows per block), so at f = 1% only 0.99^128 = 28% of the blocks can
be referenced and at 5% 0.1%: a 64 KiB block grid rewrites nearly the whole table. Under Zipf access
the expectation is mean over blocks of prod over its rows of (1 - p_row)^n, printed beside the
measured figure ("expect").

For each (pattern, f), --runs times, in a fresh folder under --dir: the chain's full save s0
(incremental=True, no base: chain 0, block hashes stored), loaded into a second model filled with
NaN; then --steps times a training step, an incremental save s<k> (base s<k-1>) and a plain full
save f<k> (omnickpt.save, no incremental) of the same state, the two in turns first; then the last
s<k> (its data lies in all the s folders) and the last f<k> loaded, in turns first. Why a full save
at every step and not s0 as the baseline: on this VM a write into page-cache pages never used before
costs ~1.4 s per 512 MB against ~0.13 s into pages just freed (a plain 512 MB pwrite, measured), and
neither save here goes around the page cache (the table's address is 64 bytes past a page boundary,
so O_DIRECT never applies): s0 comes right after the previous run's folder was deleted and would be
flattered, so the full saves compared are made at the same moments as the incremental ones, all
files kept until the run ends. Saves are sync and durable (fsync); seconds are the wall time of the
call; loads read from the page cache (the files were just written). Every load is checked bitwise
against the model it was saved from. Reported: medians over runs (and over their steps for saves)
of written bytes (the chain's full save s0 and the incremental saves, from the report's
"incremental" record) and their ratio, save seconds of the plain full and of the incremental saves,
load seconds of the last full and of the last incremental checkpoint. Save seconds of 512 MB are
bimodal here (~0.3 s, or 1-1.6 s when the page cache has to take fresh pages), so the table prints
median/min; the min is the cost of the save itself. A warm-up save and load come first and are not
counted.

Then a CheckpointManager(incremental=True, full_every=--full-every, keep_last=--keep-last) saves
--mgr-steps steps under the --mgr-pattern access: per step its chain and written bytes, and at the
end the bytes on disk under the root (retention keeps the files of retired steps that kept ones
reference), every kept step loaded (checksums verified) and the latest checked bitwise.

Results to bench/out/incremental.json (--out). `--block-bytes 4096` measures a smaller block.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

BAG = 32          # lookups summed per sample
ZIPF_S = 1.1
LR = 0.05


def _model(rows: int, dim: int):
    import torch
    from torch import nn

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(rows, dim, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(dim, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                     nn.Linear(1024, 1))

        def forward(self, idx):
            return self.mlp(self.emb(idx).mean(1))

    model = Rec()
    # two groups: the table's lr is set per step (_train_step), the MLP's stays
    return model, torch.optim.SGD([{"params": model.emb.parameters()}, {"params": model.mlp.parameters()}], lr=LR)


class Sampler:
    """Row indices of one training step's lookups, and the expected fraction of changed blocks."""

    def __init__(self, rows: int, rpb: int, seed: int = 0):
        import numpy as np
        self.rows, self.rpb = rows, rpb
        self.rng = np.random.default_rng(seed)
        p = np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_S
        p /= p.sum()
        self.cdf = np.cumsum(p)
        self.perm = self.rng.permutation(rows)          # rank k -> row perm[k]
        self.p_row = np.empty(rows)
        self.p_row[self.perm] = p

    def draw(self, pattern: str, n: int):
        import numpy as np
        if pattern == "uniform":
            return self.rng.choice(self.rows, size=n, replace=False)
        ranks = np.searchsorted(self.cdf, self.rng.random(n) * self.cdf[-1], side="right")
        return self.perm[np.minimum(ranks, self.rows - 1)]

    def expected_changed_blocks(self, pattern: str, n: int) -> float:
        """Expected fraction of the table's blocks holding at least one changed row."""
        import numpy as np
        if pattern == "uniform":   # the formula of the docstring ((1-f)^rpb; exact would be hypergeometric)
            return 1 - (1 - n / self.rows) ** self.rpb
        logs = n * np.log1p(-self.p_row)
        pad = (-self.rows) % self.rpb
        per_block = np.concatenate([logs, np.zeros(pad)]).reshape(-1, self.rpb).sum(1)
        return float(1 - np.exp(per_block).mean())


def _train_step(model, opt, idx, gen):
    import torch
    idx = torch.as_tensor(idx, dtype=torch.int64).view(-1, BAG)
    target = torch.randn(idx.shape[0], 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(idx), target)
    # Each looked-up row takes a per-sample step (LR against its own sample's loss): against the
    # batch-mean loss, a row's update shrinks with the batch (up to 1,562 bags at 5% of 1 M rows)
    # until, for a few percent of the rows, it rounds away in every element and the row stays as it
    # was, which would make the measured fraction of changed rows depend on the batch size.
    opt.param_groups[0]["lr"] = LR * idx.shape[0]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _changed(weight, prev, rpb: int) -> tuple[int, int]:
    """(rows, blocks) of the table that differ from `prev` (bitwise)."""
    import torch
    rows = (weight.view(torch.int32) != prev.view(torch.int32)).any(1)
    pad = (-rows.numel()) % rpb
    blocks = torch.cat([rows, rows.new_zeros(pad)]).view(-1, rpb).any(1)
    return int(rows.sum()), int(blocks.sum())


def _exact(a, b) -> bool:
    """Every tensor of two modules' state dicts equal bit for bit."""
    import torch

    def raw(t):
        return t.reshape(-1).view(torch.uint8)
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(raw(sa[k]), raw(sb[k])) for k in sa)


def _load_timed(path, target, topt) -> float:
    import torch

    import omnickpt
    with torch.no_grad():
        for p in target.parameters():
            p.fill_(float("nan"))
    t = time.perf_counter()
    omnickpt.load(path, {"model": target, "optimizer": topt})
    return time.perf_counter() - t


def _save_timed(path, state, **kw) -> tuple[float, dict]:
    import omnickpt
    t = time.perf_counter()
    report = omnickpt.save(path, state, **kw).wait()
    return time.perf_counter() - t, report


def _disk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _one(model, opt, target, topt, sampler, pattern, f, steps, root, prev, gen, run: int, block_bytes: int) -> dict:
    """One run of one (pattern, f): the chain's full save s0, then per step a training step, an
    incremental save s<k> (base s<k-1>) and a plain full save f<k> of the same state, in turns
    first; then the last of each loaded, in turns first."""
    import omnickpt
    n = max(BAG, round(f * sampler.rows / BAG) * BAG)
    state = {"model": model, "optimizer": opt}
    w = model.emb.weight.detach()
    folder = tempfile.mkdtemp(prefix="run-", dir=root)
    at = lambda name: os.path.join(folder, name)   # noqa: E731
    try:
        s, rep = _save_timed(at("s0"), state, incremental=True, block_bytes=block_bytes)
        assert rep["incremental"]["chain"] == 0 and rep["incremental"]["base"] is None, rep["incremental"]
        assert rep["incremental"]["referenced_bytes"] == 0, rep["incremental"]
        out = {"lookups": n, "chain0_written": rep["incremental"]["written_bytes"], "chain0_s": s,
               "chain0_phases": {p: v["median"] for p, v in rep["phases"].items()},
               "chain0_load_s": _load_timed(at("s0"), target, topt)}
        assert _exact(model, target), "full save of the chain (s0): load is not bitwise exact"
        prev.copy_(w)
        for key in ("inc_written", "inc_referenced", "inc_s", "inc_phases", "full_written", "full_s", "full_phases",
                    "rows_changed", "blocks_changed"):
            out[key] = []
        for k in range(1, steps + 1):
            _train_step(model, opt, sampler.draw(pattern, n), gen)
            rows, blocks = _changed(w, prev, sampler.rpb)
            # a looked-up row whose update rounds away in every element stays bitwise the same (rare)
            assert pattern != "uniform" or rows >= 0.99 * n, f"{rows} rows changed of {n} looked up"
            prev.copy_(w)
            out["rows_changed"].append(rows)
            out["blocks_changed"].append(blocks)
            for which in (("inc", "full") if (run + k) % 2 else ("full", "inc")):
                if which == "inc":
                    s, rep = _save_timed(at(f"s{k}"), state, incremental=True, base=at(f"s{k - 1}"),
                                         block_bytes=block_bytes)
                    inc = rep["incremental"]
                    assert inc["chain"] == k and inc["base"] == f"s{k - 1}", inc
                    out["inc_written"].append(inc["written_bytes"])
                    out["inc_referenced"].append(inc["referenced_bytes"])
                else:
                    s, rep = _save_timed(at(f"f{k}"), state)
                    out["full_written"].append(rep["total_bytes"])
                out[f"{which}_s"].append(s)
                out[f"{which}_phases"].append({p: v["median"] for p, v in rep["phases"].items()})
        for which in (("inc", "full") if run % 2 else ("full", "inc")):
            out[f"load_{which}_s"] = _load_timed(at(f"s{steps}" if which == "inc" else f"f{steps}"), target, topt)
            assert _exact(model, target), f"{which} checkpoint of step {steps}: load is not bitwise exact"
        with omnickpt.open(at(f"s{steps}")) as r:   # how fragmented the last incremental checkpoint is
            out["inc_table_boxes"] = len(r.manifest.tensors["model/emb.weight"].columns.lengths)
            out["inc_files"] = len(r.manifest.files)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _manager(model, opt, target, topt, sampler, pattern, f, steps, full_every, keep_last, root, prev, gen,
             block_bytes: int) -> dict:
    import omnickpt
    n = max(BAG, round(f * sampler.rows / BAG) * BAG)
    state = {"model": model, "optimizer": opt}
    folder = tempfile.mkdtemp(prefix="manager-", dir=root)
    per_step = []
    try:
        with omnickpt.CheckpointManager(folder, incremental=True, full_every=full_every, keep_last=keep_last,
                                        block_bytes=block_bytes) as mgr:
            for step in range(steps):
                rows = blocks = None
                if step:
                    _train_step(model, opt, sampler.draw(pattern, n), gen)
                    rows, blocks = _changed(model.emb.weight.detach(), prev, sampler.rpb)
                prev.copy_(model.emb.weight.detach())
                t = time.perf_counter()
                rep = mgr.save(step, state).wait()
                s = time.perf_counter() - t
                per_step.append({"step": step, "chain": rep["incremental"]["chain"], "base": rep["incremental"]["base"],
                                 "rows_changed": rows, "blocks_changed": blocks,
                                 "written_bytes": rep["incremental"]["written_bytes"], "save_s": s,
                                 "disk_bytes": _disk_bytes(folder)})
            kept = mgr.steps()
            present = sorted(os.listdir(folder))
            loads = {}
            for step in kept:   # every kept step loads with its checksums verified (references intact)
                t = time.perf_counter()
                mgr.load(step, {"model": target, "optimizer": topt})
                loads[step] = time.perf_counter() - t
            exact = _exact(model, target)   # the last load was the latest step
            assert exact, "manager: the latest step does not load bitwise exact"
        return {"per_step": per_step, "kept_steps": kept, "folders": present, "load_s": loads,
                "disk_bytes": _disk_bytes(folder), "latest_exact": exact}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    import torch

    from omnickpt.engine.incremental import BLOCK_BYTES, rows_per_block
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--fractions", default="0.001,0.01,0.05")
    ap.add_argument("--patterns", default="uniform,zipf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="incremental saves after each full one")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temporary folder)")
    ap.add_argument("--mgr-steps", type=int, default=10)
    ap.add_argument("--mgr-pattern", default="zipf:0.01")
    ap.add_argument("--full-every", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--block-bytes", type=int, default=None, help="incremental block size (default: omnickpt's, 64 KiB)")
    ap.add_argument("--out", default=None, help="results file (default bench/out/incremental.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    model, opt = _model(args.rows, args.dim)
    target, topt = _model(args.rows, args.dim)
    prev = torch.empty_like(model.emb.weight.detach())
    args.block_bytes = args.block_bytes or BLOCK_BYTES
    rpb = rows_per_block((args.rows, args.dim), 4, args.block_bytes)
    sampler = Sampler(args.rows, rpb)
    table = args.rows * args.dim * 4
    dense = sum(p.numel() * 4 for p in model.mlp.parameters())
    root = tempfile.mkdtemp(prefix="omnickpt-bench-incremental-", dir=args.dir)
    doc = {"rows": args.rows, "dim": args.dim, "block_bytes": args.block_bytes, "rows_per_block": rpb, "table_bytes": table,
           "dense_bytes": dense, "bag": BAG, "zipf_s": ZIPF_S, "runs": args.runs, "steps": args.steps, "dir": root,
           "results": {}}
    print(f"table {args.rows} x {args.dim} fp32 = {table / 1e6:.0f} MB, dense MLP {dense / 1e6:.1f} MB, "
          f"{rpb} rows per {args.block_bytes / 1024:g} KiB block; {args.runs} runs x (chain start + {args.steps} x (incremental "
          f"+ plain full save)); "
          f"checkpoints in {root}")
    try:
        # warm-up (not counted): the first save into fresh files and the first load are slower
        folder = tempfile.mkdtemp(prefix="warmup-", dir=root)
        _save_timed(os.path.join(folder, "w"), {"model": model, "optimizer": opt}, incremental=True,
                    block_bytes=args.block_bytes)
        _load_timed(os.path.join(folder, "w"), target, topt)
        shutil.rmtree(folder)
        print("save s: median/min; boxes: the table's boxes (runs of rows) in the last incremental checkpoint")
        print(f"{'pattern':<8} {'f':>6} {'rows chg':>8} {'blk chg':>8} {'expect':>7} {'full MB':>8} {'incr MB':>8} "
              f"{'ratio':>6} {'full s':>9} {'incr s':>9} {'load full':>9} {'load incr':>9} {'boxes':>6}  exact")
        for pattern in args.patterns.split(","):
            for f in (float(x) for x in args.fractions.split(",")):
                runs = [_one(model, opt, target, topt, sampler, pattern, f, args.steps, root, prev, gen, run,
                             args.block_bytes)
                        for run in range(args.runs)]
                every = lambda key: [v for r in runs for v in r[key]]   # noqa: E731
                med = lambda key: statistics.median(r[key] for r in runs)   # noqa: E731
                phases = lambda key: {p: statistics.median(ph.get(p, 0.0) for ph in every(key))   # noqa: E731
                                      for p in every(key)[0]}
                n = runs[0]["lookups"]
                blocks = math.ceil(args.rows / rpb)
                row = {"lookups": n, "rows_changed_frac": statistics.median(every("rows_changed")) / args.rows,
                       "blocks_changed_frac": statistics.median(every("blocks_changed")) / blocks,
                       "expected_blocks_changed_frac": sampler.expected_changed_blocks(pattern, n),
                       "chain0_written_bytes": med("chain0_written"), "chain0_save_s": med("chain0_s"),
                       "full_written_bytes": statistics.median(every("full_written")),
                       "incr_written_bytes": statistics.median(every("inc_written")),
                       "incr_referenced_bytes": statistics.median(every("inc_referenced")),
                       "full_save_s": statistics.median(every("full_s")),
                       "incr_save_s": statistics.median(every("inc_s")),
                       "full_save_min_s": min(every("full_s")), "incr_save_min_s": min(every("inc_s")),
                       "incr_table_boxes": med("inc_table_boxes"), "incr_files": med("inc_files"),
                       "full_phases_s": phases("full_phases"), "incr_phases_s": phases("inc_phases"),
                       "chain0_phases_s": {p: statistics.median(r["chain0_phases"].get(p, 0.0) for r in runs)
                                           for p in runs[0]["chain0_phases"]},
                       "load_full_s": med("load_full_s"), "load_incr_s": med("load_inc_s"), "exact": True,
                       "runs": runs}
                row["ratio"] = row["incr_written_bytes"] / row["chain0_written_bytes"]
                doc["results"][f"{pattern}/{f}"] = row
                print(f"{pattern:<8} {f:>6.3%} {row['rows_changed_frac']:>8.2%} {row['blocks_changed_frac']:>8.1%} "
                      f"{row['expected_blocks_changed_frac']:>7.1%} {row['chain0_written_bytes'] / 1e6:>8.1f} "
                      f"{row['incr_written_bytes'] / 1e6:>8.1f} {row['ratio']:>6.3f} "
                      f"{row['full_save_s']:>4.2f}/{row['full_save_min_s']:<4.2f} {row['incr_save_s']:>4.2f}/"
                      f"{row['incr_save_min_s']:<4.2f} {row['load_full_s']:>9.2f} {row['load_incr_s']:>9.2f} "
                      f"{row['incr_table_boxes']:>6.0f}  yes")
        pattern, f = args.mgr_pattern.split(":")
        m = _manager(model, opt, target, topt, sampler, pattern, float(f), args.mgr_steps, args.full_every,
                     args.keep_last, root, prev, gen, args.block_bytes)
        doc["manager"] = {"pattern": pattern, "fraction": float(f), "steps": args.mgr_steps,
                          "full_every": args.full_every, "keep_last": args.keep_last, **m}
        print(f"\nCheckpointManager(incremental=True, full_every={args.full_every}, keep_last={args.keep_last}), "
              f"{pattern} f={float(f):.2%}, {args.mgr_steps} steps")
        print(f"{'step':>4} {'chain':>5} {'base':>14} {'rows chg':>8} {'blk chg':>8} {'written MB':>10} {'save s':>7} "
              f"{'on disk MB':>10}")
        nblocks = math.ceil(args.rows / rpb)
        for r in m["per_step"]:
            chg = (f"{r['rows_changed'] / args.rows:>8.2%} {r['blocks_changed'] / nblocks:>8.1%}" if r["step"]
                   else f"{'-':>8} {'-':>8}")
            print(f"{r['step']:>4} {r['chain']:>5} {str(r['base']):>14} {chg} {r['written_bytes'] / 1e6:>10.1f} "
                  f"{r['save_s']:>7.2f} {r['disk_bytes'] / 1e6:>10.1f}")
        print(f"kept steps {m['kept_steps']}, folders {m['folders']}, {m['disk_bytes'] / 1e6:.0f} MB on disk "
              f"({m['disk_bytes'] / (table + dense):.2f} x one full checkpoint); every kept step loads "
              f"({', '.join(f'{s}: {v:.2f} s' for s, v in m['load_s'].items())}), latest bitwise exact")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc["seconds"] = time.perf_counter() - t0
    print(f"total {doc['seconds']:.0f} s")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(args.out or os.path.join(HERE, "out", "incremental.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
