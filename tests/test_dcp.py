"""PyTorch DCP checkpoints (omnickpt/formats/dcp.py): `dcp.save` folders load with omnickpt.load at other
world sizes and layouts, bit for bit (model, Adam moments and step, param groups); omnickpt
checkpoints export to folders `dcp.load` reads; and a DCP folder is untrusted input: a `.metadata`
or tensor pickle that would run code runs nothing, damaged files fail with CorruptCheckpointError
naming the file before anything is installed.

Expected values come from the saving side (DTensor.full_tensor() under FSDP2), never from omnickpt.
Cost: one 2-rank launch (dcp.save and omnickpt.save of the same FSDP2 model), one 3-rank load, and one
2-rank launch for Megatron-core's torch_dist saver (skipped without megatron-core).
"""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)

import omnickpt
from dist import run_ranks
from models import ToyMLP, full_values, hand_made_dcp, stepped, toy
from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.export.dcp import export_dcp
from omnickpt.formats import dcp as dcp_format
from omnickpt.storage import storage_for

GROUP_FIELDS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def _groups(opt) -> list[dict]:
    return [{k: g[k] for k in GROUP_FIELDS} for g in opt.param_groups]


def _diff(want: dict, got: dict) -> list[str]:
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
    return [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]


# ---------------------------------------------------------------------- multi-rank bodies
def _save_fsdp2(rank, world_size, dcp_path, omni_path):
    """FSDP2 ToyMLP + Adam after one step: dcp.save of get_state_dict, and omnickpt.save of the same
    state (with a scheduler and a plain value); returns the full values and param groups."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    model, opt = toy("fsdp2", 0, mesh)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=dcp_path)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    omnickpt.save(omni_path, {"model": model, "optimizer": opt, "sched": sched, "epoch": 7,
                              "extra": {"t": torch.arange(3.0), "note": "x"}}).wait()
    return full_values(model, opt), _groups(opt), sched.state_dict()


def _load_fsdp2(rank, world_size, path):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    model, opt = toy("fsdp2", 5, mesh)
    result = omnickpt.load(path, {"model": model, "optimizer": opt})
    return full_values(model, opt), _groups(opt), result.differences


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    dcp_path, omni_path = str(root / "dcp"), str(root / "omni")
    values, groups, sched = run_ranks(2, _save_fsdp2, dcp_path, omni_path)[0]
    return {"dcp": dcp_path, "omni": omni_path, "values": values, "groups": groups, "sched": sched}


# ---------------------------------------------------------------------- loading DCP checkpoints
def test_fsdp2_dcp_checkpoint_loads_into_a_plain_process(saved):
    manifest = omnickpt.api.read_manifest(storage_for(saved["dcp"]))
    assert manifest.layout["format"] == "dcp" and manifest.world_size == 2
    assert all(b.sums is None for t in manifest.tensors.values() for b in t.boxes)
    model, opt = toy("plain", 5)
    result = omnickpt.load(saved["dcp"], {"model": model, "optimizer": opt})
    assert result.differences == []
    assert _diff(saved["values"], full_values(model, opt)) == []
    assert _groups(opt) == saved["groups"]
    assert {k for st in opt.state.values() for k in st} == {"exp_avg", "exp_avg_sq", "step"}
    stepped(model, opt)     # the loaded optimizer steps like the saved one would


def test_fsdp2_dcp_checkpoint_loads_into_three_fsdp2_ranks(saved):
    for values, groups, differences in run_ranks(3, _load_fsdp2, saved["dcp"]):
        assert differences == []
        assert _diff(saved["values"], values) == []
        assert groups == saved["groups"]


def test_other_top_level_entries_load_into_state_entries(tmp_path):
    model, opt = toy("plain", 0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sched.step()
    rng = torch.get_rng_state()
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
              "sched": sched.state_dict(), "epoch": 4, "extra": {"note": "x", "t": torch.arange(3.0), "l": [1, 2]},
              "rng": rng}, checkpoint_id=str(tmp_path), no_dist=True)
    model2, opt2 = toy("plain", 5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=9)
    t = torch.zeros(3)
    state = {"model": model2, "optimizer": opt2, "sched": sched2, "epoch": 0, "extra": {"t": t}, "rng": None}
    omnickpt.load(str(tmp_path), state)
    assert _diff(full_values(model, opt), full_values(model2, opt2)) == []
    assert sched2.state_dict() == sched.state_dict()
    assert state["epoch"] == 4 and state["extra"]["note"] == "x" and state["extra"]["l"] == [1, 2]
    assert state["extra"]["t"] is t and torch.equal(t, torch.arange(3.0))   # filled in place
    assert torch.equal(state["rng"], rng)


def test_flat_model_state_dict_and_flattened_optimizer(tmp_path):
    """dcp.save(model.state_dict()) (keys at the top level) reads as the module "model"; an optimizer
    state dict from flatten_optimizer_state_dict=True (torchtitan's) as an optimizer."""
    model, opt = toy("plain", 0)
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**get_model_state_dict(model), "optimizer": flat}, checkpoint_id=str(tmp_path), no_dist=True)
    assert dcp_format.read_manifest(storage_for(str(tmp_path))).layout["implied_keys"] == ["model"]
    model2, opt2 = toy("plain", 5)
    omnickpt.load(str(tmp_path), {"model": model2, "optimizer": opt2})
    assert _diff(full_values(model, opt), full_values(model2, opt2)) == []
    assert _groups(opt2) == _groups(opt)


