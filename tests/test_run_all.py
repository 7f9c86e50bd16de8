"""storage.base.run_all: the one way the engine runs tasks that write into memory the caller frees
when it returns (landing buffers, destination tensors reached by raw address). It must not return
or raise while any task it started still runs."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from omnickpt.storage.base import run_all


def test_results_come_back_in_the_order_of_the_calls():
    with ThreadPoolExecutor(3) as ex:
        assert run_all(ex, lambda a, b: a * b, [(k, 10) for k in range(7)]) == [0, 10, 20, 30, 40, 50, 60]


def test_a_failure_is_raised_only_after_the_running_calls_finished_and_the_rest_is_cancelled():
    finished, started = [], []

    def task(k: int) -> None:
        started.append(k)
        if k == 0:
            raise ValueError("task 0 failed")
        time.sleep(0.3)
        finished.append(k)

    with ThreadPoolExecutor(2) as ex:
        with pytest.raises(ValueError, match="task 0 failed"):
            run_all(ex, task, [(k,) for k in range(6)])
        # every call that had started when task 0 failed is done by the time the error arrives
        assert sorted(finished) == sorted(k for k in started if k), (started, finished)
        assert 1 in finished and len(started) < 6   # the calls not started by then never run


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_an_interrupted_wait_still_waits_for_the_running_calls():
    """A signal handler raising on the waiting (main) thread, as a SIGTERM handler may: the task
    still copying is awaited before the exception leaves run_all."""
    assert threading.current_thread() is threading.main_thread()
    done = threading.Event()

    def task(k: int) -> None:
        time.sleep(0.5)
        done.set()

    def interrupt(signum, frame):
        raise KeyboardInterrupt("interrupted while waiting")

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with ThreadPoolExecutor(1) as ex:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                run_all(ex, task, [(0,), (1,)])
            assert done.is_set(), "run_all left while a task was still running"
            assert time.monotonic() - t0 >= 0.45
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
