"""How often to checkpoint: a fixed interval, "auto" (CheckFreq's rule: the most frequent cadence
whose measured cost stays under a fraction of the training time) or "continuous" (the next save as
soon as the previous one is durable, Orbax's continuous mode).

The cost of one save is what training loses to it, measured the way a stopwatch outside the job
would: every step that a save affected against the baseline step time.

- The **baseline** is the mean of recent *quiet* steps: no save in flight, and not the first
  `SETTLE` step(s) after one became durable (a save's tail - write-back, freed memory, a finishing
  thread - still slows the step after it; measuring against that step understated the cost).
  A **profiling window** at start: after the first save (a resume point at the first call),
  "auto" saves a second time once `PROFILE_STEPS` quiet steps are measured, and chooses its
  first interval from that second save. The baseline is refreshed all along: every interval
  "auto" chooses leaves at least one quiet step after each save's flight and settling step, and
  the window keeps the newest `_WINDOW` of them.
- The profiling window's quiet steps are a process's first ones, and often slower than its later
  ones (its allocator grows and its memory is faulted in: mlp/ddp 0.87-0.89 s a step there, 0.55-0.6 s
  later). Against them the next saves seemed to cost less than nothing, and "auto" kept its shortest
  interval for 40 steps and more: +1.3% reported, +8.7% measured outside (bench/cadence.py). They are
  **forgotten** once `PROFILE_STEPS` quiet steps after "auto"'s second save are measured, and the saves
  measured against them are measured against the baseline since (`_forget_warm_up`).
- The **first save** of a cadence is kept apart (`first_cost_s` in the report). It pays what only
  a process's first save pays: its staging memory faulted in, its plan made, its threads' first
  work. On the 806 MB MLP (2 DDP ranks) that was 2.8 s against 0.2-0.4 s for each later save; in
  the mean of the window it set the interval at 56 steps instead of about 20 for the next 16
  saves, and the report said +5.0% where a stopwatch measured 0% (bench/cadence.py). The
  interval is for the saves to come, and a one-time cost is not one of theirs. A job whose every
  save pays it (`release_staging=True`) still has it in every later save's cost: in the step the
  copy holds, or, where the manager warms the staging ahead (`warming()`), in the steps the warm
  overlaps, which count as the save's affected steps rather than quiet ones.
- The **affected steps** of a save are the steps from its call until it is durable (the first one
  holds its stall) plus the settling step(s). Its **cost** is their time minus as many baseline
  steps, the baseline of the quiet steps around it: the last ones before it and the first ones
  after (the machine's speed drifts from minute to minute, and on both sides a drift one way
  cancels, as in bench/cadence.py's alternating rounds). The interference is that cost less the
  stall; the interval never uses a cost below the stall, which is measured directly.

    overhead(k) = cost / (k * baseline)          for a save every k steps

"auto" picks the smallest k with overhead(k) <= max_overhead and k >= (steps in flight) + SETTLE + 1
(one quiet step at least after each save, to keep the baseline fresh; in whole calls where save() is
called every few steps: one quiet call), capped by max_interval.
The cost is the mean over the recent saves: training loses the sum of the saves' costs, which a
stopwatch sees, and saves' costs are skewed (most cost little, the one that meets a busy disk or an
optimizer step much more), so a median under-reported them (mlp/ddp in bench/cadence.py: +4.9%
reported, +8.9% measured outside). The baseline is a mean for the same reason: step times are
skewed too (most steps alike, now and then one much slower), and the affected steps' time is a sum,
so a median baseline counted the slow steps' share of the affected steps as the save's cost (a
right-skewed loop whose saves cost nothing was measured at half a step per save, and mlp/ddp
in bench/cadence.py reported +4.9% against -0.2% outside). Flights are medians (of the recent saves),
so one slow save does not swing the interval; on a noisy machine a single save's cost can come out
negative, and is kept so that the mean is not biased upwards.

A save whose affected steps were seen only in a call that covered several steps (save() not called
at every step: a loop that paused its calls, bench/cadence.py's rounds without saves) is measured
with the noise of all those steps: in bench/cadence.py one came out at -2.7 s beside saves of
0.1-0.8 s, the mean fell below zero and the interval to its minimum (+14% measured outside against a
5% target on wide/ddp). Such saves count only while no save was measured step by step (a loop that
calls save() every other step has no other measurements).

`choose_interval` is the pure rule; `Cadence` keeps the measurements and answers `due(step)`;
neither touches storage or processes. `CadencePolicy` is the manager's save decision built on them:
it times the manager's saves, asks `Cadence`, and makes the ranks decide alike (through the
manager's comm). bench/cadence.py checks the report against a stopwatch outside the manager.

A save that fails (on_error="warn" lets training go on) still counts as the cadence's attempt: the
next one is due an interval after it, not at the next step. Failures in a row space the attempts
out further (`backoff`: 2, 4, then 8 intervals at most; "continuous" counts 1 step as its interval),
so that storage that is down costs the loop a failed attempt now and then, not one per step; the
first save that succeeds restores the interval.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

MODES = ("auto", "continuous")
_WINDOW = 16   # recent measurements kept (quiet steps, saves)
MAX_BACKOFF = 8   # after failed saves in a row, attempts at most this many intervals apart
SETTLE = 1        # steps after a save became durable that still count as affected by it
PROFILE_STEPS = 4  # quiet steps measured before "auto" chooses its first interval
_LOCAL = 8         # the quiet steps around a save that are its baseline (up to half of them after it)


# How fast a background thread faults fresh host memory in beside training (bytes per second), until
# a warm has measured it on this machine (StagingPool.warm_rate): 400 MB per rank on two ranks at once
# took 0.7 s here with nothing else running (a VM whose host backs reported free memory anew).
WARM_BYTES_PER_S = 0.4e9


def warm_lead(nbytes: int, step_s: float | None, rate: float | None = None) -> int:
    """How many calls ahead of a due save to start warming `nbytes` of staging (pure): the steps
    the warm takes at `rate` bytes per second (WARM_BYTES_PER_S when not measured), and one more;
    2 with no step time measured yet."""
    if not step_s or step_s <= 0:
        return 2
    return math.ceil(nbytes / (rate or WARM_BYTES_PER_S) / step_s - 1e-9) + 1


def backoff(failures: int) -> int:
    """Intervals between attempts after `failures` failed saves in a row (pure): 1, 1, 2, 4, 8, 8..."""
    return 1 if failures <= 1 else min(2 ** (failures - 1), MAX_BACKOFF)


def choose_interval(step_s: float, stall_s: float, background_s: float, interference_s: float = 0.0, *,
                    max_overhead: float, max_interval: int, min_interval: int = 1) -> int:
    """Steps between two saves (pure): the smallest k >= min_interval with
    (stall + interference) / (k * step) <= max_overhead and k >= ceil(background / step) + 1 (the
    previous save durable and one step run without a save in flight; 1 when saves have no
    background part), at most max_interval. With no measured step time yet, min_interval."""
    if not step_s > 0:
        return min_interval
    cost = max(stall_s, 0.0) + max(interference_s, 0.0)
    k_cost = math.ceil(cost / (max_overhead * step_s) - 1e-9) if cost > 0 else 1
    # Longer than a save's flight by a whole step: the flight overlaps the next ceil(background / step)
    # steps (all slowed by it, counted as in flight), and at least one step after them runs with no
    # save in flight, which is what the interference is measured against (with one step fewer, a
    # save durable within a step made every step "in flight" and the interference unmeasurable).
    k_flight = math.ceil(background_s / step_s - 1e-9) + 1 if background_s > 0 else 1
    return max(min_interval, min(max_interval, max(k_cost, k_flight, 1)))


def check_cadence(every: int | str, max_overhead: float, max_interval: int) -> None:
    """ValueError naming the first of Cadence's arguments that is not valid."""
    if isinstance(every, bool) or not (isinstance(every, int) and every >= 1 or every in MODES):
        raise ValueError(f"every={every!r}: must be a positive int, 'auto' or 'continuous'")
    if not (isinstance(max_overhead, (int, float)) and 0 < max_overhead < 1):
        raise ValueError(f"max_overhead={max_overhead!r}: must be a fraction between 0 and 1 (0.02 is 2%)")
    if isinstance(max_interval, bool) or not isinstance(max_interval, int) or max_interval < 1:
        raise ValueError(f"max_interval={max_interval!r}: must be a positive int")


