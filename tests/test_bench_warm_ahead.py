"""bench/warm_ahead.py's figures add up: a variant's cost per save is its lead-in and save cycles less
two of its clean cycles, the median over rounds; the report's phases are the median of the slowest
rank's. The benchmark runs 2 ranks for minutes; its summary is a pure function, checked here."""
from __future__ import annotations

import pytest
from benchmods import bench_module


def _bench():
    return bench_module("warm_ahead")


def test_the_cost_per_save_is_the_lead_in_and_save_cycles_less_two_clean_ones():
    bench = _bench()
    rounds = {}
    for v, (extra_lead, extra_busy) in {"kept": (0.0, 0.1), "released": (0.0, 2.0), "warmed": (0.3, 0.2)}.items():
        rounds[v] = [{"clean": 3.0 + d, "lead_in": 3.0 + d + extra_lead, "busy": 3.0 + d + extra_busy, "lead": 2,
                      "report": {"held": extra_busy / 2, "snapshot_lazy": 0.1, "stall": 0.01}}
                     for d in (0.0, 0.5, -0.4)]   # the machine's speed drifts from round to round
    fig = bench.summarize(rounds)
    assert fig["kept"]["cost_s"] == pytest.approx(0.1)
    assert fig["released"]["cost_s"] == pytest.approx(2.0) and fig["released"]["held_s"] == pytest.approx(1.0)
    assert fig["warmed"]["cost_s"] == pytest.approx(0.5)   # the warm's 0.3 s counted with the save's 0.2 s
    assert fig["warmed"]["clean_s"] == pytest.approx(3.0) and fig["warmed"]["lead"] == 2
