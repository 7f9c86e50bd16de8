"""bench/resume.py's figures add up: the lead-in's excess is its steps less as many of the loop's
steps (each round's steps but the one after a save), and a kind's figures are medians over launches
of the slowest rank's. The benchmark runs fresh 2-rank launches for minutes; its summaries are pure."""
from __future__ import annotations

import pytest
from benchmods import bench_module


def test_the_lead_in_is_measured_against_the_loops_steps_that_follow_no_save():
    resume = bench_module("resume")
    # rounds: the first step of rounds 1-2 follows a save (2.0 s, held); the others are the baseline 0.5 s
    rounds = [[0.9, 0.5, 0.5], [2.0, 0.5, 0.5], [0.6, 0.5, 0.5]]
    assert resume.lead_in_excess([0.8, 0.7, 0.5], rounds) == pytest.approx(0.5)
    assert resume.lead_in_excess([], rounds) == 0


def test_a_kind_reports_the_slowest_ranks_lead_in_median_over_launches():
    resume = bench_module("resume")

    def rank(lead: float, after: float) -> dict:
        return {"async_stalls": [0.01, 0.01, 0.01], "async_after": [after, 0.1], "held": [after, 0.05, 0.05],
                "lead_in_excess": lead}
    launches = [[rank(0.4, 2.0), rank(0.6, 1.8)], [rank(0.1, 0.3), rank(0.2, 0.2)], [rank(0.9, 0.2), rank(0.3, 0.2)]]
    fig = resume.summarize(launches)
    assert fig["lead_in_per_launch"] == [0.6, 0.2, 0.9] and fig["lead_in_excess"] == pytest.approx(0.6)
    assert fig["lost_first"] == pytest.approx(0.31)   # launches' first saves: 2.01, 0.31, 0.21
