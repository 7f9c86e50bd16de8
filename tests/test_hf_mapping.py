"""HF export through a model's own state-dict adapter (export_hf(mapping=), `omnickpt convert --mapping`;
docs/hf_mapping.md), checked with the real packages on both sides: torchtitan's llama3 model and its
Llama3StateDictAdapter, transformers' LlamaForCausalLM.from_pretrained (tiny configs built here, nothing
downloaded).

- the adapter's to_hf renames AND permutes q/k rows (RoPE): the exported folder loads into transformers with
  every parameter equal to to_hf(model.state_dict()) and the same logits as the torchtitan model; a rename by
  transforms alone gets every q/k weight wrong, which is why the mapping exists;
- the mapping is called group by group (a layer's tensors together, the rest together), or as group= says,
  so an adapter can fuse what belongs together; what it returns is checked (tensors only, one group per name)
  and a refused export leaves nothing behind;
- a mapping that needs values (it cannot run on meta tensors) still exports;
- the command line imports the function `--mapping module:function` names.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import omnickpt
from omnickpt.errors import MismatchError, UnsupportedError
from omnickpt.export import export_hf
from omnickpt.export.mapping import layer_group
from omnickpt.transforms import Rename

sys.path.insert(0, os.path.dirname(__file__))
from test_cli import _run  # noqa: E402  (one copy of the CLI-driving helpers)

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchtitan")
from safetensors.torch import load_file  # noqa: E402

DIM, HEADS, KV_HEADS, VOCAB, LAYERS, HIDDEN, THETA = 64, 4, 2, 256, 2, 128, 10000.0


def _torchtitan_llama():
    """torchtitan's Llama3Model at a tiny size and its adapter. Its q/k/v are one fused wqkv parameter (torchtitan's
    default); its state dict splits them into wq/wk/wv, the names the adapter maps."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
                                    fuse_qkv=True, attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=THETA)))
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    with torch.no_grad():
        # larger weights than the init's 0.02: attention far from uniform, so a wrong q/k layout shows in logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return model, Llama3StateDictAdapter(config, None)


def _hf_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                    rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": THETA})


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """(checkpoint path, torchtitan model, its adapter): the model saved by omnickpt.save in this process."""
    model, adapter = _torchtitan_llama()
    path = tmp_path_factory.mktemp("titan") / "ckpt"
    omnickpt.save(str(path), {"model": model})
    return str(path), model, adapter


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------- torchtitan -> HF
def test_torchtitan_adapter_export_loads_in_transformers_with_equal_weights_and_logits(titan, tmp_path):
    path, model, adapter = titan
    expected = adapter.to_hf(_state(model))
    dst = tmp_path / "hf"
    # small shards: the mapped tensors are laid out over several files and an index, as without a mapping
    result = export_hf(path, str(dst), mapping=adapter.to_hf, max_shard_size=100_000, progress=False)
    assert result["tensors"] == len(expected) == 3 + 9 * LAYERS and len(result["files"]) > 1
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)

    _hf_config().save_pretrained(str(dst))   # a torchtitan checkpoint holds no HF config: one is put beside it
    hf = transformers.LlamaForCausalLM.from_pretrained(str(dst)).eval()
    got = hf.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name

    titan_logits, hf_logits = _logits(model, hf)
    assert titan_logits.abs().max() > 1   # not a degenerate model whose logits agree whatever the weights
    torch.testing.assert_close(hf_logits, titan_logits, rtol=1e-4, atol=1e-4)


def _logits(model, hf) -> tuple[torch.Tensor, torch.Tensor]:
    """The torchtitan model's and the transformers model's logits on the same tokens."""
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    # FlexAttention runs on CPU only without autograd; eager (torchtitan compiles it): no minute of CPU compiling
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        return model(tokens, positions, model.get_attention_masks(positions)), hf(tokens).logits


