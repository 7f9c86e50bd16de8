"""omnickpt's HF Trainer mixin against the Trainer's own checkpointing, on the same job.

    .venv/bin/python bench/hf_trainer.py [--layers 4 --width 512 --vocab 8192 --kinds plain,sync,async]

2 gloo ranks on CPU (DDP through the Trainer), a GPT-2 built from a config (4 layers, 512 wide, vocab
8192: about 17M parameters, 200 MB of state with AdamW), a save every 2 steps for 8 steps. Kinds: the
plain Trainer (rank 0 writes model.safetensors, optimizer.pt...), OmnickptTrainer sync (durable: fsync),
and async. Figures, slowest rank, medians: `save` = time inside Trainer._save_checkpoint per save (what
training waits for), `load` = time inside the Trainer's checkpoint loads of a resumed run
(_load_from_checkpoint + _load_optimizer_and_scheduler + _load_rng_state), the checkpoint files dropped
from the page cache first (a restarted job reads cold; --warm keeps them cached).
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


def body(rank, world, root, kind, dims, warm):
    import gc
    gc.freeze()   # Trainer.train() calls gc.collect(): seconds over a large heap, the same for every kind
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    import omnickpt
    from omnickpt.integrations.hf_trainer import OmnickptTrainerMixin
    layers, width, vocab = dims
    times = {"save": [], "load": []}

    class Timed:
        def _save_checkpoint(self, model, trial):
            t = time.perf_counter()
            super()._save_checkpoint(model, trial)
            times["save"].append(time.perf_counter() - t)

        def _load_from_checkpoint(self, *a, **k):
            t = time.perf_counter()
            super()._load_from_checkpoint(*a, **k)
            times["load"].append(time.perf_counter() - t)

        def _load_optimizer_and_scheduler(self, *a, **k):
            t = time.perf_counter()
            super()._load_optimizer_and_scheduler(*a, **k)
            times["load"].append(time.perf_counter() - t)

        def _load_rng_state(self, *a, **k):
            t = time.perf_counter()
            super()._load_rng_state(*a, **k)
            times["load"].append(time.perf_counter() - t)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(vocab, (64, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    base = Trainer if kind == "plain" else type("OmnickptTrainer", (OmnickptTrainerMixin, Trainer), {})
    cls = type("TimedTrainer", (Timed, base), {})
    extra = {} if kind == "plain" else {"omnickpt_options": omnickpt.SaveOptions(async_save=kind == "async")}

    def trainer(steps):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=8, vocab_size=vocab, n_positions=8))
        args = TrainingArguments(output_dir=os.path.join(root, kind), max_steps=steps, per_device_train_batch_size=2,
                                 save_strategy="steps", save_steps=2, use_cpu=True, report_to=[], disable_tqdm=True,
                                 ddp_find_unused_parameters=False, logging_steps=100)
        return cls(model=model, args=args, train_dataset=Tokens(), **extra)

    trainer(8).train()
    saves = list(times["save"])
    times["load"].clear()
    if not warm:
        evict(os.path.join(root, kind))
    torch.distributed.barrier()
    trainer(9).train(resume_from_checkpoint=True)
    return saves, sum(times["load"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--kinds", default="plain,sync,async")
    ap.add_argument("--warm", action="store_true", help="load with the checkpoint in the page cache")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        for kind in args.kinds.split(","):
            out = run_ranks(2, body, d, kind, (args.layers, args.width, args.vocab), args.warm, timeout=1800)
            saves = [max(r[0][i] for r in out) for i in range(len(out[0][0]))]
            load = max(r[1] for r in out)
            print(f"{kind:6s} save {statistics.median(saves):.3f} s (median of {len(saves)})  load {load:.3f} s",
                  flush=True)


if __name__ == "__main__":
    main()
