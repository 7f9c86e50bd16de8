"""Canonical names (omnickpt/adapters/module.py `canonical_name`) and optimizers whose state_dict() is
not torch's (omnickpt/adapters/optimizer.py, DCP's flattened layout: torchtitan's OptimizersContainer).

Module and optimizer tensors are named as PyTorch DCP names them, without the segments that
activation checkpointing (`_checkpoint_wrapped_module`), torch.compile (`_orig_mod`, at any depth) and
FSDP1 (`_fsdp_wrapped_module`) insert: a checkpoint saved with them loads without them and back, and a
DCP checkpoint (canonical names) loads into a wrapped model. Checkpoints an earlier omnickpt wrote
under the wrapped names keep loading (written here with the canonicalisation switched off, which is
what that version did). An Optimizer subclass with a flattened state_dict() round-trips, reshards from
2 FSDP2 ranks to 1, loads torch optimizers' and DCP's checkpoints of the same parameters, and refuses,
by name, the state of another kind of optimizer.

Everything is real: checkpoint_wrapper, torch.compile (wrapping only: nothing is called), DCP's
get_optimizer_state_dict and dcp.save, FSDP2 on 2 gloo ranks (one launch).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

import omnickpt
import omnickpt.adapters.module as module_adapter
import omnickpt.adapters.optimizer as optimizer_adapter
from dist import run_ranks
from models import TinyGPT, ToyMLP, apply_layout, stepped
from omnickpt.errors import MismatchError
from omnickpt.storage import storage_for

WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _names(path) -> set[str]:
    return set(omnickpt.read_manifest(storage_for(str(path))).tensors)


def _gpt(seed: int, ac: bool = False, compiled: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TinyGPT + Adam after one step; `ac`: every block in checkpoint_wrapper (torchtitan's default);
    `compiled`: block 0 compiled and the whole model compiled again (nested compile)."""
    torch.manual_seed(seed)
    model = TinyGPT()
    if ac:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stepped(model, opt)
    if compiled:
        model.blocks[0] = torch.compile(model.blocks[0])
        model = torch.compile(model)
    return model, opt


