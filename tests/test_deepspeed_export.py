"""export_deepspeed / `omnickpt convert SRC DST --to deepspeed`: a checkpoint of a model and its Adam state written
as a DeepSpeed universal checkpoint, which real DeepSpeed engines (2 gloo ranks, ZeRO 1, 2 and 3, fp32 and bf16)
load with load_universal: their fp32 master weights and Adam moments equal the source's bitwise, and they train on.
And what a failed or refused export leaves: no `latest`, and an existing checkpoint untouched."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import omnickpt
from omnickpt.cli import main as cli
from omnickpt.convert import convert
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.export import deepspeed as ds_export
from omnickpt.export import export_deepspeed

from dist import run_ranks
from models import ToyMLP, stepped, toy

LR = 3e-3    # not DeepSpeed's config lr (1e-2): the loaded param groups must carry the source's


def _single_rank_source(path: str, steps: int = 3, dtype: torch.dtype = torch.float32) -> str:
    """A plain ToyMLP and torch Adam, stepped `steps` times, saved by one process."""
    torch.manual_seed(0)
    model = ToyMLP().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(steps):
        stepped(model, opt)
    omnickpt.save(path, {"model": model, "optimizer": opt}).wait()
    return path


def _fsdp2_save(rank, world_size, path):
    """run_ranks body: an FSDP2 ToyMLP with Adam (lr LR) stepped 3 times, saved sharded by both ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    model, opt = toy("fsdp2", 0, mesh)
    for g in opt.param_groups:
        g["lr"] = LR
    stepped(model, opt)
    stepped(model, opt)
    omnickpt.save(path, {"model": model, "optimizer": opt}).wait()


@pytest.fixture(scope="module")
def sources():
    """{"single": a 1-rank source, "fsdp2": one saved sharded by 2 FSDP2 ranks}, made once for the module."""
    root = tempfile.mkdtemp(prefix="ds-export-src-")
    single = _single_rank_source(os.path.join(root, "single"))
    sharded = os.path.join(root, "fsdp2")
    run_ranks(2, _fsdp2_save, sharded)
    yield {"single": single, "fsdp2": sharded}
    shutil.rmtree(root, ignore_errors=True)


def _expected(src: str) -> dict:
    """{fqn: {"fp32", "exp_avg", "exp_avg_sq", "step"}} of the source, read back through omnickpt."""
    with omnickpt.open(src) as r:
        fqns = [n[len("model/"):] for n in r.names() if n.startswith("model/") and n != "model/scale"]
        return {f: {"fp32": r.get(f"model/{f}").float(), "exp_avg": r.get(f"optimizer/state/{f}/exp_avg"),
                    "exp_avg_sq": r.get(f"optimizer/state/{f}/exp_avg_sq"),
                    "step": r.get(f"optimizer/state/{f}/step")} for f in fqns}


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


