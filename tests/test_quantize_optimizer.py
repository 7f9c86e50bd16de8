"""save(quantize_optimizer="int8" | "fp8"): optimizer moments stored quantized (lossy, opt-in),
weights and step counts exact, the manifest records each quantized tensor's scheme and measured
largest error, a load reports them, resharded loads and verify work, damage is caught."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli.verify import verify
from omnickpt.errors import CorruptCheckpointError, UnsupportedError
from models import flip_byte


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(15):
        model(torch.randn(16, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 32))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _moments(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"optim/state/{names[id(p)]}/{k}": v for p, s in opt.state.items() for k, v in s.items()}


def _data_bytes(path) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "data", "*.bin")))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_moments_within_the_recorded_error_weights_and_steps_exact(tmp_path, scheme, capsys):
    model, opt = _trained()
    q, plain = str(tmp_path / "q"), str(tmp_path / "plain")
    omnickpt.save(q, {"model": model, "optim": opt}, quantize_optimizer=scheme)
    omnickpt.save(plain, {"model": model, "optim": opt})
    m2, o2 = _fresh()
    result = omnickpt.load(q, {"model": m2, "optim": o2})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    with omnickpt.open(q) as r:
        recorded = r.manifest.quantized
    saved, loaded = _moments(model, opt), _moments(m2, o2)
    for name, want in saved.items():
        got = loaded[name]
        if name.endswith("/step"):
            assert torch.equal(got, want) and name not in recorded
            continue
        assert recorded[name]["scheme"] == scheme
        err = (got.double() - want.double()).abs().max().item()
        assert err == pytest.approx(recorded[name]["max_error"], rel=1e-9, abs=0)   # measured, not a guess
        # square roots for non-negative blocks (exp_avg_sq): up to ~2x the linear grid's absolute error
        assert 0 < err <= want.abs().max().item() / (127 if scheme == "int8" else 7)
    assert set(result.report["quantized"]) == set(recorded)
    # int8 moments are ~1/4 of their fp32 bytes: two thirds of the plain checkpoint is moments
    assert _data_bytes(q) < 0.55 * _data_bytes(plain)
    assert verify(q).ok
    from omnickpt.cli import main as cli
    assert cli(["inspect", q]) == 0
    assert f"8 tensor(s) quantized ({scheme}, lossy)" in capsys.readouterr().out
    with omnickpt.open(plain) as r:
        assert r.manifest.quantized == {}


def test_quantized_and_compressed_together(tmp_path):
    model, opt = _trained(1)
    path = str(tmp_path / "qz")
    omnickpt.save(path, {"model": model, "optim": opt}, quantize_optimizer="int8", compression="bytesplit-zstd")
    m2, o2 = _fresh()
    omnickpt.load(path, {"model": m2, "optim": o2})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    with omnickpt.open(path) as r:
        assert r.manifest.compression == "bytesplit-zstd" and len(r.manifest.quantized) == 8


def test_a_damaged_quantized_chunk_is_caught(tmp_path):
    model, opt = _trained(2)
    path = str(tmp_path / "q")
    omnickpt.save(path, {"model": model, "optim": opt}, quantize_optimizer="fp8")
    with omnickpt.open(path) as r:
        box = r.manifest.tensors["optim/state/0.weight/exp_avg_sq"].boxes[0]
    data = glob.glob(os.path.join(path, "data", "*.bin"))[0]
    flip_byte(data, box.offset + 100, 0x01)
    assert not verify(path).ok
    m2, o2 = _fresh()
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        omnickpt.load(path, {"model": m2, "optim": o2})


def test_bad_options_are_refused(tmp_path):
    model, opt = _trained()
    with pytest.raises(ValueError, match="quantize_optimizer"):
        omnickpt.save(str(tmp_path / "a"), {"model": model, "optim": opt}, quantize_optimizer="int4")
    with pytest.raises(UnsupportedError, match="quantize_optimizer"):
        omnickpt.save(str(tmp_path / "b"), {"model": model, "optim": opt}, quantize_optimizer="int8",
                      incremental=True)


def _fsdp2_quantized(rank, world, path):
    from torch.distributed.device_mesh import DeviceMesh
    from models import full_values, toy
    mesh = DeviceMesh("cpu", torch.arange(world))
    model, opt = toy("fsdp2", 0, mesh)
    omnickpt.save(path, {"model": model, "optim": opt}, quantize_optimizer="int8")
    return full_values(model, opt)


def test_an_fsdp2_quantized_checkpoint_loads_resharded_at_one_rank(tmp_path):
    from dist import run_ranks
    from models import full_values, toy
    path = str(tmp_path / "q")
    want, _ = run_ranks(2, _fsdp2_quantized, path)
    model, opt = toy("plain", 1)
    result = omnickpt.load(path, {"model": model, "optim": opt})
    got = full_values(model, opt)
    with omnickpt.open(path) as r:
        recorded = r.manifest.quantized
    assert recorded and set(result.report["quantized"]) == set(recorded)
    for name, w in want.items():
        stored = name.replace("optim/", "optim/state/", 1)     # full_values() leaves out the "state" level
        if stored in recorded:
            assert (got[name].double() - w.double()).abs().max().item() <= recorded[stored]["max_error"]
            assert not name.endswith("/step")
        else:
            assert torch.equal(got[name], w), name
    assert sum(n.startswith("optim/") for n in recorded) == sum(not n.endswith("/step") for n in want
                                                                 if n.startswith("optim/"))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_the_next_adam_step_from_quantized_moments_stays_close_to_the_exact_one(tmp_path, scheme):
    """A second moment 2500x below its block's largest must not come back as 0 (Adam's next step
    would be m / eps, ~10^6 too large): square roots for non-negative blocks, and no value to 0."""
    import copy

    def setup():
        torch.manual_seed(0)
        model = nn.Linear(256, 1, bias=False)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.full((1, 256), 0.02)
        g[0, 0] = 1.0
        model.weight.grad = g
        opt.step()
        return model, opt
    model, opt = setup()
    exact_model, exact_opt = copy.deepcopy(model), None
    exact_opt = torch.optim.Adam(exact_model.parameters(), lr=1e-3)
    exact_opt.load_state_dict(opt.state_dict())
    path = str(tmp_path / scheme)
    omnickpt.save(path, {"model": model, "optim": opt}, quantize_optimizer=scheme)
    loaded_model = nn.Linear(256, 1, bias=False)
    loaded_opt = torch.optim.Adam(loaded_model.parameters(), lr=1e-3)
    omnickpt.load(path, {"model": loaded_model, "optim": loaded_opt})
    steps = []
    for m, o in ((exact_model, exact_opt), (loaded_model, loaded_opt)):
        before = m.weight.detach().clone()
        m.weight.grad = torch.zeros_like(m.weight)
        o.step()
        steps.append(m.weight.detach() - before)
    ratio = steps[1] / steps[0]
    assert (ratio > 0.5).all() and (ratio < 2.0).all(), (ratio.min(), ratio.max())
    assert (loaded_opt.state[loaded_model.weight]["exp_avg_sq"] > 0).all()