def _optim_values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """parameter name (canonical, by DCP) / state key -> value: the expected side, from DCP itself."""
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {k: v.clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _model_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {module_adapter.canonical_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------- the names
def test_canonical_name_drops_every_wrapper_segment_as_dcp_does():
    c = module_adapter.canonical_name
    assert c("blocks.0._checkpoint_wrapped_module.qkv.weight") == "blocks.0.qkv.weight"
    assert c("_orig_mod.blocks.0._orig_mod._fsdp_wrapped_module.fc.weight") == "blocks.0.fc.weight"
    # whole tensor names: the segment right after a state key or a "/" is a segment too
    assert c("optim/state/_checkpoint_wrapped_module.fc.weight/exp_avg") == "optim/state/fc.weight/exp_avg"
    assert c("model/head.weight") == "model/head.weight"
    assert c("model/my_orig_model.weight") == "model/my_orig_model.weight"   # a name that only looks alike


@pytest.mark.parametrize("saved_ac, loaded_ac", [(True, False), (False, True)])
def test_optimizer_state_saved_with_activation_checkpointing_loads_without_and_back(tmp_path, saved_ac, loaded_ac):
    model, opt = _gpt(0, ac=saved_ac)
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optim": opt})
    assert not [n for n in _names(tmp_path / "c") if any(w in n for w in WRAPPERS)]
    model2, opt2 = _gpt(7, ac=loaded_ac)
    omnickpt.load(str(tmp_path / "c"), {"model": model2, "optim": opt2})
    assert _same(_model_values(model), _model_values(model2)) == []
    assert _same(_optim_values(model, opt), _optim_values(model2, opt2)) == []


def test_nested_compile_is_named_like_the_plain_model(tmp_path):
    model, opt = _gpt(0, ac=True, compiled=True)
    omnickpt.save(str(tmp_path / "c"), {"model": model, "optim": opt})
    names = _names(tmp_path / "c")
    assert "model/blocks.0.qkv.weight" in names and "optim/state/blocks.0.qkv.weight/exp_avg" in names
    assert not [n for n in names if any(w in n for w in WRAPPERS)]
    plain, plain_opt = _gpt(7)
    omnickpt.load(str(tmp_path / "c"), {"model": plain, "optim": plain_opt})
    assert _same(_model_values(model), _model_values(plain)) == []
    assert _same(_optim_values(model, opt), _optim_values(plain, plain_opt)) == []


def test_checkpoint_saved_under_wrapped_names_keeps_loading(tmp_path, monkeypatch):
    """What omnickpt wrote before names were canonical: optimizer state after named_parameters()
    (`_checkpoint_wrapped_module`), module tensors of a compiled block with `_orig_mod`."""
    model, opt = _gpt(0, ac=True, compiled=True)
    with monkeypatch.context() as m:
        m.setattr(optimizer_adapter, "canonical_name", lambda name: name)
        m.setattr(module_adapter, "canonical_names", lambda where, names: {})
        omnickpt.save(str(tmp_path / "old"), {"model": model, "optim": opt})
    names = _names(tmp_path / "old")
    assert "optim/state/blocks.0._orig_mod._checkpoint_wrapped_module.qkv.weight/exp_avg" in names
    assert "model/blocks.0._orig_mod.qkv.weight" in names
    for ac, compiled in ((False, False), (True, False), (True, True)):
        model2, opt2 = _gpt(7, ac=ac, compiled=compiled)
        omnickpt.load(str(tmp_path / "old"), {"model": model2, "optim": opt2})   # strict
        assert _same(_model_values(model), _model_values(model2)) == [], (ac, compiled)
        assert _same(_optim_values(model, opt), _optim_values(model2, opt2)) == [], (ac, compiled)
        assert [g["lr"] for g in opt2.param_groups] == [0.01]
    # and its Hugging Face export is named as the plain model is
    from omnickpt.export import export_hf
    from safetensors import safe_open
    export_hf(str(tmp_path / "old"), str(tmp_path / "hf"), key="model", progress=False)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(_gpt(0)[0].state_dict())
    # and its DCP export loads into the plain model's get_state_dict with dcp.load, strictly
    from omnickpt.export import export_dcp
    export_dcp(str(tmp_path / "old"), str(tmp_path / "dcp"), progress=False)
    plain, plain_opt = _gpt(7)
    msd, osd = get_state_dict(plain, plain_opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(plain, plain_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert _same(_model_values(model), _model_values(plain)) == []
    assert _same(_optim_values(model, opt), _optim_values(plain, plain_opt)) == []


def test_dcp_checkpoint_loads_into_a_model_with_activation_checkpointing(tmp_path):
    model, opt = _gpt(0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    model2, opt2 = _gpt(7, ac=True)
    omnickpt.load(str(tmp_path), {"model": model2, "optimizer": opt2})
    assert _same(_model_values(model), _model_values(model2)) == []
    assert _same(_optim_values(model, opt), _optim_values(model2, opt2)) == []


# ---------------------------------------------------------------------- flattened optimizer state dicts
class OptimizersContainer(torch.optim.Optimizer):
    """Stands in for torchtitan's components/optimizer.py OptimizersContainer: one optimizer per model
    part behind one Optimizer, state_dict() flat and keyed by canonical parameter name."""

    def __init__(self, parts: list[nn.Module], cls=torch.optim.Adam, **kwargs):
        self.parts = parts
        self.optimizers = [cls(p.parameters(), **kwargs) for p in parts]
        # as torchtitan does: Optimizer.__init__ for the hooks, over every part's parameters
        torch.optim.Optimizer.__init__(self, [q for p in parts for q in p.parameters()], kwargs)

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        get = functools.partial(get_optimizer_state_dict, options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {k: v for sd in map(get, self.parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict):
        for part, o in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, o, optim_state_dict=state_dict,
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))


class Stage(nn.Module):
    """A pipeline stage: one Linear under its own name, so the stages' parameter names differ."""

    def __init__(self, name: str, i: int, o: int):
        super().__init__()
        self.add_module(name, nn.Linear(i, o))


def _stages(seed: int, ac: bool = False, step: bool = True) -> tuple[list[nn.Module], OptimizersContainer]:
    torch.manual_seed(seed)
    parts = [Stage("embed", 5, 7), Stage("head", 7, 3)]
    if ac:
        parts[0].embed = checkpoint_wrapper(parts[0].embed)
    opt = OptimizersContainer(parts, lr=0.01)
    if step:
        for p in parts:
            stepped(p, opt.optimizers[parts.index(p)])
    return parts, opt


def _container_values(opt: OptimizersContainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state_dict().items() if isinstance(v, torch.Tensor)}


def test_flat_optimizer_container_round_trips(tmp_path):
    parts, opt = _stages(0, ac=True)
    for o in opt.optimizers:
        o.param_groups[0]["lr"] = 0.03          # param groups come back too
    state = {"embed": parts[0], "head": parts[1], "optim": opt}
    omnickpt.save(str(tmp_path / "c"), state)
    names = _names(tmp_path / "c")
    assert "optim/state/embed.weight/exp_avg" in names and "optim/state/head.bias/step" in names
    parts2, opt2 = _stages(3, step=False)      # never stepped, no activation checkpointing
    omnickpt.load(str(tmp_path / "c"), {"embed": parts2[0], "head": parts2[1], "optim": opt2})
    assert _same(_container_values(opt), _container_values(opt2)) == []
    assert [o.param_groups[0]["lr"] for o in opt2.optimizers] == [0.03, 0.03]


def test_flat_optimizer_container_loads_a_torch_optimizers_and_a_dcp_checkpoint(tmp_path):
    model, opt = _gpt(0)
    want = _optim_values(model, opt)
    omnickpt.save(str(tmp_path / "omni"), {"model": model, "optim": opt})
    # as torchtitan writes it: the container's flattened state dict under "optim"
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": get_state_dict(model, opt)[0], "optim": flat}, checkpoint_id=str(tmp_path / "dcp"),
             no_dist=True)
    for path in ("omni", "dcp"):
        torch.manual_seed(5)
        model2 = TinyGPT()
        opt2 = OptimizersContainer([model2], lr=0.5)
        omnickpt.load(str(tmp_path / path), {"model": model2, "optim": opt2})
        assert _same(want, _container_values(opt2)) == [], path
        assert opt2.optimizers[0].param_groups[0]["lr"] == 0.01


def test_flat_optimizer_container_refuses_another_kind_of_state_by_name(tmp_path):
    model, opt = _gpt(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(model, sgd)
    omnickpt.save(str(tmp_path / "sgd"), {"model": model, "optim": sgd})
    torch.manual_seed(5)
    model2 = TinyGPT()
    with pytest.raises(MismatchError, match=r"momentum_buffer.*torch\.optim\.sgd\.SGD.*OptimizersContainer"):
        omnickpt.load(str(tmp_path / "sgd"), {"model": model2, "optim": OptimizersContainer([model2], lr=0.5)})
    # and a container's checkpoint into a torch optimizer that has no state yet: named, not a KeyError
    parts, container = _stages(0)
    omnickpt.save(str(tmp_path / "c"), {"embed": parts[0], "head": parts[1], "optim": container})
    parts2, _ = _stages(1, step=False)
    adam = torch.optim.Adam([p for part in parts2 for p in part.parameters()])
    with pytest.raises(MismatchError, match="OptimizersContainer"):
        omnickpt.load(str(tmp_path / "c"), {"embed": parts2[0], "head": parts2[1], "optim": adam})


def _fsdp2_container(rank, world_size, path):
    """run_ranks body: FSDP2 ToyMLP behind a container; save, load into a fresh one (another seed);
    returns the saved full values and the names that came back different."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    mesh = DeviceMesh("cpu", torch.arange(world_size))

    def build(seed):
        torch.manual_seed(seed)
        model = apply_layout(ToyMLP(), "fsdp2", mesh=mesh)
        opt = OptimizersContainer([model], lr=0.01)
        stepped(model, opt.optimizers[0])
        return model, opt

    def full(opt):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone()) for k, v in opt.state_dict().items()
                if isinstance(v, torch.Tensor)}

    model, opt = build(0)
    saved = full(opt)
    omnickpt.save(path, {"model": model, "optim": opt})
    model2, opt2 = build(4)
    omnickpt.load(path, {"model": model2, "optim": opt2})
    got = full(opt2)
    return saved, [k for k in saved if not torch.equal(saved[k], got[k])]


def test_flat_optimizer_container_under_fsdp2_reshards_from_2_ranks_to_1(tmp_path):
    path = str(tmp_path / "c")
    results = run_ranks(2, _fsdp2_container, path)
    saved = results[0][0]
    assert [r[1] for r in results] == [[], []]
    assert any(n.startswith("optim/state/fc1.weight/") for n in _names(path))
    torch.manual_seed(9)
    model = ToyMLP()
    opt = OptimizersContainer([model], lr=0.5)
    omnickpt.load(path, {"model": model, "optim": opt})
    assert _same(saved, _container_values(opt)) == []
    assert opt.optimizers[0].param_groups[0]["lr"] == 0.01


class NestedContainer(OptimizersContainer):
    """A container whose state_dict() is neither torch's nor flattened: one torch state dict per part."""

    def state_dict(self):
        return {f"part{i}": o.state_dict() for i, o in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict):
        for i, o in enumerate(self.optimizers):
            o.load_state_dict(state_dict[f"part{i}"])


def test_optimizer_with_another_state_dict_layout_round_trips_as_a_stateful(tmp_path):
    parts, _ = _stages(0, step=False)
    opt = NestedContainer(parts, lr=0.02)
    for part, o in zip(parts, opt.optimizers):
        stepped(part, o)
    omnickpt.save(str(tmp_path / "c"), {"embed": parts[0], "head": parts[1], "optim": opt})
    parts2, _ = _stages(3, step=False)
    opt2 = NestedContainer(parts2, lr=0.5)
    omnickpt.load(str(tmp_path / "c"), {"embed": parts2[0], "head": parts2[1], "optim": opt2})
    for a, b in zip(opt.optimizers, opt2.optimizers):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
