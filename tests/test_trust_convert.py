"""Issue 17, a careless/hostile-user sweep of quantization, convert and diff: quantize_optimizer
stores the moments only, never reads a second moment back as 0 and survives non-finite state;
convert keeps the record that a tensor is lossy, refuses casts that overflow or flush values unless
allowed, and never writes inside its source; diff says which side is lossy."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import omnickpt
from omnickpt.cli import main as cli
from omnickpt.cli.diff import diff, format_text
from omnickpt.cli.verify import verify
from omnickpt.convert import convert, location, refuse_nested
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.format.codec import decode_into, encode_chunk


def _state_keys(opt) -> dict[str, torch.Tensor]:
    return {f"optim/state/w/{k}": v for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}


def _stepped(make, steps: int = 3, shape=(300,), dtype=torch.float32):
    """A one-parameter module (named "w") and its optimizer after a few steps."""
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(*shape, dtype=dtype))
    opt = make([model.w])
    for _ in range(steps):
        model.w.grad = torch.randn(*shape, dtype=dtype)
        opt.step()
    return model, opt


def _fresh_like(model, opt):
    m2 = nn.Module()
    m2.w = nn.Parameter(torch.zeros_like(model.w))
    o2 = type(opt)([m2.w], **{k: v for k, v in opt.defaults.items() if k not in ("params",)})
    return m2, o2


def _roundtrip(path, model, opt, **kw):
    omnickpt.save(path, {"model": model, "optim": opt}, **kw)
    m2, o2 = _fresh_like(model, opt)
    o2.load_state_dict(opt.state_dict())   # the state exists, so the load has destinations of the right kinds
    for s in o2.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
    omnickpt.load(path, {"model": m2, "optim": o2})
    return m2, o2


# ------------------------------------------------------------------ quantize_optimizer: moments only
OPTIMIZERS = {
    "ASGD": (lambda p: torch.optim.ASGD(p, lr=0.01, t0=0), set()),
    "Rprop": (lambda p: torch.optim.Rprop(p, lr=0.01), set()),
    "Adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.01), set()),
    "NAdam": (lambda p: torch.optim.NAdam(p, lr=0.01), {"exp_avg", "exp_avg_sq"}),
    "Adam-amsgrad": (lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), {"momentum_buffer"}),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
                {"square_avg", "momentum_buffer", "grad_avg"}),
    "Adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg", "acc_delta"}),
    "Adamax": (lambda p: torch.optim.Adamax(p, lr=0.01), {"exp_avg", "exp_inf"}),
}


def test_only_the_moments_of_each_torch_optimizer_are_quantized_and_the_rest_loads_bit_exact(tmp_path):
    for kind, (make, moments) in OPTIMIZERS.items():
        model, opt = _stepped(make)
        path = str(tmp_path / kind)
        m2, o2 = _roundtrip(path, model, opt, quantize_optimizer="int8")
        with omnickpt.open(path) as r:
            recorded = set(r.manifest.quantized)
        assert recorded == {f"optim/state/w/{k}" for k in moments}, kind
        loaded = _state_keys(o2)
        for name, want in _state_keys(opt).items():
            if name not in recorded:   # ASGD's ax / eta / mu, Rprop's prev / step_size, Adagrad's sum, mu_product, step
                assert torch.equal(loaded[name], want), (kind, name)


# ------------------------------------------------------------------ quantize: what a scheme cannot represent
def _codec_roundtrip(x: np.ndarray, dtype_name: str, scheme: str) -> tuple[np.ndarray, bool, float]:
    raw = memoryview(x.tobytes())
    stored, err = encode_chunk(raw, scheme, x.itemsize, dtype_name)
    out = bytearray(len(raw))
    if len(stored) == len(raw):
        out[:] = stored
    else:
        decode_into(stored, scheme, x.itemsize, dtype_name, memoryview(out), "t")
    return np.frombuffer(bytes(out), dtype=x.dtype), len(stored) == len(raw), err


def _fp16_edge() -> np.ndarray:
    # a root block whose smallest code squares to below half of float16's smallest subnormal
    x = np.full(300, 1e-5, dtype=np.float16)
    x[0], x[1] = 4.6e-4, 5.96e-8
    return x


@pytest.mark.parametrize("x, scheme", [
    (np.full(300, 1e-44, dtype=np.float32), "int8"),                 # the scale underflows: a subnormal block
    (np.full(300, 1e-44, dtype=np.float32), "fp8"),
    (np.array([1e-50, 1e-320] + [0.5] * 254, dtype=np.float64), "int8"),   # below float32's range
    (np.array([1e-50, 1e-320] + [0.5] * 254, dtype=np.float64), "fp8"),
    (_fp16_edge(), "int8"),                                           # rounding into float16 flushes it
], ids=["subnormal-f32-int8", "subnormal-f32-fp8", "tiny-f64-int8", "tiny-f64-fp8", "f16-rounding-int8"])
def test_a_non_zero_second_moment_never_reads_back_as_zero(x, scheme):
    back, _, _ = _codec_roundtrip(x, str(x.dtype), scheme)
    assert not ((back == 0) & (x != 0)).any()


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39])
def test_a_chunk_quantization_cannot_represent_is_stored_exactly(bad, scheme):
    dtype = np.float64 if bad == 1e39 else np.float32
    x = np.linspace(-1, 1, 1000).astype(dtype)
    x[17] = bad
    back, raw, err = _codec_roundtrip(x, str(x.dtype), scheme)
    assert raw and err == 0.0 and back.tobytes() == x.tobytes()


def test_subnormal_adam_second_moments_load_non_zero(tmp_path):
    model, opt = _stepped(lambda p: torch.optim.Adam(p, lr=0.01))
    opt.state[model.w]["exp_avg_sq"].fill_(1e-44)   # a parameter whose gradients are ~1e-22
    _, o2 = _roundtrip(str(tmp_path / "q"), model, opt, quantize_optimizer="int8")
    assert (o2.state[o2.param_groups[0]["params"][0]]["exp_avg_sq"] != 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39])
def test_one_non_finite_moment_does_not_fail_the_save_and_loads_bit_exact(tmp_path, bad):
    dtype = torch.float64 if bad == 1e39 else torch.float32
    model, opt = _stepped(lambda p: torch.optim.Adam(p, lr=0.01), shape=(4, 300), dtype=dtype)
    state = opt.state[model.w]
    state["exp_avg"][1, 3] = bad
    path = str(tmp_path / "q")
    _, o2 = _roundtrip(path, model, opt, quantize_optimizer="int8")
    got = o2.state[o2.param_groups[0]["params"][0]]
    # the chunk holding the bad value (here the whole tensor) is stored raw: every bit comes back
    assert got["exp_avg"].view(torch.uint8).equal(state["exp_avg"].view(torch.uint8))
    with omnickpt.open(path) as r:
        q = r.manifest.quantized
    assert q["optim/state/w/exp_avg"]["max_error"] == 0.0            # stored exactly: nothing lost
    assert q["optim/state/w/exp_avg_sq"]["max_error"] > 0             # the other moment is still quantized
    assert verify(path).ok


# ------------------------------------------------------------------ convert keeps the lossy record; diff shows it
def _adam_ckpt(tmp_path, name: str, **kw) -> tuple[str, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    path = str(tmp_path / name)
    omnickpt.save(path, {"model": model, "optim": opt}, **kw)
    return path, model, opt


def test_convert_to_omnickpt_keeps_the_quantized_record_and_diff_says_both_sides_are_lossy(tmp_path, capsys):
    q, _, _ = _adam_ckpt(tmp_path, "q", quantize_optimizer="int8")
    dst = str(tmp_path / "copy")
    out = convert(q, dst, to="omnickpt", progress=False)
    with omnickpt.open(q) as a, omnickpt.open(dst) as b:
        assert a.manifest.quantized and b.manifest.quantized == a.manifest.quantized
        assert out["lossy"] == a.manifest.quantized
    assert verify(dst).ok
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    result = omnickpt.load(dst, {"model": model, "optim": opt})
    assert set(result.report["quantized"]) == set(out["lossy"])          # a load still reports what was lost
    report = diff(q, dst)
    assert not report.differs and len(report.lossy("a")) == len(report.lossy("b")) == len(out["lossy"])
    assert cli(["diff", q, dst]) == 0
    text = capsys.readouterr().out
    assert "lossy in B: 8 tensor(s) stored quantized (int8" in text and "equal (lossy A+B)" in text


def test_diff_of_an_exact_original_and_a_quantized_copy_names_the_lossy_side(tmp_path):
    q, model, opt = _adam_ckpt(tmp_path, "q", quantize_optimizer="fp8")
    plain = str(tmp_path / "plain")
    omnickpt.save(plain, {"model": model, "optim": opt})
    report = diff(plain, q)
    rows = {t["name"]: t for t in report.tensors}
    moment = rows["optim/state/0.weight/exp_avg_sq"]
    assert moment["lossy_b"]["scheme"] == "fp8" and "lossy_a" not in moment
    assert moment["status"] == "differs" and moment["within_lossy_error"] is True
    assert "lossy_b" not in rows["model/0.weight"] and rows["model/0.weight"]["status"] == "equal"
    assert "differs (lossy B, within recorded error)" in format_text(report)
    assert report.as_dict()["lossy"] == {"a": 0, "b": 8}


def test_an_equal_row_with_a_lossy_side_is_listed_even_without_all(tmp_path):
    q, _, _ = _adam_ckpt(tmp_path, "q", quantize_optimizer="int8")
    dcp = str(tmp_path / "dcp")
    out = convert(q, dcp, to="dcp", progress=False)
    assert set(out["lossy"]) == {n for n in out["lossy"] if n.startswith("optim/")} and len(out["lossy"]) == 8
    text = format_text(diff(q, dcp))
    assert "equal (lossy A)" in text and "lossy in A: 8 tensor(s)" in text


def test_a_cast_of_a_lossy_tensor_keeps_a_bound_against_the_original(tmp_path, capsys):
    q, model, opt = _adam_ckpt(tmp_path, "q", quantize_optimizer="int8")
    dst = str(tmp_path / "half")
    out = convert(q, dst, to="omnickpt", dtype="bfloat16", progress=False)
    with omnickpt.open(q) as a, omnickpt.open(dst) as b:
        for name, rec in a.manifest.quantized.items():
            kept = b.manifest.quantized[name]
            assert kept["scheme"] == rec["scheme"] and kept["max_error"] > rec["max_error"]
            original = _moment(model, opt, name)
            assert (b.get(name).double() - original.double()).abs().max().item() <= kept["max_error"]
        assert b.manifest.layout["converted_from"]["dtype"] == "bfloat16"
    assert out["lossy"] and "lossy_casts" not in out


def test_a_tensor_a_transform_renames_or_fuses_stays_marked_lossy_with_its_own_recorded_error(tmp_path):
    from omnickpt.transforms import Fuse, Rename
    q, _, _ = _adam_ckpt(tmp_path, "q", quantize_optimizer="int8")
    dst = str(tmp_path / "renamed")
    out = convert(q, dst, to="omnickpt", progress=False,
                  transforms=[Rename.regex(r"/0\.", "/first."), Fuse(["first.bias", "1.bias"], into="biases")])
    with omnickpt.open(q) as a, omnickpt.open(dst) as b:
        src = a.manifest.quantized
        fused = {m: [src[f"optim/state/{p}.bias/{m}"] for p in ("0", "1")] for m in ("exp_avg", "exp_avg_sq")}
        assert all(x["max_error"] != y["max_error"] for x, y in fused.values())
        assert b.manifest.quantized == out["lossy"] == {
            "optim/state/first.weight/exp_avg": src["optim/state/0.weight/exp_avg"],
            "optim/state/first.weight/exp_avg_sq": src["optim/state/0.weight/exp_avg_sq"],
            "optim/state/1.weight/exp_avg": src["optim/state/1.weight/exp_avg"],
            "optim/state/1.weight/exp_avg_sq": src["optim/state/1.weight/exp_avg_sq"],
            **{f"optim/state/biases/{m}": max(parts, key=lambda r: r["max_error"]) for m, parts in fused.items()}}


def _moment(model, opt, name: str) -> torch.Tensor:
    _, _, param, key = name.split("/")
    return opt.state[dict(model.named_parameters())[param]][key]


# ------------------------------------------------------------------ lossy dtype casts
def _extreme(tmp_path) -> str:
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1e6, 1.0, 1e-9, 0.5], [-1e6, 2.0, 0.0, 3.0]]))
    path = str(tmp_path / "src")
    omnickpt.save(path, {"model": model})
    return path


@pytest.mark.parametrize("to", ["omnickpt", "hf"])
def test_a_cast_that_overflows_or_flushes_is_refused_naming_the_tensor_then_counted_when_allowed(tmp_path, to):
    src = _extreme(tmp_path)
    dst = str(tmp_path / "half")
    with pytest.raises(UnsupportedError) as e:
        convert(src, dst, to=to, key="model", dtype="float16", progress=False)
    msg = str(e.value)
    assert "model/weight" in msg and "2 finite value(s) into inf" in msg and "1 non-zero value(s) into 0" in msg
    assert "allow_lossy_cast=True" in msg and "--allow-lossy-cast" in msg
    assert not glob.glob(os.path.join(dst, "**", "*.*"), recursive=True)   # nothing half-written is left
    out = convert(src, dst, to=to, key="model", dtype="float16", progress=False, allow_lossy_cast=True)
    assert out["lossy_casts"] == {"model/weight": {"overflow": 2, "flush": 1}}
    # bfloat16 holds both values: nothing to refuse, nothing reported
    out = convert(src, str(tmp_path / "bf"), to=to, key="model", dtype="bfloat16", progress=False)
    assert "lossy_casts" not in out


def test_the_cli_refuses_a_lossy_cast_and_with_the_flag_prints_and_records_the_counts(tmp_path, capsys):
    src = _extreme(tmp_path)
    dst = str(tmp_path / "half")
    assert cli(["convert", src, dst, "--to", "omnickpt", "--dtype", "float16"]) == 1
    assert "model/weight" in capsys.readouterr().err
    assert cli(["convert", src, dst, "--to", "omnickpt", "--dtype", "float16", "--allow-lossy-cast"]) == 0
    out = capsys.readouterr().out
    assert "note: model/weight: the cast turned 2 finite value(s) into inf and 1 non-zero value(s) into 0" in out
    with omnickpt.open(dst) as r:
        assert r.manifest.layout["converted_from"]["lossy_casts"] == {"model/weight": {"overflow": 2, "flush": 1}}


# ------------------------------------------------------------------ convert never writes inside its source
@pytest.mark.parametrize("to", ["omnickpt", "hf", "dcp"])
def test_convert_into_the_source_is_refused_naming_both(tmp_path, to):
    src = _extreme(tmp_path)
    before = sorted(glob.glob(os.path.join(src, "**"), recursive=True))
    for dst in (os.path.join(src, "data", "copy"), os.path.join(src, "export"), src):
        with pytest.raises(CheckpointError) as e:
            convert(src, dst, to=to, progress=False)
        assert src in str(e.value) and dst in str(e.value)
    assert sorted(glob.glob(os.path.join(src, "**"), recursive=True)) == before   # nothing was written
    with pytest.raises(CheckpointError, match="lies inside the destination"):
        convert(src, str(tmp_path), to=to, progress=False)


def test_nesting_is_judged_on_real_paths_and_url_components(tmp_path, monkeypatch):
    src = _extreme(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(CheckpointError, match="inside the source"):
        convert(src, str(link / "data" / "x"), to="omnickpt", progress=False)
    monkeypatch.chdir(src)
    with pytest.raises(CheckpointError, match="inside the source"):
        convert(src, "data/../data/x", to="omnickpt", progress=False)
    with pytest.raises(CheckpointError, match="inside the source"):
        refuse_nested("s3://bucket/run/step_1", "fsspec+s3://bucket/run/step_1/data/x")
    with pytest.raises(CheckpointError, match="inside the destination"):
        refuse_nested("memory://run/step_1", "memory://run")
    refuse_nested("s3://bucket/run/step_1", "s3://bucket/run/step_10")   # a sibling, not inside
    refuse_nested("s3://bucket/run", "s3://other/run/x")
    assert location("s3://b/a//c/./d") == ("s3", "b", "a", "c", "d")


def test_convert_refuses_a_destination_inside_a_folder_the_incremental_source_references(tmp_path):
    model = nn.Linear(64, 64)
    a, b = str(tmp_path / "step_1"), str(tmp_path / "step_2")
    omnickpt.save(a, {"model": model}, incremental=True)
    omnickpt.save(b, {"model": model}, incremental=True, base=a)
    with pytest.raises(CheckpointError, match="references"):
        convert(b, os.path.join(a, "export"), to="omnickpt", progress=False)
    convert(b, str(tmp_path / "elsewhere"), to="omnickpt", progress=False)


# ------------------------------------------------------------------ a dtype cast leaves optimizer bookkeeping alone
def test_a_dtype_cast_never_casts_step_counts_or_other_scalar_optimizer_state(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    nadam = torch.optim.NAdam(model.parameters(), lr=1e-3)
    for opt in (adam, nadam):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    steps = dict(zip(model.parameters(), (1000.0, 1001.0, 2049.0, 257.0)))   # 1001 and 257 are not bfloat16s
    for p, s in steps.items():
        adam.state[p]["step"].fill_(s)
        nadam.state[p]["mu_product"].fill_(0.123456789)
    src, dst = str(tmp_path / "src"), str(tmp_path / "bf16")
    omnickpt.save(src, {"model": model, "adam": adam, "nadam": nadam})
    assert cli(["convert", src, dst, "--to", "omnickpt", "--dtype", "bfloat16"]) == 0
    with omnickpt.open(src) as a, omnickpt.open(dst) as b:
        for name in a.names():
            kept = name.endswith(("/step", "/mu_product"))
            assert b.info(name).dtype == (torch.float32 if kept else torch.bfloat16), name
            if kept:
                assert torch.equal(b.get(name), a.get(name)), name
        assert b.get("adam/state/0.weight/step").item() == 1000.0
        assert b.get("adam/state/0.bias/step").item() == 1001.0
    # the converted checkpoint resumes from the step it was saved at
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    omnickpt.load(dst, {"model": fresh, "adam": opt}, strict=False)
    assert [opt.state[p]["step"].item() for p in fresh.parameters()] == list(steps.values())


# ------------------------------------------------------------------ diff: relative differences against zeros of B
def _weights(path: str, values: list[float]) -> str:
    model = nn.Linear(len(values), 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values], dtype=torch.float64))
    omnickpt.save(path, {"model": model})
    return path


def test_diff_against_exact_zeros_of_b_reports_inf_counts_them_and_gives_the_rtol_the_rest_need(tmp_path, capsys):
    a = _weights(str(tmp_path / "a"), [1e-3, 2.0, 0.0, 4.0])
    b = _weights(str(tmp_path / "b"), [0.0, 2.0, 0.0, 4.0 * (1 + 2 ** -20)])
    row = diff(a, b).tensors[0]
    # as numpy.testing.assert_allclose reports it: no rtol covers 1e-3 against 0, never the largest float
    assert row["max_rel"] == float("inf") and row["zero_b"] == 1
    assert row["max_rel_nonzero_b"] == pytest.approx(2 ** -20, rel=1e-5) and row["max_abs"] == 1e-3
    # with rtol = max_rel_nonzero_b only the differences from zeros of B are beyond it, as numpy.isclose says
    x, y = np.array([1e-3, 2.0, 0.0, 4.0]), np.array([0.0, 2.0, 0.0, 4.0 * (1 + 2 ** -20)])
    rtol = row["max_rel_nonzero_b"]
    assert diff(a, b, rtol=rtol).tensors[0]["mismatched"] == (~np.isclose(x, y, rtol=rtol, atol=0)).sum() == 1
    assert diff(a, b).as_dict()["tensors"][0]["max_rel"] == "inf"
    assert cli(["diff", a, b]) == 1
    assert "inf (1 at B=0, else 9.54e-07)" in capsys.readouterr().out
    # the other way round B holds no zero that A misses: a finite relative difference, 1e-3 / 1e-3
    back = diff(b, a).tensors[0]
    assert back["max_rel"] == pytest.approx(1.0) and back["zero_b"] == 0
    # an infinity against a number is an infinite difference, not 1.8e308
    inf = _weights(str(tmp_path / "inf"), [float("inf"), 2.0, 0.0, 4.0])
    assert diff(inf, a).tensors[0]["max_abs"] == float("inf")


# ------------------------------------------------------------------ hf export: the casts of the entry it writes
def _top_level_extreme(tmp_path) -> str:
    """_extreme's model with its tensors at the top level of the state ("weight", no "model/" above it), as
    dcp.save({**model.state_dict()}) keeps them (omnickpt.save files plain top-level tensors as objects)."""
    from omnickpt.transforms import Rename
    flat = str(tmp_path / "flat")
    convert(_extreme(tmp_path), flat, to="omnickpt", transforms=[Rename.regex("^model/", "")], progress=False)
    return flat


def test_an_hf_cast_of_top_level_tensors_is_refused_naming_the_tensor_then_counted_with_the_entry(tmp_path):
    src = _top_level_extreme(tmp_path)
    dst = str(tmp_path / "half")
    with pytest.raises(UnsupportedError) as e:
        convert(src, dst, to="hf", dtype="float16", progress=False)
    assert str(e.value).startswith("weight: casting float32 to float16 would turn 2 finite value(s) into inf")
    assert not os.path.exists(dst)   # the export made the folder, and removed it with what it had written
    out = convert(src, dst, to="hf", dtype="float16", progress=False, allow_lossy_cast=True)
    assert out["lossy_casts"] == {"weight": {"overflow": 2, "flush": 1}}
    assert out["key"] == "" and out["entry"] == "the top-level tensors of the state"
    written = load_file(os.path.join(dst, "model.safetensors"))
    assert written["weight"].dtype == torch.float16 and int(torch.isinf(written["weight"]).sum()) == 2


def test_the_cli_says_which_entry_an_hf_conversion_exported(tmp_path, capsys):
    src = _top_level_extreme(tmp_path)
    dst = str(tmp_path / "half")
    assert cli(["convert", src, dst, "--to", "hf", "--dtype", "float16"]) == 1
    assert "weight: casting float32 to float16" in capsys.readouterr().err and not os.path.exists(dst)
    assert cli(["convert", src, dst, "--to", "hf", "--dtype", "float16", "--allow-lossy-cast"]) == 0
    out = capsys.readouterr().out
    assert "(hf) from the top-level tensors of the state: tensors 2, files 1" in out
    assert "note: weight: the cast turned 2 finite value(s) into inf and 1 non-zero value(s) into 0" in out
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "named"), "--to", "hf"]) == 0
    assert "(hf) from state entry 'model' (plain): tensors 2" in capsys.readouterr().out
