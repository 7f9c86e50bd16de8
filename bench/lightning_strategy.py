"""omnickpt's Lightning strategy against Lightning's own default, on the same job.

    .venv/bin/python bench/lightning_strategy.py [--width 2048 --layers 6 --saves 4]

2 gloo ranks on CPU (DDP), a LightningModule of `layers` Linear(width, width) with AdamW (about
`12 * width^2 * layers` bytes of state: 300 MB at the defaults), ModelCheckpoint saving every 2 steps.
Strategies: Lightning's DDPStrategy (its default: rank 0 writes the whole checkpoint dict with
torch.save), OmnickptDDPStrategy (every rank writes its part; sync), OmnickptDDPStrategy(async_save=True)
and (--kinds omnickpt-dedup) loads with LoadOptions(dedup_reads=True).
Figures, slowest rank, medians: `save` = time inside strategy.save_checkpoint per save (what the
training loop waits for), `durable` = for async saves, save + the wait for the commit at the end of fit
(the saves before it were awaited by the next save), `load` = time inside strategy.load_checkpoint of
a resumed fit (fresh weights, ckpt_path="last"), the checkpoint files dropped from the page cache first
(a restarted job reads cold; --warm keeps them cached).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ranks import evict, run_ranks  # noqa: E402


def _timed(base):
    """`base` with save_checkpoint / load_checkpoint / teardown timed (teardown: where an async save's
    last commit is awaited)."""
    class Timed(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.times = {"save": [], "load": [], "teardown": []}

        def save_checkpoint(self, *a, **k):
            t = time.perf_counter()
            super().save_checkpoint(*a, **k)
            self.times["save"].append(time.perf_counter() - t)

        def load_checkpoint(self, *a, **k):
            t = time.perf_counter()
            out = super().load_checkpoint(*a, **k)
            self.times["load"].append(time.perf_counter() - t)
            return out

        def teardown(self):
            t = time.perf_counter()
            super().teardown()
            self.times["teardown"].append(time.perf_counter() - t)
    return Timed


def body(rank, world, root, kind, width, layers, saves, warm):
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from omnickpt.integrations.lightning import OmnickptDDPStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            x = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def strategy():
        if kind == "lightning":
            return _timed(DDPStrategy)()
        if kind == "omnickpt-dedup":   # one rank reads each replicated byte and forwards it (LoadOptions)
            import omnickpt
            return _timed(OmnickptDDPStrategy)(load_options=omnickpt.LoadOptions(dedup_reads=True))
        return _timed(OmnickptDDPStrategy)(async_save=kind == "omnickpt-async")

    def trainer(strat, steps):
        ckpt = ModelCheckpoint(dirpath=f"{root}/{kind}", every_n_train_steps=2, save_top_k=-1, save_last=True)
        return L.Trainer(strategy=strat, accelerator="cpu", devices=world, max_steps=steps, callbacks=[ckpt],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)

    first = strategy()
    trainer(first, 2 * saves).fit(Model())
    if not warm:
        evict(f"{root}/{kind}")
    torch.distributed.barrier()
    resumed = strategy()
    trainer(resumed, 2 * saves + 1).fit(Model(), ckpt_path="last")
    return first.times, resumed.times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--kinds", default="lightning,omnickpt,omnickpt-async")
    ap.add_argument("--warm", action="store_true", help="load with the checkpoint in the page cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for kind in args.kinds.split(","):
            out = run_ranks(2, body, d, kind, args.width, args.layers, args.saves, args.warm, timeout=1800)
            saves = [max(r[0]["save"][i] for r in out) for i in range(len(out[0][0]["save"]))]
            # saves == (each ModelCheckpoint save and its save_last copy): every call counts
            teardown = max(r[0]["teardown"][0] if r[0]["teardown"] else 0.0 for r in out)
            loads = [max(r[1]["load"][i] for r in out) for i in range(len(out[0][1]["load"]))]
            print(f"{kind:15s} save {statistics.median(saves):.3f} s (n={len(saves)})  "
                  f"last commit awaited at teardown {teardown:.3f} s  load {statistics.median(loads):.3f} s",
                  flush=True)


if __name__ == "__main__":
    main()
