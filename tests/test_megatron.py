"""Megatron-core models (the real package, 0.12.x) saved at one tensor/pipeline-parallel split and
loaded at another: TP2xPP1 -> TP1xPP2 -> TP1xPP1 -> TP1xPP2 -> TP2xPP1, fused QKV (GQA), SwiGLU
fc1 (a ShardedTensorFactory under TP), vocabularies padded differently per split, Adam state;
into a plain PyTorch module through a name map; and a resumed training run whose losses continue.

Expected values never come from omnickpt or from Megatron's sharded_state_dict: `assemble` puts
each split's *local* state dicts together by Megatron's documented layout (column-parallel
weights concatenated on dim 0, row-parallel on dim 1, fc1 as [gate; up] of the TP-local halves,
layers numbered by pipeline stage), so a wrong box anywhere shows up as a mismatch.

Megatron on CPU: the local (non-Transformer-Engine) layer spec with a small CPU core attention
(Megatron's DotProductAttention takes a CUDA buffer), learned absolute positions (its rotary
embedding moves to CUDA), no fused kernels, `use_cpu_initialization`, dropout 0 with the RNG
tracker that needs no CUDA, and a hand-written one-microbatch pipeline schedule (Megatron's p2p
schedules allocate CUDA buffers). Megatron's global parallel state is re-initialised in place
to change the split, so one 2-rank launch covers every split.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import omnickpt
from dist import run_ranks
from omnickpt.errors import MismatchError
from omnickpt.transforms import Rename, ResizeVocab, SplitFused, SplitQKV, UnstackExperts

try:
    import megatron.core  # noqa: F401
    from megatron.core.transformer.module import MegatronModule
except Exception as e:  # ImportError, or a CUDA extension failing to build on import (0.15+)
    pytest.skip(f"megatron-core cannot be imported ({type(e).__name__}: {e}); install the version that runs on "
                "CPU: pip install megatron-core==0.12.2 --no-deps", allow_module_level=True)

LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ, BATCH = 4, 16, 4, 2, 24, 8, 2
HEAD_DIM = HIDDEN // HEADS
VOCAB, DIVISIBLE = 50, 8   # padded to 64 at TP2 (a multiple of 8*2) and to 56 at TP1
EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"


def padded(vocab: int, tp: int) -> int:
    """Megatron-LM's padding: the vocabulary rounded up to a multiple of divisible_by * TP."""
    step = DIVISIBLE * tp
    return (vocab + step - 1) // step * step


# ---------------------------------------------------------------------- Megatron on CPU
class CPUCoreAttention(nn.Module):
    """Causal GQA attention on [s, b, heads, d] inputs, what DotProductAttention computes."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, **_):
        super().__init__()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
        b, n, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def build(tp: int, pp: int, vocab: int, seed: int):
    """A GPTModel at TP x PP on this rank (Megatron's parallel state re-initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)
    # Dropout is 0; the inference tracker's fork() needs no CUDA generator.
    initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), tokens[:, 1:]


def train_step(model, opt, step: int) -> float:
    """One step on the global batch (every data-parallel replica sees all of it, so replicas stay
    equal with no gradient all-reduce); a one-microbatch schedule across pipeline stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ids, pos, labels = batch(step)
    opt.zero_grad()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    shape = (SEQ, BATCH, HIDDEN)
    if first and last:
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
    elif first:
        hidden = model(ids, pos, None)
        dist.send(hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty(shape)
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        hidden.backward(grad)
        loss = torch.zeros(())
    else:
        received = torch.empty(shape)
        dist.recv(received, ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_()
        model.set_input_tensor(received)
        loss = model(None, None, None, labels=labels).mean()
        loss.backward()
        dist.send(received.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
    opt.step()
    last_rank = ps.get_pipeline_model_parallel_last_rank()
    loss = loss.detach().clone()
    dist.broadcast(loss, last_rank, group=ps.get_pipeline_model_parallel_group())
    return float(loss)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def megatron_fp32_optimizer(model):
    """Megatron's FP32Optimizer over the same Adam. Its __init__ only adds a loss-scale tensor that
    it allocates on CUDA; sharded_state_dict, load_state_dict and step are Megatron's own code."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CPUFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer, config, init_state_fn):
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0])
            self.is_stub_optimizer = False

    def init_state_fn(opt, config=None):   # what megatron.core.optimizer gives Adam
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    return CPUFP32Optimizer(adam(model), OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), init_state_fn)