@dataclass
class CadenceReport:
    mode: str
    interval: int | None
    step_s: float | None             # the baseline: mean of recent quiet steps
    stall_s: float | None
    background_s: float | None       # call to durable
    interference_s: float | None     # cost less the stall
    overhead: float | None           # cost / (interval * step)
    max_overhead: float | None
    steps_in_flight: float | None = None   # steps from a save's call until durable, per save (median)
    failures_in_a_row: int = 0              # failed saves since the last one that succeeded (backoff)
    cost_s: float | None = None             # per save (mean): the affected steps' time less as many baseline steps
    steps_affected: float | None = None     # per save (median): in flight + SETTLE
    quiet_steps: int = 0                    # quiet steps in the baseline's window
    profiling: bool = False                 # "auto" still measuring its baseline (no interval chosen yet)
    first_cost_s: float | None = None       # the first save's cost, kept apart (one-time costs)


@dataclass
class _Flight:
    """One save's affected steps, accumulated call by call."""
    stall: float
    # the quiet steps around it, each as (its number among the quiet steps, seconds): the _LOCAL just
    # before it, and the first _LOCAL // 2 after it as they come
    before: tuple[tuple[int, float], ...] = ()
    after: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0      # time of the affected steps (between save() calls)
    steps: int = 0
    flight_steps: int = 0     # of which until durable
    background: float | None = None    # call to durable; None while in flight
    settle_left: int = SETTLE
    coarse: bool = False      # some of its steps were seen only as one call covering several


