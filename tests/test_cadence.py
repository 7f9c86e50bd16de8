"""The cadence rule (omnickpt/cadence.py): with synthetic step times and stalls, the chosen interval
is the formula's, and the tracker measures what the manager feeds it."""
from __future__ import annotations

import itertools
import math

import pytest

from omnickpt.cadence import _LOCAL, PROFILE_STEPS, SETTLE, WARM_BYTES_PER_S, Cadence, choose_interval


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


def _feed(c, steps, t, seconds):
    """save() called at each of `steps`, `seconds` apart; returns the time of the last call."""
    for s in steps:
        t += seconds
        c.observe_call(s, t)
    return t


def _one_save(c, step, t, stall, extra=0.0):
    """A save at `step` whose call's step holds `stall` (+ `extra`), 3 more steps in flight at 0.6 s,
    durable, then 1 settling step (the save's tail) at 0.7 s: all affected. Returns (step, t) after."""
    c.started(step, stall_s=stall)
    t = _feed(c, [step + 1], t, 0.6 + stall + extra)
    t = _feed(c, [step + 2, step + 3, step + 4], t, 0.6)
    c.durable(background_s=2.5)
    assert c.profiling() or c.interval() is not None
    t = _feed(c, [step + 5], t, 0.7)                       # settling: affected, not quiet
    return step + 5, t


def test_auto_cadence_measures_the_cost_of_every_step_a_save_affected_against_quiet_steps():
    c = Cadence("auto", max_overhead=0.02)
    assert c.due(0, in_flight=False)                      # the first call saves: a resume point
    c.observe_call(0, 0.0)
    # the first save pays 2 s more in its step (staging faulted in: once per process)
    step, t = _one_save(c, 0, 0.0, 0.1, extra=2.0)
    assert c.step_s is None and c.profiling() and c.interval() is None and not c.due(step + 1, in_flight=False)
    t = _feed(c, range(step + 1, step + PROFILE_STEPS), t, 0.5)
    assert not c.due(step + PROFILE_STEPS - 1, in_flight=False)   # one quiet step short of the window
    t = _feed(c, [step + PROFILE_STEPS], t, 0.5)
    step += PROFILE_STEPS
    assert c.step_s == pytest.approx(0.5)
    # profiled: a second save is due now, and the report shows the first one's figures meanwhile
    rep = c.report()
    assert c.profiling() and c.interval() is None and rep.interval is None and rep.profiling
    assert rep.cost_s == pytest.approx(2.7) and rep.first_cost_s == pytest.approx(2.7)
    assert c.due(step, in_flight=False)
    step, t = _one_save(c, step, t, 0.1)
    assert not c.due(step, in_flight=False)   # still profiling: one quiet step after it, at least
    t = _feed(c, [step + 1], t, 0.5)
    step += 1
    # cost: 5 affected steps (0.7 + 3 x 0.6 + 0.7 = 3.2 s) less 5 baseline steps (2.5 s) = 0.7 s; the
    # first save's 2.7 s is kept apart
    assert not c.profiling()
    rep = c.report()
    assert rep.cost_s == pytest.approx(0.7) and rep.stall_s == pytest.approx(0.1)
    assert rep.first_cost_s == pytest.approx(2.7)
    assert rep.interference_s == pytest.approx(0.6) and rep.steps_affected == 5 and rep.steps_in_flight == 4
    # 0.7 / (0.02 * 0.5) = 70 steps (with the first save in the mean, 1.7 s: 170 steps)
    assert c.interval() == 70 and rep.interval == 70
    assert rep.overhead == pytest.approx(0.7 / (70 * 0.5)) and rep.overhead <= 0.02 + 1e-12
    last = step - 6
    assert not c.due(last + 69, in_flight=False) and c.due(last + 70, in_flight=False)