def local_state(model, opt) -> dict:
    """This rank's local tensors (module names) and Adam state, with where they sit in the split."""
    from megatron.core import parallel_state as ps
    inner = getattr(opt, "optimizer", opt)
    by_param = {id(p): n for n, p in model.named_parameters()}
    optim = {by_param[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in inner.state.items()}
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "model": {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
            "optim": optim}


# ---------------------------------------------------------------------- the unsharded reference
def _merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if "linear_fc1" in name:      # each TP rank holds [gate_r; up_r]
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if any(k in name for k in ("linear_qkv", "word_embeddings", "output_layer")):
        return torch.cat(parts)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(parts, dim=1)
    for p in parts[1:]:           # replicated across TP ranks
        assert torch.equal(p, parts[0]), name
    return parts[0]


def assemble(pieces: list[dict], what: str, state_key: str | None = None) -> dict[str, torch.Tensor]:
    """Full tensors, TP1xPP1 module names, from every rank's local state."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for piece in pieces:
        per_stage = LAYERS // piece["pp"]
        for name, value in piece[what].items():
            t = value if state_key is None else value.get(state_key)
            if not isinstance(t, torch.Tensor) or not t.dim():
                continue
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
            if m:
                name = f"decoder.layers.{int(m[1]) + piece['pp_rank'] * per_stage}.{m[2]}"
            by_name.setdefault(name, {})[piece["tp_rank"]] = t
    return {n: _merge(n, [parts[r] for r in sorted(parts)]) for n, parts in by_name.items()}


def assert_same(got: dict, want: dict, what: str) -> None:
    """Bit-for-bit equality; vocabulary tensors on the true vocabulary's rows (the padding differs)."""
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:6]}"
    for name in want:
        g, w = got[name], want[name]
        if name.endswith((EMB, OUT)):
            g, w = g[:VOCAB], w[:VOCAB]
        assert g.shape == w.shape and torch.equal(g, w), f"{what}: {name} differs"