class Cadence:
    """Whether a step is due for a save. `every`: an int (a fixed interval), "auto" or "continuous".

    The manager calls `observe_call(step, now)` at every save() call (the time between calls is the
    step time), `started(step, stall_s)` when a save has started, `durable(background_s)` once it is
    durable (sync saves: at once), `failed(step)` when one fails and `succeeded()` when one is known
    committed, and `due(step, in_flight)` to decide."""

    def __init__(self, every: int | str, *, max_overhead: float = 0.02, max_interval: int = 10_000):
        check_cadence(every, max_overhead, max_interval)
        self.every, self.max_overhead, self.max_interval = every, float(max_overhead), max_interval
        self._last_call: tuple[int, float] | None = None
        self._call_steps: deque[int] = deque(maxlen=_WINDOW)   # steps between recent save() calls
        self._quiet: deque[float] = deque(maxlen=_WINDOW)      # seconds per quiet step
        self._open: _Flight | None = None                      # the save whose affected steps run now
        self._saves: deque[_Flight] = deque(maxlen=_WINDOW)    # closed: every affected step measured
        self._first: _Flight | None = None    # the first save measured to its end, kept apart
        # Steps run while the next save's staging warms (warming()): that save's, not quiet ones.
        self._pre: _Flight | None = None
        self._warm_pending = False   # warming() was told: the steps after the open save closes go to _pre
        # The quiet steps measured before "auto"'s second save (the profiling window's, early in the
        # process: its warm-up) are the window's oldest `_provisional` ones until PROFILE_STEPS
        # quiet steps after them are in the window too; then they are forgotten.
        self._seen = 0         # quiet steps measured so far (each one's number: _Flight.before, .after)
        self._mark_seen = 0    # ... when the second save marked the warm-up (0: not marked yet)
        self._forgotten = 0    # quiet steps numbered below this are the forgotten warm-up
        self.quiet_since_save = 0    # quiet steps measured since the last save started
        self._last_saved: int | None = None   # the step of the last attempt, failed or not
        self.failures = 0                     # failed attempts in a row
        # "auto" across ranks: each rank measures its own times, so the interval in force is one the
        # ranks agreed on (the coordinator's, handed out at each save), with the report it was
        # chosen from; None: this rank's own, on its measurements now.
        self.agreed: int | None = None
        self._agreed_report: CadenceReport | None = None

    # ------------------------------------------------------------------ measurements
    def observe_call(self, step: int, now: float) -> None:
        """A save() call at `step`, at monotonic time `now`: the steps since the previous call were
        affected by the save open now, or quiet."""
        if self._last_call is not None:
            prev_step, prev_t = self._last_call
            if step > prev_step and now > prev_t:
                self._call_steps.append(step - prev_step)
                self._count(now - prev_t, step - prev_step)
        self._last_call = (step, now)

    def _count(self, seconds: float, steps: int) -> None:
        f = self._open
        if f is None and self._warm_pending:
            if self._pre is None:
                self._pre = _Flight(stall=0.0, before=self._recent())
            self._pre.seconds += seconds
            self._pre.steps += steps
            self._pre.coarse = self._pre.coarse or steps > 1
            return
        if f is None:
            self._quiet.append(seconds / steps)
            self.quiet_since_save += 1
            for f in self._saves:
                if len(f.after) < _LOCAL // 2:
                    f.after.append((self._seen, seconds / steps))
            self._seen += 1
            if self._provisional and self._seen - self._mark_seen >= PROFILE_STEPS:
                self._forget_warm_up()
            return
        f.seconds += seconds
        f.steps += steps
        f.coarse = f.coarse or steps > 1
        if f.background is None or f.flight_steps == 0:   # the steps after its call hold its stall
            f.flight_steps += steps
        else:
            f.settle_left -= steps
            if f.settle_left <= 0:
                self._close()

    def _forget_warm_up(self) -> None:
        """PROFILE_STEPS quiet steps were measured after the second save: the profiling window's go,
        from the window and from the quiet steps around each save (_local_base). The saves measured
        against them are measured against the quiet steps after them instead (the second save's
        are PROFILE_STEPS at least by now), or, with none, the baseline of each later report. (The
        window's mean at a later report was the rule until the fifteenth session: in a process still
        speeding up, it charged the second save for the drift of every step since.)"""
        for _ in range(self._provisional):
            self._quiet.popleft()
        self._forgotten = self._mark_seen

    def _close(self) -> None:
        if self._open is not None and self._open.steps > 0:
            if self._first is None and not self._saves:
                self._first = self._open   # one-time costs (see the module's docstring)
            else:
                self._saves.append(self._open)
        self._open = None

    def started(self, step: int, stall_s: float) -> None:
        """A save started at `step` (after its stall): the steps from its call on are its own. A save
        still settling is closed (a new save in its settling step takes that step's time)."""
        self._close()
        if self.every == "auto" and not self._mark_seen and self._first is not None and self._quiet:
            # "auto"'s first save after the first with quiet steps before it (its second, unless one was
            # forced before any quiet step): the quiet steps so far were measured early in the process
            self._mark_seen = self._seen   # > 0: the window holds a quiet step
        pre, self._pre, self._warm_pending = self._pre, None, False
        self.quiet_since_save = 0
        if pre is not None:   # the steps since its staging began to warm are this save's too
            self._open = dataclasses.replace(pre, stall=max(stall_s, 0.0))
        else:
            self._open = _Flight(stall=max(stall_s, 0.0), before=self._recent())
        self._last_saved = step

    def warming(self) -> None:
        """The next save's staging begins to warm now (in the background): the steps from here to
        that save (from the end of the last save's settling, if it still settles) count as affected
        by it, against the quiet steps before (the warm's faults are CPU work, which slows training
        where no core is idle, and that is part of what the save costs). Not while "auto" profiles:
        its second save waits for PROFILE_STEPS quiet steps, which those steps would never become
        (a review found a job that never saved again), so a warm then weighs on the baseline."""
        if not self.profiling():
            self._warm_pending = True

    def durable(self, background_s: float) -> None:
        """The open save is durable, `background_s` after its call: SETTLE more steps count as its."""
        if self._open is not None and self._open.background is None:
            self._open.background = max(background_s, 0.0)

    @property
    def last_saved(self) -> int | None:
        """The step of the last attempt, failed or not (None before the first)."""
        return self._last_saved

    def failed(self, step: int | None) -> None:
        """The save attempted at `step` failed (None: an async save, found failed later, whose
        attempt was already counted by started()): it counts as the attempt, and as one more failure
        in a row. (The steps it affected still cost training their time: measured as a save's.)"""
        if step is not None:
            self._last_saved = step
            self._pre, self._warm_pending = None, False   # the save warmed for did not start
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0

    # ------------------------------------------------------------------ decisions
    @property
    def step_s(self) -> float | None:
        """The baseline: seconds per quiet step (the mean of the recent ones: see the module's docstring)."""
        return statistics.fmean(self._quiet) if self._quiet else None

    def profiling(self) -> bool:
        """"auto" has no interval yet: fewer than PROFILE_STEPS quiet steps, or no save after the
        first measured to its end."""
        return self.every == "auto" and (len(self._quiet) < PROFILE_STEPS or not self._later_done())

    def _later_done(self) -> list[_Flight]:
        """The saves after the first, measured to their end."""
        return [f for f in self._saves if f.background is not None]

    def _profiling_save_due(self) -> bool:
        """"auto" in its profiling window: the first save has been measured to its end, with
        PROFILE_STEPS quiet steps since, and no other save has started yet: the second one is due."""
        return (self._first is not None and self._first.background is not None and not self._saves
                and self._open is None and len(self._quiet) >= PROFILE_STEPS)

    @property
    def _provisional(self) -> int:
        """The window's oldest quiet steps that the second save marked as the warm-up's, not forgotten
        yet (they leave as the window moves on, or all at once in _forget_warm_up)."""
        if self._forgotten:
            return 0
        return max(0, self._mark_seen - (self._seen - len(self._quiet)))

    def _recent(self) -> tuple[tuple[int, float], ...]:
        """The last _LOCAL quiet steps, numbered."""
        recent = list(self._quiet)[-_LOCAL:]
        return tuple(zip(range(self._seen - len(recent), self._seen), recent))

    def _local_base(self, f: _Flight) -> float | None:
        """The quiet steps around a save: the first _LOCAL // 2 after it as they come, and as many of
        those just before it as make _LOCAL. On both sides, as bench/cadence.py alternates its rounds:
        a machine whose speed drifts one way (a process speeding up through its first hundred steps:
        gpt/fsdp2 1.48 -> 1.03 s a step) made a baseline of the steps before each save too slow, and
        the cost too low, by the drift over half the window."""
        # the first save ran in the warm-up itself: its quiet steps are kept
        cut = 0 if f is self._first else self._forgotten
        after = [s for n, s in f.after if n >= cut]
        around = after + [s for n, s in f.before if n >= cut][len(after) - _LOCAL:]
        return statistics.fmean(around) if around else None

    def _cost(self, f: _Flight, base: float) -> float:
        """A save's cost: its affected steps' time less as many steps of the quiet steps around it
        (of `base`, the baseline now, for a save with none, or whose quiet steps were the profiling
        window's: _forget_warm_up)."""
        local = self._local_base(f)
        return f.seconds - (local if local is not None else base) * f.steps

    def _figures(self) -> dict | None:
        """What the interval is chosen from: the baseline and the cost per save as means (a stopwatch
        sums both), the stall, time until durable and steps per save as medians, over the saves
        after the first (the first's until there are none); None before a save has been measured to
        its end."""
        base = self.step_s
        done = self._later_done()
        if not done and self._first is not None and self._first.background is not None:
            done = [self._first]
        if base is None or not done:
            return None
        # saves measured step by step, when there are any (see the module's docstring: calls that skip steps)
        done = [f for f in done if not f.coarse] or done
        med = statistics.median
        # each save against the quiet steps around it (the machine's speed drifts: a baseline
        # from other minutes made single costs swing by a step's time); a save with none (the
        # first, at a job's start), against the baseline now
        # the mean: training loses the sum of the costs (see the module's docstring)
        cost = statistics.fmean(self._cost(f, base) for f in done)
        stall = med(f.stall for f in done)
        return {"step": base, "stall": stall, "background": med(f.background for f in done),
                "cost": cost, "interference": cost - stall, "flight": med(f.flight_steps for f in done),
                "affected": med(f.steps for f in done)}

    def interval(self) -> int | None:
        """Steps between saves under the current measurements (None in continuous mode, and while
        "auto" is profiling)."""
        if isinstance(self.every, int):
            return self.every
        if self.every == "continuous" or self.profiling():
            return None
        m = self._figures()
        # the stall is measured directly: noise can make the mean cost smaller, not the save cheaper
        return choose_interval(m["step"], max(m["cost"], m["stall"]), 0.0, max_overhead=self.max_overhead,
                               max_interval=self.max_interval,
                               min_interval=min(self.max_interval, self._min_interval(m["flight"], m["affected"])))

    def _min_interval(self, flight: float, affected: float) -> int:
        """The shortest interval that leaves one quiet *call* after a save's flight and settling: a
        loop that calls save() every c steps settles in whole calls and measures quiet steps a call
        at a time, so flight + SETTLE + 1 steps left it none (every call after a save was in flight
        or settling, the baseline was never refreshed, and the profiling window's warm-up steps were
        kept for good); with c = 1 the same. c is the median of the recent calls' steps, and calls
        spaced unevenly (4, 1, 1, ...) can settle in a long one: the steps saves were seen to affect
        (in whole calls) and one call more bound it too."""
        c = max(1, math.ceil(statistics.median(self._call_steps))) if self._call_steps else 1
        return max(math.ceil(flight) + (math.ceil(SETTLE / c) + 1) * c, math.ceil(affected) + c)

    def steps_until_due(self, step: int) -> int | None:
        """Calls from `step` (a call not due) until the next due one, as due() would decide them
        with nothing else changing (in "auto"'s profiling window: the quiet steps its second save
        still waits for; after failed attempts: the interval times their backoff, as due() spaces
        them); None where that is not known ahead: before the first save, "continuous", and "auto"
        before its first save is measured to its end."""
        last = self._last_saved
        if last is None or self.every == "continuous":
            return None
        if self.failures:
            interval = self.agreed or self.interval() or 1
            return max(last + interval * backoff(self.failures) - step, 0)
        if isinstance(self.every, int):
            k = self.every
            return min(-(-step // k) * k, max(step, last + k)) - step
        if self.agreed is None and self.profiling():
            # the profiling window's second save comes once PROFILE_STEPS quiet steps follow the first
            f = self._first
            if f is None or f.background is None or self._saves or self._open is not None:
                return None
            return max(PROFILE_STEPS - len(self._quiet), 0)
        interval = self.agreed or self.interval()
        return None if interval is None else max(last + interval - step, 0)

    def adopt(self, interval: int | None, report: CadenceReport | None) -> None:
        """Put in force an interval the ranks agreed on and the report it was chosen from (the
        report then says the same interval and the figures that give it)."""
        self.agreed, self._agreed_report = interval, report

    def due(self, step: int, in_flight: bool) -> bool:
        if self.every == "continuous" and in_flight:
            return False
        if self.failures and self._last_saved is not None:
            interval = 1 if self.every == "continuous" else (self.agreed or self.interval() or 1)
            return step - self._last_saved >= interval * backoff(self.failures)
        if self.every == "continuous":
            return not in_flight
        if self._last_saved is None:
            return True
        if isinstance(self.every, int):
            return step % self.every == 0 or step - self._last_saved >= self.every
        if self.every == "auto" and self.agreed is None and self.profiling():
            return self._profiling_save_due()
        interval = self.agreed or self.interval()
        return interval is not None and step - self._last_saved >= interval

    def own_report(self) -> CadenceReport:
        """This rank's measurements and the interval they give."""
        interval, m = self.interval(), self._figures()
        overhead = None
        if interval and m:
            overhead = max(m["cost"], m["stall"]) / (interval * m["step"])
        g = (lambda k: m[k]) if m else (lambda k: None)   # noqa: E731
        seen = ([self._first] if self._first is not None else []) + list(self._saves)
        stall = g("stall") if m else (statistics.median(f.stall for f in seen) if seen else None)
        return CadenceReport(mode=str(self.every) if not isinstance(self.every, int) else "fixed", interval=interval,
                             step_s=self.step_s, stall_s=stall, background_s=g("background"),
                             interference_s=(max(m["interference"], 0.0) if m else None), overhead=overhead,
                             max_overhead=self.max_overhead if self.every == "auto" else None,
                             steps_in_flight=g("flight"), failures_in_a_row=self.failures,
                             cost_s=g("cost"), steps_affected=g("affected"), quiet_steps=len(self._quiet),
                             profiling=self.profiling(), first_cost_s=self._first_cost())

    def _first_cost(self) -> float | None:
        f, base = self._first, self.step_s
        return self._cost(f, base) if f is not None and f.background is not None and base is not None else None

    def report(self) -> CadenceReport:
        if self.every == "auto" and self.agreed is not None and self._agreed_report is not None:
            return dataclasses.replace(self._agreed_report, interval=self.agreed, failures_in_a_row=self.failures)
        return self.own_report()


class CadencePolicy:
    """A manager's save decision with every=: which save() calls save, measured on the job itself.
    The manager asks `due(step, in_flight)` at every call (every rank decides alike), tells it when
    a save starts (`started`), fails (`failed`) or is known committed (`succeeded`), and lets it
    wait for the previous save before the next (`before_save`). It keeps the timing of the save in
    flight, and agrees across ranks through `comm` (the manager's process group): "continuous"
    with one small all-gather per call; "auto" with one broadcast of the coordinator's interval per
    save, and, while no interval is agreed yet (the profiling window after the first save), one
    broadcast of the coordinator's decision per call. Its figures: report()."""

    def __init__(self, cadence: Cadence, comm):
        self.cadence = cadence
        self.comm = comm
        self._started: float | None = None        # monotonic time of the call of the save in flight
        self._warmed_after: int | None = None     # the last save's step when staging was warmed for the next

    @property
    def every(self) -> int | str:
        return self.cadence.every

    def due(self, step: int, in_flight: bool, now: float | None = None) -> bool:
        """Every rank, at each save() call: measure, then decide alike on every rank. `in_flight`:
        a save of ours is still on its way to being durable (this rank's view)."""
        cadence = self.cadence
        now = time.monotonic() if now is None else now
        # the steps since the previous call: the open save's (the one that ended holds its moment of
        # becoming durable, so it is in flight), or quiet
        cadence.observe_call(step, now)
        if not in_flight and self._started is not None:   # the save in flight became durable since the last call
            self._durable(now)
        if cadence.every == "continuous":
            # each rank sees the previous save become durable at its own moment
            if self.comm.world_size > 1:
                in_flight = any(self.comm.all_gather_object(in_flight, step="cadence"))
            return not in_flight
        if (cadence.every == "auto" and cadence.agreed is None and cadence.last_saved is not None
                and self.comm.world_size > 1):
            # no interval agreed yet: each rank's baseline fills at its own pace, so the coordinator decides
            return bool(self.comm.broadcast_object(cadence.due(step, in_flight), step="cadence"))
        return cadence.due(step, in_flight)

    def before_save(self, wait) -> None:
        """Every rank, before a save that is due: when the previous one is still in flight, wait
        for it here (`wait()`: the manager's, None when it failed), so that its time until durable
        is measured and the next one's stall is its own."""
        if self._started is not None:
            if wait() is not None:
                self.cadence.succeeded()
            self._durable(time.monotonic())

    def started(self, step: int, t0: float, async_save: bool) -> None:
        """Every rank, after a save started at monotonic time `t0` (the save() call): its stall, and
        (auto) the interval until the next one, the coordinator's measurement handed to every rank
        (one broadcast per save)."""
        cadence, stall = self.cadence, time.monotonic() - t0
        cadence.started(step, stall)
        if async_save:
            self._started = t0
        else:
            cadence.durable(stall)
            cadence.succeeded()
        if cadence.every == "auto":
            mine = (cadence.interval(), cadence.own_report())
            cadence.adopt(*(self.comm.broadcast_object(mine, step="cadence") if self.comm.world_size > 1
                            else mine))

    def warm_due(self, step: int, cold_bytes: int, rate: float | None = None) -> bool:
        """At a call that does not save: whether to start warming `cold_bytes` of staging now for
        the next due save, at most once per save: warm_lead calls ahead of it (from the measured
        step time and warming `rate`), but never in the first half of the calls between two saves,
        so that memory released after each save stays released for half the interval at least
        (with a lead longer than that the warm starts at mid-interval, and the save takes the
        buffer as far as it is warm), and only once a quiet step has been measured since the last
        save: the steps from here to the save count as its own, and the baseline needs one quiet
        step an interval to follow the machine's speed (an interval at its minimum, flight +
        SETTLE + 1, has just that one, and its save is not warmed ahead)."""
        cadence = self.cadence
        if not cold_bytes or self._warmed_after == cadence.last_saved or cadence.quiet_since_save < 1:
            return False
        ahead = cadence.steps_until_due(step)
        if ahead is None or ahead > warm_lead(cold_bytes, cadence.step_s, rate):
            return False
        if step - cadence.last_saved <= ahead:   # the first half of the interval
            return False
        self._warmed_after = cadence.last_saved
        cadence.warming()
        return True

    def failed(self, step: int | None) -> None:
        self.cadence.failed(step)

    def succeeded(self) -> None:
        self.cadence.succeeded()

    def report(self) -> dict:
        """The mode, the interval in force, and what it was chosen from (the baseline seconds per
        step, stall, time until durable, cost and interference per save) with the overhead they give."""
        return dataclasses.asdict(self.cadence.report())

    def _durable(self, now: float) -> None:
        self.cadence.durable(now - self._started)
        self._started = None


def cadence_of(every: int | str | None, max_overhead: float, max_interval: int, comm) -> CadencePolicy | None:
    """The save decision of a manager built with every= (None without)."""
    if every is None:
        return None
    return CadencePolicy(Cadence(every, max_overhead=max_overhead, max_interval=max_interval), comm)
