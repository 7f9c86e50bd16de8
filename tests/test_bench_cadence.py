"""bench/cadence.py's stopwatch: a pair's overhead and the order of its rounds. The benchmark runs 2 ranks
for tens of minutes; what it computes from its rounds is pure, checked here."""
from __future__ import annotations

import pytest
from benchmods import bench_module


def test_a_with_round_that_ran_past_its_steps_at_the_baseline_pace_costs_nothing():
    bench = bench_module("cadence")
    # 12 steps of 1.0 s without saves; the with-round ran 2 steps past its 12 (its last save's flight)
    assert bench.pair_overhead(12.0, 12, 14.0, 14, 12) == pytest.approx(0.0)
    # 0.6 s more than 14 baseline steps, against the 12 steps its saves cover
    assert bench.pair_overhead(12.0, 12, 14.6, 14, 12) == pytest.approx(0.05)
    # the baseline's pace is its own: 12 steps in 24 s are 2 s each
    assert bench.pair_overhead(24.0, 12, 25.2, 12, 12) == pytest.approx(0.05)


def test_the_round_without_saves_runs_first_in_every_other_pair():
    """A machine slowing through a run would be counted as the saves' cost if the round with saves always
    came second; alternating the order weighs the drift on both kinds of round alike."""
    bench = bench_module("cadence")
    order = [bench.quiet_first(k) for k in range(6)]
    assert order == [True, False, True, False, True, False]
    # a linear drift of +0.01 s per step through four rounds of 10 steps, saves costing nothing:
    # timed in the alternating order, the two pairs' overheads cancel
    rounds = [sum(1.0 + 0.01 * (10 * r + i) for i in range(10)) for r in range(4)]
    pairs = []
    for k in range(2):
        first, second = rounds[2 * k], rounds[2 * k + 1]
        quiet, busy = (first, second) if order[k] else (second, first)
        pairs.append(bench.pair_overhead(quiet, 10, busy, 10, 10))
    assert pairs[0] > 0.05 and pairs[1] < -0.05   # each pair alone is off by the drift
    assert sum(pairs) / 2 == pytest.approx(0.0, abs=0.02)


def test_the_steps_after_a_save_are_placed_against_the_round_without_saves():
    """A with-round whose saves slow the step after their call by 20% and the next by 10%, with the
    cadence's baseline 5% above the round without saves: by_position says where the cost landed,
    baseline_bias how far the cadence's quiet steps sit above the stopwatch's."""
    bench = bench_module("cadence")
    trace = [(1.0, False), (1.0, True), (1.2, False), (1.1, False), (1.0, True), (1.2, False), (1.1, False)]
    pair = {"trace_with": trace, "without_s_per_step": 1.0, "report_step_s": 1.05}
    pos = bench.by_position([pair, {**pair, "without_s_per_step": 2.0,
                                    "trace_with": [(2 * t, s) for t, s in trace]}])
    assert pos == pytest.approx({0: 0.0, 1: 0.2, 2: 0.1})   # the step before the first save left out
    assert bench.baseline_bias([pair]) == pytest.approx(0.05)
    assert bench.baseline_bias([{**pair, "report_step_s": None}]) is None
