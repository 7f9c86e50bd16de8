"""Declared transforms (omnickpt/transforms.py): a checkpoint saved by one model definition loads
into another that names, fuses, splits, pads or ties its parameters differently, bit for bit.

Every expected value is computed from the saving model with plain torch indexing (view, slicing,
cat, stack), never with omnickpt, so a wrong box offset or byte offset shows up as a mismatch.
The Megatron-style pair of models also runs forward: the plain model given the converted weights
computes what the fused model computes, which checks the layout conventions themselves (GQA
grouping, gate-before-up), not only the bookkeeping.
"""
from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import omnickpt
from dist import run_ranks
from omnickpt.errors import CorruptCheckpointError, MismatchError
from omnickpt.planner.load_plan import ZERO_FILL, WindowBox
from omnickpt.transforms import (Alias, Drop, Fuse, FuseQKV, RelayoutQKV, Rename, ResizeVocab, SplitFused, SplitQKV,
                                 StackExperts, UnstackExperts, qkv_rows)


# ---------------------------------------------------------------------- helpers
def bag(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose state dict is exactly `tensors` (dotted names become submodules)."""
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if p not in m._modules:
                m.add_module(p, nn.Module())
            m = m._modules[p]
        m.register_parameter(leaf, nn.Parameter(t.clone()))
    return root


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def save_bag(path, tensors):
    omnickpt.save(str(path), {"model": bag(tensors)}).wait()


def load_bag(path, shapes: dict[str, tuple], transforms, fill=7.0, **kw) -> dict[str, torch.Tensor]:
    """Load into a fresh bag of the given shapes, pre-filled with `fill` so that an element the
    load does not write stays visibly wrong."""
    target = bag({k: torch.full(s, fill) for k, s in shapes.items()})
    omnickpt.load(str(path), {"model": target}, transforms=transforms, **kw)
    return {k: v.detach().clone() for k, v in target.state_dict().items()}


def qkv_reference(w: torch.Tensor, nh: int, d: int, g: int, layout: str):
    """q, k, v of a fused tensor by plain torch indexing."""
    if layout == "concat":
        return w[:nh * d], w[nh * d:nh * d + g * d], w[nh * d + g * d:]
    qpg = nh // g
    per = w.reshape(g, (qpg + 2) * d, *w.shape[1:])
    return (per[:, :qpg * d].reshape(nh * d, *w.shape[1:]), per[:, qpg * d:qpg * d + d].reshape(g * d, *w.shape[1:]),
            per[:, qpg * d + d:].reshape(g * d, *w.shape[1:]))


def qkv_fuse_reference(q, k, v, nh: int, d: int, g: int, layout: str):
    if layout == "concat":
        return torch.cat([q, k, v])
    qpg = nh // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)],
                     dim=1).reshape(-1, *rest)


# ---------------------------------------------------------------------- fused QKV
@pytest.mark.parametrize("nh,g", [(4, 4), (6, 2), (4, 1)], ids=["mha-per-head", "gqa", "mqa"])
@pytest.mark.parametrize("layout", ["grouped", "concat"])
def test_fused_qkv_loads_into_separate_qkv_and_back(tmp_path, nh, g, layout):
    d, hidden = 3, 5
    rows = (nh + 2 * g) * d
    w, b = rand(rows, hidden, seed=1), rand(rows, seed=2)
    save_bag(tmp_path / "fused", {"attn.qkv.weight": w, "attn.qkv.bias": b})
    geo = dict(num_heads=nh, head_dim=d, num_groups=g, layout=layout)
    split = [SplitQKV("attn.qkv.weight", into=("attn.q.weight", "attn.k.weight", "attn.v.weight"), **geo),
             SplitQKV("attn.qkv.bias", into=("attn.q.bias", "attn.k.bias", "attn.v.bias"), **geo)]
    shapes = {"attn.q.weight": (nh * d, hidden), "attn.k.weight": (g * d, hidden), "attn.v.weight": (g * d, hidden),
              "attn.q.bias": (nh * d,), "attn.k.bias": (g * d,), "attn.v.bias": (g * d,)}
    got = load_bag(tmp_path / "fused", shapes, split)
    for suffix, ref in (("weight", w), ("bias", b)):
        for part, expect in zip("qkv", qkv_reference(ref, nh, d, g, layout)):
            assert torch.equal(got[f"attn.{part}.{suffix}"], expect), (part, suffix)

    # ... and back: the separate tensors, saved, load into the fused layout bit for bit.
    save_bag(tmp_path / "separate", got)
    fuse = [FuseQKV(("attn.q.weight", "attn.k.weight", "attn.v.weight"), into="attn.qkv.weight", **geo),
            FuseQKV(("attn.q.bias", "attn.k.bias", "attn.v.bias"), into="attn.qkv.bias", **geo)]
    back = load_bag(tmp_path / "separate", {"attn.qkv.weight": (rows, hidden), "attn.qkv.bias": (rows,)}, fuse)
    assert torch.equal(back["attn.qkv.weight"], w) and torch.equal(back["attn.qkv.bias"], b)

    # one fused layout into the other (Megatron grouped <-> [Q; K; V])
    other = "concat" if layout == "grouped" else "grouped"
    rel = load_bag(tmp_path / "fused", {"attn.qkv.weight": (rows, hidden), "attn.qkv.bias": (rows,)},
                   [RelayoutQKV("attn.qkv.weight", num_heads=nh, head_dim=d, num_groups=g, saved=layout, target=other),
                    RelayoutQKV("attn.qkv.bias", num_heads=nh, head_dim=d, num_groups=g, saved=layout, target=other)])
    for suffix, ref in (("weight", w), ("bias", b)):
        expect = qkv_fuse_reference(*qkv_reference(ref, nh, d, g, layout), nh, d, g, other)
        assert torch.equal(rel[f"attn.qkv.{suffix}"], expect)


def test_qkv_rows_spell_out_the_layouts():
    # Megatron-core grouped layout, 4 query heads in 2 groups, head_dim 2: [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert qkv_rows(4, 2, 2) == [(0, 0, 4), (1, 0, 2), (2, 0, 2), (0, 4, 4), (1, 2, 2), (2, 2, 2)]
    assert qkv_rows(4, 2, 2, "concat") == [(0, 0, 8), (1, 0, 4), (2, 0, 4)]
    with pytest.raises(ValueError, match="multiple of num_groups"):
        qkv_rows(4, 2, 3)


# ---------------------------------------------------------------------- two sub-parameters (SwiGLU)
def test_swiglu_split_and_fuse_along_rows_and_columns(tmp_path):
    f, hidden = 6, 5
    fc1 = rand(2 * f, hidden, seed=3)
    wide = rand(hidden, 14, seed=4)      # two parts side by side along dim 1 (unequal: 5 + 9)
    save_bag(tmp_path / "fused", {"mlp.fc1.weight": fc1, "mlp.wide": wide})
    got = load_bag(tmp_path / "fused",
                   {"mlp.gate.weight": (f, hidden), "mlp.up.weight": (f, hidden), "mlp.a": (hidden, 5),
                    "mlp.b": (hidden, 9)},
                   [SplitFused("mlp.fc1.weight", into=["mlp.gate.weight", "mlp.up.weight"], sizes=[f, f]),
                    SplitFused("mlp.wide", into=["mlp.a", "mlp.b"], sizes=[5, 9], dim=1)])
    assert torch.equal(got["mlp.gate.weight"], fc1[:f]) and torch.equal(got["mlp.up.weight"], fc1[f:])
    # along dim 1 the parts are strided windows of the stored box
    assert torch.equal(got["mlp.a"], wide[:, :5]) and torch.equal(got["mlp.b"], wide[:, 5:])

    save_bag(tmp_path / "split", got)
    back = load_bag(tmp_path / "split", {"mlp.fc1.weight": (2 * f, hidden), "mlp.wide": (hidden, 14)},
                    [Fuse(["mlp.gate.weight", "mlp.up.weight"], into="mlp.fc1.weight"),
                     Fuse(["mlp.a", "mlp.b"], into="mlp.wide", dim=1)])
    assert torch.equal(back["mlp.fc1.weight"], fc1) and torch.equal(back["mlp.wide"], wide)


# ---------------------------------------------------------------------- vocabulary padding
def test_vocab_pad_zero_fills_and_truncate_drops(tmp_path):
    emb, head_b = rand(29, 4, seed=5), rand(29, seed=6)
    save_bag(tmp_path / "v29", {"tok.weight": emb, "head.bias": head_b})
    padded = load_bag(tmp_path / "v29", {"tok.weight": (32, 4), "head.bias": (32,)},
                      [ResizeVocab("tok.weight", rows=32), ResizeVocab("head.bias", rows=32)])
    assert torch.equal(padded["tok.weight"][:29], emb) and torch.equal(padded["head.bias"][:29], head_b)
    # the target was pre-filled with 7s: the pad rows were written, with zeros
    assert torch.equal(padded["tok.weight"][29:], torch.zeros(3, 4))
    assert torch.equal(padded["head.bias"][29:], torch.zeros(3))
    truncated = load_bag(tmp_path / "v29", {"tok.weight": (24, 4)},
                         [ResizeVocab("tok.weight", rows=24), Drop("head.bias")])
    assert torch.equal(truncated["tok.weight"], emb[:24])

    # a padded checkpoint truncated back to the true vocabulary, and padded further
    save_bag(tmp_path / "v32", padded)
    assert torch.equal(load_bag(tmp_path / "v32", {"tok.weight": (29, 4), "head.bias": (29,)},
                                [ResizeVocab("*.weight", rows=29), ResizeVocab("*.bias", rows=29)])["tok.weight"], emb)
    wider = load_bag(tmp_path / "v32", {"tok.weight": (40, 4), "head.bias": (40,)},
                     [ResizeVocab("tok.weight", rows=40), ResizeVocab("head.bias", rows=40)])
    assert torch.equal(wider["tok.weight"], torch.cat([emb, torch.zeros(11, 4)]))


# ---------------------------------------------------------------------- tied embeddings
def test_tied_alias_into_untied_and_tied_targets(tmp_path):
    emb = rand(11, 4, seed=7)
    save_bag(tmp_path / "tied", {"tok.weight": emb})     # a tied model stored one copy
    alias = [Alias("model/head.weight", source="model/tok.weight")]
    untied = load_bag(tmp_path / "tied", {"tok.weight": (11, 4), "head.weight": (11, 4)}, alias)
    assert torch.equal(untied["tok.weight"], emb) and torch.equal(untied["head.weight"], emb)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11, bias=False)
            self.head.weight = self.tok.weight     # state_dict names it twice
    model = Tied()
    with pytest.raises(MismatchError, match="head.weight: missing from the checkpoint"):
        omnickpt.load(str(tmp_path / "tied"), {"model": model})
    omnickpt.load(str(tmp_path / "tied"), {"model": model}, transforms=alias)
    assert torch.equal(model.head.weight.detach(), emb) and model.head.weight is model.tok.weight


# ---------------------------------------------------------------------- experts
def test_stacked_experts_unstack_and_stack(tmp_path):
    w1 = rand(3, 4, 5, seed=8)
    save_bag(tmp_path / "stacked", {"moe.experts.w1": w1})
    per = load_bag(tmp_path / "stacked", {f"moe.experts.{e}.w1": (4, 5) for e in range(3)},
                   [UnstackExperts("moe.experts.w1", into="moe.experts.{e}.w1")])
    for e in range(3):
        assert torch.equal(per[f"moe.experts.{e}.w1"], w1[e]), e
    save_bag(tmp_path / "per", per)
    back = load_bag(tmp_path / "per", {"moe.experts.w1": (3, 4, 5)},
                    [StackExperts("moe.experts.{e}.w1", into="moe.experts.w1")])
    assert torch.equal(back["moe.experts.w1"], w1)
    # an expert dimension stored as rows of one 2-D tensor (E*F rows): split, then stack
    save_bag(tmp_path / "rows", {"moe.w": w1.reshape(12, 5)})
    stacked = load_bag(tmp_path / "rows", {"moe.w": (3, 4, 5)},
                       [SplitFused("moe.w", into=[f"moe.{e}.w" for e in range(3)]),
                        StackExperts("moe.{e}.w", into="moe.w", num_experts=3)])
    assert torch.equal(stacked["moe.w"], w1)


# ---------------------------------------------------------------------- Megatron-style models
class Cfg:
    def __init__(self, vocab=29, padded=32, hidden=10, heads=4, groups=2, head_dim=3, ffn=6, layers=2):
        self.vocab, self.padded, self.hidden, self.heads, self.groups = vocab, padded, hidden, heads, groups
        self.head_dim, self.ffn, self.layers = head_dim, ffn, layers


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _attend(q, k, v, qpg):
    # q (b, t, heads, d); k, v (b, t, groups, d): query head h uses key/value group h // qpg
    k, v = k.repeat_interleave(qpg, dim=2), v.repeat_interleave(qpg, dim=2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2).flatten(2)


class MegatronStyleGPT(nn.Module):
    """Megatron-core names and fusing: linear_qkv grouped per query group, linear_fc1 = [gate; up],
    a vocabulary padded to `padded` rows, optionally tied output weights (no output_layer then)."""

    def __init__(self, c: Cfg, seed=0, tied=False):
        super().__init__()
        self.c, self.tied = c, tied
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(c.padded, c.hidden)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList()
        for _ in range(c.layers):
            layer = nn.Module()
            layer.self_attention = nn.Module()
            layer.self_attention.linear_qkv = nn.Linear(c.hidden, (c.heads + 2 * c.groups) * c.head_dim)
            layer.self_attention.linear_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
            layer.mlp = nn.Module()
            layer.mlp.linear_fc1 = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
            layer.mlp.linear_fc2 = nn.Linear(c.ffn, c.hidden, bias=False)
            self.decoder.layers.append(layer)
        self.decoder.final_layernorm = nn.LayerNorm(c.hidden, bias=False)
        if not tied:
            self.output_layer = nn.Linear(c.hidden, c.padded, bias=False)
        _randomize(self, seed)

    def forward(self, idx):
        c, qpg = self.c, self.c.heads // self.c.groups
        x = self.embedding.word_embeddings(idx)
        b, t, _ = x.shape
        for layer in self.decoder.layers:
            qkv = layer.self_attention.linear_qkv(x).view(b, t, c.groups, (qpg + 2) * c.head_dim)
            q, k, v = qkv.split([qpg * c.head_dim, c.head_dim, c.head_dim], dim=-1)
            y = _attend(q.reshape(b, t, c.heads, c.head_dim), k, v, qpg)
            x = x + layer.self_attention.linear_proj(y)
            gate, up = layer.mlp.linear_fc1(x).chunk(2, dim=-1)
            x = x + layer.mlp.linear_fc2(F.silu(gate) * up)
        x = self.decoder.final_layernorm(x)
        w = self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight
        return x @ w.t()


class PlainGPT(nn.Module):
    """The same network written plainly: separate q/k/v, gate/up/down, the true vocabulary."""

    def __init__(self, c: Cfg, seed=1, tied=False):
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList()
        for _ in range(c.layers):
            layer = nn.Module()
            layer.attn = nn.Module()
            layer.attn.q = nn.Linear(c.hidden, c.heads * c.head_dim)
            layer.attn.k = nn.Linear(c.hidden, c.groups * c.head_dim)
            layer.attn.v = nn.Linear(c.hidden, c.groups * c.head_dim)
            layer.attn.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
            layer.mlp = nn.Module()
            for n, (i, o) in {"gate": (c.hidden, c.ffn), "up": (c.hidden, c.ffn), "down": (c.ffn, c.hidden)}.items():
                setattr(layer.mlp, n, nn.Linear(i, o, bias=False))
            self.layers.append(layer)
        self.norm = nn.LayerNorm(c.hidden, bias=False)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        _randomize(self, seed)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        c = self.c
        x = self.tok(idx)
        b, t, _ = x.shape
        for layer in self.layers:
            a = layer.attn
            q = a.q(x).view(b, t, c.heads, c.head_dim)
            k, v = a.k(x).view(b, t, c.groups, c.head_dim), a.v(x).view(b, t, c.groups, c.head_dim)
            x = x + a.o(_attend(q, k, v, c.heads // c.groups))
            x = x + layer.mlp.down(F.silu(layer.mlp.gate(x)) * layer.mlp.up(x))
        return self.head(self.norm(x))


def megatron_to_plain(c: Cfg, tied=False) -> list:
    geo = dict(num_heads=c.heads, head_dim=c.head_dim, num_groups=c.groups)
    attn = "decoder.layers.*.self_attention"
    out = [
        SplitQKV(f"{attn}.linear_qkv.weight", into=("layers.*.attn.q.weight", "layers.*.attn.k.weight",
                                                     "layers.*.attn.v.weight"), **geo),
        SplitQKV(f"{attn}.linear_qkv.bias", into=("layers.*.attn.q.bias", "layers.*.attn.k.bias",
                                                   "layers.*.attn.v.bias"), **geo),
        SplitFused("decoder.layers.*.mlp.linear_fc1.weight", into=("layers.*.mlp.gate.weight", "layers.*.mlp.up.weight")),
        # a regex works on full names, a dict on parameter names (with "*")
        Rename.regex(r"decoder\.layers\.(\d+)\.self_attention\.linear_proj", r"layers.\1.attn.o"),
        Rename({"decoder.layers.*.mlp.linear_fc2.weight": "layers.*.mlp.down.weight",
                "decoder.final_layernorm.weight": "norm.weight",
                "embedding.word_embeddings.weight": "tok.weight",
                **({} if tied else {"output_layer.weight": "head.weight"})}),
        ResizeVocab("tok.weight", rows=c.vocab),
    ]
    out.append(Alias("model/head.weight", source="model/tok.weight") if tied else ResizeVocab("head.weight", c.vocab))
    return out


def plain_to_megatron(c: Cfg) -> list:
    geo = dict(num_heads=c.heads, head_dim=c.head_dim, num_groups=c.groups)
    return [
        FuseQKV(("layers.*.attn.q.weight", "layers.*.attn.k.weight", "layers.*.attn.v.weight"),
                into="decoder.layers.*.self_attention.linear_qkv.weight", **geo),
        FuseQKV(("layers.*.attn.q.bias", "layers.*.attn.k.bias", "layers.*.attn.v.bias"),
                into="decoder.layers.*.self_attention.linear_qkv.bias", **geo),
        Fuse(("layers.*.mlp.gate.weight", "layers.*.mlp.up.weight"), into="decoder.layers.*.mlp.linear_fc1.weight"),
        Rename({"layers.*.attn.o.weight": "decoder.layers.*.self_attention.linear_proj.weight",
                "layers.*.mlp.down.weight": "decoder.layers.*.mlp.linear_fc2.weight",
                "norm.weight": "decoder.final_layernorm.weight",
                "tok.weight": "embedding.word_embeddings.weight", "head.weight": "output_layer.weight"}),
        ResizeVocab("embedding.word_embeddings.weight", rows=c.padded),
        ResizeVocab("output_layer.weight", rows=c.padded),
    ]


def plain_reference(m: MegatronStyleGPT) -> dict[str, torch.Tensor]:
    """The plain model's state dict that `m` converts to, by torch indexing."""
    c, sd = m.c, {k: v.detach() for k, v in m.state_dict().items()}
    out = {"tok.weight": sd["embedding.word_embeddings.weight"][:c.vocab],
           "norm.weight": sd["decoder.final_layernorm.weight"],
           "head.weight": (sd["embedding.word_embeddings.weight"] if m.tied else sd["output_layer.weight"])[:c.vocab]}
    for i in range(c.layers):
        p = f"decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            q, k, v = qkv_reference(sd[f"{p}self_attention.linear_qkv.{suffix}"], c.heads, c.head_dim, c.groups,
                                    "grouped")
            out.update({f"layers.{i}.attn.q.{suffix}": q, f"layers.{i}.attn.k.{suffix}": k,
                        f"layers.{i}.attn.v.{suffix}": v})
        out[f"layers.{i}.attn.o.weight"] = sd[f"{p}self_attention.linear_proj.weight"]
        fc1 = sd[f"{p}mlp.linear_fc1.weight"]
        out[f"layers.{i}.mlp.gate.weight"], out[f"layers.{i}.mlp.up.weight"] = fc1[:c.ffn], fc1[c.ffn:]
        out[f"layers.{i}.mlp.down.weight"] = sd[f"{p}mlp.linear_fc2.weight"]
    return out


