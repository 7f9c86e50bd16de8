"""How often to checkpoint: a fixed interval, "auto" (CheckFreq's rule: the most frequent cadence
whose measured cost stays under a fraction of the training time) or "continuous" (the next save as
soon as the previous one is durable, Orbax's continuous mode).

The cost of one asynchronous save is what training loses to it: the stall (the loop waits for the
snapshot) plus the interference (steps that run while the save is in flight are slower, because
the save's copying, checksumming and writing share the cores and the memory bus). Both are
measured on the job itself, from the times at which the manager's save() is called:

    overhead(k) = (stall + interference) / (k * step)          for a save every k steps

and "auto" picks the smallest k with overhead(k) <= max_overhead, and never one so small that a save
would start before the previous one is durable and a step has run with none in flight
(k >= ceil(background / step) + 1: that quiet step is what the slowdown is measured against),
capped by max_interval.

`choose_interval` is the pure rule; `Cadence` keeps the measurements (medians of the recent ones,
so one slow step or save does not swing the interval) and answers `due(step)`; neither touches
storage or processes. `CadencePolicy` is the manager's save decision built on them: it times the
manager's saves, asks `Cadence`, and makes the ranks decide alike (through the manager's comm).

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
from dataclasses import dataclass

MODES = ("auto", "continuous")
_WINDOW = 16   # recent measurements kept for each median
MAX_BACKOFF = 8   # after failed saves in a row, attempts at most this many intervals apart


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
    step_s: float | None
    stall_s: float | None
    background_s: float | None
    interference_s: float | None
    overhead: float | None          # measured: (stall + interference) / (interval * step)
    max_overhead: float | None
    steps_in_flight: float | None = None   # steps that ran while a save was in flight, per save (median)
    failures_in_a_row: int = 0              # failed saves since the last one that succeeded (backoff)


class Cadence:
    """Whether a step is due for a save. `every`: an int (a fixed interval), "auto" or "continuous".

    The manager calls `observe_call(step, now, in_flight)` at every save() call (it learns the step
    time from consecutive calls, and whether a save was in flight during those steps),
    `observe_save(stall_s, background_s)` once a save it started is durable, `saved(step)` when a
    save starts, `failed(step)` when one fails and `succeeded()` when one is known committed, and
    `due(step, in_flight)` to decide."""

    def __init__(self, every: int | str, *, max_overhead: float = 0.02, max_interval: int = 10_000):
        check_cadence(every, max_overhead, max_interval)
        self.every, self.max_overhead, self.max_interval = every, float(max_overhead), max_interval
        self._last_call: tuple[int, float] | None = None
        self._steps: dict[bool, deque[float]] = {False: deque(maxlen=_WINDOW), True: deque(maxlen=_WINDOW)}
        self._stalls: deque[float] = deque(maxlen=_WINDOW)
        self._backgrounds: deque[float] = deque(maxlen=_WINDOW)
        self._in_flight_steps: deque[int] = deque(maxlen=_WINDOW)
        self._last_saved: int | None = None   # the step of the last attempt, failed or not
        self.failures = 0                     # failed attempts in a row
        # "auto" across ranks: each rank measures its own times, so the interval in force is one the
        # ranks agreed on (the coordinator's, handed out at each save), with the measurements it was
        # chosen from; None: this rank's own, on its measurements now.
        self.agreed: int | None = None
        self._basis: tuple[float | None, float | None, float | None, float | None] | None = None

    # ------------------------------------------------------------------ measurements
    def observe_call(self, step: int, now: float, in_flight: bool) -> None:
        """A save() call at `step`, at monotonic time `now`; `in_flight`: a save of ours was in flight
        during the steps since the previous call."""
        if self._last_call is not None:
            prev_step, prev_t = self._last_call
            if step > prev_step and now > prev_t:
                self._steps[in_flight].append((now - prev_t) / (step - prev_step))
        self._last_call = (step, now)

    def observe_save(self, stall_s: float, background_s: float, steps_in_flight: int | None = None) -> None:
        self._stalls.append(max(stall_s, 0.0))
        self._backgrounds.append(max(background_s, 0.0))
        if steps_in_flight is not None:
            self._in_flight_steps.append(steps_in_flight)

    def saved(self, step: int) -> None:
        self._last_saved = step

    def failed(self, step: int | None) -> None:
        """The save attempted at `step` failed (None: an async save, found failed later, whose
        attempt was already counted by saved()): it counts as the attempt, and as one more failure
        in a row."""
        if step is not None:
            self._last_saved = step
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0

    # ------------------------------------------------------------------ decisions
    @property
    def step_s(self) -> float | None:
        quiet = self._steps[False] or self._steps[True]
        return statistics.median(quiet) if quiet else None

    def interference_s(self) -> float:
        """Training time lost per save to its background work: the slowdown of a step with a save
        in flight, times the steps that run while one is."""
        quiet, busy = self._steps[False], self._steps[True]
        if not quiet or not busy:
            return 0.0
        per_step = max(statistics.median(busy) - statistics.median(quiet), 0.0)
        flights = statistics.median(self._in_flight_steps) if self._in_flight_steps else 1
        return per_step * flights

    def interval(self) -> int | None:
        """Steps between saves under the current measurements (None in continuous mode)."""
        if isinstance(self.every, int):
            return self.every
        if self.every == "continuous":
            return None
        step = self.step_s
        if step is None or not self._stalls:
            return 1      # nothing measured yet: save, and learn from it
        return choose_interval(step, statistics.median(self._stalls), statistics.median(self._backgrounds),
                               self.interference_s(), max_overhead=self.max_overhead,
                               max_interval=self.max_interval)

    def basis(self) -> tuple[float | None, float | None, float | None, float | None]:
        """The measurements an interval is chosen from now: (step, stall, background, interference)."""
        stall = statistics.median(self._stalls) if self._stalls else None
        background = statistics.median(self._backgrounds) if self._backgrounds else None
        return self.step_s, stall, background, (self.interference_s() if stall is not None else None)

    def adopt(self, interval: int, basis: tuple[float | None, float | None, float | None, float | None]) -> None:
        """Put in force an interval the ranks agreed on and the measurements it was chosen from
        (the report then says the same interval and the figures that give it)."""
        self.agreed, self._basis = interval, tuple(basis)

    def due(self, step: int, in_flight: bool) -> bool:
        if self.every == "continuous" and in_flight:
            return False
        if self.failures and self._last_saved is not None:
            interval = 1 if self.every == "continuous" else (self.agreed or self.interval())
            return step - self._last_saved >= interval * backoff(self.failures)
        if self.every == "continuous":
            return not in_flight
        if self._last_saved is None:
            return True
        if isinstance(self.every, int):
            return step % self.every == 0 or step - self._last_saved >= self.every
        return step - self._last_saved >= (self.agreed or self.interval())

    def report(self) -> CadenceReport:
        if self.every == "auto" and self.agreed is not None and self._basis is not None:
            interval, (step, stall, background, interference) = self.agreed, self._basis
        else:
            interval, (step, stall, background, interference) = self.interval(), self.basis()
        overhead = None
        if interval and step and stall is not None:
            overhead = (stall + (interference or 0.0)) / (interval * step)
        return CadenceReport(mode=str(self.every) if not isinstance(self.every, int) else "fixed", interval=interval,
                             step_s=step, stall_s=stall, background_s=background, interference_s=interference,
                             overhead=overhead,
                             max_overhead=self.max_overhead if self.every == "auto" else None,
                             steps_in_flight=(statistics.median(self._in_flight_steps) if self._in_flight_steps
                                              else None),
                             failures_in_a_row=self.failures)


class CadencePolicy:
    """A manager's save decision with every=: which save() calls save, measured on the job itself.
    The manager asks `due(step, in_flight)` at every call (every rank decides alike), tells it when
    a save starts (`started`), fails (`failed`) or is known committed (`succeeded`), and lets it
    wait for the previous save before the next (`before_save`). It keeps the timing of the save in
    flight, and agrees across ranks through `comm` (the manager's process group): "continuous"
    with one small all-gather per call, "auto" with one broadcast of the coordinator's interval per
    save. Its figures: report()."""

    def __init__(self, cadence: Cadence, comm):
        self.cadence = cadence
        self.comm = comm
        self._busy = False                        # a save of ours was in flight at the previous call
        self._started: tuple[float, float] | None = None   # (start, stall) of the save in flight
        self._flight_calls = 0                    # save() calls while it was in flight

    @property
    def every(self) -> int | str:
        return self.cadence.every

    def due(self, step: int, in_flight: bool, now: float | None = None) -> bool:
        """Every rank, at each save() call: measure, then decide alike on every rank. `in_flight`:
        a save of ours is still on its way to being durable (this rank's view)."""
        cadence = self.cadence
        now = time.monotonic() if now is None else now
        cadence.observe_call(step, now, self._busy)
        if self._busy and self._started is not None:
            # the step that just ended ran with the save in flight (counted even when the save became
            # durable during it: a save durable within one step still slowed that step)
            self._flight_calls += 1
        self._busy = in_flight
        if not in_flight and self._started is not None:   # the save in flight became durable since the last call
            self._observe_durable(now)
        if cadence.every == "continuous":
            # each rank sees the previous save become durable at its own moment
            if self.comm.world_size > 1:
                in_flight = any(self.comm.all_gather_object(in_flight, step="cadence"))
            return not in_flight
        return cadence.due(step, in_flight)

    def before_save(self, wait) -> None:
        """Every rank, before a save that is due: when the previous one is still in flight, wait
        for it here (`wait()`: the manager's, None when it failed), so that its time until durable
        is measured and the next one's stall is its own."""
        if self._started is not None:
            if wait() is not None:
                self.cadence.succeeded()
            self._observe_durable(time.monotonic())

    def started(self, step: int, t0: float, async_save: bool) -> None:
        """Every rank, after a save started at monotonic time `t0`: its stall, and (auto) the
        interval until the next one, the coordinator's measurement handed to every rank (one
        broadcast per save)."""
        cadence, stall = self.cadence, time.monotonic() - t0
        if not async_save:
            cadence.succeeded()
        cadence.saved(step)
        if async_save:
            self._started, self._flight_calls = (t0, stall), 0
            self._busy = True    # the next step runs with this save in flight (and may wait at its fence)
        else:
            cadence.observe_save(stall, 0.0, 0)
        if cadence.every == "auto":
            mine = (cadence.interval(), cadence.basis())
            cadence.adopt(*(self.comm.broadcast_object(mine, step="cadence") if self.comm.world_size > 1
                            else mine))

    def failed(self, step: int | None) -> None:
        self.cadence.failed(step)

    def succeeded(self) -> None:
        self.cadence.succeeded()

    def report(self) -> dict:
        """The mode, the interval in force, and what it was chosen from (seconds per step, stall,
        background time, interference per save) with the overhead they give."""
        return dataclasses.asdict(self.cadence.report())

    def _observe_durable(self, now: float) -> None:
        start, stall = self._started
        self.cadence.observe_save(stall, now - start, self._flight_calls)
        self._started = None


def cadence_of(every: int | str | None, max_overhead: float, max_interval: int, comm) -> CadencePolicy | None:
    """The save decision of a manager built with every= (None without)."""
    if every is None:
        return None
    return CadencePolicy(Cadence(every, max_overhead=max_overhead, max_interval=max_interval), comm)
