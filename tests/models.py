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


# ---- damage, for the tests that check it is caught --------------------------------------------------
def flip_byte(file, offset: int, mask: int = 0x55) -> None:
    """XOR one byte of `file` in place (twice: repaired)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


# ---- shared by the storage-backend tests (test_s3.py, test_fsspec.py) ----------------------------
def stepped(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step with gradients that are a function of the parameters: every rank and
    layout computes the same numbers without a forward pass."""
    for p in model.parameters():
        p.grad = torch.cos(p.detach() * 3.0) * 0.1 + 0.02
    opt.step()
    opt.zero_grad(set_to_none=True)


def toy(layout: str, seed: int, mesh=None):
    """A ToyMLP in `layout` with Adam state from one deterministic step."""
    torch.manual_seed(seed)
    model = apply_layout(ToyMLP(), layout, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stepped(model, opt)
    return model, opt


def full_values(model, opt) -> dict:
    """Every tensor of the model and its Adam state as a full tensor (collective under FSDP2:
    every rank calls it)."""
    from torch.distributed.tensor import DTensor
    from omnickpt.adapters.module import unwrap

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    inner = unwrap(model)
    names = {id(p): n for n, p in inner.named_parameters()}
    out = {f"model/{k}": full(v) for k, v in inner.state_dict().items()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optim/{names[id(p)]}/{k}"] = full(v)
    return out


def two_rank_fsdp2_roundtrip(rank, world_size, sync_url, async_url):
    """run_ranks body: FSDP2 saves to both URLs (sync, then async with a lazy snapshot and two
    optimizer steps right after the call), loads each back into fresh objects; returns (saved
    values, {url: names that differ})."""
    import omnickpt
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    model, opt = toy("fsdp2", 0, mesh)
    saved = full_values(model, opt)
    omnickpt.save(sync_url, {"model": model, "optimizer": opt}).wait()
    # async: the commit goes through storage (the coordinator polls for the ranks' records)
    handle = omnickpt.save(async_url, {"model": model, "optimizer": opt}, async_save=True)
    stepped(model, opt)               # training goes on: the step waits for the lazy copy, never reaches it
    stepped(model, opt)
    handle.wait()
    out = {}
    for url in (sync_url, async_url):
        fresh, fresh_opt = toy("fsdp2", 5, mesh)
        omnickpt.load(url, {"model": fresh, "optimizer": fresh_opt})
        got = full_values(fresh, fresh_opt)
        assert saved.keys() == got.keys()
        out[url] = [k for k in saved if not torch.equal(saved[k], got[k])]
    return saved, out


def hand_made_dcp(path, item: bytes) -> None:
    """A DCP folder at `path` (a pathlib.Path) holding one float32 tensor "model.w" of shape [2, 1] stored as the
    torch.save archive `item`: for damaged and hostile tensor items that dcp.save would never write."""
    import os
    import pickle
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    os.makedirs(path, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(item)
    size = torch.Size([2, 1])
    md = Metadata({"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                                    [ChunkStorageMetadata(torch.Size([0, 0]), size)])},
                  planner_data={"model.w": ("model", "w")},
                  storage_data={MetadataIndex("model.w", [0, 0]): _StorageInfo("__0_0.distcp", 0, len(item))})
    (path / ".metadata").write_bytes(pickle.dumps(md))