# ---------------------------------------------------------------------------------- what is written
def test_layout_holds_the_source_values_and_latest_names_the_tag(sources, tmp_path):
    src = sources["single"]
    dst = tmp_path / "ds"
    out = export_deepspeed(src, str(dst), progress=False)
    assert out["tag"] == "global_step3" and out["params"] == 6 and out["buffers"] == 1
    assert (dst / "latest").read_text() == "global_step3" == (dst / "latest_universal").read_text()
    tag = dst / "global_step3"
    for fqn, want in _expected(src).items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(tag / "zero" / fqn / f"{key}.pt", weights_only=False)
            assert saved["param"].dtype == torch.float32 and torch.equal(saved["param"], want[key]), (fqn, key)
        assert torch.equal(torch.load(tag / "zero" / fqn / "step.pt", weights_only=False), want["step"])
    opt_state = torch.load(tag / "zero" / "optimizer_state.pt", weights_only=False)
    assert opt_state["param_groups"][0]["lr"] == LR and opt_state["param_groups"][0]["params"] == list(range(6))
    assert torch.equal(opt_state["optimizer_state_dict"]["state"][0]["step"], torch.tensor(3.0))
    record = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    # the buffer, which DeepSpeed's universal load does not restore, is kept where a user can find it
    with omnickpt.open(src) as r:
        assert list(record["module"]) == ["scale"] and torch.equal(record["module"]["scale"], r.get("model/scale"))
    assert record["global_steps"] == 3 and list(record["param_shapes"][0])[0] == "fc1.weight"
    # the same record under the name ZeRO-3 engines glob for
    assert ((tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes()
            == (tag / "mp_rank_00_model_states.pt").read_bytes())
    assert not [n for n in os.listdir(dst) if n.startswith(".")]    # no staging folder left behind


# ---------------------------------------------------------------------------------- DeepSpeed loads it
def _load_in_deepspeed(rank, world_size, cases):
    """run_ranks body: for each (dst, stage, bf16) of `cases`, in the same processes (each start imports
    deepspeed: seconds), `_load_one`."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return [_load_one(rank, *case) for case in cases]


def _load_one(rank, dst, stage, bf16):
    """A DeepSpeed engine (ZeRO `stage`, fp32 or bf16) on a freshly initialised ToyMLP loads the universal
    checkpoint `dst`; returns (its fp32 master weights, exp_avg, exp_avg_sq, steps, lr) as read back through
    DeepSpeed's own accessors, and the same after one more training step."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    torch.manual_seed(123)          # not the source's initialisation: the load must replace it
    model = ToyMLP()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "checkpoint": {"load_universal": True}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, _ = engine.load_checkpoint(dst)
    assert path is not None

    def read():
        out = {}
        for name, p in engine.module.named_parameters():
            out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone(),
                         "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
                         "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()}
        steps = sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s})
        return out, steps, [g["lr"] for g in engine.optimizer.optimizer.param_groups]

    loaded = read()
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
    loss = engine(x.to(torch.bfloat16) if bf16 else x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loaded, read(), engine.global_steps


def _check_loaded(src: str, result, bf16: bool) -> None:
    (values, steps, lrs), (after, steps_after, _), global_steps = result
    want = _expected(src)
    assert sorted(values) == sorted(want)
    for fqn, w in want.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(values[fqn][key].float(), w[key].float()), (fqn, key)
    step = float(next(iter(want.values()))["step"])
    assert steps == [step] and all(lr == LR for lr in lrs)
    # and training went on from there: one more Adam step, every master weight moved
    assert steps_after == [step + 1] and global_steps == int(step) + 1
    assert all(not torch.equal(after[f]["fp32"], values[f]["fp32"]) for f in want)
    assert all(torch.isfinite(after[f]["fp32"]).all() for f in want)


# (stage, bf16, source, via): every ZeRO stage, a bf16 engine, a 1-rank and an FSDP2 source, the API and the CLI
_LOADS = [(1, False, "single", "api"), (2, False, "fsdp2", "cli"), (3, False, "fsdp2", "api"), (3, True, "single", "cli")]


def test_deepspeed_engines_load_the_export_bitwise_and_train_on(sources, tmp_path, capsys):
    pytest.importorskip("deepspeed")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("DeepSpeed builds a small C++ op on first use and no compiler is installed")
    cases = []
    for i, (stage, bf16, source, via) in enumerate(_LOADS):
        src, dst = sources[source], str(tmp_path / f"ds{i}")
        if via == "cli":
            assert cli(["convert", src, dst, "--to", "deepspeed", "--no-progress"]) == 0
            assert "(deepspeed): tag global_step3" in capsys.readouterr().out
        else:
            export_deepspeed(src, dst, progress=False)
        cases.append((dst, stage, bf16))
    results = run_ranks(2, _load_in_deepspeed, cases)[0]
    for (stage, bf16, source, via), result in zip(_LOADS, results):
        _check_loaded(sources[source], result, bf16)


# ---------------------------------------------------------------------------------- refused, failed
def test_an_existing_deepspeed_checkpoint_is_untouched_by_a_refused_export(sources, tmp_path):
    dst = tmp_path / "ds"
    export_deepspeed(sources["single"], str(dst), progress=False)
    (dst / "notes.txt").write_text("mine")
    before = _files(dst)
    other = _single_rank_source(str(tmp_path / "other"), steps=3)   # same tag, other values: would replace it
    torch.manual_seed(1)
    with pytest.raises(CheckpointError, match=r"already holds global_step3, latest, latest_universal.*overwrite"):
        export_deepspeed(other, str(dst), progress=False)
    with pytest.raises(CheckpointError, match="overwrite"):
        convert(other, str(dst), to="deepspeed", progress=False)
    assert _files(dst) == before
    # told to, it replaces the tag as a whole, keeps the files that are not DeepSpeed's, and leaves nothing aside
    third = _single_rank_source(str(tmp_path / "third"), steps=4)
    export_deepspeed(third, str(dst), tag="global_step3", overwrite=True, progress=False)
    assert (dst / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(dst) if n.startswith(".")]
    with omnickpt.open(third) as r:
        got = torch.load(dst / "global_step3" / "zero" / "fc1.weight" / "exp_avg.pt", weights_only=False)["param"]
        assert torch.equal(got, r.get("optimizer/state/fc1.weight/exp_avg"))


class _FailingReader(omnickpt.reader.CheckpointReader):
    """A reader whose third tensor read fails as a full disk would: a conversion that dies midway."""
    reads = 0

    def get(self, name, box=None, dtype=None):
        if not name.endswith("/step"):
            _FailingReader.reads += 1
            if _FailingReader.reads == 3:
                raise OSError(28, "No space left on device")
        return super().get(name, box, dtype)


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "folder-with-files"])
def test_a_conversion_failing_midway_publishes_no_latest(sources, tmp_path, monkeypatch, existing):
    dst = tmp_path / "ds"
    if existing:
        dst.mkdir()
        (dst / "global_step1").mkdir()      # another run's tag, and its own files: left as they are
        (dst / "global_step1" / "x.pt").write_bytes(b"old")
    before = _files(dst) if existing else None
    monkeypatch.setattr(ds_export, "CheckpointReader", _FailingReader)
    _FailingReader.reads = 0
    with pytest.raises((OSError, CheckpointError)):
        export_deepspeed(sources["single"], str(dst), progress=False)
    assert _FailingReader.reads == 3
    if existing:
        assert _files(dst) == before and sorted(os.listdir(dst)) == ["global_step1"]
    else:
        assert not dst.exists()


