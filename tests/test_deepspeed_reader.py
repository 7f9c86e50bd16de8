"""DeepSpeed checkpoints read by omnickpt: ZeRO-1/2/3 tags written by the real `engine.save_checkpoint` at
2 ranks (fp32 and bf16), and universal folders of DeepSpeed's own `ds_to_universal`, loaded at 1 rank
(plain module + torch AdamW, what DeepSpeed's "Adam" steps) and 3 ranks (FSDP2), weights and Adam moments compared bitwise with what
DeepSpeed itself holds (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state` at save time) and
with `zero_to_fp32`'s reconstruction; hostile pickles, interrupted tags and model-parallel tags refused."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.errors import CorruptCheckpointError, MismatchError, NotCommittedError, UnsafeCheckpointError, UnsupportedError
from tests.dist import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# deepspeed is imported inside the functions that use it: the ranks that only load with omnickpt (spawned
# processes import this module) are spared its import
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]
# what real runs have besides: two parameter groups (no weight decay on biases), a frozen layer, buffers
RICH = [(2, "rich"), (3, "rich")]
ZERO0 = [(0, "fp32"), (0, "bf16")]     # no ZeRO: the module and the optimizer whole in the model file
ADAM = ("exp_avg", "exp_avg_sq")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # odd sizes: the partitions cut parameters in the middle and the flat buffers are padded
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def _rich() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    m[0].requires_grad_(False)
    return m


def _groups(m: nn.Module) -> list[dict]:
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _save_all(rank, world, root):
    """Each case: an engine trained 3 steps, saved by DeepSpeed; DeepSpeed's own full view of its fp32 master
    weights and Adam moments comes back from rank 0."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage, dtype in CASES + RICH + ZERO0:
        m = _rich() if dtype == "rich" else _model()
        params = _groups(m) if dtype == "rich" else m.parameters()
        eng, *_ = deepspeed.initialize(model=m, model_parameters=params, config=_config(stage, dtype))
        torch.manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randn(2, 10, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
            loss = eng(x).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
        eng.save_checkpoint(f"{root}/z{stage}_{dtype}", tag="global_step3", client_state={"epoch": 7})
        ref = {}
        if stage == 0:
            out[(stage, dtype)] = _zero0_reference(eng)
            continue
        for name, p in eng.module.named_parameters():
            if not p.requires_grad:
                ref[f"frozen/{name}"] = _rich().state_dict()[name]
                continue
            ref[f"model/{name}"] = safe_get_full_fp32_param(p).clone()
            # DeepSpeed 0.19.8's safe_get_full_optimizer_state fails for a second parameter group of ZeRO-1/2
            # ("exp_avg not found in optimizer state fragment"): those moments come from ds_to_universal
            for k in ADAM if dtype != "rich" else ():
                ref[f"optimizer/state/{name}/{k}"] = safe_get_full_optimizer_state(p, k).clone()
        for name, b in eng.module.named_buffers():
            ref[f"buffer/{name}"] = b.clone()
        out[(stage, dtype)] = ref
    return out if rank == 0 else None


def _zero0_reference(eng) -> dict[str, torch.Tensor]:
    """What a ZeRO-0 engine steps: the module's parameters (fp32), or FP16_UnfusedOptimizer's fp32 copies of
    them (bf16), and the torch optimizer's state of those."""
    opt = eng.optimizer
    groups = getattr(opt, "fp32_groups", None)
    params = [p for p in eng.module.parameters()]
    masters = [m for g in groups for m in g] if groups is not None else params
    inner = getattr(opt, "optimizer", opt)
    ref = {}
    for (name, _), m in zip(eng.module.named_parameters(), masters):
        ref[f"model/{name}"] = m.detach().clone()
        for k in ADAM:
            ref[f"optimizer/state/{name}/{k}"] = inner.state[m][k].clone()
    assert groups is None or all(m.dtype == torch.float32 for m in masters) and params[0].dtype == torch.bfloat16
    return ref


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    refs = run_ranks(2, _save_all, str(root))[0]
    return root, refs


def _plain_load(path) -> dict[str, torch.Tensor]:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    omnickpt.load(path, {"model": m, "optimizer": opt})
    out = {f"model/{n}": p.detach().clone() for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        for k in ADAM:
            out[f"optimizer/state/{n}/{k}"] = opt.state[p][k].clone()
        out[f"optimizer/state/{n}/step"] = opt.state[p]["step"].clone()
    return out


@pytest.mark.parametrize("stage,dtype", CASES)
def test_zero_tag_loads_into_a_plain_module_exactly(saved, stage, dtype):
    root, refs = saved
    got = _plain_load(root / f"z{stage}_{dtype}")   # the folder with `latest`
    for name, want in refs[(stage, dtype)].items():
        assert torch.equal(got[name], want), name
    assert all(float(got[f"optimizer/state/{n}/step"]) == 3.0 for n, _ in _model().named_parameters())
    # zero_to_fp32's reconstruction of the weights, the same bits
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / f"z{stage}_{dtype}"))
    for name, t in fp32.items():
        assert torch.equal(got[f"model/{name}"], t.contiguous()), name


