"""bench/save_cost.py's figures add up: a save's cost is its cycle's time less the quiet cycle's beside
it (the first pair, the process's first save, apart), and the positions are each step's mean. The
benchmark itself runs 2 ranks for minutes; its summary is a pure function, checked here on cycles
whose answer is known."""
from __future__ import annotations

import statistics

import pytest
from benchmods import bench_module


def _bench():
    return bench_module("save_cost")


def _cycles(costs: list[float], interval: int, step: float = 0.5):
    """Per-step and per-cycle records of pairs whose save cycle is `costs[c]` longer, spent in the step
    after the save's (position 1); the machine drifts from pair to pair (step + 0.1 c)."""
    steps, cycles = [], []
    for c, cost in enumerate(costs):
        base = step + 0.1 * c
        for kind in ("save", "quiet"):
            times = [base] * interval
            if kind == "save":
                times[1] += cost
            steps += [(c, kind, p, t) for p, t in enumerate(times)]
            cycles.append((c, kind, sum(times)))
    return steps, cycles


def test_the_cost_is_the_save_cycle_less_the_quiet_one_beside_it():
    bench = _bench()
    costs = [2.0, 0.10, 0.30, 0.20]   # the first: the process's first save, reported apart
    steps, cycles = _cycles(costs, interval=4)
    got = bench.summarize(steps, cycles, 4, len(costs))
    assert got["cost_s"] == pytest.approx(0.20)          # the mean of the later pairs, drift cancelled
    assert got["cost_se_s"] == pytest.approx(statistics.stdev(costs[1:]) / 3 ** 0.5)
    assert got["first_cost_s"] == pytest.approx(2.0)
    # the positions say where the cost went: the step after the save's, nothing after it
    later = [0.5 + 0.1 * c for c in (1, 2, 3)]
    assert got["positions"]["save"][1] == pytest.approx(statistics.fmean(later) + 0.2)
    assert got["positions"]["save"][2] == pytest.approx(got["positions"]["quiet"][2])
    assert got["step_s"] == pytest.approx(statistics.fmean(later))
