"""The lazy snapshot's fence (omnickpt/fence.py): which storages may be copied late, and an
optimizer's step held until the copy is done."""
from __future__ import annotations

import threading
import time

import torch
from torch import nn

from omnickpt.fence import SnapshotFence, optimizers_in, step_stable_storages


def _model_and_opt():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_parameters_and_moments_are_step_stable_buffers_and_user_tensors_are_not():
    model, opt = _model_and_opt()
    extra = torch.randn(10)
    state = {"model": model, "optim": opt, "extra": {"t": extra}}
    stable = step_stable_storages(state)
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() in stable
        assert opt.state[p]["exp_avg"].untyped_storage().data_ptr() in stable
    assert model[1].running_mean.untyped_storage().data_ptr() not in stable   # forward changes it
    assert extra.untyped_storage().data_ptr() not in stable


def test_optimizers_are_found_anywhere_in_the_state_once():
    _, opt = _model_and_opt()

    class Wrapper:      # Megatron's optimizers hold the torch optimizer as .optimizer
        optimizer = opt
    assert optimizers_in({"a": opt, "b": [opt, {"c": Wrapper()}]}) == [opt]


def test_a_step_waits_for_the_release_and_the_hooks_come_off():
    model, opt = _model_and_opt()
    fence = SnapshotFence([opt], "save to x")
    before = [p.detach().clone() for p in model.parameters()]
    stepped = threading.Event()

    def train():
        opt.step()
        stepped.set()
    t = threading.Thread(target=train)
    t.start()
    time.sleep(0.2)
    assert not stepped.is_set(), "the optimizer stepped before the snapshot released it"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    fence.release()
    t.join(10)
    assert stepped.is_set()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    fence.remove()
    assert not opt._optimizer_step_pre_hooks
    opt.step()      # no fence left


def test_the_time_a_step_is_held_is_counted_from_its_wait_to_the_release():
    model, opt = _model_and_opt()
    seen = []
    fence = SnapshotFence([opt], "save to x", on_held=lambda seconds, start: seen.append((seconds, start)))
    t = threading.Thread(target=opt.step)
    t.start()
    time.sleep(0.25)
    before_release = time.perf_counter()
    fence.release()
    t.join(10)
    assert len(seen) == 1 and seen[0][0] == fence.held_s
    held, start = seen[0]
    assert 0.2 <= held <= time.perf_counter() - start
    assert start < before_release - 0.2   # the wait began in the step, not at the release
    fence.remove()
    assert fence.held_s == held   # removing the hooks after the release waits for nothing


def test_a_fence_released_before_any_step_holds_nothing():
    model, opt = _model_and_opt()
    seen = []
    fence = SnapshotFence([opt], "save to x", on_held=lambda seconds, start: seen.append(seconds))
    fence.release()
    opt.step()
    fence.remove()
    assert fence.held_s == 0.0 and seen == []


def test_only_an_optimizer_steps_wait_is_counted():
    """The next save's or load's wait for the copy is in its own stall; fence() and wait() are the
    caller's choice: none of them is a held step."""
    model, opt = _model_and_opt()
    fence = SnapshotFence([opt], "save to x")
    t = threading.Thread(target=fence.remove)
    t.start()
    time.sleep(0.2)
    fence.release()
    t.join(10)
    assert fence.held_s == 0.0


def _step_in_child(opt, queue):
    opt.step()
    queue.put("stepped")


def test_a_child_forked_while_the_fence_holds_steps_on_its_own_copy():
    # The parent's snapshot copies the parent's memory; the child's step cannot change it, and no
    # thread of the child would ever release the fence: it must not wait for it.
    import multiprocessing
    model, opt = _model_and_opt()
    fence = SnapshotFence([opt], "save to x")
    before = [p.detach().clone() for p in model.parameters()]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_step_in_child, args=(opt, queue))
    child.start()
    try:
        assert queue.get(timeout=30) == "stepped"
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    # The parent is still held, and its parameters untouched by the child's step.
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    stepped = threading.Event()
    t = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    t.start()
    time.sleep(0.2)
    assert not stepped.is_set()
    fence.release()
    t.join(10)
    assert stepped.is_set()
