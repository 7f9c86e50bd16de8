"""The cadence rule (omnickpt/cadence.py): with synthetic step times and stalls, the chosen interval
is the formula's, and the tracker measures what the manager feeds it."""
from __future__ import annotations

import math

import pytest

from omnickpt.cadence import Cadence, choose_interval


@pytest.mark.parametrize("step,stall,background,interference,target", [
    (0.5, 0.2, 1.0, 0.0, 0.02),     # cost-bound: 0.2 / (0.02 * 0.5) = 20 steps
    (0.5, 0.01, 3.2, 0.0, 0.02),    # flight-bound: in flight during 7 steps (6.4) -> 8: one step without
    (0.5, 0.01, 3.0, 0.0, 0.02),    # in flight for exactly 6 steps -> 7: one step without a save in flight
    (1.0, 0.001, 0.4, 0.0, 0.02),   # durable within one step -> 2, never every step
    (0.1, 0.05, 0.0, 0.05, 0.035),  # stall + interference: 0.1 / (0.035 * 0.1) = 28.57 -> 29
    (1.0, 0.0, 0.0, 0.0, 0.02),     # free saves: every step
])
def test_the_interval_is_the_smallest_that_keeps_the_overhead_under_the_target(step, stall, background,
                                                                              interference, target):
    k = choose_interval(step, stall, background, interference, max_overhead=target, max_interval=10_000)
    k_flight = math.ceil(background / step - 1e-9) + 1 if background > 0 else 1
    want = max(1, math.ceil((stall + interference) / (target * step) - 1e-9), k_flight)
    assert k == want
    assert (stall + interference) / (k * step) <= target + 1e-12
    assert k * step > background and (background == 0 or (k - 1) * step >= background - 1e-9)
    if k > k_flight and (stall + interference) > 0:
        assert (stall + interference) / ((k - 1) * step) > target     # and no smaller one would do


def test_the_interval_is_capped_and_needs_a_step_time():
    assert choose_interval(0.01, 10.0, 0.0, max_overhead=0.01, max_interval=500) == 500
    assert choose_interval(0.0, 1.0, 1.0, max_overhead=0.02, max_interval=500) == 1


def test_auto_cadence_measures_steps_stalls_and_interference_from_calls():
    c = Cadence("auto", max_overhead=0.02)
    assert c.due(0, in_flight=False)                      # nothing measured: save and learn
    c.saved(0)
    t = 0.0
    # the manager sees save() called every step: 10 quiet steps of 0.5 s, then 4 with a save in flight of 0.6 s
    for s in range(1, 11):
        t += 0.5
        c.observe_call(s, t, in_flight=False)
    for s in range(11, 15):
        t += 0.6
        c.observe_call(s, t, in_flight=True)
    c.observe_save(stall_s=0.1, background_s=2.0, steps_in_flight=4)
    assert c.step_s == pytest.approx(0.5)
    assert c.interference_s() == pytest.approx(0.1 * 4)
    # (0.1 + 0.4) / (0.02 * 0.5) = 50 steps; the flight needs 5
    assert c.interval() == 50
    assert not c.due(49, in_flight=False) and c.due(50, in_flight=False)
    rep = c.report()
    assert rep.interval == 50 and rep.overhead == pytest.approx(0.5 / (50 * 0.5)) and rep.overhead <= 0.02


def test_continuous_saves_whenever_nothing_is_in_flight_and_fixed_every_n():
    c = Cadence("continuous")
    assert c.due(7, in_flight=False) and not c.due(8, in_flight=True)
    f = Cadence(10)
    assert f.due(0, False)
    f.saved(0)
    assert not f.due(5, False) and f.due(10, False)


@pytest.mark.parametrize("kwargs", [dict(every=0), dict(every="sometimes"), dict(every=True),
                                    dict(every="auto", max_overhead=0), dict(every="auto", max_overhead=2),
                                    dict(every="auto", max_interval=0)])
def test_bad_options_are_refused_by_name(kwargs):
    every = kwargs.pop("every")
    with pytest.raises(ValueError, match="every=|max_overhead=|max_interval="):
        Cadence(every, **kwargs)


# ---------------------------------------------------------------------------- the manager's every=
def _train(mgr, steps, step_s, async_save=True):
    import time

    import torch
    from torch import nn
    model = nn.Linear(64, 64)
    saved = []
    for step in range(steps):
        time.sleep(step_s)                       # the training step
        with torch.no_grad():
            model.weight.add_(1.0)
        if mgr.save(step, {"model": model}, async_save=async_save) is not None:
            saved.append(step)
    mgr.wait()
    return saved


def test_a_fixed_cadence_saves_every_nth_call_and_force_saves_anyway(tmp_path):
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every=3) as mgr:
        saved = _train(mgr, 10, 0.0, async_save=False)
        assert saved == [0, 3, 6, 9]
        assert mgr.steps() == [0, 3, 6, 9]
        from torch import nn
        assert mgr.save(10, {"model": nn.Linear(2, 2)}, force=True) is not None
        assert mgr.cadence_report()["interval"] == 3


def test_auto_cadence_keeps_the_measured_overhead_under_the_target(tmp_path):
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every="auto", max_overhead=0.05) as mgr:
        saved = _train(mgr, 60, 0.01)
        rep = mgr.cadence_report()
    assert saved[0] == 0 and len(saved) < 60
    assert rep["mode"] == "auto" and rep["interval"] > 1 and rep["step_s"] > 0.005
    # the interval in force is the formula's on what was measured
    want = choose_interval(rep["step_s"], rep["stall_s"], rep["background_s"], rep["interference_s"],
                           max_overhead=0.05, max_interval=10_000)
    assert rep["interval"] == want
    assert rep["overhead"] <= 0.05 + 1e-9
    # the saves after the first measured ones are spaced: fewer saves than steps
    assert len(saved) < 40, saved


def test_continuous_saves_as_soon_as_the_previous_one_is_durable(tmp_path):
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every="continuous", keep_last=2) as mgr:
        saved = _train(mgr, 30, 0.005)
    assert saved[0] == 0 and 1 < len(saved) <= 30


def _two_rank_auto(rank, world, root):
    import omnickpt
    with omnickpt.CheckpointManager(root, every="auto", max_overhead=0.05) as mgr:
        # rank 1's steps are slower: its own measurement would pick another interval
        return _train(mgr, 40, 0.01 if rank == 0 else 0.03), mgr.cadence_report()


def test_ranks_agree_on_the_auto_cadence(tmp_path):
    from dist import run_ranks
    (saved0, rep0), (saved1, rep1) = run_ranks(2, _two_rank_auto, str(tmp_path))
    assert saved0 == saved1 and len(saved0) >= 2
    assert rep0["interval"] == rep1["interval"]


def test_a_save_durable_within_one_step_still_counts_that_step_as_slowed(tmp_path):
    """The step after an async save runs with it in flight even when the save is durable before the
    next call: counting no such step made every measured interference 0 (bench/cadence.py)."""
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every="auto", max_overhead=0.05) as mgr:
        _train(mgr, 12, 0.05)        # a Linear(64, 64) save is durable well within a 50 ms step
        rep = mgr.cadence_report()
    assert rep["steps_in_flight"] is not None and rep["steps_in_flight"] >= 1
