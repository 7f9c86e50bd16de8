"""bench/compare.py's first-save figure is a median over launches: a process has one first save, so
one launch gives one sample of it. Its summary is a pure function, checked here on launches whose
answer is known (the benchmark itself runs for minutes)."""
from __future__ import annotations

import pytest
from benchmods import bench_module


def _compare():
    return bench_module("compare")


def _launch(stalls_per_rank: list[list[float]], after_per_rank: list[list[float]] | None = None) -> list[dict]:
    """One 2-rank launch of the async loop alone (async-only shape: no sync saves or loads)."""
    after = after_per_rank or [[0.0] * (len(s) - 1) for s in stalls_per_rank]
    return [{"rank": r, "code": "c0", "state_bytes": 100, "copy_floor_s": 0.01, "async_stalls": s,
             "async_after": a, "async_waits": [0.0] * (len(s) - 1), "rss_async": {"start_mb": 10.0, "peak_mb": 20.0 + r}}
            for r, (s, a) in enumerate(zip(stalls_per_rank, after))]


def test_first_stall_is_the_median_over_launches_of_the_slowest_rank():
    compare = _compare()
    main = _launch([[0.050, 0.010, 0.011], [0.020, 0.012, 0.009]])     # first save: 0.050 (rank 0)
    firsts = [_launch([[0.018, 0.008, 0.010], [0.021, 0.007, 0.013]]),  # 0.021 (rank 1)
              _launch([[0.030, 0.009, 0.006], [0.012, 0.005, 0.006]])]  # 0.030
    res = compare.summarize_lib(main, None, None, firsts)
    fig, extra = res["figures"], res["extra"]
    assert extra["stalls_first_launches"] == [0.050, 0.021, 0.030]
    assert fig["stall_first"] == 0.030   # not the main launch's 0.050 alone
    # steady: every launch's later saves, slowest rank: 0.012 0.011 | 0.008 0.013 | 0.009 0.006
    assert fig["stall_steady"] == pytest.approx(0.010)
    assert extra["stalls_all"] == [0.050, 0.012, 0.011]   # the main launch's own record is kept
    assert fig["rss_async"] == 21.0


def test_without_extra_launches_the_main_launch_alone_gives_the_figures():
    compare = _compare()
    res = compare.summarize_lib(_launch([[0.040, 0.010, 0.020], [0.030, 0.011, 0.012]]), None, None)
    assert res["figures"]["stall_first"] == 0.040
    assert res["figures"]["stall_steady"] == pytest.approx(0.0155)


def test_what_a_save_costs_training_adds_the_next_steps_excess_to_its_stall():
    """A lazy snapshot's copy into new staging holds the next optimizer step: the first save's stall
    alone hides it. Per save (not the last, which no step follows): the slowest rank's stall plus the
    excess of the step after it; first = median over launches, steady = the later saves pooled."""
    compare = _compare()
    main = _launch([[0.010, 0.004, 0.005], [0.012, 0.003, 0.004]], [[2.000, 0.030], [1.500, 0.050]])
    firsts = [_launch([[0.011, 0.004], [0.009, 0.005]], [[0.800], [0.900]]),
              _launch([[0.020, 0.006], [0.010, 0.004]], [[1.100], [0.200]])]
    res = compare.summarize_lib(main, None, None, firsts)
    fig, extra = res["figures"], res["extra"]
    assert extra["lost_per_save"] == [[pytest.approx(2.010), pytest.approx(0.053)], [pytest.approx(0.909)],
                                      [pytest.approx(1.120)]]
    assert fig["lost_first"] == pytest.approx(1.120)
    assert fig["lost_steady"] == pytest.approx(0.053)
    assert fig["stall_first"] == pytest.approx(0.012)   # the stall alone is unchanged


def test_the_step_after_a_save_is_measured_against_the_loops_other_steps():
    scenario = bench_module("scenario")
    # rounds: the steps before save 0, 1, 2; the first step of rounds 1 and 2 follows saves 0 and 1;
    # the baseline is the other steps' median (0.29, 0.31, 0.30), not the loop's cold first step
    rounds = [[0.90, 0.31], [2.50, 0.29], [0.40, 0.30]]
    assert scenario.after_save_excess(rounds) == [pytest.approx(2.20), pytest.approx(0.10)]
    assert scenario.after_save_excess([[0.3], [0.5], [0.4]]) == []   # one step a round: nothing to compare with