# ---------------------------------------------------------------------- plain PyTorch counterpart
class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, GROUPS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, GROUPS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.gate, self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (f(h).view(b, s, GROUPS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // GROUPS, 1)
                for f in (self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList(PlainBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


# Megatron's stacked layer tensors [LAYERS, ...] (a prepended layer axis), by sharded key suffix.
STACKED = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
           "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
           "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
           "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]


def megatron_to_plain() -> list:
    """The name map: unstack the layer axis, split fused QKV and SwiGLU fc1, rename, unpad."""
    out: list = [UnstackExperts(f"decoder.layers.{s}", into=f"decoder.layers.{{e}}.{s}") for s in STACKED]
    for kind in ("weight", "bias"):
        out.append(SplitQKV(f"decoder.layers.*.self_attention.linear_qkv.{kind}",
                            into=tuple(f"layers.*.{p}.{kind}" for p in "qkv"),
                            num_heads=HEADS, head_dim=HEAD_DIM, num_groups=GROUPS))
        out.append(SplitFused(f"decoder.layers.*.mlp.linear_fc1.{kind}", into=(f"layers.*.gate.{kind}",
                                                                               f"layers.*.up.{kind}")))
    names = {"self_attention.linear_qkv.layer_norm_weight": "ln1.weight",
             "self_attention.linear_qkv.layer_norm_bias": "ln1.bias",
             "self_attention.linear_proj.weight": "o.weight", "self_attention.linear_proj.bias": "o.bias",
             "mlp.linear_fc1.layer_norm_weight": "ln2.weight", "mlp.linear_fc1.layer_norm_bias": "ln2.bias",
             "mlp.linear_fc2.weight": "down.weight", "mlp.linear_fc2.bias": "down.bias"}
    mapping = {f"decoder.layers.*.{k}": f"layers.*.{v}" for k, v in names.items()}
    mapping.update({EMB: "tok.weight", "embedding.position_embeddings.weight": "pos.weight",
                    "decoder.final_layernorm.weight": "norm.weight", "decoder.final_layernorm.bias": "norm.bias",
                    OUT: "head.weight"})
    return out + [Rename(mapping), ResizeVocab("tok.weight", rows=VOCAB), ResizeVocab("head.weight", rows=VOCAB)]


def plain_expected(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain module's tensors from the TP1xPP1 Megatron tensors, by plain torch indexing."""
    q_per_group = HEADS // GROUPS * HEAD_DIM
    out = {"tok.weight": full[EMB][:VOCAB], "pos.weight": full["embedding.position_embeddings.weight"],
           "norm.weight": full["decoder.final_layernorm.weight"], "norm.bias": full["decoder.final_layernorm.bias"],
           "head.weight": full[OUT][:VOCAB]}
    for i in range(LAYERS):
        m = f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = full[f"{m}self_attention.linear_qkv.{kind}"].view(GROUPS, q_per_group + 2 * HEAD_DIM, -1)
            out[f"layers.{i}.q.{kind}"] = qkv[:, :q_per_group].reshape(HEADS * HEAD_DIM, -1).squeeze(-1)
            out[f"layers.{i}.k.{kind}"] = qkv[:, q_per_group:q_per_group + HEAD_DIM].reshape(GROUPS * HEAD_DIM, -1).squeeze(-1)
            out[f"layers.{i}.v.{kind}"] = qkv[:, q_per_group + HEAD_DIM:].reshape(GROUPS * HEAD_DIM, -1).squeeze(-1)
            gate, up = full[f"{m}mlp.linear_fc1.{kind}"].chunk(2)
            out[f"layers.{i}.gate.{kind}"], out[f"layers.{i}.up.{kind}"] = gate, up
            out[f"layers.{i}.o.{kind}"] = full[f"{m}self_attention.linear_proj.{kind}"]
            out[f"layers.{i}.down.{kind}"] = full[f"{m}mlp.linear_fc2.{kind}"]
            out[f"layers.{i}.ln1.{kind}"] = full[f"{m}input_layernorm.{kind}"]
            out[f"layers.{i}.ln2.{kind}"] = full[f"{m}pre_mlp_layernorm.{kind}"]
    return out


# ---------------------------------------------------------------------- TP/PP changes
def _reshard_chain(rank, world, root):
    from megatron.core import parallel_state as ps
    out: dict = {}

    def save(name, model, opt):
        omnickpt.save(os.path.join(root, name), {"model": model, "optim": opt}).wait()

    def load(name, model, opt, transforms=()):
        omnickpt.load(os.path.join(root, name), {"model": model, "optim": opt}, transforms=transforms)

    # TP2xPP1, vocabulary padded to 64; one step so that Adam has state and step=1.
    model = build(2, 1, padded(VOCAB, 2), seed=0)
    opt = adam(model)
    train_step(model, opt, 0)
    save("tp2pp1", model, opt)
    out["tp2pp1"] = local_state(model, opt)

    # -> TP1xPP2 (padded to 56). Without ResizeVocab the shapes differ: a MismatchError naming
    # the vocabulary tensor on the stage that holds it, nothing half-loaded.
    model, opt = build(1, 2, padded(VOCAB, 1), seed=1), None
    opt = adam(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        load("tp2pp1", model, opt)
        out["unresized_error"] = None
    except Exception as e:
        out["unresized_error"] = f"{type(e).__name__}: {e}"
    out["unchanged_after_error"] = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    load("tp2pp1", model, opt, [ResizeVocab(EMB, rows=56), ResizeVocab(OUT, rows=56)])
    out["tp1pp2"] = local_state(model, opt)
    save("tp1pp2", model, opt)

    # -> TP1xPP1 (both ranks are data-parallel replicas): its logits for the plain module check.
    model = build(1, 1, padded(VOCAB, 1), seed=2)
    opt = adam(model)
    load("tp1pp2", model, opt)
    out["tp1pp1"] = local_state(model, opt)
    with torch.no_grad():
        ids, pos, _ = batch(99)
        out["logits"] = model(ids, pos, None)[..., :VOCAB].clone()
    save("tp1pp1", model, opt)

    # and back: -> TP1xPP2 -> TP2xPP1 (padded to 64 again: the rows 56..63 load as zeros)
    model = build(1, 2, padded(VOCAB, 1), seed=3)
    opt = adam(model)
    load("tp1pp1", model, opt)
    out["back_tp1pp2"] = local_state(model, opt)
    save("back_tp1pp2", model, opt)
    model = build(2, 1, padded(VOCAB, 2), seed=4)
    opt = adam(model)
    load("back_tp1pp2", model, opt, [ResizeVocab(EMB, rows=64), ResizeVocab(OUT, rows=64)])
    out["back_tp2pp1"] = local_state(model, opt)

    # The TP2 checkpoint into a plain PyTorch module through a name map.
    ps.destroy_model_parallel()
    torch.manual_seed(5)
    plain = PlainGPT()
    omnickpt.load(os.path.join(root, "tp2pp1"), {"model": plain}, transforms=megatron_to_plain())
    out["plain"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    with torch.no_grad():
        out["plain_logits"] = plain(batch(99)[0])
    return out


@pytest.fixture(scope="module")
def chain_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return root, run_ranks(2, _reshard_chain, str(root))


@pytest.fixture(scope="module")
def chain(chain_root):
    return chain_root[1]


def test_tp_pp_changes_keep_every_tensor_and_optimizer_state(chain):
    source = [r["tp2pp1"] for r in chain]
    want_model, want_steps = assemble(source, "model"), {}
    want_optim = {k: assemble(source, "optim", k) for k in ("exp_avg", "exp_avg_sq")}
    assert len(want_model) == 2 + LAYERS * 12 + 2 + 1   # embeddings, layers, final norm, head
    for split in ("tp1pp2", "tp1pp1", "back_tp1pp2", "back_tp2pp1"):
        pieces = [r[split] for r in chain]
        assert_same(assemble(pieces, "model"), want_model, split)
        for k in ("exp_avg", "exp_avg_sq"):
            assert_same(assemble(pieces, "optim", k), want_optim[k], f"{split} {k}")
        steps = {float(st["step"]) for p in pieces for st in p["optim"].values()}
        assert steps == {1.0}, f"{split}: Adam steps {steps}"
        want_steps[split] = steps
    # Padding: 64 rows at TP2, 56 at TP1; the rows TP1 never had come back as zeros.
    back = assemble([r["back_tp2pp1"] for r in chain], "model")
    mid = assemble([r["tp1pp1"] for r in chain], "model")
    for name in (EMB, OUT):
        assert mid[name].shape[0] == 56 and back[name].shape[0] == 64
        assert torch.equal(back[name][:56], want_model[name][:56])
        assert not back[name][56:].any()
        assert torch.equal(mid[name], want_model[name][:56])   # padding rows 50..55 carried over too


def test_every_element_stored_exactly_once(chain_root):
    """Replicas (TP-replicated norms at TP2, data-parallel copies at TP1xPP1, Megatron's replica_id
    != 0) are written once, and the pipeline stages' layer boxes tile the stacked tensors."""
    import math

    from omnickpt.format import Manifest
    root, _ = chain_root
    for name in ("tp2pp1", "tp1pp2", "tp1pp1", "back_tp1pp2"):
        manifest = Manifest.decode((root / name / "manifest.json").read_bytes())
        assert "model/decoder.layers.self_attention.linear_qkv.weight" in manifest.tensors
        for tname, entry in manifest.tensors.items():
            stored = sum(math.prod(b.lengths) for b in entry.boxes)
            assert stored == math.prod(entry.shape), f"{name}: {tname} stores {stored} of {math.prod(entry.shape)}"


def test_padding_mismatch_is_an_error_that_changes_nothing(chain):
    for r in chain:
        assert r["unresized_error"] is not None and "MismatchError" in r["unresized_error"]
        assert r["unchanged_after_error"]
    # each stage names the vocabulary tensor it holds: the first the embedding, the last the head
    assert EMB in chain[0]["unresized_error"] and OUT in chain[1]["unresized_error"]


def test_megatron_checkpoint_loads_into_plain_module_through_name_map(chain):
    want = plain_expected(assemble([r["tp2pp1"] for r in chain], "model"))
    for r in chain:
        assert_same(r["plain"], want, "plain")
    # The same numbers compute the same function: GQA grouping and gate-before-up are right.
    torch.testing.assert_close(chain[0]["plain_logits"], chain[0]["logits"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- resume
STEPS, SAVE_AT = 6, 3
RESUME_VOCAB = 64   # the same padding at TP1 and TP2: the padded logits take part in the loss


def _resume(rank, world, root):
    ckpt = os.path.join(root, "step3")
    out: dict = {}
    model = build(2, 1, RESUME_VOCAB, seed=0)
    opt = adam(model)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            omnickpt.save(ckpt, {"model": model, "optim": opt}).wait()
        losses.append(train_step(model, opt, step))
    out["tp2pp1"] = losses

    # TP1xPP2 with Megatron's own FP32Optimizer; its first resumed step is saved in turn.
    model = build(1, 2, RESUME_VOCAB, seed=1)
    opt = megatron_fp32_optimizer(model)
    omnickpt.load(ckpt, {"model": model, "optim": opt})
    losses = []
    for step in range(SAVE_AT, STEPS):
        losses.append(train_step(model, opt, step))
        if step == SAVE_AT:
            omnickpt.save(os.path.join(root, "step4"), {"model": model, "optim": opt}).wait()
    out["tp1pp2_megatron_optimizer"] = losses

    model = build(1, 1, RESUME_VOCAB, seed=2)
    opt = adam(model)
    omnickpt.load(ckpt, {"model": model, "optim": opt})
    out["tp1pp1"] = [train_step(model, opt, step) for step in range(SAVE_AT, STEPS)]

    # Control: the model alone with a fresh Adam does not continue the curve, so the equalities
    # above need the optimizer state.
    model = build(1, 1, RESUME_VOCAB, seed=2)
    opt = adam(model)
    omnickpt.load(ckpt, {"model": model})
    out["fresh_optimizer"] = [train_step(model, opt, step) for step in range(SAVE_AT, STEPS)]

    # the Megatron optimizer's checkpoint back into TP2 with a plain torch Adam
    model = build(2, 1, RESUME_VOCAB, seed=3)
    opt = adam(model)
    omnickpt.load(os.path.join(root, "step4"), {"model": model, "optim": opt})
    out["tp2pp1_from_megatron_optimizer"] = [train_step(model, opt, step) for step in range(SAVE_AT + 1, STEPS)]
    return out


def test_resume_in_another_split_continues_the_loss(tmp_path):
    results = run_ranks(2, _resume, str(tmp_path))
    for r in results:
        full = r["tp2pp1"]
        for name in ("tp1pp2_megatron_optimizer", "tp1pp1"):
            torch.testing.assert_close(r[name], full[SAVE_AT:], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(r["tp2pp1_from_megatron_optimizer"], full[SAVE_AT + 1:], rtol=1e-5, atol=1e-6)
        fresh = r["fresh_optimizer"]
        assert fresh[0] == pytest.approx(full[SAVE_AT], rel=1e-5)   # same weights
        assert all(abs(a - b) > 1e-3 for a, b in zip(fresh[1:], full[SAVE_AT + 1:]))


# ---------------------------------------------------------------------- flattened ranges, objects
class _Pieces(MegatronModule):
    """A module whose sharded_state_dict holds its weight as Megatron's distributed optimizer
    holds state: flattened ranges of the local tensor, under a prepended (layer) axis; plus an
    object shard. `pieces` None: the whole local tensor."""

    def __init__(self, config, layer: int, pieces, fill: float):
        super().__init__(config)
        self.layer, self.pieces = layer, pieces
        self.weight = nn.Parameter(torch.arange(30, dtype=torch.float32).view(5, 6) + 100 * layer
                                   if fill is None else torch.full((5, 6), fill))
        self.note = {"layer": layer} if fill is None else None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        offsets = [(0, self.layer, 3)]
        if self.pieces is None:
            out = {"weight": ShardedTensor.from_rank_offsets("w", self.weight, *offsets, prepend_axis_num=1)}
        else:
            flat = self.weight.data.view(-1)
            out = {f"weight.{i}": ShardedTensor.from_rank_offsets_flat(
                "w", flat[a:b], (5, 6), *offsets, prepend_axis_num=1, flattened_range=slice(a, b)) for i, (a, b) in enumerate(self.pieces)}
        # Megatron's object shards are modules' extra state (Transformer Engine's fp8 metadata)
        out["_extra_state"] = ShardedObject("note", self.note, (3,), (self.layer,), replica_id=0)
        return out

    def get_extra_state(self):
        return self.note

    def set_extra_state(self, state):
        self.note = state


def test_flattened_ranges_and_prepended_axes_reshard(tmp_path):
    """Ranges of a flattened local tensor (what the distributed optimizer saves) become boxes:
    saved as ranges [0, 7) + [7, 23) + [23, 30) of layer 1, loaded whole, and the other way."""
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=3, hidden_size=8, num_attention_heads=2)
    ranged = _Pieces(cfg, 1, [(0, 7), (7, 23), (23, 30)], fill=None)
    omnickpt.save(str(tmp_path / "ranges"), {"m": ranged}).wait()
    whole = _Pieces(cfg, 1, None, fill=-1.0)
    omnickpt.load(str(tmp_path / "ranges"), {"m": whole})
    assert torch.equal(whole.weight, ranged.weight)
    assert whole.note == {"layer": 1}

    omnickpt.save(str(tmp_path / "whole"), {"m": whole}).wait()
    back = _Pieces(cfg, 1, [(0, 11), (11, 13), (13, 30)], fill=-1.0)
    omnickpt.load(str(tmp_path / "whole"), {"m": back})
    assert torch.equal(back.weight, ranged.weight)
    # A layer the checkpoint does not have is an error, not zeros: its object shard is missing,
    # and even when that is waived (strict=False) the tensor's box is not covered.
    other = _Pieces(cfg, 2, None, fill=-1.0)
    with pytest.raises(MismatchError, match="m/note/shard_2_3: missing"):
        omnickpt.load(str(tmp_path / "whole"), {"m": other})
    with pytest.raises(MismatchError, match="m/w: the checkpoint holds only 0 of the 30"):
        omnickpt.load(str(tmp_path / "whole"), {"m": other}, strict=False)
    assert (other.weight == -1).all()