@pytest.mark.parametrize("stage", [2, 3])
def test_groups_frozen_layers_and_buffers_load_exactly(saved, stage, tmp_path):
    root, refs = saved
    ref = dict(refs[(stage, "rich")])
    _universal(root / f"z{stage}_rich" / "global_step3", tmp_path / "u")     # DeepSpeed's own view of the moments
    for name, p in _rich().named_parameters():
        for k in ADAM if p.requires_grad else ():
            t = torch.load(tmp_path / "u" / "zero" / name / f"{k}.pt", weights_only=True)
            ref[f"optimizer/state/{name}/{k}"] = (t["param"] if isinstance(t, dict) else t).view(p.shape)
    m = _rich()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    opt = torch.optim.AdamW(_groups(m), lr=1e-2)
    omnickpt.load(root / f"z{stage}_rich", {"model": m, "optimizer": opt})
    named = dict(m.named_parameters())
    for key, want in ref.items():
        kind, name = key.split("/", 1)
        if kind == "frozen":
            got = named[name]
        elif kind == "buffer":
            got = dict(m.named_buffers())[name]
        elif kind == "model":
            got = named[name]
        else:
            pname, k = name.removeprefix("state/").rsplit("/", 1)
            got = opt.state[named[pname]][k]
        assert torch.equal(got.detach(), want), key
    # each group keeps its own hyper-parameters and its own parameters
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    biases = {id(named[n]) for n in named if n.endswith("bias") and n != "0.bias"}
    assert {id(p) for p in opt.param_groups[1]["params"]} == biases


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero0_tags_load_their_fp32_masters(saved, dtype):
    """No ZeRO: the weights are the fp32 masters (bf16: FP16_UnfusedOptimizer's fp32_groups, not the module's
    bf16 copies, which would lose the masters' precision silently), the moments the torch optimizer's."""
    root, refs = saved
    got = _plain_load(root / f"z0_{dtype}")
    for name, want in refs[(0, dtype)].items():
        assert torch.equal(got[name], want), name
    assert omnickpt.open(root / f"z0_{dtype}").layout["zero_stage"] == 0


def test_engine_state_and_client_state_are_objects(saved):
    root, _ = saved
    reader = omnickpt.open(root / "z2_bf16" / "global_step3")
    assert reader.layout["format"] == "deepspeed" and reader.layout["zero_stage"] == 2
    assert reader.layout["world_size"] == 2
    objects = reader.objects()
    assert objects["epoch"] == 7
    assert objects["deepspeed"]["global_steps"] == 3 and objects["deepspeed"]["ds_config"]["bf16"]["enabled"]
    assert [g["params"] for g in objects["optimizer"]["param_groups"]] == [[n for n, _ in _model().named_parameters()]]


def _load_full(m: nn.Module, path) -> dict[str, torch.Tensor]:
    """Load `path` into sharded module `m` and a torch Adam over it; every weight and moment gathered whole."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    omnickpt.load(path, {"model": m, "optimizer": opt})
    out = {}
    for n, p in m.named_parameters():
        out[f"model/{n}"] = p.full_tensor().clone()
        for k in ADAM:
            out[f"optimizer/state/{n}/{k}"] = opt.state[p][k].full_tensor().clone()
    return out


def _fsdp2_load(rank, world, paths):
    from torch.distributed.fsdp import fully_shard
    outs = []
    for path in paths:
        m = _model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        outs.append(_load_full(m, path))
    return outs if rank == 0 else None


def test_zero_tags_load_into_three_fsdp2_ranks_exactly(saved):
    root, refs = saved
    cases = CASES
    got = run_ranks(3, _fsdp2_load, [str(root / f"z{stage}_{dtype}") for stage, dtype in cases])[0]
    for case, mine in zip(cases, got):
        for name, want in refs[case].items():
            assert torch.equal(mine[name], want), (case, name)


def _two_d_load(rank, world, path):
    """FSDP2 x tensor parallel on a 2 x 2 mesh: layer 0 column-wise, layer 2 row-wise, all sharded over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    out = _load_full(m, path)
    return out if rank == 0 else None