def test_a_failure_while_publishing_removes_the_new_tag_and_pointers(sources, tmp_path, monkeypatch):
    dst = tmp_path / "ds"
    real = ds_export._publish

    def publish(dest, name, tag):
        if name == "latest":       # latest_universal is out, latest fails: neither may name a tag left half-there
            raise ds_export.os_failure("publishing", dest.file(name), OSError(30, "Read-only file system"))
        real(dest, name, tag)

    monkeypatch.setattr(ds_export, "_publish", publish)
    with pytest.raises(CheckpointError, match="Read-only"):
        export_deepspeed(sources["single"], str(dst), progress=False)
    assert not dst.exists()


def test_a_source_without_what_deepspeed_needs_is_refused_before_writing(tmp_path):
    torch.manual_seed(0)
    model = ToyMLP()
    weights_only = str(tmp_path / "weights")
    omnickpt.save(weights_only, {"model": model}).wait()
    with pytest.raises(UnsupportedError, match=r"holds no optimizer state.*--to hf"):
        export_deepspeed(weights_only, str(tmp_path / "a"), progress=False)
    # SGD's momentum is no Adam state: DeepSpeed's ZeRO-3 universal load reads exp_avg and exp_avg_sq
    sgd_model = ToyMLP()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=LR, momentum=0.9)
    stepped(sgd_model, sgd)
    omnickpt.save(str(tmp_path / "sgd"), {"model": sgd_model, "optimizer": sgd}).wait()
    with pytest.raises(UnsupportedError, match=r"torch.optim.sgd.SGD\) holds no Adam moments"):
        export_deepspeed(str(tmp_path / "sgd"), str(tmp_path / "a"), progress=False)
    # a parameter that never had a gradient has no Adam moments: named, not written as zeros
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for name, p in model.named_parameters():
        p.grad = None if name == "norm.bias" else torch.ones_like(p)
    opt.step()
    partial = str(tmp_path / "partial")
    omnickpt.save(partial, {"model": model, "optimizer": opt}).wait()
    with pytest.raises(UnsupportedError, match=r"'norm.bias' has no exp_avg or exp_avg_sq"):
        export_deepspeed(partial, str(tmp_path / "b"), progress=False)
    # parameters stepped a different number of times: DeepSpeed holds one step for all
    model.norm.bias.grad = torch.ones_like(model.norm.bias)
    for name, p in model.named_parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    uneven = str(tmp_path / "uneven")
    omnickpt.save(uneven, {"model": model, "optimizer": opt}).wait()
    with pytest.raises(UnsupportedError, match="stepped a different number of times"):
        export_deepspeed(uneven, str(tmp_path / "c"), progress=False)
    assert not any((tmp_path / n).exists() for n in ("a", "b", "c"))


def test_convert_to_deepspeed_refuses_options_it_cannot_honour(sources, tmp_path):
    with pytest.raises(UnsupportedError, match="convert to deepspeed takes no dtype"):
        convert(sources["single"], str(tmp_path / "a"), to="deepspeed", dtype="bf16",
                                 progress=False)
    with pytest.raises(UnsupportedError, match="convert to dcp takes no tag"):
        convert(sources["single"], str(tmp_path / "b"), to="dcp", tag="x", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_state_keys_are_inferred_or_named(tmp_path):
    torch.manual_seed(0)
    model, ema = ToyMLP(), ToyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    stepped(model, opt)
    src = str(tmp_path / "src")
    omnickpt.save(src, {"net": model, "ema": ema, "optim": opt}).wait()
    # two modules, neither called "model": the optimizer's parameter names ("net/fc1.weight") say which it steps
    with pytest.raises(omnickpt.errors.MismatchError, match="steps the parameters of 'net', not of model_key 'ema'"):
        export_deepspeed(src, str(tmp_path / "a"), model_key="ema", progress=False)
    assert not (tmp_path / "a").exists()
    out = export_deepspeed(src, str(tmp_path / "b"), tag="moved", progress=False)
    assert out["tag"] == "moved" and (tmp_path / "b" / "latest_universal").read_text() == "moved"
    saved = torch.load(tmp_path / "b" / "moved" / "zero" / "fc2.weight" / "fp32.pt", weights_only=False)["param"]
    assert torch.equal(saved, model.fc2.weight.detach())
    # a tag that would leave the destination is refused
    with pytest.raises(omnickpt.errors.UnsafeCheckpointError, match="tag '../x'"):
        export_deepspeed(src, str(tmp_path / "c"), tag="../x", progress=False)