def megatron_reference(p: PlainGPT, padded: int) -> dict[str, torch.Tensor]:
    """The Megatron-style state dict that `p` converts to (pad rows zero), by torch indexing."""
    c, sd = p.c, {k: v.detach() for k, v in p.state_dict().items()}

    def pad(t):
        return torch.cat([t, torch.zeros(padded - t.shape[0], *t.shape[1:])])
    out = {"embedding.word_embeddings.weight": pad(sd["tok.weight"]), "output_layer.weight": pad(sd["head.weight"]),
           "decoder.final_layernorm.weight": sd["norm.weight"]}
    for i in range(c.layers):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        dst = f"decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            out[f"{dst}self_attention.linear_qkv.{suffix}"] = qkv_fuse_reference(
                sd[f"{a}q.{suffix}"], sd[f"{a}k.{suffix}"], sd[f"{a}v.{suffix}"], c.heads, c.head_dim, c.groups,
                "grouped")
        out[f"{dst}self_attention.linear_proj.weight"] = sd[f"{a}o.weight"]
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([sd[f"{m}gate.weight"], sd[f"{m}up.weight"]])
        out[f"{dst}mlp.linear_fc2.weight"] = sd[f"{m}down.weight"]
    return out


def f64(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).double()


def assert_state_equal(got: dict, expect: dict):
    assert set(got) == set(expect), set(got) ^ set(expect)
    for k, v in expect.items():
        assert torch.equal(got[k], v), k