# ---------------------------------------------------------------------- export
def test_export_of_a_two_rank_omnickpt_checkpoint_loads_with_dcp(saved, tmp_path):
    out = str(tmp_path / "exported")
    report = export_dcp(saved["omni"], out, progress=False)
    assert report["tensors"] == len(saved["values"]) and report["chunks"] > report["tensors"]   # FSDP2 shards kept
    model = ToyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    # dcp.load fills the keys the target holds: a fresh scheduler's state dict has them all
    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt), "epoch": 0,
          "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=9).state_dict(),
          "extra": {"t": torch.zeros(3), "note": ""}}
    t = sd["extra"]["t"]
    dcp.load(sd, checkpoint_id=out, no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert _diff(saved["values"], full_values(model, opt)) == []
    assert _groups(opt) == saved["groups"]
    assert sd["epoch"] == 7 and sd["sched"] == saved["sched"] and sd["extra"]["note"] == "x"
    assert sd["extra"]["t"] is t and torch.equal(t, torch.arange(3.0))     # a tensor to DCP: filled in place
    # and the export reads back through omnickpt's own DCP reader
    model2, opt2 = toy("plain", 5)
    omnickpt.load(out, {"model": model2, "optimizer": opt2})
    assert _diff(saved["values"], full_values(model2, opt2)) == []


def test_export_refuses_a_destination_that_is_not_empty(saved, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(omnickpt.errors.CheckpointError, match="not empty"):
        export_dcp(saved["omni"], str(tmp_path), progress=False)
    assert os.listdir(tmp_path) == ["keep.txt"]


# ---------------------------------------------------------------------- untrusted input
class _Call:
    """Pickles as a call of `fn(*args)`: what a malicious checkpoint would hold."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _plain_dcp(path) -> None:
    model, opt = toy("plain", 0)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("attack", ["os.system", "subprocess", "eval", "nested"])
def test_malicious_metadata_runs_nothing(tmp_path, attack):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _plain_dcp(ckpt)
    refused = {"os.system": "posix.system", "subprocess": "subprocess.check_call", "eval": "builtins.eval",
               "nested": "posix.system"}[attack]
    payload = {"os.system": _Call(os.system, f"touch {marker}"),
               "subprocess": _Call(subprocess.check_call, ["touch", str(marker)]),
               "eval": _Call(eval, f"open({str(marker)!r}, 'w')")}.get(attack)
    if attack == "nested":   # a real DCP Metadata whose planner data holds the call, deep inside
        with open(ckpt / ".metadata", "rb") as f:
            md = pickle.load(f)
        md.planner_data["model.fc1.weight"] = (_Call(os.system, f"touch {marker}"),)
        payload = md
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload))
    model, opt = toy("plain", 5)
    before = full_values(model, opt)
    with pytest.raises(UnsafeCheckpointError) as err:
        omnickpt.load(str(ckpt), {"model": model, "optimizer": opt})
    assert str(ckpt / ".metadata") in str(err.value) and refused in str(err.value)
    assert not marker.exists()
    assert _diff(before, full_values(model, opt)) == []


def test_malicious_tensor_pickle_and_value_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    # a value DCP stores with torch.save: torch's weights-only unpickler refuses it
    dcp.save({"x": torch.zeros(2), "evil": _Call(os.system, f"touch {marker}")}, checkpoint_id=str(tmp_path / "a"),
             no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="'evil'.*weights-only"):
        dcp_format.read_manifest(storage_for(str(tmp_path / "a")))
    # a tensor item whose data.pkl calls os.system, in an otherwise well-formed archive and folder
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=2))
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", bytes(8))
    hand_made_dcp(tmp_path / "b", archive.getvalue())
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0.distcp.*'model.w'.*posix.system"):
        omnickpt.load(str(tmp_path / "b"), {"model": nn.Linear(1, 2, bias=False)})
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_metadata_is_corrupt(tmp_path, damage):
    _plain_dcp(tmp_path)
    raw = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes({"truncated": raw[:len(raw) // 2], "garbage": os.urandom(300),
                                          "empty": b""}[damage])
    model, opt = toy("plain", 5)
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path / ".metadata")):
        omnickpt.load(str(tmp_path), {"model": model, "optimizer": opt})


def test_truncated_data_file_fails_before_anything_is_installed(tmp_path):
    _plain_dcp(tmp_path)
    path = tmp_path / "__0_0.distcp"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 700])
    model, opt = toy("plain", 5)
    before = full_values(model, opt)
    with pytest.raises(CorruptCheckpointError, match=f"{path}.*truncated"):
        omnickpt.load(str(tmp_path), {"model": model, "optimizer": opt})
    assert _diff(before, full_values(model, opt)) == []


def test_damaged_tensor_item_names_the_tensor(tmp_path):
    _plain_dcp(tmp_path)
    manifest = dcp_format.read_manifest(storage_for(str(tmp_path)))
    box = manifest.tensors["model/fc1.weight"].boxes[0]
    path = tmp_path / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    start = data.rfind(b"PK\x05\x06", 0, box.offset + box.nbytes + 2000)   # that item's end of central directory
    data[start:start + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp.*'model.fc1.weight'"):
        dcp_format.read_manifest(storage_for(str(tmp_path)))


def test_unmappable_items_are_refused_clearly(tmp_path):
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3).t())    # column-major storage: torch.save keeps the strides
    dcp.save({"model": T().state_dict()}, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    with pytest.raises(UnsupportedError, match=r"'model.w'.*not row-major"):
        dcp_format.read_manifest(storage_for(str(tmp_path / "t")))
    # stream transforms (compression): refused from the metadata alone
    _plain_dcp(tmp_path / "z")
    with open(tmp_path / "z" / ".metadata", "rb") as f:
        md = pickle.load(f)
    next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
    (tmp_path / "z" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsupportedError, match="stream transforms"):
        dcp_format.read_manifest(storage_for(str(tmp_path / "z")))


def test_not_a_dcp_folder(tmp_path):
    assert dcp_format.read_manifest(storage_for(str(tmp_path / "missing"))) is None
    assert dcp_format.read_manifest(storage_for(str(tmp_path))) is None


def test_metadata_unpickler_admits_what_real_metadata_holds(tmp_path):
    """Every global a real torch 2.13 .metadata names is admitted (a dcp.save with every kind of entry)."""
    names = set()

    class Log(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    model, opt = toy("plain", 0)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
              "half": torch.ones(2, dtype=torch.bfloat16), "v": {"a": 1}}, checkpoint_id=str(tmp_path), no_dist=True)
    Log(io.BytesIO((tmp_path / ".metadata").read_bytes())).load()
    assert names and all(n in dcp_format._METADATA_GLOBALS for n in names), names - set(dcp_format._METADATA_GLOBALS)


# ---------------------------------------------------------------------- Megatron-core torch_dist
def _megatron_on_cpu() -> None:
    """Let megatron-core 0.12's torch_dist saver run in a CPU test rank, with its own code path and file
    format: it imports psutil (only for a memory log line), forks writer processes (our ranks are
    daemonic), synchronises CUDA and puts a CUDA flag tensor through an all-reduce, and calls torch's
    _write_item without the serialization_format argument torch 2.13 added."""
    import multiprocessing
    import sys
    import types
    sys.modules.setdefault("psutil", types.ModuleType("psutil"))
    multiprocessing.current_process()._config.pop("daemon", None)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa
    from torch.distributed.checkpoint import filesystem as tfs
    fa._process_memory = lambda: 0
    fa._write_item = lambda *a: tfs._write_item(*a, tfs.SerializationFormat.TORCH_SAVE)


def _megatron_torch_dist(rank, world_size, path):
    """A GPTModel at TP2 and Megatron's FP32Optimizer(Adam) after one step, saved by Megatron's
    dist_checkpointing (torch_dist) and by omnickpt; each loaded by omnickpt into TP1 x PP2."""
    _megatron_on_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from test_megatron import VOCAB, build, local_state, megatron_fp32_optimizer, train_step
    model = build(2, 1, VOCAB, 0)
    opt = megatron_fp32_optimizer(model)
    train_step(model, opt, 1)
    omnickpt.save(f"{path}-omnickpt", {"model": model, "optimizer": opt}).wait()
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, path,
                            TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    out = []
    for src in (f"{path}-omnickpt", path):
        model2 = build(1, 2, VOCAB, 3)
        opt2 = megatron_fp32_optimizer(model2)
        train_step(model2, opt2, 2)
        out.append((omnickpt.load(src, {"model": model2, "optimizer": opt2}).differences, local_state(model2, opt2)))
    return out


def test_megatron_torch_dist_checkpoint_loads_like_omnickpts_own(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.12.2 "
                                                "--no-deps)")
    path = str(tmp_path / "torch_dist")
    os.makedirs(path)
    for (d_omni, own), (d_dcp, theirs) in run_ranks(2, _megatron_torch_dist, path):
        assert d_omni == d_dcp == []
        assert own["model"].keys() == theirs["model"].keys() and own["optim"].keys() == theirs["optim"].keys()
        assert not [k for k in own["model"] if not torch.equal(own["model"][k], theirs["model"][k])]
        assert not [(p, k) for p, st in own["optim"].items() for k in st
                    if not torch.equal(st[k], theirs["optim"][p][k])]
        assert {k for st in theirs["optim"].values() for k in st} == {"exp_avg", "exp_avg_sq", "step"}
    layout = omnickpt.api.read_manifest(storage_for(path)).layout
    assert layout["format"] == "dcp" and layout["megatron"]["sharded_backend"] == "torch_dist"
    assert layout["implied_keys"] == ["model", "optimizer"] and "skipped" not in layout["megatron"]


def test_megatron_flattened_optimizer_state_maps_to_its_boxes(tmp_path):
    """Distributed-optimizer state (flattened_range) as torch_dist stores it: global shape [4, 6] with local
    blocks [2, 6] reformulated as [2, 1, 12], chunks being flat ranges of a block."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    full = torch.arange(24.0).reshape(4, 6)
    blocks = [full[:2].reshape(-1), full[2:].reshape(-1)]
    chunks = [((0, 0, 0), blocks[0][:5]), ((0, 0, 5), blocks[0][5:]), ((1, 0, 0), blocks[1])]
    data, storage_data, metas = io.BytesIO(), {}, []
    for offsets, values in chunks:
        at = data.tell()
        torch.save(values.clone().reshape(1, 1, -1), data)
        metas.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size([1, 1, values.numel()])))
        storage_data[MetadataIndex("w", offsets)] = _StorageInfo("__0_0.distcp", at, data.tell() - at)
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 1, 12]), metas)},
                  storage_data=storage_data)
    md.mcore_data = {"w": {"nd_reformulated_orig_global_shape": (4, 6)}}
    (tmp_path / "__0_0.distcp").write_bytes(data.getvalue())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(4, 6))
    omnickpt.load(str(tmp_path), {"model": module})
    assert torch.equal(module.w.detach(), full)
