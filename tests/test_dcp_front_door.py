"""omnickpt.dcp: code written for torch.distributed.checkpoint switches by one import and back (issue 19).

The training script below is DCP's documented pattern (an AppState Stateful calling get_state_dict /
set_state_dict, FSDP2 on 2 gloo ranks); it takes the checkpoint module as an argument, so the very same
code runs with `torch.distributed.checkpoint` and with `omnickpt.dcp`. Resume checks: the losses of the
steps after a resume equal an uninterrupted run's, bit for bit.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import omnickpt
from dist import run_ranks
from omnickpt import dcp
from omnickpt.errors import MismatchError, UnsupportedError
from omnickpt.export.dcp import export_dcp

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

STEPS, SAVE_AT = 6, 3


class AppState(Stateful):
    """DCP's tutorial wrapper: the model's and optimizer's state dicts through get/set_state_dict."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _module(name: str):
    return omnickpt.dcp if name == "omnickpt" else torch_dcp


def _build(world_size: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    if world_size > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh("cpu", torch.arange(world_size))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _step(model, opt, sched, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.item()


def _state(model, opt, sched, step):
    return {"app": AppState(model, opt), "sched": sched, "step": step}


def _train_and_save(rank, world_size, paths):
    """Uninterrupted run; at SAVE_AT the same state is saved by torch DCP, omnickpt.dcp (sync) and
    omnickpt.dcp.async_save (awaited at the end, after more steps changed the state)."""
    model, opt, sched = _build(world_size)
    losses, pending, full = [], None, None
    for step in range(1, STEPS + 1):
        losses.append(_step(model, opt, sched, step, rank))
        if step == SAVE_AT:
            torch_dcp.save(_state(model, opt, sched, step), checkpoint_id=paths["torch"])
            dcp.save(_state(model, opt, sched, step), checkpoint_id=paths["omnickpt"])
            pending = dcp.async_save(_state(model, opt, sched, step), checkpoint_id=paths["async"])
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                    for k, v in get_state_dict(model, opt)[0].items()}   # the model as saved
    report = pending.result(timeout=120)
    return losses, report["path"], full


def _resume(rank, world_size, runs):
    """The DCP script's resume, once per (module name, path) of `runs` (in one launch: starting ranks is
    the slow part): build, load with that module's load, train to STEPS."""
    out = []
    for module_name, path in runs:
        model, opt, sched = _build(world_size, seed=99)    # other initial values: the load must replace them
        state = _state(model, opt, sched, 0)
        _module(module_name).load(state, checkpoint_id=path)
        out.append((state["step"], [_step(model, opt, sched, step, rank) for step in range(state["step"] + 1,
                                                                                          STEPS + 1)]))
    return out


def _full_after_load(rank, world_size, paths):
    out = []
    for path in paths:
        model, opt, sched = _build(world_size, seed=99)
        state = _state(model, opt, sched, 0)
        dcp.load(state, checkpoint_id=path)
        out.append((state["step"], sched.state_dict(), {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                                                        for k, v in get_state_dict(model, opt)[0].items()}))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontdoor")
    paths = {k: str(root / k) for k in ("torch", "omnickpt", "async")}
    out = run_ranks(2, _train_and_save, paths)
    paths["export"] = str(root / "export")
    export_dcp(paths["omnickpt"], paths["export"], progress=False)
    return {"paths": paths, "losses": [o[0] for o in out], "saved": out[0][2]}


def test_code_written_for_dcp_resumes_exactly_through_omnickpt_dcp(trained):
    paths, losses = trained["paths"], trained["losses"]
    assert omnickpt.is_committed(paths["omnickpt"]) and omnickpt.is_committed(paths["async"])
    runs = [("omnickpt", paths["omnickpt"]), ("omnickpt", paths["async"]),
            # a running DCP job's own checkpoints load unchanged into the same state dict
            ("omnickpt", paths["torch"]),
            # and back: the export is read by torch's dcp.load into the same state dict
            ("torch", paths["export"])]
    for rank, results in enumerate(run_ranks(2, _resume, runs)):
        for (name, path), (step, resumed) in zip(runs, results):
            assert step == SAVE_AT, (name, path)
            assert resumed == losses[rank][SAVE_AT:], (name, path, rank, resumed, losses[rank])


def test_a_two_rank_checkpoint_loads_on_one_rank(trained):
    # the omnickpt.dcp checkpoint and torch DCP's of the same state, both loaded on one rank
    (step, sched, full), (step2, sched2, full2) = run_ranks(
        1, _full_after_load, [trained["paths"]["omnickpt"], trained["paths"]["torch"]])[0]
    assert step == step2 == SAVE_AT and sched == sched2 and sched["last_epoch"] == SAVE_AT
    assert full.keys() == full2.keys() == trained["saved"].keys()
    for k in full:   # both equal the 2-rank model as it was saved (not merely each other)
        assert torch.equal(full[k], trained["saved"][k]) and torch.equal(full2[k], trained["saved"][k]), k


# ---------------------------------------------------------------------- one process
def _plain(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _same_model(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_keys_are_the_callers_and_values_come_back_in_place(tmp_path):
    model, opt = _plain(1)
    extra = torch.arange(5.0)
    dcp.save({"app": AppState(model, opt), "step": 7, "extra": extra, "w": torch.ones(3)},
             checkpoint_id=str(tmp_path / "c"))
    names = set(omnickpt.open(str(tmp_path / "c")).manifest.tensors)
    assert {"app/model/0.weight", "app/optim/state/0.weight/exp_avg", "extra", "w"} <= names, sorted(names)
    model2, opt2 = _plain(2)
    target_extra = torch.zeros(5)
    sd = {"app": AppState(model2, opt2), "step": 0, "extra": target_extra, "w": torch.zeros(3)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["step"] == 7 and sd["extra"] is target_extra and torch.equal(target_extra, extra)
    assert torch.equal(sd["w"], torch.ones(3)) and _same_model(model, model2)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])


def test_a_key_the_checkpoint_lacks_is_an_error_and_extra_checkpoint_keys_are_left(tmp_path):
    model, opt = _plain(1)
    dcp.save({"model": model.state_dict(), "epoch": 3}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(MismatchError, match="missing"):
        dcp.load({"model": model.state_dict(), "sched": {"last_epoch": 0}}, checkpoint_id=str(tmp_path / "c"))
    model2, _ = _plain(2)
    dcp.load({"model": model2.state_dict()}, checkpoint_id=str(tmp_path / "c"))   # "epoch" not asked for: fine
    assert _same_model(model, model2)
    from torch.distributed.checkpoint import DefaultLoadPlanner
    sd = {"model": _plain(3)[0].state_dict(), "sched": {"last_epoch": 0}}
    result = dcp.load(sd, checkpoint_id=str(tmp_path / "c"), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert any("sched" in d for d in result.differences) and sd["sched"] == {"last_epoch": 0}


def test_a_native_omnickpt_checkpoint_loads_into_dcp_state_dicts(tmp_path):
    model, opt = _plain(1)
    omnickpt.save(str(tmp_path / "n"), {"model": model, "optim": opt}).wait()
    model2, opt2 = _plain(2)
    msd, osd = get_state_dict(model2, opt2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path / "n"))
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert _same_model(model, model2)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_a_hugging_face_folder_loads_into_a_flat_dict_of_named_tensors(tmp_path):
    from safetensors.torch import save_file
    tensors = {"model.embed.weight": torch.randn(10, 4), "lm_head.weight": torch.randn(10, 4)}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    flat = {k: torch.zeros_like(v) for k, v in tensors.items()}
    omnickpt.load(str(tmp_path / "hf"), {"model": flat})
    assert all(torch.equal(flat[k], tensors[k]) for k in tensors)
    dcp.load({"model": (flat2 := {k: torch.zeros_like(v) for k, v in tensors.items()})},
             checkpoint_id=str(tmp_path / "hf"))
    assert all(torch.equal(flat2[k], tensors[k]) for k in tensors)


def test_async_save_return_types(tmp_path):
    model, opt = _plain(1)
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "a"))
    assert future.result(timeout=60)["path"].endswith("a") and omnickpt.is_committed(str(tmp_path / "a"))
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    response = dcp.async_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "b"), async_stager=object())
    assert isinstance(response, AsyncSaveResponse) and response.staging_completion.done()
    response.upload_completion.result(timeout=60)
    assert omnickpt.is_committed(str(tmp_path / "b"))