def test_megatron_style_checkpoint_into_plain_module_and_back(tmp_path):
    c = Cfg()
    idx = torch.randint(0, c.vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    for tied in (False, True):
        meg = MegatronStyleGPT(c, seed=10, tied=tied)
        omnickpt.save(str(tmp_path / f"meg{tied}"), {"model": meg}).wait()
        plain = PlainGPT(c, seed=11, tied=tied)
        omnickpt.load(str(tmp_path / f"meg{tied}"), {"model": plain}, transforms=megatron_to_plain(c, tied))
        assert_state_equal({k: v.detach() for k, v in plain.state_dict().items()}, plain_reference(meg))
        # the plain network computes what the fused one computes on the true vocabulary (in
        # float64, so that the different summation order of fused and split matmuls is noise)
        with torch.no_grad():
            torch.testing.assert_close(f64(plain)(idx), f64(meg)(idx)[..., :c.vocab])

    # plain -> Megatron-style: fused QKV and fc1 assembled, vocabulary padded with zero rows
    plain = PlainGPT(c, seed=12)
    omnickpt.save(str(tmp_path / "plain"), {"model": plain}).wait()
    meg = MegatronStyleGPT(c, seed=13)
    omnickpt.load(str(tmp_path / "plain"), {"model": meg}, transforms=plain_to_megatron(c))
    assert_state_equal({k: v.detach() for k, v in meg.state_dict().items()}, megatron_reference(plain, c.padded))
    with torch.no_grad():
        torch.testing.assert_close(f64(meg)(idx)[..., :c.vocab], f64(plain)(idx))


# ---------------------------------------------------------------------- manifest-level contract
def test_transforms_are_pure_keep_whole_box_checksums_and_still_catch_corruption(tmp_path):
    fc1 = rand(8, 3, seed=20)
    save_bag(tmp_path / "c", {"fc1.weight": fc1, "tok.weight": rand(5, 3, seed=21)})
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(tmp_path / "c")))
    before = manifest.encode()
    ts = [SplitFused("fc1.weight", into=["gate.weight", "up.weight"]), Rename({"tok.weight": "emb.weight"}),
          Alias("model/head.weight", source="model/emb.weight"), ResizeVocab("model/head.weight", rows=7),
          SplitFused("model/emb.weight", into=["model/e1", "model/e2"], sizes=[2, 1], dim=1)]
    out = manifest
    for t in ts:
        out = t.apply(out)
    assert manifest.encode() == before, "a transform changed the manifest it was given"
    assert sorted(out.tensors) == ["model/e1", "model/e2", "model/gate.weight", "model/head.weight", "model/up.weight"]
    saved_tok = manifest.tensors["model/tok.weight"].boxes[0]
    gate = out.tensors["model/gate.weight"].boxes[0]
    # a range of leading rows is a contiguous byte range of the stored box, no checksum
    saved_fc1 = manifest.tensors["model/fc1.weight"].boxes[0]
    up = out.tensors["model/up.weight"].boxes[0]
    assert (gate.offset, gate.nbytes, gate.checksum) == (saved_fc1.offset, 4 * 3 * 4, None)
    assert (up.offset, up.lengths) == (saved_fc1.offset + 4 * 3 * 4, (4, 3)) and not isinstance(up, WindowBox)
    # a renamed/aliased whole box keeps its checksum; the pad rows are a zero-fill box
    head = out.tensors["model/head.weight"]
    assert head.shape == (7, 3) and head.boxes[0] == saved_tok and head.boxes[0].checksum is not None
    assert head.boxes[1].file == ZERO_FILL and head.boxes[1].offsets == (5, 0)
    assert isinstance(out.tensors["model/e1"].boxes[0], WindowBox)

    # the kept checksum is still verified: corrupt tok.weight's bytes and load it renamed
    data = glob.glob(str(tmp_path / "c" / "data" / "*.bin"))[0]
    with open(data, "r+b") as fh:
        fh.seek(saved_tok.offset)
        fh.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptCheckpointError, match="tok|emb"):
        load_bag(tmp_path / "c", {"emb.weight": (5, 3)}, [Rename({"tok.weight": "emb.weight"}), Drop("fc1.weight")])


