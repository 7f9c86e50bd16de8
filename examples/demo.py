"""omnickpt demo: train on 2 ranks with FSDP2 and async saves, stop, resume on 1 rank as a plain module.

    python examples/demo.py [--dir DIR] [--steps 40] [--save-every 10]

1. Two CPU processes (gloo) train a small GPT-style model sharded with FSDP2 (`fully_shard`) for
   all --steps steps. Every --save-every steps they save the whole training state (model,
   AdamW, LR scheduler, RNG streams, data position) asynchronously through
   omnickpt.CheckpointManager; training only waits for the memory copy. Then the processes exit.
2. A fresh process - one rank, a plain nn.Module, no FSDP, no process group, weights initialised
   from a different seed - loads the latest checkpoint (step k) and trains steps k+1..N.
3. The losses of both runs for steps k+1..N are printed side by side; they must agree to float
   rounding (the single rank processes the same global batch the two ranks shared, and the two
   ranks' mean loss is the mean over that batch). The exit code is 1 if they do not.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import omnickpt

VOCAB, DIM, HEADS, LAYERS, SEQ = 128, 96, 4, 2, 32
GLOBAL_BATCH = 16              # sequences per step, split evenly over the ranks
TOLERANCE = 1e-4               # |loss difference| allowed between layouts (float rounding is ~1e-6)


# ---------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------------- data
class SyntheticTokens:
    """Deterministic token stream: batch i is drawn from a generator seeded with (seed, i), so the
    position alone says where to continue. Sequences follow x[t+1] = 5 x[t] + 3 (mod VOCAB) with
    10% random tokens, something the model can learn in a few dozen steps.

    Stateful (state_dict/load_state_dict), so omnickpt saves the position with the checkpoint.
    """

    def __init__(self, seed: int = 0):
        self.seed, self.position = seed, 0

    def next_global_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        seq = torch.empty(GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(VOCAB, (GLOBAL_BATCH,), generator=g)
        noise = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        noisy = torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) < 0.1
        for t in range(SEQ):
            nxt = (seq[:, t] * 5 + 3) % VOCAB
            seq[:, t + 1] = torch.where(noisy[:, t + 1], noise[:, t + 1], nxt)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.position = sd["seed"], sd["position"]


def make_training(model: nn.Module, total_steps: int):
    """AdamW plus a warmup-then-cosine LR schedule (so a wrong scheduler state shows in the losses)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = 5

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def train_step(model, opt, sched, data, rank: int, world_size: int) -> torch.Tensor:
    """One step on this rank's share of the global batch; returns the local mean loss."""
    inputs, targets = data.next_global_batch()
    share = GLOBAL_BATCH // world_size
    inputs, targets = inputs[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]
    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()   # FSDP2 averages the gradients over the ranks: the gradient of the global mean
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ---------------------------------------------------------------------------- phase 1: 2 ranks, FSDP2
def train_fsdp2(rank: int, world_size: int, port: int, root: str, steps: int, save_every: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)      # two ranks share the CPU cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)      # same initial weights on every rank, then each keeps its shard
        model = GPT()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt, sched = make_training(model, steps)
        data = SyntheticTokens(seed=0)
        state = {"model": model, "optimizer": opt, "scheduler": sched, "rng": omnickpt.RNGState(), "data": data}

        manager = omnickpt.CheckpointManager(root, keep_last=2)   # older steps are deleted after each commit
        losses, handles = {}, {}
        for step in range(1, steps + 1):
            loss = train_step(model, opt, sched, data, rank, world_size)
            dist.all_reduce(loss)                 # gloo has no AVG: sum, then divide
            losses[step] = loss.item() / world_size
            if step % save_every == 0 and step < steps:
                # Returns after the memory copy; writing and committing go on in the background
                # while the next steps train. The manager waits for it before the next save.
                handles[step] = manager.save(step, state, async_save=True)
        manager.wait()
        reports = {step: h.wait() for step, h in handles.items()}   # every step committed
        if rank == 0:
            with open(os.path.join(root, "run_2ranks.json"), "w") as f:
                json.dump({"losses": losses, "reports": reports,
                           "params": sum(p.numel() for p in model.parameters())}, f, default=str)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- phase 2: 1 rank, plain module
