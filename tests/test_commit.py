"""omnickpt/commit.py: the commit protocol through storage, on a real LocalStorage; threads play
the ranks (the protocol is storage only: no process group is involved)."""
from __future__ import annotations

import threading
import time

import pytest

from omnickpt import commit
from omnickpt.errors import CheckpointError, CheckpointTimeoutError, CorruptCheckpointError, StorageError
from omnickpt.storage import LocalStorage


def _storage(tmp_path) -> LocalStorage:
    return LocalStorage(str(tmp_path / "ckpt"))


def _later(seconds: float, fn, *args) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn(*args)))
    t.start()
    return t


def test_records_of_every_rank_are_awaited_and_returned_by_rank(tmp_path):
    st = _storage(tmp_path)
    threads = [_later(0.05 * (3 - r), commit.post_record, st, "s1", r, {"bytes": 10 * r}) for r in range(3)]
    records = commit.await_records(st, "s1", 3, timeout=10, what="save to X")
    for t in threads:
        t.join()
    assert [r["rank"] for r in records] == [0, 1, 2]
    assert [r["bytes"] for r in records] == [0, 10, 20]
    assert commit.read_status(st, "s1") is None   # awaiting decides nothing: the caller commits


def test_missing_ranks_are_named_within_the_timeout_and_the_status_says_failed(tmp_path):
    st = _storage(tmp_path)
    commit.post_record(st, "s1", 0, {})
    commit.post_record(st, "s1", 2, {})
    with pytest.raises(CheckpointTimeoutError, match=r"save to X: rank\(s\) 1, 3 did not report") as e:
        commit.await_records(st, "s1", 4, timeout=0.3, what="save to X")
    assert "rank(s) 0" not in str(e.value)
    status = commit.read_status(st, "s1")
    assert status["state"] == "failed" and status["class"] == "CheckpointTimeoutError"
    # a rank that still waits for the verdict gets the same class
    with pytest.raises(CheckpointTimeoutError, match="rank\\(s\\) 1, 3"):
        commit.await_status(st, "s1", timeout=1, what="save to X")


def test_a_failure_record_ends_the_wait_at_once_with_the_ranks_error_class(tmp_path):
    st = _storage(tmp_path)
    commit.post_record(st, "s1", 0, {})
    commit.post_failure(st, "s1", 2, CorruptCheckpointError("rank 2: the staging copy is corrupt"))
    # rank 1 never reports: without the early end this would be a CheckpointTimeoutError after 30 s
    with pytest.raises(CorruptCheckpointError, match="save to X failed: rank 2: the staging copy is corrupt"):
        commit.await_records(st, "s1", 3, timeout=30, what="save to X")
    assert commit.read_status(st, "s1")["class"] == "CorruptCheckpointError"


def test_a_failure_posted_as_class_and_message_crosses_as_that_class(tmp_path):
    st = _storage(tmp_path)
    commit.post_failure(st, "s1", 0, ("StorageError", "rank 0: disk full"))
    with pytest.raises(StorageError, match="disk full"):
        commit.await_records(st, "s1", 1, timeout=5, what="w")


def test_status_round_trip_between_coordinator_and_a_waiting_rank(tmp_path):
    st = _storage(tmp_path)
    t = _later(0.1, commit.set_status, st, "s1")
    assert commit.await_status(st, "s1", timeout=10, what="save to X") == {"state": "committed"}
    t.join()


@pytest.mark.parametrize("cls", [CorruptCheckpointError, StorageError, CheckpointError])
def test_a_failed_status_raises_the_same_class_on_the_waiting_rank(tmp_path, cls):
    st = _storage(tmp_path)
    commit.set_status(st, "s1", (cls.__name__, "rank 1: it broke"))
    with pytest.raises(cls, match="save to X failed: rank 1: it broke") as e:
        commit.await_status(st, "s1", timeout=10, what="save to X")
    assert type(e.value) is cls


def test_a_waiting_rank_names_the_coordinator_when_no_status_comes(tmp_path):
    st = _storage(tmp_path)
    with pytest.raises(CheckpointTimeoutError, match=r"save to X: the coordinator \(rank 0\) did not commit"):
        commit.await_status(st, "s1", timeout=0.2, what="save to X")


def test_a_failed_status_write_is_best_effort_and_a_committed_one_raises(tmp_path):
    (tmp_path / "file").write_text("a file where the checkpoint folder must go")
    st = LocalStorage(str(tmp_path / "file"))
    commit.set_status(st, "s1", ("CheckpointError", "boom"))   # swallowed: the error being reported matters more
    commit.post_failure(st, "s1", 0, ("CheckpointError", "boom"))
    with pytest.raises(StorageError, match="status.json"):   # the other ranks wait for it: never swallowed
        commit.set_status(st, "s1")
    with pytest.raises(StorageError, match="r00003.json"):   # nor a record: the coordinator waits for it
        commit.post_record(st, "s1", 3, {})