def test_optimizer_state_follows_parameter_names_unless_the_name_is_full(tmp_path):
    model = bag({"fc1.weight": rand(8, 3, seed=22)})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.fc1.weight.sum().backward()
    opt.step()
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": opt}).wait()
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(tmp_path / "c")))
    out = SplitFused("fc1.weight", into=["gate.weight", "up.weight"]).apply(manifest)
    assert {n for n in out.tensors if "exp_avg" in n} == {
        "optimizer/state/gate.weight/exp_avg", "optimizer/state/up.weight/exp_avg",
        "optimizer/state/gate.weight/exp_avg_sq", "optimizer/state/up.weight/exp_avg_sq"}
    assert out.tensors["optimizer/state/up.weight/exp_avg"].shape == (4, 3)
    # the 0-dim step goes to both parts
    assert out.tensors["optimizer/state/gate.weight/step"] == manifest.tensors["optimizer/state/fc1.weight/step"]
    # unstacking experts copies the step to every expert, however many the stacked tensor has
    moe = bag({"moe.w": rand(3, 2, 2, seed=23)})
    moe_opt = torch.optim.Adam(moe.parameters(), lr=0.1)
    moe.moe.w.sum().backward()
    moe_opt.step()
    omnickpt.save(str(tmp_path / "moe"), {"model": moe, "optimizer": moe_opt}).wait()
    per = UnstackExperts("moe.w", into="moe.{e}.w").apply(
        omnickpt.read_manifest(omnickpt.api.storage_for(str(tmp_path / "moe"))))
    assert sorted(n for n in per.tensors if n.endswith("/step")) == [f"optimizer/state/moe.{e}.w/step" for e in range(3)]
    assert per.tensors["optimizer/state/moe.2.w/exp_avg"].shape == (2, 2)
    exact = SplitFused("model/fc1.weight", into=["model/gate.weight", "model/up.weight"]).apply(manifest)
    assert "optimizer/state/fc1.weight/exp_avg" in exact.tensors and "model/up.weight" in exact.tensors
    # the moments land where torch indexing says
    target = {"m": bag({"gate.weight": torch.zeros(4, 3), "up.weight": torch.zeros(4, 3)})}
    omnickpt.load(str(tmp_path / "c"), target, strict=False,
                  transforms=[SplitFused("fc1.weight", into=["gate.weight", "up.weight"]),
                              Rename({"optimizer/state/up.weight/exp_avg": "m/up.weight",
                                      "optimizer/state/gate.weight/exp_avg": "m/gate.weight"})])
    exp_avg = opt.state[model.fc1.weight]["exp_avg"]
    assert torch.equal(target["m"].up.weight.detach(), exp_avg[4:])
    assert torch.equal(target["m"].gate.weight.detach(), exp_avg[:4])