def test_dcp_storage_layers_and_planners(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
    model, _ = _plain(1)
    dcp.save({"model": model.state_dict()}, storage_writer=FileSystemWriter(str(tmp_path / "w")),
             planner=DefaultSavePlanner())
    model2, _ = _plain(2)
    dcp.load({"model": model2.state_dict()}, storage_reader=FileSystemReader(str(tmp_path / "w")))
    assert _same_model(model, model2)

    class MyPlanner(DefaultSavePlanner):
        pass
    with pytest.raises(UnsupportedError, match="planner=MyPlanner"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "p"), planner=MyPlanner())
    with pytest.raises(ValueError, match="checkpoint_id is required"):
        dcp.save({"model": model.state_dict()})
    assert not (tmp_path / "p").exists()


def test_the_names_dcp_code_reaches_through_its_module_are_there(tmp_path):
    # code that switched its import keeps calling dcp.FileSystemWriter, dcp.DefaultLoadPlanner, ...
    from torch.distributed.checkpoint import state_dict_saver
    for name in ("FileSystemWriter", "FileSystemReader", "DefaultSavePlanner", "DefaultLoadPlanner"):
        assert getattr(dcp, name) is getattr(torch_dcp, name), name
    for name in ("AsyncCheckpointerType", "AsyncSaveResponse"):
        assert getattr(dcp, name) is getattr(state_dict_saver, name), name
    assert dcp.Stateful is Stateful and dcp.stateful.Stateful is Stateful
    model, _ = _plain(1)
    future = dcp.async_save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "w")),
                            async_checkpointer_type=dcp.AsyncCheckpointerType.PROCESS)
    future.result(timeout=60)
    model2, _ = _plain(2)
    dcp.load({"model": model2.state_dict()}, storage_reader=dcp.FileSystemReader(str(tmp_path / "w")),
             planner=dcp.DefaultLoadPlanner())
    assert _same_model(model, model2)