class _Clock:
    """Time that passes only when slept: the backoff sequence is checked exactly, whatever the load
    of the machine (the real clock is used by every other test here)."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_poll_backs_off_from_1_ms_doubling_to_50_ms_and_returns_the_first_result(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(commit, "time", clock)
    calls = []

    def probe():
        calls.append(clock.now)
        return "done" if len(calls) == 10 else None

    assert commit.poll(probe, timeout=60, on_timeout=lambda: AssertionError("timed out")) == "done"
    assert clock.sleeps == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05])


def test_poll_raises_past_its_deadline_after_one_last_probe(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(commit, "time", clock)
    calls = []
    with pytest.raises(CheckpointTimeoutError, match="nobody"):
        commit.poll(lambda: calls.append(clock.now), timeout=1.0, on_timeout=lambda: CheckpointTimeoutError("nobody"))
    assert calls[-1] > 100.0 + 1.0 and calls[-2] <= 100.0 + 1.0   # probed once more past the deadline, then gave up
    # a result that comes at that last probe still wins
    clock2 = _Clock()
    monkeypatch.setattr(commit, "time", clock2)
    assert commit.poll(lambda: "late" if clock2.now > 101.0 else None, timeout=1.0,
                       on_timeout=lambda: CheckpointTimeoutError("nobody")) == "late"


def test_poll_on_the_real_clock_gives_up_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError):
        commit.poll(lambda: None, timeout=0.2, on_timeout=lambda: CheckpointTimeoutError("nobody"))
    assert time.monotonic() - t0 >= 0.2


# ---------------------------------------------------------------------- the choreography (run_round)
def _round(st, rank: int, world: int = 3, timeout: float = 10) -> commit.Round:
    return commit.Round(st, "s2", rank, world, timeout, "save to X")


def _ranks(st, world: int, local, finish=None, after=None, skip=(), timeout: float = 10):
    """Run run_round on `world` threads (rank r's local is local(r)); each rank's value or error."""
    out, failures = {}, {}

    def one(r):
        try:
            out[r] = commit.run_round(_round(st, r, world, timeout), lambda: local(r), finish or (lambda recs: recs),
                                      after=after, on_failure=lambda e, recs: failures.setdefault(r, recs))
        except BaseException as e:
            out[r] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in range(world) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, failures


def test_a_round_commits_with_every_rank_record_in_rank_order(tmp_path):
    st = _storage(tmp_path)
    out, failures = _ranks(st, 3, lambda r: (time.sleep(0.02 * (3 - r)), {"bytes": r})[1])
    assert [rec["bytes"] for rec in out[0]] == [0, 1, 2] and [rec["rank"] for rec in out[0]] == [0, 1, 2]
    assert out[1] is None and out[2] is None and failures == {}
    assert commit.read_status(st, "s2") == {"state": "committed"}


def test_a_round_with_one_rank_failing_fails_on_every_rank_with_its_class(tmp_path):
    st = _storage(tmp_path)
    finished = []

    def local(r):
        if r == 1:
            raise CorruptCheckpointError("block 7 is damaged")
        return {}
    out, failures = _ranks(st, 3, local, finish=finished.append)
    assert isinstance(out[0], CorruptCheckpointError) and "rank 1: CorruptCheckpointError: block 7" in str(out[0])
    assert isinstance(out[1], CorruptCheckpointError) and str(out[1]) == "block 7 is damaged"
    assert isinstance(out[2], CorruptCheckpointError)   # the waiting rank: the coordinator's verdict
    assert finished == [] and commit.read_status(st, "s2")["state"] == "failed"
    assert failures[0] is None   # the coordinator cleaned up, without records


def test_a_round_with_one_rank_missing_names_it_at_the_timeout(tmp_path):
    st = _storage(tmp_path)
    out, failures = _ranks(st, 3, lambda r: {}, skip=(2,), timeout=0.5)
    assert isinstance(out[0], CheckpointTimeoutError) and "rank(s) 2 did not report" in str(out[0])
    assert isinstance(out[1], CheckpointTimeoutError)   # rank 1 waits for a verdict and hears of the timeout
    assert commit.read_status(st, "s2")["state"] == "failed" and 0 in failures


def test_a_failed_commit_sets_the_status_and_cleans_up_with_the_records(tmp_path):
    st = _storage(tmp_path)

    def finish(records):
        raise StorageError("disk full")
    out, failures = _ranks(st, 2, lambda r: {"r": r}, finish=finish)
    assert isinstance(out[0], StorageError) and str(out[0]) == "disk full"
    assert isinstance(out[1], StorageError) and "rank 0: StorageError: disk full" in str(out[1])
    assert [rec["r"] for rec in failures[0]] == [0, 1]


def test_a_verdict_after_the_commit_is_raised_as_its_class_with_its_message(tmp_path):
    st = _storage(tmp_path)

    def after(value):
        raise commit.Verdict(("StorageError", "committed, but retention failed"), committed=True)
    out, _ = _ranks(st, 2, lambda r: {}, after=after)
    assert isinstance(out[0], StorageError) and str(out[0]).endswith("committed, but retention failed")
    # (rank 1 went on once the status said committed, or hears of the failure: the race is real)
    assert commit.read_status(st, "s2") == {"state": "failed", "error": "committed, but retention failed",
                                            "class": "StorageError"}


def test_a_rank_whose_record_reports_a_failure_raises_it(tmp_path):
    st = _storage(tmp_path)
    out, _ = _ranks(st, 2, lambda r: {"error": f"rank {r}: disk gone", "error_class": "StorageError"} if r else {})
    assert isinstance(out[1], StorageError) and str(out[1]) == "rank 1: disk gone"
    assert isinstance(out[0], StorageError) and "rank 1: disk gone" in str(out[0])