def test_errors_name_the_transform_and_the_tensor(tmp_path):
    save_bag(tmp_path / "c", {"fc1.weight": rand(8, 3), "qkv.weight": rand(12, 3), "a.w": rand(2, 2),
                              "b.w": rand(2, 2)})
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(tmp_path / "c")))
    cases = [
        (SplitFused("fc2.weight", into=["x", "y"]), r"no tensor matches 'fc2.weight'.*model/fc1.weight"),
        (SplitFused("fc1.weight", into=["x", "y"], sizes=[3, 3]), r"'model/fc1.weight'.*sizes \[3, 3\]"),
        (SplitFused("fc1.weight", into=["x", "y", "z"]), r"does not split into 3 equal parts"),
        (SplitQKV("qkv.weight", into=("q", "k", "v"), num_heads=4, head_dim=2), r"12 rows.*make 24"),
        (Alias("model/a.w", source="model/b.w"), r"'model/a.w' is already a tensor"),
        (Rename({"a.w": "c.w", "b.w": "c.w"}), r"both 'model/a.w' and 'model/b.w' would be renamed to 'model/c.w'"),
        (Rename(lambda name: None), r"renames no tensor"),
        (StackExperts("e.{e}.w", into="e.w", num_experts=2), r"no tensor matches 'e.0.w'"),
        (Fuse(["a.w", "fc1.weight"], into="f", dim=1), r"cannot concatenate shapes"),
    ]
    for t, pattern in cases:
        with pytest.raises(MismatchError, match=pattern):
            t.apply(manifest)
    # a load whose transforms leave the target uncovered says what is missing
    with pytest.raises(MismatchError, match="gate.weight: missing from the checkpoint"):
        load_bag(tmp_path / "c", {"gate.weight": (4, 3)}, [Drop("fc1.weight", "qkv.weight", "a.w", "b.w")])


