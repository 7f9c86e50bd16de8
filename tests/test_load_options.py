"""Loading that fits real workflows: dtype casting on request, part of a state by glob patterns,
strict=False that covers the optimizer, and metadata stored with the checkpoint."""
from __future__ import annotations


from omnickpt.format import manifest_document
import os

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt import MismatchError, UnsupportedError


def _trained(seed: int, hidden: int = 6):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_cast_loads_an_fp32_checkpoint_into_a_bf16_model_only_when_asked(tmp_path):
    model, _ = _trained(0)
    omnickpt.save(str(tmp_path / "c"), {"model": model}).wait()
    target = _trained(1)[0].to(torch.bfloat16)
    with pytest.raises(MismatchError, match="cast=True"):
        omnickpt.load(str(tmp_path / "c"), {"model": target})
    omnickpt.load(str(tmp_path / "c"), {"model": target}, cast=True)
    for k, v in model.state_dict().items():
        assert target.state_dict()[k].dtype == torch.bfloat16
        assert torch.equal(target.state_dict()[k], v.to(torch.bfloat16)), k


def test_include_and_exclude_load_part_of_a_state(tmp_path):
    model, opt = _trained(0)
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optim": opt, "extra": {"step": 7}}).wait()
    m2, o2 = _trained(1)
    before_opt = {k: v.clone() for k, v in o2.state[next(iter(o2.state))].items()}
    extra = {"step": 0}
    omnickpt.load(str(tmp_path / "c"), {"model": m2, "optim": o2, "extra": extra}, include=["model"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    assert extra["step"] == 0                                  # not included
    assert all(torch.equal(v, before_opt[k]) for k, v in o2.state[next(iter(o2.state))].items())
    # Exclude one tensor of the model by pattern: it keeps its value, the rest loads.
    m3, _ = _trained(2)
    keep = m3[2].weight.detach().clone()
    omnickpt.load(str(tmp_path / "c"), {"model": m3}, exclude=["model/2.*"])
    assert torch.equal(m3[2].weight, keep) and torch.equal(m3[0].weight, model[0].weight)
    with pytest.raises(TypeError, match="glob patterns"):
        omnickpt.load(str(tmp_path / "c"), {"model": m3}, include="model")


def test_strict_false_loads_the_optimizer_state_that_fits_and_reports_the_rest(tmp_path):
    model, opt = _trained(0, hidden=6)
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optim": opt}).wait()
    m2, o2 = _trained(1, hidden=8)                  # the hidden layer grew: layer 0 and 2 changed shape
    m2[2] = nn.Linear(8, 3)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.5)
    m2(torch.randn(5, 4)).sum().backward()
    o2.step()
    result = omnickpt.load(str(tmp_path / "c"), {"model": m2, "optim": o2}, strict=False)
    diffs = "\n".join(result.differences)
    assert "model/0.weight" in diffs and "optim/state/0.weight/exp_avg" in diffs
    # The parameters whose shape did not change (the last bias) load their state and values.
    saved_bias_state = opt.state[model[2].bias]
    assert torch.equal(m2[2].bias, model[2].bias)
    assert torch.equal(o2.state[m2[2].bias]["exp_avg"], saved_bias_state["exp_avg"])
    # The others keep their own state, which still fits them: training goes on.
    assert o2.state[m2[0].weight]["exp_avg"].shape == m2[0].weight.shape
    m2(torch.randn(5, 4)).sum().backward()
    o2.step()
    # Param groups that do not fit are reported, not raised, and the optimizer keeps its own.
    m3, _ = _trained(3)
    o3 = torch.optim.Adam([{"params": [m3[0].weight]}, {"params": [p for n, p in m3.named_parameters()
                                                                   if n != "0.weight"], "lr": 0.3}], lr=0.2)
    result = omnickpt.load(str(tmp_path / "c"), {"model": m3, "optim": o3}, strict=False)
    assert any("param groups" in d for d in result.differences)
    assert [g["lr"] for g in o3.param_groups] == [0.2, 0.3]
    with pytest.raises(MismatchError, match="param groups"):
        omnickpt.load(str(tmp_path / "c"), {"model": m3, "optim": o3})


def test_metadata_is_stored_in_the_manifest_and_validated(tmp_path):
    model, _ = _trained(0)
    meta = {"config": {"hidden_size": 6, "architectures": ["Toy"], "rope": None}, "run": "abc"}
    omnickpt.save(str(tmp_path / "c"), {"model": model}, metadata=meta).wait()
    with open(os.path.join(tmp_path, "c", "manifest.json"), "rb") as f:
        assert manifest_document(f.read())["layout"]["metadata"] == meta
    assert omnickpt.read_manifest(omnickpt.storage.storage_for(str(tmp_path / "c"))).layout["metadata"] == meta
    for bad in ({"t": torch.ones(1)}, {"f": float("nan")}, {"s": {1, 2}}):
        with pytest.raises(UnsupportedError, match="metadata"):
            omnickpt.save(str(tmp_path / "d"), {"model": model}, metadata=bad)
    # As from any JSON file: integer keys (a config's id2label) come back as strings, tuples as lists.
    omnickpt.save(str(tmp_path / "e"), {"model": model}, metadata={"id2label": {0: "a"}, "t": (1, 2)}).wait()
    with open(os.path.join(tmp_path, "e", "manifest.json"), "rb") as f:
        assert manifest_document(f.read())["layout"]["metadata"] == {"id2label": {"0": "a"}, "t": [1, 2]}
    with pytest.raises(TypeError):
        omnickpt.save(str(tmp_path / "d"), {"model": model}, metadata=["not a dict"])
    # Values the fast JSON writer refuses or writes otherwise come back exactly: an integer beyond
    # 64 bits (a seed, a hash), text beyond ASCII.
    exact = {"seed": 2 ** 70 + 1, "name": "modèle 模型", "small": 1e-300}
    omnickpt.save(str(tmp_path / "f"), {"model": model}, metadata=exact).wait()
    assert omnickpt.read_manifest(omnickpt.storage.storage_for(str(tmp_path / "f"))).layout["metadata"] == exact


def _fsdp2_save(rank, world_size, path):
    from torch.distributed.device_mesh import DeviceMesh
    from models import toy
    model, opt = toy("fsdp2", 0, DeviceMesh("cpu", torch.arange(world_size)))
    omnickpt.save(path, {"model": model, "optim": opt}).wait()


def test_the_saved_mesh_and_placements_are_recorded_and_shown(tmp_path, capsys):
    from dist import run_ranks
    from omnickpt.cli import main as cli
    path = str(tmp_path / "c")
    run_ranks(2, _fsdp2_save, path)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        meshes = manifest_document(f.read())["layout"]["meshes"]
    assert meshes["model"]["mesh"]["shape"] == [2]
    assert meshes["model"]["placements"] == {"(Shard(dim=0),)": 6}   # the ToyMLP's six sharded tensors
    assert "optim" not in meshes
    assert cli(["inspect", path]) == 0
    assert "Shard(dim=0)" in capsys.readouterr().out
