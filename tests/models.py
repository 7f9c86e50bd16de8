"""Small models and the one function that puts a model into a parallel layout, shared by the
multi-rank tests.

Dimensions are deliberately not divisible by 2, 3 or 4, so every sharded layout at those world
sizes has uneven shards (and at 4 ranks some ranks hold empty ones).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("plain", "ddp", "fsdp2", "tp", "2d")


class ToyMLP(nn.Module):
    """Linear(7, 13) -> ReLU -> Linear(13, 5) -> LayerNorm(5), plus a buffer.

    Under tensor parallelism fc1 is column-wise and fc2 row-wise; the LayerNorm and the buffer stay
    plain tensors, so a 2-D layout mixes DTensors on a 2-D mesh with ones on the data-parallel mesh.
    """

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(13, 5)
        self.norm = nn.LayerNorm(5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.norm(self.fc2(self.act(self.fc1(x)))) * self.scale

    def tp_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}

    def fsdp_units(self) -> list[nn.Module]:
        return [self.fc1, self.fc2]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 3 * dim + 1)
        self.out = nn.Linear(3 * dim + 1, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` pre-norm transformer blocks, an untied LM head."""

    def __init__(self, vocab: int = 29, dim: int = 14, heads: int = 2, layers: int = 2, block: int = 9,
                 dropout: float = 0.0):
        super().__init__()
        self.vocab, self.block = vocab, block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)


def apply_layout(model: nn.Module, layout: str, mesh=None, group=None) -> nn.Module:
    """Put `model` (identical full weights on every rank) into `layout`; returns the module to use.

    mesh: a 1-D DeviceMesh for fsdp2/tp, a 2-D one with dims ("dp", "tp") for 2d; group: the
    process group for ddp. Sharding slices each rank's full copy, so every layout starts from the
    same global tensors.
    """
    if layout == "plain":
        return model
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, process_group=group)
    from torch.distributed.fsdp import fully_shard
    if layout == "fsdp2":
        for unit in model.fsdp_units():
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import parallelize_module
    if layout == "tp":
        return parallelize_module(model, mesh, model.tp_plan())
    if layout == "2d":
        parallelize_module(model, mesh["tp"], model.tp_plan())
        for unit in model.fsdp_units():
            fully_shard(unit, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
