"""Save handles (omnickpt/api.py SaveHandleProtocol): every handle that save() or a manager returns
has done(), wait() and fence(); the tiered manager's fence holds back in-place changes until the
memory save's lazy snapshot is copied. Also: the memory tier's options are refused without
memory= (they used to be ignored).

Cost: one in-process memory tier (a small model in /dev/shm); no child processes.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import uuid

import pytest
import torch

import omnickpt
from omnickpt.api import SaveHandle, SaveHandleProtocol
from omnickpt.storage.shm import clear_memory
from omnickpt.tiered import MemoryTierOptions, TieredCheckpointManager, TieredSave
from test_lazy import _hold_copier


@pytest.fixture
def job():
    """A job name of its own, and its shared memory given back whatever the test did."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    clear_memory(name)


def _trained(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    """A model whose optimizer has state (one Adam step), so that the save holds moments too."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, per_param in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.detach().clone() for k, v in per_param.items() if torch.is_tensor(v)})
    return out


def _step_and_edit(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """What the training loop does after fence(): an in-place change outside any step (which only
    fence() makes safe: a step is held by the snapshot's hooks anyway, so it comes second here), then
    an optimizer step."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()


def test_the_protocol_has_the_three_methods_and_both_handles_follow_it():
    for cls in (SaveHandle, TieredSave):
        for name in ("done", "wait", "fence", "staged"):
            assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
        # wait(timeout=None) everywhere: one call site serves every handle.
        assert inspect.signature(cls.wait).parameters["timeout"].default is None


def test_handles_of_save_and_of_both_managers_are_save_handles(job, tmp_path):
    model, opt = _trained()
    state = {"model": model, "optimizer": opt}
    handle = omnickpt.save(str(tmp_path / "plain"), state, async_save=True)
    assert isinstance(handle, SaveHandleProtocol)
    handle.fence()
    handle.wait()
    assert handle.done()
    with omnickpt.CheckpointManager(str(tmp_path / "managed")) as mgr:
        handle = mgr.save(1, state, async_save=True)
        assert isinstance(handle, SaveHandleProtocol)
        handle.fence()
        handle.wait()
        assert handle.done()
    with TieredCheckpointManager(str(tmp_path / "tiered"), memory=f"shm://{job}") as mgr:
        handle = mgr.save(1, state, async_save=True)
        assert isinstance(handle, TieredSave) and isinstance(handle, SaveHandleProtocol)
        handle.fence()
        report = handle.wait()
        assert handle.done() and "durable" in report


def test_staged_says_without_blocking_when_a_lazy_snapshot_is_copied(tmp_path):
    # torchtitan's staging_completion: the training loop asks, and waits only when it must.
    ckpt = omnickpt.Checkpointer()
    try:
        model, opt = _trained()
        state = {"model": model, "optimizer": opt}
        _hold_copier(ckpt, seconds=1.0)   # the background copy starts only after a second
        handle = ckpt.save(str(tmp_path / "lazy"), state, async_save=True)
        assert not handle.staged()        # returned at once: the copy has not run
        handle.fence()                    # waits for it
        assert handle.staged()
        handle.wait()
        eager = ckpt.save(str(tmp_path / "eager"), state, async_save=True, snapshot="eager")
        assert eager.staged()             # everything was copied before save() returned
        eager.wait()
    finally:
        ckpt.close()


@pytest.mark.parametrize("snapshot", ["lazy", "eager"])
def test_tiered_fence_keeps_later_changes_out_of_the_checkpoint(job, tmp_path, snapshot):
    ckpt = omnickpt.Checkpointer()
    try:
        model, opt = _trained()
        state = {"model": model, "optimizer": opt}
        with TieredCheckpointManager(str(tmp_path / "root"), memory=f"shm://{job}", checkpointer=ckpt) as mgr:
            at_save = _values(model, opt)
            # The background copy starts only later: a fence() that did not wait for it would let
            # the changes below into the checkpoint.
            _hold_copier(ckpt)
            handle = mgr.save(3, state, async_save=True, snapshot=snapshot)
            handle.fence()
            assert not opt._optimizer_step_pre_hooks, "fence() leaves the snapshot's step hooks on the optimizer"
            _step_and_edit(model, opt)
            changed = _values(model, opt)
            assert all(not torch.equal(changed[k], at_save[k]) for k in at_save if k.startswith("param."))
            handle.wait()
            fresh, fresh_opt = _trained(seed=1)   # every value differs from the saved ones
            mgr.load(3, {"model": fresh, "optimizer": fresh_opt})   # the durable root's copy
            loaded = _values(fresh, fresh_opt)
        assert loaded.keys() == at_save.keys()
        for key, value in at_save.items():
            assert torch.equal(loaded[key], value), f"{key}: the checkpoint holds a value changed after fence()"
    finally:
        ckpt.close()


# ---------------------------------------------------------------------- memory options without memory=
def _tier_options() -> dict:
    """One value for every memory tier option: the fields of MemoryTierOptions but its url."""
    values = {"memory_keep": 2, "persist_every": 2, "ranks_per_node": 1, "peer_replicas": False,
              "persist_on_failure": False, "on_close": "keep_latest", "flush_timeout": 5.0}
    fields = {f.name for f in dataclasses.fields(MemoryTierOptions)} - {"url"}
    assert fields == set(values), "a new MemoryTierOptions field: refuse it without memory= too (manager.py)"
    return values


@pytest.mark.parametrize("name", sorted(_tier_options()))
def test_memory_options_without_memory_are_refused(tmp_path, name):
    root = tmp_path / "run"
    value = _tier_options()[name]
    for memory in ({}, {"memory": None}):
        with pytest.raises(TypeError, match=rf"\['{name}'\].*memory="):
            omnickpt.CheckpointManager(str(root), **memory, **{name: value})
    assert not os.path.exists(root)   # refused before the manager touched its root


def test_a_subclass_given_memory_is_refused(tmp_path):
    class Mine(omnickpt.CheckpointManager):
        pass

    with pytest.raises(TypeError, match="TieredCheckpointManager"):
        Mine(str(tmp_path / "run"), memory="shm://never-made")


def test_the_three_ways_build_the_same_tiered_manager(job, tmp_path):
    # CheckpointManager(root, memory=...), the third way, is a TypeError naming TieredCheckpointManager now
    # (test_memory_tier.py); the package's own name is the other spelling of the first way.
    options = MemoryTierOptions(f"shm://{job}", memory_keep=2, persist_on_failure=False)
    ways = [lambda root: TieredCheckpointManager(root, memory=f"shm://{job}", memory_keep=2, persist_on_failure=False),
            lambda root: TieredCheckpointManager(root, memory=options),
            lambda root: omnickpt.TieredCheckpointManager(root, memory=f"shm://{job}", memory_keep=2,
                                                          persist_on_failure=False)]
    for build in ways:
        with build(str(tmp_path / "root")) as mgr:
            assert type(mgr) is TieredCheckpointManager and mgr.options == options