def test_a_rename_by_transforms_alone_gets_every_q_and_k_weight_wrong(titan, tmp_path):
    """What the mapping fixes: the names alone (the adapter's own name map, as a transform) export every q/k
    weight in torchtitan's row order, which transformers loads without complaint."""
    path, model, adapter = titan
    expected = adapter.to_hf(_state(model))
    to_hf_name = {v: k for k, v in adapter.from_hf_map.items() if v is not None}

    def hf_name(full: str) -> str:
        name = full.removeprefix("model/")
        abstract = name if "layers" not in name else name.replace(name.split(".")[1], "{}", 1)
        layer = name.split(".")[1] if "layers" in name else ""
        return "model/" + to_hf_name[abstract].format(layer)

    dst = tmp_path / "renamed"
    export_hf(path, str(dst), transforms=[Rename(hf_name)], progress=False)
    renamed = load_file(str(dst / "model.safetensors"))
    assert set(renamed) == set(expected)
    wrong = sorted(n for n in expected if not torch.equal(renamed[n], expected[n]))
    assert wrong == sorted(n for n in expected if n.endswith(("q_proj.weight", "k_proj.weight")))
    assert len(wrong) == 2 * LAYERS
    # and it shows: transformers loads the folder silently, with other logits
    _hf_config().save_pretrained(str(dst))
    titan_logits, hf_logits = _logits(model, transformers.LlamaForCausalLM.from_pretrained(str(dst)).eval())
    assert not torch.allclose(hf_logits, titan_logits, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------- groups
def test_the_mapping_sees_one_layer_at_a_time_and_can_fuse_within_it(titan, tmp_path):
    path, model, _ = titan
    state = _state(model)
    seen: list[tuple[bool, tuple[str, ...]]] = []

    def fuse_qkv(tensors: dict) -> dict:
        seen.append((next(iter(tensors.values())).is_meta, tuple(sorted(tensors))))
        out = {}
        for name, t in tensors.items():
            if name.endswith("wq.weight"):   # wq, wk, wv of a layer as one fused weight
                stem = name.removesuffix("wq.weight")
                out[stem + "wqkv.weight"] = torch.cat([t, tensors[stem + "wk.weight"], tensors[stem + "wv.weight"]])
            elif not name.endswith(("wk.weight", "wv.weight")):
                out[name] = t
        return out

    export_hf(path, str(tmp_path / "fused"), mapping=fuse_qkv, dtype=torch.bfloat16, progress=False)
    # each call a layer's tensors ("layers.1.", never "layers.1" with "layers.10"), or the ones outside any layer;
    # each group once on meta tensors (to lay the files out) and once on its values
    groups = [tuple(sorted(n for n in state if layer_group(n) == g)) for g in ("", "layers.0.", "layers.1.")]
    assert sorted(seen) == sorted((meta, g) for g in groups for meta in (True, False))
    assert groups[0] == ("lm_head.weight", "norm.weight", "tok_embeddings.weight")
    written = load_file(str(tmp_path / "fused" / "model.safetensors"))
    for i in range(LAYERS):
        q, k, v = (state[f"layers.{i}.attention.qkv_linear.{w}.weight"] for w in ("wq", "wk", "wv"))
        assert torch.equal(written[f"layers.{i}.attention.qkv_linear.wqkv.weight"],
                           torch.cat([q, k, v]).to(torch.bfloat16))
    assert written["norm.weight"].dtype == torch.bfloat16 and len(written) == len(state) - 2 * LAYERS


@pytest.mark.parametrize("name, group", [
    ("layers.3.attention.wq.weight", "layers.3."), ("layers.3.moe.experts.7.w1", "layers.3."),
    ("model.layers.12.mlp.up_proj.weight", "model.layers.12."), ("0.weight", "0."), ("blocks/2/w", "blocks/2/"),
    ("conv1.weight", ""), ("tok_embeddings.weight", ""), ("h.7", "h.7")])
def test_the_default_group_is_the_name_up_to_its_first_integer_segment(name, group):
    assert layer_group(name) == group


def test_group_fuses_tensors_of_several_layers_into_one(titan, tmp_path):
    """group= puts every layer's w1 in one group: an adapter stacking them (as MoE adapters fuse experts) sees
    all of them in one call."""
    path, model, _ = titan
    state = _state(model)
    calls: list[int] = []

    def group(name: str) -> str:
        return "w1" if name.endswith("feed_forward.w1.weight") else layer_group(name)

    def stack_w1(tensors: dict) -> dict:
        calls.append(len(tensors))
        if all(n.endswith("w1.weight") for n in tensors):
            return {"stacked.w1.weight": torch.stack([tensors[f"layers.{i}.feed_forward.w1.weight"]
                                                      for i in range(LAYERS)])}
        return dict(tensors)

    export_hf(path, str(tmp_path / "stacked"), mapping=stack_w1, group=group, progress=False)
    written = load_file(str(tmp_path / "stacked" / "model.safetensors"))
    assert torch.equal(written["stacked.w1.weight"],
                       torch.stack([state[f"layers.{i}.feed_forward.w1.weight"] for i in range(LAYERS)]))
    assert set(written) == {n for n in state if not n.endswith("w1.weight")} | {"stacked.w1.weight"}
    # the w1 group, the rest, each layer less its w1: each on meta tensors, then on values
    assert sorted(calls) == sorted(([LAYERS, 3] + [8] * LAYERS) * 2)


def test_a_mapping_that_needs_values_is_called_on_them(titan, tmp_path):
    """A mapping that cannot run on meta tensors (it reads a value) is called on the group's values to learn what
    it makes; the export is the same."""
    path, model, _ = titan
    state = _state(model)

    def by_sign(tensors: dict) -> dict:
        # a value-dependent choice: meta tensors have no values, so .item() fails on them
        return {(f"{n}.pos" if t.sum().item() > 0 else f"{n}.neg"): t * 2 for n, t in tensors.items()}

    export_hf(path, str(tmp_path / "signed"), mapping=by_sign, progress=False)
    written = load_file(str(tmp_path / "signed" / "model.safetensors"))
    assert len(written) == len(state)
    for name, t in state.items():
        key = f"{name}.pos" if t.sum().item() > 0 else f"{name}.neg"
        assert torch.equal(written[key], t * 2), name


def test_a_flat_model_of_plain_tensors_exports_through_a_mapping(tmp_path):
    """Tensors saved at the top level of the state (key ""), the small ones inside their objects: grouped and mapped
    as a module's are."""
    torch.manual_seed(3)
    state = {"blocks.0.w": torch.randn(4, 4), "blocks.1.w": torch.randn(300, 300), "head": torch.randn(2, 4)}
    omnickpt.save(str(tmp_path / "flat"), dict(state))
    seen = []

    def prefixed(tensors: dict) -> dict:
        seen.append(sorted(tensors))
        return {"model." + n: t.T for n, t in tensors.items()}

    export_hf(str(tmp_path / "flat"), str(tmp_path / "hf"), key="", mapping=prefixed, progress=False)
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == {"model." + n for n in state}
    assert all(torch.equal(written["model." + n], t.T) for n, t in state.items())
    assert sorted(map(tuple, seen)) == sorted([("blocks.0.w",), ("blocks.1.w",), ("head",)] * 2)


# ----------------------------------------------------------------------------------------- refusals
def test_a_mapping_giving_values_other_shapes_than_meta_tensors_is_refused(titan, tmp_path):
    """The files are laid out from what the mapping makes of meta tensors: values that map to another shape would
    be written over their neighbours, so the export stops and removes what it wrote."""
    path, _, _ = titan

    def shifty(tensors: dict) -> dict:
        return {n: (t if t.is_meta or not n.startswith("layers.1.") else t[:1]) for n, t in tensors.items()}

    with pytest.raises(MismatchError, match=r"group 'layers\.1\.'") as e:
        export_hf(path, str(tmp_path / "shifty"), mapping=shifty, progress=False)
    assert any(d.startswith("layers.1.attention.wo.weight: planned") for d in e.value.differences)
    assert not (tmp_path / "shifty").exists()


def test_a_mapping_returning_a_non_tensor_is_refused_naming_the_group(titan, tmp_path):
    path, _, _ = titan

    def bad(tensors: dict) -> dict:
        return {n: (t.tolist() if n.startswith("layers.1.") and n.endswith("wo.weight") else t)
                for n, t in tensors.items()}

    with pytest.raises(UnsupportedError, match=r"list as 'layers\.1\.attention\.wo\.weight'.*group 'layers\.1\.'"):
        export_hf(path, str(tmp_path / "bad"), mapping=bad, progress=False)
    assert not (tmp_path / "bad").exists()   # refused before any file was written


def test_two_groups_returning_one_name_are_refused_naming_both(titan, tmp_path):
    path, _, _ = titan

    def collide(tensors: dict) -> dict:
        return {n.replace("layers.1.", "layers.0."): t for n, t in tensors.items()}

    first = r"'layers\.0\.attention\.qkv_linear\.wq\.weight' for both group 'layers\.0\.'"
    with pytest.raises(MismatchError, match=first) as e:
        export_hf(path, str(tmp_path / "dup"), mapping=collide, progress=False)
    assert any("group 'layers.1.'" in d for d in e.value.differences)
    assert not (tmp_path / "dup").exists()


def test_a_mapping_that_raises_keeps_its_error_with_a_note_naming_the_group(titan, tmp_path):
    path, _, _ = titan

    def strict(tensors: dict) -> dict:
        unknown = [n for n in tensors if n.startswith("layers.1.")]
        if unknown:
            raise KeyError(unknown[0])
        return tensors

    with pytest.raises(KeyError) as e:
        export_hf(path, str(tmp_path / "raised"), mapping=strict, progress=False)
    assert any("group 'layers.1.'" in note for note in e.value.__notes__)


# ----------------------------------------------------------------------------------------- command line
def test_convert_mapping_imports_the_named_function(titan, tmp_path, capsys, monkeypatch):
    path, model, _ = titan
    state = _state(model)
    (tmp_path / "my_export.py").write_text(
        "import torch\n"
        "class Adapter:\n"
        "    def to_hf(self, sd):\n"
        "        return {'hf.' + n: torch.flip(t, [0]) for n, t in sd.items()}\n"
        "adapter = Adapter()\n")
    monkeypatch.chdir(tmp_path)   # the command imports from the current directory
    rc, out, err = _run(["convert", path, tmp_path / "out", "--to", "hf", "--mapping", "my_export:adapter.to_hf"],
                        capsys)
    assert rc == 0, err
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == {f"hf.{n}" for n in state}
    assert all(torch.equal(written[f"hf.{n}"], torch.flip(t, [0])) for n, t in state.items())

    rc, _, err = _run(["convert", path, tmp_path / "out2", "--to", "hf", "--mapping", "my_export:to_hf"], capsys)
    assert rc == 1 and "'my_export' has no attribute 'to_hf'" in err
    rc, _, err = _run(["convert", path, tmp_path / "dcp", "--to", "dcp", "--mapping", "my_export:adapter.to_hf"],
                      capsys)
    assert rc == 1 and "convert to dcp takes no mapping" in err
    with pytest.raises(SystemExit):
        _run(["convert", "--help"], capsys)
    assert "runs that module's code" in " ".join(capsys.readouterr().out.split())