def test_zero_tag_loads_into_a_two_d_mesh_exactly(saved):
    root, refs = saved
    got = run_ranks(4, _two_d_load, str(root / "z2_fp32"))[0]
    for name, want in refs[(2, "fp32")].items():
        assert torch.equal(got[name], want), name


def _universal(src: Path, dst: Path) -> None:
    """DeepSpeed's offline converter, in this process (one worker each way runs no pool; a process of its own
    would spend seconds importing deepspeed for each conversion)."""
    from contextlib import redirect_stdout
    from io import StringIO
    from deepspeed.checkpoint import ds_to_universal
    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", str(src), "--output_folder", str(dst), "--inject_missing_state",
                "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        with redirect_stdout(StringIO()):
            ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def _ds_universal_load(rank, world, cases):
    """DeepSpeed's own universal load into an engine at `world` ranks: its view of the weights and moments."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    deepspeed.init_distributed(dist_backend="gloo")
    outs = []
    for folder, stage, dtype in cases:
        m = _model()
        cfg = {**_config(stage, dtype), "checkpoint": {"load_universal": True}}
        eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        eng.load_checkpoint(folder, tag="universal")
        out = {}
        for name, p in eng.module.named_parameters():
            out[f"model/{name}"] = safe_get_full_fp32_param(p).clone()
            for k in ADAM:
                out[f"optimizer/state/{name}/{k}"] = safe_get_full_optimizer_state(p, k).clone()
        outs.append(out)
    return outs


def test_universal_folders_load_like_deepspeeds_own_universal_load(saved, tmp_path):
    root, refs = saved
    cases = []
    for stage, dtype in [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]:
        folder = tmp_path / f"u{stage}{dtype}"
        _universal(root / f"z{stage}_{dtype}" / "global_step3", folder / "universal")
        got = _plain_load(folder / "universal")
        for name, want in refs[(stage, dtype)].items():
            assert torch.equal(got[name], want), (stage, dtype, name)
        assert omnickpt.open(folder / "universal").layout["universal"] is True
        cases.append((got, (str(folder), stage, dtype)))
    theirs = run_ranks(1, _ds_universal_load, [case for _, case in cases])[0]
    for (got, case), their in zip(cases, theirs):
        for name, want in their.items():
            assert torch.equal(got[name], want), (case, name)


# ---------------------------------------------------------------------- refusals
class _Hostile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_raises_unsafe_and_runs_nothing(saved, tmp_path):
    root, _ = saved
    tag = tmp_path / "z1"
    shutil.copytree(root / "z1_fp32" / "global_step3", tag)
    marker = tmp_path / "ran"
    torch.save({"module": {}, "buffer_names": [], "param_shapes": [{}], "evil": _Hostile(str(marker))},
               tag / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"mp_rank_00_model_states\.pt.*posix\.system|system"):
        omnickpt.open(tag)
    with pytest.raises(UnsafeCheckpointError):
        omnickpt.load(tag, {"model": _model()})
    assert not marker.exists()
    # the hostile global in an optimizer file is refused the same way, by file name
    tag2 = tmp_path / "z1b"
    shutil.copytree(root / "z1_fp32" / "global_step3", tag2)
    torch.save({"optimizer_state_dict": {"x": _Hostile(str(marker))}}, tag2 / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        omnickpt.open(tag2)
    assert not marker.exists()


def test_a_pickle_that_builds_state_on_a_shared_object_is_refused(saved, tmp_path):
    tag = tmp_path / "z"
    shutil.copytree(saved[0] / "z1_fp32" / "global_step3", tag)
    # BUILD onto a dtype (a process-wide object) instead of onto a record
    payload = b"\x80\x02ctorch\nfloat32\n}X\x01\x00\x00\x00aK\x01sb."
    with zipfile.ZipFile(tag / "mp_rank_00_model_states.pt", "w") as z:
        z.writestr("archive/data.pkl", payload)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_00_model_states\.pt.*BUILD"):
        omnickpt.open(tag)
    assert not hasattr(torch.float32, "a")


def test_latest_naming_an_unfinished_tag_is_refused_by_name(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved[0] / "z2_fp32", root)
    (root / "latest").write_text("global_step9")      # DeepSpeed wrote `latest`, the crash lost the tag
    with pytest.raises(NotCommittedError, match=r"global_step9.*interrupted.*global_step3"):
        omnickpt.load(root, {"model": _model()})
    (root / "latest").write_text("global_step3")
    os.remove(root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(NotCommittedError, match=r"rank.*missing"):
        omnickpt.load(root, {"model": _model()})


def test_model_parallel_and_pipeline_tags_are_refused_by_name(saved, tmp_path):
    tag = tmp_path / "tp"
    shutil.copytree(saved[0] / "z1_fp32" / "global_step3", tag)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(UnsupportedError, match=r"model-parallel.*mp_rank 0, 1.*ds_to_universal"):
        omnickpt.open(tag)
    pp = tmp_path / "pp"
    shutil.copytree(saved[0] / "z1_fp32" / "global_step3", pp)
    shutil.copy(pp / "mp_rank_00_model_states.pt", pp / "layer_01-model_00-model_states.pt")
    with pytest.raises(UnsupportedError, match="pipeline-parallel"):
        omnickpt.open(pp)


def test_a_shape_mismatch_names_the_tensor(saved):
    m = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    with pytest.raises(MismatchError, match=r"0\.weight"):
        omnickpt.load(saved[0] / "z3_fp32", {"model": m})


# ---------------------------------------------------------------------- the tools
def test_tools_read_a_deepspeed_tag(saved, tmp_path):
    root, refs = saved
    tag = root / "z3_bf16" / "global_step3"
    shown = subprocess.run([sys.executable, "-m", "omnickpt", "inspect", str(tag)], capture_output=True, text=True,
                           check=True).stdout
    assert "deepspeed" in shown and "model/0.weight" in shown
    report = omnickpt.verify(tag)
    assert report.ok, report.problems
    from omnickpt.convert import convert
    for to in ("omnickpt", "hf", "dcp", "deepspeed"):
        convert(str(tag), str(tmp_path / to), to=to, progress=False)
    back = _plain_load(tmp_path / "deepspeed")     # our universal export, read back by the reader
    for name, want in refs[(3, "bf16")].items():
        assert torch.equal(back[name], want), name
    mine = omnickpt.open(tmp_path / "omnickpt")
    assert torch.equal(mine.get("model/2.weight"), refs[(3, "bf16")]["model/2.weight"])
    assert torch.equal(mine.get("optimizer/state/2.weight/exp_avg"), refs[(3, "bf16")]["optimizer/state/2.weight/exp_avg"])
    assert not omnickpt.diff(tag, tmp_path / "omnickpt").differs
    from safetensors.torch import load_file
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(hf["0.weight"], refs[(3, "bf16")]["model/0.weight"])


# ---------------------------------------------------------------------- into a live engine, no offline step
def _into_engine(rank, world, tag, stage):
    """A ZeRO-3 tag of 2 ranks into an engine of `world` ranks at another stage, by omnickpt's load_checkpoint."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from omnickpt.integrations.deepspeed import load_checkpoint
    deepspeed.init_distributed(dist_backend="gloo")
    m = nn.Sequential(*[nn.Linear(i, o) for i, o in ((10, 7), (7, 5), (5, 3))])   # other initial weights
    m.insert(1, nn.ReLU())
    m.insert(3, nn.ReLU())
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, "fp32"))
    client = load_checkpoint(eng, tag)
    out = {"client": client, "global_steps": eng.global_steps}
    for name, p in eng.module.named_parameters():
        out[f"model/{name}"] = safe_get_full_fp32_param(p).clone()
        for k in ADAM:
            out[f"optimizer/state/{name}/{k}"] = safe_get_full_optimizer_state(p, k).clone()
    x = torch.randn(2, 10)
    loss = eng(x).pow(2).mean()
    eng.backward(loss)
    eng.step()          # and training goes on from it
    out["stepped"] = bool(torch.isfinite(loss))
    return out


def test_a_zero3_tag_of_two_ranks_loads_into_a_zero1_engine_of_one(saved):
    root, refs = saved
    got = run_ranks(1, _into_engine, str(root / "z3_fp32"), 1)[0]
    for name, want in refs[(3, "fp32")].items():
        assert torch.equal(got[name], want), name
    assert got["client"] == {"epoch": 7} and got["global_steps"] == 3 and got["stepped"]
    assert omnickpt.open(root / "z3_fp32").layout["frameworks"]["optimizer"] == "torch.optim.adamw.AdamW"