# ---------------------------------------------------------------------- two ranks
TWO_RANK_CFG = dict(vocab=29, padded=32, hidden=10, heads=9, groups=3, head_dim=2, ffn=5, layers=1)


class TwoLinears(nn.Module):
    """a: row-wise under TP (boxes split along dim 1), b: column-wise (uneven rows 7 + 6), and a
    stacked expert weight [3, 4, 5]."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(14, 6, bias=False)
        self.b = nn.Linear(5, 13)
        self.experts = nn.Parameter(torch.empty(3, 4, 5))
        _randomize(self, 30)


def _two_rank_scenarios(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = init_device_mesh("cpu", (world_size,))
    c = Cfg(**TWO_RANK_CFG)
    out = {}

    def full(module):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in module.state_dict().items()}

    # 1. Megatron-style model saved from FSDP2 (every fused tensor's rows split over 2 boxes,
    #    mid-head for linear_qkv) -> plain model under FSDP2, and a tied one under DDP with
    #    zero-redundancy reads (aliases and pad fills must not collide in the forwarding plan).
    meg = fully_shard(MegatronStyleGPT(c, seed=40), mesh=mesh)
    omnickpt.save(f"{root}/meg", {"model": meg}).wait()
    plain = fully_shard(PlainGPT(c, seed=41), mesh=mesh)
    omnickpt.load(f"{root}/meg", {"model": plain}, transforms=megatron_to_plain(c))
    out["plain_fsdp2"] = full(plain)
    meg_tied = fully_shard(MegatronStyleGPT(c, seed=42, tied=True), mesh=mesh)
    omnickpt.save(f"{root}/meg_tied", {"model": meg_tied}).wait()
    tied = PlainGPT(c, seed=43, tied=True)
    omnickpt.load(f"{root}/meg_tied", {"model": DDP(tied)}, transforms=megatron_to_plain(c, tied=True),
                  dedup_reads=True)
    out["plain_tied_ddp"] = full(tied)

    # 2. plain saved from FSDP2 -> Megatron-style under FSDP2 and under DDP with dedup reads
    src = fully_shard(PlainGPT(c, seed=44), mesh=mesh)
    omnickpt.save(f"{root}/plain", {"model": src}).wait()
    m2 = fully_shard(MegatronStyleGPT(c, seed=45), mesh=mesh)
    omnickpt.load(f"{root}/plain", {"model": m2}, transforms=plain_to_megatron(c))
    out["meg_fsdp2"] = full(m2)
    m3 = MegatronStyleGPT(c, seed=46)
    omnickpt.load(f"{root}/plain", {"model": DDP(m3)}, transforms=plain_to_megatron(c), dedup_reads=True)
    out["meg_ddp"] = full(m3)

    # 3. tensor parallel source: a split along dim 1 across dim-1 boxes (strided windows), rows
    #    across uneven dim-0 boxes, padding and experts; loaded into a TP target whose boxes differ.
    from torch.distributed.tensor import Shard, distribute_tensor
    tp = parallelize_module(TwoLinears(), mesh, {"a": RowwiseParallel(), "b": ColwiseParallel()})
    tp.experts = nn.Parameter(distribute_tensor(tp.experts.detach(), mesh, [Shard(0)]))   # rows 2 + 1
    omnickpt.save(f"{root}/tp", {"model": tp}).wait()
    sharded = nn.Module()   # every target tensor row-sharded: boxes unlike the saved ones
    shapes = {"a1": (6, 5), "a2": (6, 9), "b_weight": (16, 5), "b_bias": (16,), **{f"x{e}": (4, 5) for e in range(3)}}
    for name, shape in shapes.items():
        sharded.register_parameter(name, nn.Parameter(distribute_tensor(torch.full(shape, 7.0), mesh, [Shard(0)])))
    omnickpt.load(f"{root}/tp", {"model": sharded},
                  transforms=[SplitFused("model/a.weight", into=["model/a1", "model/a2"], sizes=[5, 9], dim=1),
                              Rename({"b.weight": "b_weight", "b.bias": "b_bias"}),
                              ResizeVocab("b_weight", rows=16), ResizeVocab("b_bias", rows=16),
                              UnstackExperts("model/experts", into="model/x{e}")])
    out["tp"] = full(sharded)
    return out


def test_two_ranks_fsdp2_tp_sources_into_sharded_and_replicated_targets(tmp_path):
    res = run_ranks(2, _two_rank_scenarios, str(tmp_path))
    c = Cfg(**TWO_RANK_CFG)
    expect_plain = plain_reference(MegatronStyleGPT(c, seed=40))
    expect_tied = plain_reference(MegatronStyleGPT(c, seed=42, tied=True))
    expect_meg = megatron_reference(PlainGPT(c, seed=44), c.padded)
    lin = TwoLinears()
    a, bw, bb = lin.a.weight.detach(), lin.b.weight.detach(), lin.b.bias.detach()
    expect_tp = {"a1": a[:, :5], "a2": a[:, 5:], "b_weight": torch.cat([bw, torch.zeros(3, 5)]),
                 "b_bias": torch.cat([bb, torch.zeros(3)]), **{f"x{e}": lin.experts.detach()[e] for e in range(3)}}
    for r in res:
        assert_state_equal(r["plain_fsdp2"], expect_plain)
        assert_state_equal(r["plain_tied_ddp"], expect_tied)
        assert_state_equal(r["meg_fsdp2"], expect_meg)
        assert_state_equal(r["meg_ddp"], expect_meg)
        assert_state_equal(r["tp"], expect_tp)
    # the 2-rank checkpoints (partial boxes) also load into one plain process
    plain = PlainGPT(c, seed=50)
    omnickpt.load(str(tmp_path / "meg"), {"model": plain}, transforms=megatron_to_plain(c))
    assert_state_equal({k: v.detach() for k, v in plain.state_dict().items()}, expect_plain)
    meg = MegatronStyleGPT(c, seed=51)
    omnickpt.load(str(tmp_path / "plain"), {"model": meg}, transforms=plain_to_megatron(c))
    assert_state_equal({k: v.detach() for k, v in meg.state_dict().items()}, expect_meg)
    assert len(os.listdir(tmp_path / "meg" / "data")) == 2     # really saved from two ranks


def test_zero_fill_items_are_made_locally_not_forwarded():
    from omnickpt.planner.load_plan import assign_readers
    # two replicas want the same pad rows and the same stored rows: only the stored ones are
    # read once and forwarded; each rank writes its own zeros
    fill = ("model/tok.weight", ZERO_FILL, 0, (29, 0), (3, 4))
    real = ("model/tok.weight", 0, 128, (0, 0), (29, 4))
    plan = assign_readers([[(fill, 48), (real, 464)], [(fill, 48), (real, 464)]])
    assert [key for key, _, _ in plan] == [real]


def test_an_optimizer_loads_across_a_split_and_rename(tmp_path):
    # A fused fc1 trained with Adam resumes as separate gate/up parameters: the moments follow the
    # split, the saved param group (naming fc1) matches the target's group by position.
    model = bag({"fc1.weight": rand(8, 3, seed=31)})
    opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.9))
    model.fc1.weight.square().sum().backward()
    opt.step()
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": opt}).wait()
    target = bag({"gate_proj.weight": torch.zeros(4, 3), "up_proj.weight": torch.zeros(4, 3)})
    topt = torch.optim.Adam(target.parameters(), lr=1.0)
    omnickpt.load(str(tmp_path / "c"), {"model": target, "optimizer": topt},
                  transforms=[SplitFused("fc1.weight", into=["gate.weight", "up.weight"]),
                              Rename({"gate.weight": "gate_proj.weight", "up.weight": "up_proj.weight"})])
    saved = opt.state[model.fc1.weight]
    for part, rows in (("gate_proj", slice(0, 4)), ("up_proj", slice(4, 8))):
        st = topt.state[dict(target.named_parameters())[f"{part}.weight"]]
        assert torch.equal(st["exp_avg"], saved["exp_avg"][rows]) and torch.equal(st["exp_avg_sq"], saved["exp_avg_sq"][rows])
        assert torch.equal(st["step"], saved["step"])
    assert topt.param_groups[0]["lr"] == 0.05 and topt.param_groups[0]["betas"] == (0.8, 0.9)


# ---------------------------------------------------------------------- lossy records follow the transforms
def _quantized_checkpoint(path, tensors: dict[str, torch.Tensor]):
    """`tensors` saved with an Adam state after one step, its moments quantized (int8)."""
    model = bag(tensors)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    omnickpt.save(str(path), {"model": model, "optimizer": opt}, quantize_optimizer="int8").wait()
    return model, opt, omnickpt.read_manifest(omnickpt.api.storage_for(str(path)))


def test_a_load_through_a_split_and_rename_reports_the_quantized_moments_under_the_new_names(tmp_path):
    _, _, manifest = _quantized_checkpoint(tmp_path / "q", {"fc1.weight": rand(128, 16, seed=41)})
    target = bag({"gate_proj.weight": torch.zeros(64, 16), "up_proj.weight": torch.zeros(64, 16)})
    topt = torch.optim.Adam(target.parameters(), lr=0.1)
    result = omnickpt.load(str(tmp_path / "q"), {"model": target, "optimizer": topt},
                           transforms=[SplitFused("fc1.weight", into=["gate.weight", "up.weight"]),
                                       Rename({"gate.weight": "gate_proj.weight", "up.weight": "up_proj.weight"})])
    # every part of a quantized tensor is as lossy as the whole: the split parts carry its record
    assert result.report["quantized"] == {
        f"optimizer/state/{part}_proj.weight/{moment}": manifest.quantized[f"optimizer/state/fc1.weight/{moment}"]
        for part in ("gate", "up") for moment in ("exp_avg", "exp_avg_sq")}


def test_a_fused_tensor_carries_the_largest_error_of_its_parts_and_a_dropped_one_no_record(tmp_path):
    _, _, manifest = _quantized_checkpoint(tmp_path / "q", {"gate.weight": rand(64, 16, seed=42),
                                                            "up.weight": 100 * rand(64, 16, seed=43),
                                                            "tok.weight": rand(30, 16, seed=44)})
    q = manifest.quantized
    out = manifest
    for t in (Fuse(["gate.weight", "up.weight"], into="fc1.weight"), ResizeVocab("tok.weight", rows=32),
              Alias("head.weight", "tok.weight"), Drop("optimizer/state/tok.weight/exp_avg_sq")):
        out = t.apply(out)
    for moment in ("exp_avg", "exp_avg_sq"):
        parts = [q[f"optimizer/state/{p}.weight/{moment}"]["max_error"] for p in ("gate", "up")]
        assert parts[0] != parts[1]
        assert out.quantized[f"optimizer/state/fc1.weight/{moment}"] == {"scheme": "int8", "max_error": max(parts)}
    tok = q["optimizer/state/tok.weight/exp_avg"]
    assert out.quantized["optimizer/state/tok.weight/exp_avg"] == tok        # padded: still lossy
    assert out.quantized["optimizer/state/head.weight/exp_avg"] == tok       # an alias reads the same bytes
    assert set(out.quantized) == {"optimizer/state/fc1.weight/exp_avg", "optimizer/state/fc1.weight/exp_avg_sq",
                                  "optimizer/state/tok.weight/exp_avg", "optimizer/state/head.weight/exp_avg",
                                  "optimizer/state/head.weight/exp_avg_sq"}
    assert manifest.quantized == q and "optimizer/state/fc1.weight/exp_avg" not in q   # the input is untouched