def _warm_up_job(warm_up_s: float, steps_s: float = 0.6, save_s: float = 0.3, saves: int = 8):
    """A job whose first quiet steps (the profiling window's, right after its first save) run at
    `warm_up_s` a step (a process's warm-up: its allocator growing, its memory faulted in), and at
    `steps_s` from the second save on; each save adds `save_s` to the step after its call, durable
    within that step. Saves as due() says, `saves` after the first."""
    c = Cadence("auto", max_overhead=0.05)
    t, step, made = 0.0, 0, 0
    c.observe_call(step, t)
    c.started(step, stall_s=0.0)
    step += 1
    t = _feed(c, [step], t, warm_up_s + 1.0)   # the first save's one-time cost
    c.durable(background_s=1.0)
    while made < saves:
        step += 1
        t = _feed(c, [step], t, warm_up_s if made == 0 else steps_s)
        if c.due(step, in_flight=False):
            c.started(step, stall_s=0.0)
            made += 1
            step += 1
            t = _feed(c, [step], t, steps_s + save_s)
            c.durable(background_s=steps_s)
    return c


def test_the_profiling_windows_warm_up_steps_are_forgotten_once_later_quiet_steps_are_measured():
    """The quiet steps measured right after the first save are a process's first steps, slower than
    its later ones (mlp/ddp here: 0.87-0.89 s against 0.55-0.6 s). Measured against them, saves
    seemed to cost less than nothing and "auto" kept its shortest interval for 40 steps and more
    (bench/cadence.py: +1.3% reported, +8.7% outside). Once PROFILE_STEPS quiet steps follow the
    second save, the profiling window's are dropped, and the saves measured against them are
    measured against the baseline since."""
    c = _warm_up_job(warm_up_s=0.9)
    rep = c.report()
    assert rep.step_s == pytest.approx(0.6)
    assert rep.cost_s == pytest.approx(0.3)
    assert rep.interval == choose_interval(0.6, 0.3, 0.0, max_overhead=0.05, max_interval=10_000) == 10
    # a steady machine: the same figures, nothing to forget
    steady = _warm_up_job(warm_up_s=0.6).report()
    assert steady.step_s == pytest.approx(0.6) and steady.cost_s == pytest.approx(0.3) and steady.interval == 10


def test_a_loop_that_calls_save_every_few_steps_keeps_a_quiet_call_after_each_save():
    """save() called every 3 steps: a save's flight and settling end on whole calls, so an interval of
    flight + SETTLE + 1 steps left no quiet call between saves. The baseline was then never refreshed:
    the profiling window's slow warm-up steps stayed in it, the saves measured against them cost less
    than nothing, and the interval stayed at that minimum for good. Now each interval leaves a quiet
    call, the warm-up is forgotten, and the cost is measured against the steps since."""
    per, c = 3, Cadence("auto", max_overhead=0.05)
    t, step, made, quiet_between, saved = 0.0, 0, 0, [], []
    c.observe_call(step, t)
    c.started(step, stall_s=0.0)
    step, t = step + per, t + per * 0.9 + 1.0
    c.observe_call(step, t)
    c.durable(background_s=1.0)
    while made < 10:
        step, t = step + per, t + per * (0.9 if made == 0 else 0.6)
        c.observe_call(step, t)
        if c.due(step, in_flight=False):
            quiet_between.append(c.quiet_since_save)
            saved.append(step)
            c.started(step, stall_s=0.0)
            made += 1
            step, t = step + per, t + per * 0.6 + 0.3    # the save's extra 0.3 s, durable within the call
            c.observe_call(step, t)
            c.durable(background_s=0.6)
    assert min(quiet_between) >= 1
    rep = c.report()
    assert rep.step_s == pytest.approx(0.6)
    assert rep.cost_s == pytest.approx(0.3)
    assert rep.interval == 10   # 0.3 / (0.05 * 0.6)
    assert saved[-1] - saved[-2] == 12   # the first call 10 steps or more after the last save


def test_calls_spaced_unevenly_still_leave_a_quiet_call_after_each_save():
    """save() called 4, 1, 1, 4, 1, 1 ... steps apart (the median: 1): a save settling in a 4-step call
    left no quiet call in flight + SETTLE + 1 steps, and the warm-up was never forgotten. The steps a
    save was seen to affect, and one call more, bound the interval too."""
    c = Cadence("auto", max_overhead=0.9)
    t, step, in_flight, quiet_between = 0.0, 0, 0, []
    c.observe_call(step, t)
    spacing = itertools.cycle([4, 1, 1])
    for _ in range(60):
        gap = next(spacing)
        step, t = step + gap, t + gap * 0.6
        c.observe_call(step, t)
        if in_flight:
            in_flight -= 1
            if not in_flight:
                c.durable(background_s=0.5)
        if c.due(step, in_flight=in_flight > 0):
            quiet_between.append(c.quiet_since_save)
            c.started(step, stall_s=0.0)
            in_flight = 2
    assert len(quiet_between) > 6 and min(quiet_between[2:]) >= 1
    assert c._provisional == 0   # the profiling window's steps were forgotten


