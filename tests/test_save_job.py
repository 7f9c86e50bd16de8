"""The save as a job (omnickpt/saving.py): SaveOptions validated once, whatever path built it, and
the save job's phases run in their order (collect, agree, plan, snapshot, then persist and commit)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.errors import UnsupportedError
from omnickpt.saving import SaveOptions, _SaveJob


@pytest.fixture
def ckpt():
    c = omnickpt.Checkpointer(io_workers=2)
    yield c
    c.close()


def _state(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


# ---------------------------------------------------------------------- SaveOptions
def test_options_default_to_a_sync_plain_save_and_are_frozen():
    o = SaveOptions()
    assert (o.async_save, o.durable, o.incremental, o.compression, o.codec, o.lazy) == (False, True, False, None,
                                                                                      None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.async_save = True


def test_lazy_and_codec_follow_from_the_options():
    assert SaveOptions(async_save=True).lazy
    assert not SaveOptions(async_save=True, snapshot="eager").lazy
    assert not SaveOptions(snapshot="lazy").lazy                       # a sync save copies nothing
    assert SaveOptions(quantize_optimizer="int8").codec == "none"     # quantized chunks need the chunked layout
    assert SaveOptions(compression="zstd", quantize_optimizer="fp8").codec == "zstd"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"snapshot": "later"}, ValueError, "snapshot='later': expected 'lazy'"),
    ({"compression": "gzip"}, ValueError, "compression='gzip': must be one of"),
    ({"quantize_optimizer": "int4"}, ValueError, "quantize_optimizer='int4': must be 'int8', 'fp8' or None"),
    ({"base": "../a"}, ValueError, "options of incremental saves: pass incremental=True"),
    ({"full_every": 3}, ValueError, "options of incremental saves"),
    ({"block_bytes": 4096}, ValueError, "options of incremental saves"),
    ({"incremental": True, "block_bytes": 0}, ValueError, "block_bytes=0: must be a positive int"),
    ({"incremental": True, "block_bytes": True}, ValueError, "block_bytes=True: must be a positive int"),
    ({"incremental": True, "full_every": 0}, ValueError, "full_every=0: must be a positive int"),
    ({"incremental": True, "full_every": 2.0}, ValueError, "full_every=2.0: must be a positive int"),
    ({"incremental": True, "compression": "zstd"}, UnsupportedError, "incremental=True with compression='zstd'"),
    ({"incremental": True, "quantize_optimizer": "int8"}, UnsupportedError,
     "incremental=True with quantize_optimizer='int8'"),
])
def test_options_are_checked_once_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        SaveOptions(**kwargs)


def test_keywords_replace_fields_of_the_options_and_are_checked_again():
    base = SaveOptions(async_save=True, compression="zstd")
    assert SaveOptions.of(base, {}) is base
    assert SaveOptions.of(base, {"durable": False}) == SaveOptions(async_save=True, compression="zstd", durable=False)
    with pytest.raises(UnsupportedError, match="incremental=True with compression='zstd'"):
        SaveOptions.of(base, {"incremental": True})
    with pytest.raises(TypeError, match="fast_savng"):
        SaveOptions.of(None, {"fast_savng": True})


def test_bad_options_fail_every_entry_point_before_anything_is_written(tmp_path, ckpt):
    state = _state()
    with pytest.raises(TypeError, match="bogus"):
        ckpt.save(str(tmp_path / "a"), state, bogus=1)
    with pytest.raises(ValueError, match="snapshot='later'"):
        ckpt.save(str(tmp_path / "a"), state, snapshot="later")
    with pytest.raises(UnsupportedError, match="incremental=True with compression"):
        omnickpt.save(str(tmp_path / "a"), state, incremental=True, compression="zstd", checkpointer=ckpt)
    assert not (tmp_path / "a").exists()


def test_checkpointer_save_takes_an_options_object_or_keywords(tmp_path, ckpt):
    state = _state()
    seen = []
    options = SaveOptions(async_save=True, compression="zstd", on_commit=seen.append)
    report = ckpt.save(str(tmp_path / "a"), state, options=options).wait()
    assert report["save_id"] and len(seen) == 1
    assert ckpt.save(str(tmp_path / "b"), state, options=options, async_save=False).wait()["save_id"]
    assert len(seen) == 2
    target = _state(seed=1)
    omnickpt.load(str(tmp_path / "a"), target, checkpointer=ckpt)
    assert torch.equal(target["model"].weight, state["model"].weight)


# ---------------------------------------------------------------------- the phases
PHASES = ["collect", "agree", "plan", "snapshot", "run", "persist", "commit"]


def _record_phases(monkeypatch) -> list[str]:
    calls = []
    for name in PHASES:
        real = getattr(_SaveJob, name)

        def phase(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(_SaveJob, name, phase)
    return calls


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_runs_its_phases_in_order(tmp_path, ckpt, monkeypatch, async_save):
    calls = _record_phases(monkeypatch)
    handle = ckpt.save(str(tmp_path / "a"), _state(), async_save=async_save)
    handle.wait()
    assert calls == PHASES
    assert omnickpt.is_committed(str(tmp_path / "a"))


def test_a_failed_collect_is_settled_before_any_later_phase(tmp_path, ckpt, monkeypatch):
    calls = _record_phases(monkeypatch)
    with pytest.raises(UnsupportedError, match="metadata cannot be stored as JSON"):
        ckpt.save(str(tmp_path / "a"), _state(), metadata={"x": float("nan")})
    assert calls == ["collect", "agree"]
    assert not omnickpt.is_committed(str(tmp_path / "a"))


# ---------------------------------------------------------------------- a failure after the commit
def _fail_after_commit(rank, world_size, path):
    import torch.distributed as dist

    def on_commit(manifest):
        raise OSError("retention could not list the root")
    model = nn.Linear(4, 4)
    torch.manual_seed(0)
    nn.init.normal_(model.weight)
    try:
        omnickpt.Checkpointer().save(path, {"model": model}, on_commit=on_commit, process_group=dist.group.WORLD)
    except Exception as e:
        message = str(e)
    else:
        message = None
    target = {"model": nn.Linear(4, 4)}
    dist.barrier()
    omnickpt.load(path, target)   # every rank's file is still there
    return message, torch.equal(target["model"].weight, model.weight)


def test_a_sync_save_failing_after_its_commit_keeps_every_ranks_files(tmp_path):
    from dist import run_ranks
    out = run_ranks(2, _fail_after_commit, str(tmp_path / "a"))
    for message, same in out:
        assert "committed, but rank 0 failed after the commit" in message and same


# ---------------------------------------------------------------------- load options
def test_load_options_are_one_object_checked_once_and_keywords_replace_its_fields(tmp_path, ckpt):
    state = _state()
    ckpt.save(str(tmp_path / "a"), state).wait()
    options = omnickpt.LoadOptions(include=["model"])
    target = _state(seed=1)
    result = ckpt.load(str(tmp_path / "a"), target, options=options)
    assert torch.equal(target["model"].weight, state["model"].weight) and result.report["kind"] == "load"
    assert not torch.equal(target["optimizer"].state_dict()["state"][0]["exp_avg"],
                           state["optimizer"].state_dict()["state"][0]["exp_avg"])   # include= was applied
    target = _state(seed=1)
    ckpt.load(str(tmp_path / "a"), target, options=options, include=())   # the keyword replaces the field
    assert torch.equal(target["optimizer"].state_dict()["state"][0]["exp_avg"],
                       state["optimizer"].state_dict()["state"][0]["exp_avg"])
    with pytest.raises(TypeError, match="no_such_option"):
        ckpt.load(str(tmp_path / "a"), target, no_such_option=True)
    with pytest.raises(TypeError, match="include= takes a list of glob patterns"):
        omnickpt.LoadOptions(include="model")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strict = False