def resume_plain(root: str, steps: int) -> dict:
    torch.manual_seed(1234)       # different initial weights: only a correct load can match the losses
    model = GPT()
    opt, sched = make_training(model, steps)
    data = SyntheticTokens(seed=99)  # wrong seed and position on purpose: the checkpoint restores both
    state = {"model": model, "optimizer": opt, "scheduler": sched, "rng": omnickpt.RNGState(), "data": data}
    manager = omnickpt.CheckpointManager(root)
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"no committed checkpoint under {root}")
    result = manager.load(step, state)
    if data.position != step:
        raise SystemExit(f"the data position is {data.position} after loading step {step}; expected {step}")
    losses = {}
    for s in range(step + 1, steps + 1):
        losses[s] = train_step(model, opt, sched, data, rank=0, world_size=1).item()
    return {"step": step, "losses": losses, "report": result.report}


# ---------------------------------------------------------------------------- main
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(report: dict, name: str) -> dict:
    return report["phases"].get(name, {"min": float("nan"), "median": float("nan"), "max": float("nan")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="checkpoint root (default: a temporary directory, removed afterwards)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=10)
    args = ap.parse_args()
    if args.save_every >= args.steps:
        ap.error("--save-every must be smaller than --steps so that some steps follow the last checkpoint")
    root = args.dir or tempfile.mkdtemp(prefix="omnickpt-demo-")
    if args.dir and os.path.exists(os.path.join(root, "run_2ranks.json")):
        ap.error(f"{root} holds an earlier demo run; pass an empty or new --dir")
    os.makedirs(root, exist_ok=True)

    try:
        import torch.multiprocessing as mp
        print(f"[1/2] training {args.steps} steps on 2 CPU ranks (gloo, FSDP2), async save every "
              f"{args.save_every} steps to {root}", flush=True)
        t0 = time.perf_counter()
        mp.spawn(train_fsdp2, args=(2, _free_port(), root, args.steps, args.save_every), nprocs=2, join=True)
        with open(os.path.join(root, "run_2ranks.json")) as f:
            run2 = json.load(f)
        t_train = time.perf_counter() - t0
        print(f"      model: {run2['params']:,} parameters; 2 ranks finished in {t_train:.1f} s and exited; "
              f"committed checkpoints: {omnickpt.CheckpointManager(root).steps()}", flush=True)

        print("[2/2] resuming on 1 rank as a plain nn.Module (no FSDP, no process group) from the latest "
              "checkpoint", flush=True)
        run1 = resume_plain(root, args.steps)
        k = run1["step"]

        print(f"\nlosses after the checkpoint at step {k}:")
        print(f"  {'step':>4}  {'2 ranks, FSDP2 (uninterrupted)':>30}  {'1 rank, plain (resumed)':>24}  {'|diff|':>9}")
        worst = 0.0
        for s in range(k + 1, args.steps + 1):
            a, b = run2["losses"][str(s)], run1["losses"][s]
            worst = max(worst, abs(a - b))
            print(f"  {s:>4}  {a:>30.6f}  {b:>24.6f}  {abs(a - b):>9.2e}")
        print(f"  max |diff| = {worst:.2e} (tolerance {TOLERANCE:.0e})")

        print("\ncheckpoint timings in seconds (stall: what training waited for, min / median / max over ranks;"
              "\ntotal: until committed, mostly in the background while training went on):")
        for step, rep in sorted(run2["reports"].items(), key=lambda kv: int(kv[0])):
            st = _phase(rep, "stall")
            print(f"  save step {step:>3}: stall {st['min']:.4f} / {st['median']:.4f} / {st['max']:.4f}   "
                  f"total {rep['seconds']:.3f}   ({rep['total_bytes'] / 1e6:.1f} MB written by 2 ranks)")
        lr = run1["report"]
        print(f"  load step {k:>3}: total {lr['seconds']:.3f} on 1 rank (resharded from 2 FSDP2 shards to a "
              f"plain module, {lr['total_bytes'] / 1e6:.1f} MB read)")

        ok = worst <= TOLERANCE and len(run1["losses"]) == args.steps - k
        if ok:
            print(f"\nVERDICT: PASS - the 1-rank plain run continues the 2-rank FSDP2 run: losses of steps "
                  f"{k + 1}..{args.steps} agree within {TOLERANCE:.0e} (max |diff| {worst:.2e})")
        else:
            print(f"\nVERDICT: FAIL - losses of steps {k + 1}..{args.steps} differ by up to {worst:.2e} "
                  f"(tolerance {TOLERANCE:.0e})")
        return 0 if ok else 1
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