def test_the_first_saves_cost_stays_measured_against_its_own_steps_after_the_warm_up_is_forgotten():
    """The first attempt fails (on_error="warn") and the next call's save is the first measured: it
    runs in the warm-up (0.9 s steps, 0.3 s more for the save) and its quiet steps are the warm-up's.
    Forgetting the warm-up for the later saves must not measure it against the 0.6 s steps since."""
    c = Cadence("auto", max_overhead=0.05)
    t, step, saves = 0.0, 0, 0
    c.observe_call(step, t)
    assert c.due(step, in_flight=False)
    c.failed(step)
    while saves < 6:
        step, t = step + 1, t + (0.9 if saves < 2 else 0.6)
        c.observe_call(step, t)
        if c.due(step, in_flight=False):
            c.started(step, stall_s=0.0)
            c.durable(background_s=0.0)
            c.succeeded()
            saves += 1
            step, t = step + 1, t + (0.9 if saves < 2 else 0.6) + 0.3
            c.observe_call(step, t)
    rep = c.report()
    assert c._provisional == 0 and rep.step_s == pytest.approx(0.6)
    assert rep.first_cost_s == pytest.approx(0.3) and rep.cost_s == pytest.approx(0.3)


def test_a_saves_quiet_steps_are_the_ones_just_before_and_just_after_it():
    """The quiet steps are numbered as measured: a save started after quiet steps 0-9 holds 2-9 as its
    before (the last _LOCAL), and the first _LOCAL // 2 measured after it closes as its after."""
    c = Cadence(100)
    t = _feed(c, range(0, 11), 0.0, 1.0)    # 10 quiet steps (the first call only starts the clock)
    c.started(10, stall_s=0.0)
    t = _feed(c, [11], t, 1.5)
    c.durable(background_s=1.0)
    t = _feed(c, [12], t, 1.2)               # settling
    c.started(12, stall_s=0.0)               # a second save at once: the first is closed now
    t = _feed(c, [13], t, 1.5)
    c.durable(background_s=1.0)
    t = _feed(c, [14], t, 1.2)
    t = _feed(c, range(15, 22), t, 2.0)      # quiet steps 10-16
    first, second = c._first, c._saves[0]
    assert [n for n, _ in first.before] == list(range(2, 10)) and first.after == []
    assert [n for n, _ in second.before] == list(range(2, 10))
    assert [n for n, _ in second.after] == list(range(10, 10 + _LOCAL // 2))
    assert c._local_base(second) == pytest.approx((4 * 2.0 + 4 * 1.0) / _LOCAL)


def test_a_save_forced_before_the_profiling_window_does_not_keep_its_warm_up():
    """save(force=True) right after the first save comes before any quiet step: the profiling
    window's steps are marked at the next save instead, and forgotten as in any job. A fixed
    interval has no profiling window, and its report keeps every quiet step it measured."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for forced in (True, False):   # the first save, then one forced at its settling step
        c.started(step, stall_s=0.0)
        step += 1
        t = _feed(c, [step], t, 0.9 + (1.0 if forced else 0.3))
        c.durable(background_s=0.9)
        step += 1
        t = _feed(c, [step], t, 0.9)   # settling
    made = 0
    while made < 8:
        step += 1
        t = _feed(c, [step], t, 0.9 if made == 0 else 0.6)   # the warm-up lasts until the next save
        if c.due(step, in_flight=False):
            c.started(step, stall_s=0.0)
            made += 1
            step += 1
            t = _feed(c, [step], t, 0.9)
            c.durable(background_s=0.6)
    assert c.step_s == pytest.approx(0.6)
    fixed = Cadence(6)
    fixed.observe_call(0, 0.0)
    t = 0.0
    for step in range(1, 21):   # quiet steps 4-6 and 9 at 1.2 s, 10-12 and 15-18 at 0.6 s
        t = _feed(fixed, [step], t, 1.2 if step < 10 else 0.6)
        if fixed.due(step, in_flight=False):
            fixed.started(step, stall_s=0.0)
            fixed.durable(background_s=0.1)
    assert fixed.step_s > 0.75   # its first quiet steps still in the mean (0.675 s if 4-6 were dropped)


def test_the_interval_leaves_quiet_steps_after_each_flight_and_settling_step():
    """A cheap save that is in flight for 3 steps: the interval is its flight + SETTLE + 1, so the
    baseline is refreshed by a quiet step after every save, never measured on the save's tail."""
    c = Cadence("auto", max_overhead=0.5)
    c.observe_call(0, 0.0)
    t, step = 0.0, 0
    for _ in range(2):      # the first save, then the profiling window's second one
        c.started(step, stall_s=0.0)
        t = _feed(c, [step + 1, step + 2, step + 3], t, 0.5)
        c.durable(background_s=1.5)
        t = _feed(c, range(step + 4, step + 4 + SETTLE + PROFILE_STEPS), t, 0.5)
        step += 3 + SETTLE + PROFILE_STEPS
    assert c.report().cost_s == pytest.approx(0.0)
    assert c.interval() == 3 + SETTLE + 1


def test_a_noisy_baseline_does_not_inflate_the_cost():
    """Costs are means of per-save differences, kept signed: noise in both directions cancels."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for i in range(9):
        c.started(step, stall_s=0.0)
        jitter = 0.05 if i % 2 else -0.05
        step += 1
        t = _feed(c, [step], t, 0.5 + 0.2 + jitter)     # the save's step: 0.2 s slower
        c.durable(background_s=0.5)
        step += 1
        t = _feed(c, [step], t, 0.5 - jitter)            # settling, noisy, not slowed
        for _ in range(3):
            step += 1
            t = _feed(c, [step], t, 0.5 + (0.05 if step % 2 else -0.05))
    assert c.report().cost_s == pytest.approx(0.2, abs=0.06)


def test_the_cost_is_the_mean_of_skewed_saves_as_a_stopwatch_sums_them():
    """Three saves in four cost 0.1 s, the fourth 0.9 s (it met the optimizer step, the disk was
    busy): over a run training loses 0.3 s a save, which is what a stopwatch outside sees. A median
    would say 0.1 s and save three times too often for the target."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for i in range(-1, 8):   # -1: the process's first save, 2 s (kept apart, not one of the eight)
        for _ in range(_LOCAL):
            step += 1
            t = _feed(c, [step], t, 1.0)
        c.started(step, stall_s=0.0)
        step += 1
        t = _feed(c, [step], t, 1.0 + (2.0 if i < 0 else 0.9 if i % 4 == 3 else 0.1))
        c.durable(background_s=1.0)
        for _ in range(SETTLE):
            step += 1
            t = _feed(c, [step], t, 1.0)
    assert c.report().cost_s == pytest.approx(0.3) and c.report().first_cost_s == pytest.approx(2.0)
    assert c.interval() == math.ceil(0.3 / (0.05 * 1.0))


@pytest.mark.parametrize("cost", [0.0, 0.4])
def test_skewed_step_times_do_not_charge_their_slow_steps_to_the_saves(cost):
    """Seven steps in eight take 0.5 s and one 1.3 s (mean 0.6 s, median 0.5 s), with or without a
    save; each save slows the two steps in flight by cost / 2. A stopwatch sees `cost` per save and
    0.6 s per step. A median baseline (0.5 s) made every save cost 0.3 s more: the slow steps' share
    of its three affected steps."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    pattern = [0.5] * 7 + [1.3]

    def run(steps: int, extra: float = 0.0) -> None:
        nonlocal t, step
        for _ in range(steps):
            step += 1
            t += pattern[step % len(pattern)] + extra
            c.observe_call(step, t)
    for _ in range(17):   # saves 11 steps apart: their affected steps meet the slow step 3 times in 8
        # (the first is kept apart: the 16 after it cover each position of the pattern twice)
        run(8)
        c.started(step, stall_s=0.0)
        run(2, cost / 2)
        c.durable(background_s=1.0)
        run(SETTLE)
    rep = c.report()
    assert rep.step_s == pytest.approx(0.6) and rep.cost_s == pytest.approx(cost, abs=1e-9)
    assert c.interval() == max(math.ceil(cost / (0.05 * 0.6) - 1e-9), 2 + SETTLE + 1)


def test_a_machine_speeding_up_does_not_make_the_saves_look_cheaper():
    """A process that speeds up through its first hundreds of steps (gpt/fsdp2 in bench/cadence.py:
    1.48 -> 1.03 s a step), each save adding 0.3 s to the step after its call. Measured against the
    quiet steps just before each save, which ran slower than its affected steps, a save cost 0.2 s;
    against the quiet steps on both sides, as the bench's alternating rounds measure it, 0.3 s."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)

    def run(steps: int, extra: float = 0.0) -> None:
        nonlocal t, step
        for _ in range(steps):
            step += 1
            t += 1.5 - 0.005 * step + extra
            c.observe_call(step, t)
    for _ in range(17):
        run(8)
        c.started(step, stall_s=0.0)
        run(1, 0.3)
        run(1)
        c.durable(background_s=1.0)
        run(SETTLE)
    run(_LOCAL // 2)   # the last save's quiet steps after it
    assert c.report().cost_s == pytest.approx(0.3, abs=0.01)


def test_each_save_is_measured_against_the_quiet_steps_just_before_it():
    """The machine slows from 0.5 to 1.0 s a step between two saves, each of which adds 0.1 s to the
    steps it affects (its call's and the settling one): both cost 0.2 s (a baseline of all quiet
    steps would make the first cost less than nothing and the second about a step more). A cost
    under the stall is never used."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for speed in (0.5, 1.0):
        for _ in range(_LOCAL):
            step += 1
            t = _feed(c, [step], t, speed)
        c.started(step, stall_s=0.0)
        step += 1
        t = _feed(c, [step], t, speed + 0.1)
        c.durable(background_s=speed)
        for _ in range(SETTLE):
            step += 1
            t = _feed(c, [step], t, speed + 0.1)
    step += 1
    t = _feed(c, [step], t, 1.0)
    want = round(0.1 * (1 + SETTLE), 6)
    assert [round(c._cost(f, math.nan), 6) for f in [c._first, *c._saves]] == [want, want]
    assert c.report().cost_s == pytest.approx(want) and c.report().first_cost_s == pytest.approx(want)
    c2 = Cadence("auto", max_overhead=0.05)
    c2.observe_call(0, 0.0)
    t, step = 0.0, 0
    for speed in (1.0, 0.8):   # the first save, then one measured faster than its baseline (noise)
        t = _feed(c2, range(step + 1, step + 1 + _LOCAL), t, 1.0)
        step += _LOCAL
        c2.started(step, stall_s=0.2)
        t = _feed(c2, [step + 1], t, speed)
        c2.durable(background_s=0.8)
        t = _feed(c2, [step + 2], t, speed)
        step += 2
    assert c2.report().cost_s < 0 and c2.interval() == math.ceil(0.2 / (0.05 * 1.0))


def test_a_save_seen_only_across_skipped_calls_does_not_drag_the_cost():
    """Saves cost 0.3 s, measured step by step. Then one save stays open while save() is not called
    for 30 steps that run 0.1 s faster than the baseline (a loop that paused its calls, like
    bench/cadence.py's rounds without saves): as one call covering 30 steps it would cost 0.3 - 3 s
    and pull the mean below zero. It is not used while saves measured step by step exist; a loop
    that never calls save() at every step still gets an interval from its coarse measurements."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for _ in range(4):
        t = _feed(c, range(step + 1, step + 1 + _LOCAL), t, 1.0)
        step += _LOCAL
        c.started(step, stall_s=0.0)
        step += 1
        t = _feed(c, [step], t, 1.3)
        c.durable(background_s=1.0)
        step += SETTLE
        t = _feed(c, [step], t, 1.0)
    fine = c.report().cost_s
    assert fine == pytest.approx(0.3)
    t = _feed(c, range(step + 1, step + 1 + _LOCAL), t, 1.0)
    step += _LOCAL
    c.started(step, stall_s=0.0)
    step += 30
    t += 30 * 0.9 + 0.3
    c.observe_call(step, t)             # one call for 30 steps
    c.durable(background_s=t)
    t = _feed(c, [step + 1], t, 1.0)
    t = _feed(c, [step + 2], t, 1.0)
    assert c._first is not None and len(c._saves) == 4
    assert c.report().cost_s == pytest.approx(fine)
    assert c.interval() == math.ceil(0.3 / (0.05 * 1.0))
    only = Cadence("auto", max_overhead=0.05)       # save() every other step: every save is coarse
    t, step = 0.0, 0
    only.observe_call(step, t)
    for _ in range(3):
        for _ in range(_LOCAL):
            step += 2
            t += 2.0
            only.observe_call(step, t)
        only.started(step, stall_s=0.0)
        step, t = step + 2, t + 2.4
        only.observe_call(step, t)
        only.durable(background_s=1.0)
        step, t = step + 2, t + 2.0
        only.observe_call(step, t)
    assert only.report().cost_s == pytest.approx(0.4) and only.interval() == math.ceil(0.4 / (0.05 * 1.0))


def test_continuous_saves_whenever_nothing_is_in_flight_and_fixed_every_n():
    c = Cadence("continuous")
    assert c.due(7, in_flight=False) and not c.due(8, in_flight=True)
    f = Cadence(10)
    assert f.due(0, False)
    f.started(0, 0.0)
    assert not f.due(5, False) and f.due(10, False)


@pytest.mark.parametrize("kwargs", [dict(every=0), dict(every="sometimes"), dict(every=True),
                                    dict(every="auto", max_overhead=0), dict(every="auto", max_overhead=2),
                                    dict(every="auto", max_interval=0)])
def test_bad_options_are_refused_by_name(kwargs):
    every = kwargs.pop("every")
    with pytest.raises(ValueError, match="every=|max_overhead=|max_interval="):
        Cadence(every, **kwargs)


# ---------------------------------------------------------------------------- the manager's every=
def _train(mgr, steps, step_s, async_save=True, until_saves=0):
    """`steps` training steps of `step_s` seconds, save() called after each; with until_saves, on
    (up to 20x `steps`) until that many saves: a save's background threads run at a lower priority
    and take longer on a loaded machine. The steps saved."""
    import time

    import torch
    from torch import nn
    model = nn.Linear(64, 64)
    saved, step = [], 0
    while step < steps or (len(saved) < until_saves and step < 20 * steps):
        time.sleep(step_s)                       # the training step
        with torch.no_grad():
            model.weight.add_(1.0)
        if mgr.save(step, {"model": model}, async_save=async_save) is not None:
            saved.append(step)
        step += 1
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
        saved = _train(mgr, 60, 0.01, until_saves=3)
        rep = mgr.cadence_report()
    assert saved[0] == 0 and len(saved) >= 3
    assert rep["mode"] == "auto" and rep["interval"] > 1 and rep["step_s"] > 0.005
    # the interval in force is the formula's on what was measured: the cost per save against the
    # baseline, and never less than the flight, a settling step and a quiet one
    want = choose_interval(rep["step_s"], max(rep["cost_s"], 0.0), 0.0, max_overhead=0.05, max_interval=10_000,
                           min_interval=math.ceil(rep["steps_in_flight"]) + SETTLE + 1)
    assert rep["interval"] == want and not rep["profiling"] and rep["quiet_steps"] >= PROFILE_STEPS
    assert rep["overhead"] <= 0.05 + 1e-9
    # the second save waits for the profiling window, the later ones are spaced by the flight, a
    # settling step and a quiet one at least
    assert saved[1] - saved[0] >= 1 + SETTLE + PROFILE_STEPS, saved
    assert all(b - a >= 1 + SETTLE + 1 for a, b in zip(saved[1:], saved[2:])), saved


def test_continuous_saves_as_soon_as_the_previous_one_is_durable(tmp_path):
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every="continuous", keep_last=2) as mgr:
        saved = _train(mgr, 30, 0.005, until_saves=2)
    assert saved[0] == 0 and 1 < len(saved) <= 30


def _two_rank_auto(rank, world, root):
    import omnickpt
    with omnickpt.CheckpointManager(root, every="auto", max_overhead=0.05) as mgr:
        # rank 1's steps are slower: its own measurement would pick another interval
        return _train(mgr, 40, 0.01 if rank == 0 else 0.03, until_saves=3), mgr.cadence_report()


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
        _train(mgr, 12, 0.05, until_saves=2)    # a Linear(64, 64) save is durable well within a 50 ms step
        rep = mgr.cadence_report()
    assert rep["steps_in_flight"] is not None and rep["steps_in_flight"] >= 1


def test_auto_profiles_quiet_steps_after_its_first_save_before_choosing_an_interval(tmp_path):
    """The first call saves (a resume point); the next save waits for the baseline: the first save's
    step, its settling step, then PROFILE_STEPS quiet steps. That second save is the first one the
    interval is chosen from (the first's one-time costs are kept apart). The report says so while it
    lasts."""
    import omnickpt
    with omnickpt.CheckpointManager(str(tmp_path), every="auto", max_overhead=0.5) as mgr:
        assert mgr.save(0, {"x": __import__("torch").zeros(4)}) is not None
        rep = mgr.cadence_report()
        assert rep["profiling"] and rep["interval"] is None and rep["quiet_steps"] == 0
        saved = [0] + _train_from(mgr, 1, 200, 0.01)
        rep = mgr.cadence_report()
    assert len(saved) >= 2 and saved[1] >= 1 + SETTLE + PROFILE_STEPS, saved
    assert not rep["profiling"] and rep["quiet_steps"] >= PROFILE_STEPS and rep["interval"] >= 1 + SETTLE + 1, rep
    assert rep["first_cost_s"] is not None and rep["cost_s"] is not None


def _train_from(mgr, first, steps, step_s):
    """_train's loop over steps first, first + 1, ... until two saves: the steps saved."""
    import time

    import torch
    out = []
    for step in range(first, first + steps):
        time.sleep(step_s)
        if mgr.save(step, {"x": torch.full((4,), float(step))}) is not None:
            out.append(step)
            if len(out) == 2:
                break
    mgr.wait()
    return out


def test_steps_until_due_agrees_with_due():
    """Counted ahead, the next due call is the one due() picks, for a fixed interval (multiples of
    it, and an interval after a save off the grid) and for "auto"; unknown where it cannot be."""
    f = Cadence(5)
    assert f.steps_until_due(3) is None              # before the first save
    f.started(3, 0.0)                                 # a first call at step 3 (a restart)
    for step in range(4, 12):
        ahead = f.steps_until_due(step)
        assert ahead == next(s for s in range(step, step + 10) if f.due(s, False)) - step
    assert f.steps_until_due(4) == 1 and f.steps_until_due(5) == 0
    a = Cadence("auto", max_overhead=0.05)
    a.observe_call(0, 0.0)
    a.started(0, 0.0)
    assert a.steps_until_due(1) is None               # profiling: the second save comes when measured
    t = _feed(a, [1], 0.0, 0.5)
    a.durable(background_s=0.5)
    t = _feed(a, [2], t, 0.5)                         # its settling step: the first save measured
    assert [a.steps_until_due(2 + i) for i in range(1)] == [PROFILE_STEPS]
    t = _feed(a, [3, 4], t, 0.5)                      # two quiet steps of the profiling window
    assert a.steps_until_due(4) == PROFILE_STEPS - 2
    t = _feed(a, [5, 6], t, 0.5)
    assert a.steps_until_due(6) == 0 and a.due(6, in_flight=False)
    a.adopt(7, None)                                  # an interval agreed on
    assert a.steps_until_due(3) == 4 and a.steps_until_due(9) == 0
    a.failed(9)
    assert a.steps_until_due(10) == 6                 # one failure: the interval, from the failed attempt
    a.failed(None)                                    # a second one in a row (found later): 2 intervals
    assert a.steps_until_due(10) == 13 and not a.due(22, False) and a.due(23, False)
    assert Cadence("continuous").steps_until_due(5) is None


def test_staging_is_warmed_as_many_steps_ahead_as_faulting_it_in_takes():
    from omnickpt.cadence import WARM_BYTES_PER_S, warm_lead
    assert warm_lead(400 << 20, None) == 2            # no step time yet
    assert warm_lead(1 << 20, 1.0) == 2               # well within a step: the call before, and one more
    n = int(4 * WARM_BYTES_PER_S)                     # 4 s of faulting
    assert warm_lead(n, 1.0) == 5 and warm_lead(n, 0.5) == 9


class _Solo:
    world_size = 1


def test_warming_ahead_waits_for_a_quiet_step_and_the_second_half_of_the_interval():
    """every=4, saves in flight for one step: the call right after a save and its settling step are
    not quiet and lie in the first half; the warm comes once a quiet step has been measured, once
    per save. An interval with no quiet step (every=3 here) is never warmed ahead: the baseline needs
    that step."""
    from omnickpt.cadence import CadencePolicy
    p = CadencePolicy(Cadence(4), _Solo())
    c = p.cadence
    c.observe_call(0, 0.0)
    c.started(0, 0.0)
    c.observe_call(1, 1.0)                            # in flight
    c.durable(0.5)
    assert not p.warm_due(1, 3 << 20)
    c.observe_call(2, 2.0)                            # settling
    assert not p.warm_due(2, 3 << 20)
    c.observe_call(3, 3.0)                            # quiet
    assert c.quiet_since_save == 1 and p.warm_due(3, 3 << 20)
    assert not p.warm_due(3, 3 << 20)                 # once per save
    c.observe_call(4, 4.0)
    c.started(4, 0.0)
    assert c.quiet_since_save == 0
    for step in (5, 6, 7):
        c.observe_call(step, float(step))
        if step == 5:
            c.durable(0.5)
    assert not p.warm_due(7, 0)                       # nothing cold: nothing to warm
    assert p.warm_due(7, 3 << 20, rate=1e12)
    three = CadencePolicy(Cadence(3), _Solo())
    three.cadence.observe_call(0, 0.0)
    three.cadence.started(0, 0.0)
    for step in range(1, 13):
        three.cadence.observe_call(step, float(step))
        if step % 3 == 0:
            three.cadence.started(step, 0.0)
        elif step % 3 == 1:
            three.cadence.durable(0.5)
        else:
            assert not three.warm_due(step, 3 << 20)
    q = CadencePolicy(Cadence(20), _Solo())
    q.cadence.observe_call(0, 0.0)
    q.cadence.started(0, 0.0)
    big = int(30 * WARM_BYTES_PER_S)                  # a lead longer than the interval at 1 s steps
    for step in range(1, 20):
        q.cadence.observe_call(step, float(step))     # 1 s steps
        if step == 1:
            q.cadence.durable(0.5)
        if q.warm_due(step, big):
            break
    assert q.cadence.step_s == pytest.approx(1.0)
    assert step == 11                                 # past mid-interval, not right after the save


def test_the_steps_while_staging_warms_are_the_next_saves_cost():
    """Where the warm's faults slow training (no idle core), the steps it overlaps are not quiet: they
    count as the save's affected steps, against the quiet steps before the warm began. While "auto"
    profiles they stay quiet steps: its second save waits for PROFILE_STEPS of them."""
    c = Cadence("auto", max_overhead=0.05)
    t, step = 0.0, 0
    c.observe_call(step, t)
    for i in range(4):   # the first save (kept apart), the profiling save, then two warmed ahead
        t = _feed(c, range(step + 1, step + 1 + _LOCAL), t, 1.0)
        step += _LOCAL
        c.warming()
        t = _feed(c, [step + 1, step + 2], t, 1.3 if i >= 2 else 1.0)   # the warm slows two steps by 0.3 s
        step += 2
        if i == 1:   # profiling: still quiet steps
            assert c._pre is None and c.quiet_since_save == _LOCAL + 2
        c.started(step, stall_s=0.0)
        t = _feed(c, [step + 1], t, 1.0)              # the save itself: into warm memory, free
        c.durable(background_s=0.5)
        t = _feed(c, [step + 1 + SETTLE], t, 1.0)
        step += 1 + SETTLE
    assert [round(c._cost(f, 1.0), 6) for f in c._saves] == [0.0, 0.6, 0.6]
    rep = c.report()
    assert rep.step_s == pytest.approx(1.0) and rep.cost_s == pytest.approx(0.4)


def test_auto_with_released_staging_goes_on_saving(tmp_path):
    """every="auto" with release_staging=True: warming ahead of the profiling save must not keep its
    quiet steps from being counted (a review found a job that never saved after its first save)."""
    import omnickpt
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        with omnickpt.CheckpointManager(str(tmp_path), checkpointer=ckpt, every="auto", max_overhead=0.5) as mgr:
            saved = _train(mgr, 60, 0.01, until_saves=4)
            rep = mgr.cadence_report()
            assert ckpt._pool.warm_rate is not None, "no save was warmed ahead"
    assert len(saved) >= 4, saved
    assert not rep["profiling"] and rep["interval"] is not None and rep["quiet_steps"] >= PROFILE_STEPS
