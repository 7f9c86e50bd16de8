"""Issue 19's defects in the exporters and the command line, each checked with the real package on the other
side: `torch.distributed.checkpoint.load` for DCP exports, safetensors and transformers' `from_pretrained` for
Hugging Face exports (tiny configs built here, nothing downloaded).

- a DCP export is what `dcp.load` reads exactly: top-level tensors keyed as saved, a model that a DCP
  checkpoint held at its top level (read as "model") written back there, optimizer state as
  get_optimizer_state_dict keys it;
- an HF export never writes an optimizer's state as the model, says what it wrote, and selects a flat model
  (tensors at the top level of the state) with key "" / `--key .`;
- config.json never says "architectures": null;
- `--dtype` takes the usual spellings (bf16, fp16, half, fp32, float);
- `verify` says what a quantized checkpoint's chunks are;
- `diff --include/--exclude` (load's patterns), and diff's blockwise comparison gives the figures the
  one-pass comparison gave.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

import omnickpt
from omnickpt import compare
from omnickpt.errors import UnsupportedError
from omnickpt.export import export_dcp, export_hf
from omnickpt.spec import ShardSpec

sys.path.insert(0, os.path.dirname(__file__))
from test_cli import _run  # noqa: E402  (one copy of the CLI-driving helpers)

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _dcp_load(state: dict, path) -> None:
    dcp.load(state, checkpoint_id=str(path), no_dist=True)


# ----------------------------------------------------------------------------------------- DCP export
def test_a_flat_state_exported_to_dcp_loads_with_dcp_load_into_the_same_flat_dict(tmp_path, capsys):
    """omnickpt.save(path, {"layer.weight": t, ...}): the keys dcp.load finds are the state's own ("layer.weight",
    never "layer.weight."), a large tensor (stored as a tensor of its own) and a small one (inside its object)."""
    torch.manual_seed(0)
    flat = {"layer.weight": torch.randn(600, 512), "layer.bias": torch.randn(512), "step": torch.tensor(7)}
    omnickpt.save(str(tmp_path / "ckpt"), flat)
    rc, _, err = _run(["convert", tmp_path / "ckpt", tmp_path / "dcp", "--to", "dcp", "--no-progress"], capsys)
    assert rc == 0, err
    target = {k: torch.zeros_like(v) for k, v in flat.items()}
    _dcp_load(target, tmp_path / "dcp")
    assert all(torch.equal(target[k], v) for k, v in flat.items())


def test_a_dcp_model_saved_at_the_top_level_exports_back_to_the_top_level_with_its_optimizer(tmp_path):
    """dcp.save({**model.state_dict(), "optimizer": ...}) is read as the module "model"; exported to DCP again,
    the same state dict that dcp.load accepted for the original accepts the export (it was keyed
    "model.0.weight")."""
    model, opt = _trained(0)
    dcp.save({**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "src"), no_dist=True)
    export_dcp(str(tmp_path / "src"), str(tmp_path / "out"), progress=False)

    fresh, fresh_opt = _trained(1)
    state = {**fresh.state_dict(), "optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
    _dcp_load(state, tmp_path / "out")
    set_state_dict(fresh, fresh_opt, model_state_dict={k: v for k, v in state.items() if k != "optimizer"},
                   optim_state_dict=state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert all(torch.equal(got["state"][i][k], v) for i, s in want["state"].items() for k, v in s.items())
    assert got["param_groups"] == want["param_groups"]


def test_an_omnickpt_model_and_optimizer_exported_to_dcp_load_with_get_state_dict_exactly(tmp_path):
    model, opt = _trained(0)
    omnickpt.save(str(tmp_path / "ckpt"), {"model": model, "optim": opt})
    export_dcp(str(tmp_path / "ckpt"), str(tmp_path / "out"), progress=False)
    fresh, fresh_opt = _trained(1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    _dcp_load(state, tmp_path / "out")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(got[i][k], v) for i, s in want.items() for k, v in s.items())


# ----------------------------------------------------------------------------------------- HF export: which entry
def _flat_model_beside_a_flat_optimizer(path) -> dict[str, torch.Tensor]:
    """A model's tensors at the top level of the state (plain tensors: a small one is stored inside its object)
    beside an optimizer's state dict flattened as torchtitan's OptimizersContainer gives it, its moments
    sharded (ShardSpec): the moments are the only tensors stored under a state key."""
    torch.manual_seed(0)
    model = {"layer.weight": torch.randn(6, 8), "layer.bias": torch.randn(6)}
    moments = {f"state.{n}.{k}": ShardSpec(torch.randn_like(t), (0,) * t.dim(), t.shape)
               for n, t in model.items() for k in ("exp_avg", "exp_avg_sq")}
    groups = {f"param_groups.{n}.lr": 0.01 for n in model}
    omnickpt.save(str(path), {**model, "optimizer": {**moments, **groups}})
    return model


def test_hf_export_never_writes_an_optimizers_moments_as_the_model(tmp_path, capsys):
    """It exported the Adam moments as "the model" with exit status 0: the optimizer was the only state entry
    holding stored tensors."""
    model = _flat_model_beside_a_flat_optimizer(tmp_path / "ckpt")
    rc, out, err = _run(["convert", tmp_path / "ckpt", tmp_path / "hf", "--to", "hf", "--no-progress"], capsys)
    assert rc == 0, err
    assert "from the top-level tensors of the state" in out
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(written) == set(model) and all(torch.equal(written[k], v) for k, v in model.items())

    # asked for by name, the optimizer is refused, naming the way to the model
    rc, _, err = _run(["convert", tmp_path / "ckpt", tmp_path / "hf2", "--to", "hf", "--key", "optimizer"], capsys)
    assert rc == 1 and "holds an optimizer's state" in err and "the top-level tensors" in err
    assert not (tmp_path / "hf2" / "model.safetensors").exists()


def test_a_flat_model_is_selected_with_key_dot_and_key_model_says_how(tmp_path, capsys):
    torch.manual_seed(0)
    model = {"layer.weight": torch.randn(600, 512), "layer.bias": torch.randn(512)}   # one large, one small
    omnickpt.save(str(tmp_path / "ckpt"), {**model, "extra": {"buf": torch.randn(3)}})
    rc, _, err = _run(["convert", tmp_path / "ckpt", tmp_path / "x", "--to", "hf", "--key", "model"], capsys)
    assert rc == 1 and "--key ." in err
    rc, out, err = _run(["convert", tmp_path / "ckpt", tmp_path / "hf", "--to", "hf", "--key", ".", "--json"],
                        capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert result["key"] == "" and result["entry"] == "the top-level tensors of the state" and result["tensors"] == 2
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(written) == set(model) and all(torch.equal(written[k], v) for k, v in model.items())


# ----------------------------------------------------------------------------------------- config.json
def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("recorded", [None, "model_class", "in_config"])
def test_config_json_never_holds_architectures_null_and_from_pretrained_loads_exactly(tmp_path, recorded):
    model = _tiny_llama()
    config = model.config.to_dict()
    assert config.get("architectures") is None     # from_config leaves it unset: what the save records
    metadata = {"config": config}
    if recorded == "model_class":
        metadata["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    elif recorded == "in_config":
        metadata["config"] = dict(config, architectures=["LlamaForCausalLM"])
    omnickpt.save(str(tmp_path / "ckpt"), {"model": model}, metadata=metadata)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)

    with open(tmp_path / "hf" / "config.json") as f:
        written = json.load(f)
    if recorded is None:
        assert "architectures" not in written
    else:
        assert written["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(loaded).__name__ == "LlamaForCausalLM"
    want = model.state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


# ----------------------------------------------------------------------------------------- --dtype spellings
@pytest.mark.parametrize("spelling, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("half", torch.float16), ("fp32", torch.float32),
                                             ("float", torch.float32), ("bfloat16", torch.bfloat16)])
def test_convert_takes_the_usual_dtype_spellings(tmp_path, capsys, spelling, dtype):
    model, _ = _trained(0)
    omnickpt.save(str(tmp_path / "ckpt"), {"model": model})
    rc, _, err = _run(["convert", tmp_path / "ckpt", tmp_path / "hf", "--to", "hf", "--dtype", spelling,
                       "--no-progress"], capsys)
    assert rc == 0, err
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {dtype}


def test_convert_refuses_a_dtype_that_is_no_floating_point_one_as_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _run(["convert", tmp_path / "a", tmp_path / "b", "--to", "hf", "--dtype", "int8"], capsys)
    assert e.value.code == 2 and "not a floating-point dtype" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- verify
def test_verify_says_the_chunks_of_an_int8_checkpoint_are_quantized_optimizer_moments(tmp_path, capsys):
    model, opt = _trained(0)
    omnickpt.save(str(tmp_path / "q"), {"model": model, "optim": opt}, quantize_optimizer="int8")
    rc, out, _ = _run(["verify", tmp_path / "q"], capsys)
    assert rc == 0
    assert "compressed with none" not in out
    assert "optimizer moment tensor(s) stored quantized (int8" in out and "raw (no compression)" in out

    omnickpt.save(str(tmp_path / "plain"), {"model": model, "optim": opt})
    rc, out, _ = _run(["verify", tmp_path / "plain"], capsys)
    assert rc == 0 and "note:" not in out


# ----------------------------------------------------------------------------------------- diff
def test_diff_of_a_checkpoint_and_its_hf_export_is_the_same_with_include_model(tmp_path, capsys):
    model, opt = _trained(0)
    omnickpt.save(str(tmp_path / "ckpt"), {"model": model, "optim": opt})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)

    rc, out, _ = _run(["diff", tmp_path / "ckpt", tmp_path / "hf"], capsys)
    assert rc == 1 and "only in A" in out                    # the optimizer: an HF folder holds the model only
    rc, out, _ = _run(["diff", tmp_path / "ckpt", tmp_path / "hf", "--include", "model"], capsys)
    assert rc == 0, out
    assert "include model" in out and "optim" not in out.replace("include model", "")
    rc, out, _ = _run(["diff", tmp_path / "ckpt", tmp_path / "hf", "--exclude", "optim", "--json"], capsys)
    assert rc == 0 and json.loads(out)["exclude"] == ["optim"]

    report = omnickpt.diff(str(tmp_path / "ckpt"), str(tmp_path / "hf"), include=["model/0.*"])
    assert [t["name"] for t in report.tensors] == ["model/0.weight", "model/0.bias"] and not report.differs
    assert report.objects == []
    with pytest.raises(TypeError, match="glob patterns"):
        omnickpt.diff(str(tmp_path / "ckpt"), str(tmp_path / "hf"), include="model")


def test_diff_compared_block_by_block_gives_the_figures_of_one_comparison(monkeypatch):
    """Blocks of a few elements, the same-bytes shortcut and the all-finite path against the general one:
    NaN in the same place equal, NaN or inf against a number infinite, -0 equal to 0, differences from 0 of B
    counted, integers compared exactly."""
    torch.manual_seed(0)
    a = torch.randn(1000, dtype=torch.float64)
    b = a.clone()
    b[3], b[17], b[400], b[401], b[999] = 0.0, a[17] + 1e-3, float("nan"), float("inf"), -a[999]
    a[400] = float("nan")
    a[5], b[5] = 0.0, -0.0
    cases = [(a, b), (a.float(), b.float()), (a.to(torch.bfloat16), b.to(torch.bfloat16)),
             (a.nan_to_num(0.0), b.nan_to_num(0.0, posinf=0.0)),   # finite: the short path
             (a.float(), b), (torch.arange(1000) * (2 ** 53 + 1), torch.arange(1000) * (2 ** 53 + 1) + 1),
             (a, a.clone())]
    for x, y in cases:
        for atol, rtol in ((0.0, 0.0), (1e-6, 1e-3), (0.5, 0.1)):
            whole = compare._compare_general(x, y, atol, rtol)
            assert compare._compare(x, y, atol, rtol) == whole, (x.dtype, y.dtype)
            monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 7)
            blocks = compare._compare_slab(x, y, atol, rtol)
            monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 1 << 18)
            assert blocks == whole, (x.dtype, y.dtype)
    finite = compare._compare(cases[3][0], cases[3][1], 0.0, 0.0)
    assert finite.zero_b == 2 and finite.max_rel == math.inf and finite.mismatched == 4
    assert compare._compare_slab(a, a.clone(), 0, 0).identical


def test_diff_never_changes_the_tensors_it_compares():
    x, y = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64), torch.tensor([1.5, -2.0, 0.0], dtype=torch.float64)
    kept = (x.clone(), y.clone())
    compare._compare(x, y, 0.0, 0.0)
    assert torch.equal(x, kept[0]) and torch.equal(y, kept[1])


def test_an_export_refuses_an_optimizer_asked_for_by_key_in_the_library_too(tmp_path):
    _flat_model_beside_a_flat_optimizer(tmp_path / "ckpt")
    with pytest.raises(UnsupportedError, match="holds an optimizer's state"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), key="optimizer", progress=False)


def test_a_plain_top_level_tensor_beside_a_module_is_not_taken_for_the_model(tmp_path):
    """An RNG state saved beside {"net": model} is a top-level tensor too: the module is still the one exported."""
    model, _ = _trained(0)
    omnickpt.save(str(tmp_path / "ckpt"), {"net": model, "rng": torch.get_rng_state()})
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert result["key"] == "net" and result["tensors"] == 4


def test_an_hf_trainer_style_folder_exports_with_its_config_and_tokenizer_files(tmp_path):
    # An HF Trainer checkpoint saved by omnickpt holds config.json and generation_config.json beside the
    # checkpoint (the Trainer writes them): the export carries them, so from_pretrained loads it as it is.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    src = tmp_path / "checkpoint-4"
    omnickpt.save(str(src), {"model": model}).wait()
    model.config.save_pretrained(str(src))
    transformers.GenerationConfig(max_new_tokens=7).save_pretrained(str(src))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    result = export_hf(str(src), str(tmp_path / "hf"), progress=False)
    assert result["config"] and sorted(result["copied"]) == ["generation_config.json", "tokenizer_config.json"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded.generation_config.max_new_tokens == 7
