"""The benchmark's workloads: models, their parallel layouts and a training step.

Shared by bench/compare.py (omnickpt and DCP, torch of the project's venv) and bench/bcp_driver.py
(ByteCheckpoint, torch 2.5 in bench/.venv-bcp), so it must work on both torch versions and must
not import omnickpt.

Every model is built from a fixed seed and takes one Adam step at once, so the optimizer state
exists (exp_avg, exp_avg_sq, step) and every rank agrees on the initial values.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

FRAMEWORKS = ("ddp", "fsdp2")


class MLPStack(nn.Module):
    """`layers` pairs of Linear(h, 4h) + Linear(4h, h): the issue's 805 MB workload at h=1024, 8 pairs
    (67.1 M float32 parameters; with Adam's two moments 3 x 268 MB)."""

    def __init__(self, hidden: int = 1024, layers: int = 8):
        super().__init__()
        self.hidden = hidden
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(hidden, 4 * hidden))
            self.layers.append(nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2 == 0:
                x = F.relu(x)
        return x

    def example_batch(self, gen: torch.Generator):
        return torch.randn(8, self.hidden, generator=gen)

    @staticmethod
    def loss(out):
        return out.pow(2).mean()

    def fsdp_units(self):
        return list(self.layers)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder: token + position embeddings, pre-norm blocks, an untied LM head. Many
    tensors of mixed sizes (LayerNorm vectors, biases, matrices), unlike the MLP stack."""

    def __init__(self, vocab: int = 16384, dim: int = 512, heads: int = 8, layers: int = 8, block: int = 128):
        super().__init__()
        self.vocab, self.block = vocab, block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def example_batch(self, gen: torch.Generator):
        return torch.randint(0, self.vocab, (2, min(self.block, 64)), generator=gen)

    def loss(self, out):
        # Next-token-like objective on random tokens: only the cost matters here.
        return out.float().logsumexp(-1).mean()

    def fsdp_units(self):
        return list(self.blocks)


# name -> (class, kwargs for the full run, kwargs for --quick)
WORKLOADS = {
    "mlp": (MLPStack, dict(hidden=1024, layers=8), dict(hidden=128, layers=2)),
    "gpt": (GPT, dict(vocab=16384, dim=512, heads=8, layers=8, block=128),
            dict(vocab=512, dim=64, heads=4, layers=2, block=32)),
}


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard      # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard   # torch 2.4 / 2.5
    return fully_shard


def build(workload: str, framework: str, *, quick: bool, seed: int = 0, device: str = "cpu"):
    """(model, optimizer, plain_module) in `framework` ('plain', 'ddp' or 'fsdp2') on the current
    process group, after one training step. `plain_module` is the model without the DDP wrapper."""
    cls, full, small = WORKLOADS[workload]
    torch.manual_seed(seed)
    module = cls(**(small if quick else full)).to(device)
    model = module
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(module)
    elif framework == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        fully_shard = _fully_shard()
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for unit in module.fsdp_units():
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
    elif framework != "plain":
        raise ValueError(f"unknown framework {framework!r}; use plain, ddp or fsdp2")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + seed)
    train_step(model, module, opt, gen)
    return model, opt, module, gen


def train_step(model, module, opt, gen: torch.Generator) -> None:
    """One forward/backward/Adam step on a random batch (same on every rank: seeded)."""
    batch = module.example_batch(gen)
    device = next(module.parameters()).device
    loss = module.loss(model(batch.to(device)))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_bytes(module: nn.Module) -> int:
    """Bytes of the full (unsharded) model + Adam state: parameters x 3 (param, exp_avg, exp_avg_sq)."""
    return sum(math.prod(p.shape) * p.element_size() for p in module.parameters()) * 3


def _local(t: torch.Tensor):
    """(local tensor, whether it is a sharded piece whose sums must be added across ranks)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Shard
    if isinstance(t, DTensor):
        return t.to_local(), any(isinstance(p, Shard) for p in t.placements)
    return t, False


def fingerprint(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    """name -> sum of the full tensor (float64) for every parameter and its Adam moments; the same
    numbers in every layout, so a load can be checked against what was saved."""
    import torch.distributed as dist
    names = {id(p): re.sub(r"^module\.", "", n) for n, p in module.named_parameters()}
    out_local, sharded = {}, {}
    for p in module.parameters():
        n = names[id(p)]
        items = [(n, p.detach())]
        st = opt.state.get(p, {})
        items += [(f"{n}:{k}", v.detach()) for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        for key, t in items:
            loc, is_sharded = _local(t)
            out_local[key] = loc.double().sum().item()
            sharded[key] = is_sharded
    keys = sorted(out_local)
    vals = torch.tensor([out_local[k] if sharded[k] else 0.0 for k in keys], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vals)
    return {k: (vals[i].item() if sharded[k] else out_local[k]) for i, k in enumerate(keys)}


def same_fingerprint(a: dict, b: dict, rel: float = 1e-6) -> bool:
    if set(a) != set(b):
        return False
    return all(abs(a[k] - b[k]) <= rel * max(1.0, abs(a[k]), abs(b[k])) for k in a)


def perturb(module: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Overwrite parameters and moments so that a load that does nothing is caught."""
    with torch.no_grad():
        for p in module.parameters():
            _local(p)[0].fill_(0.5)
            for k, v in opt.state.get(p, {}).items():
                if k in ("exp_avg", "exp_avg_sq"):
                    _local(v)[0].fill_(0.25)
