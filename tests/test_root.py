"""The step root (omnickpt/root.py StepRoot), used directly as both managers use it: the owner lease
(taken, refused on another live job's root, given back), `latest` and retention after a commit (a
step being loaded kept), the removal of a failed save's folder (only by the lease's holder, never a
committed step), the warning about an abandoned run's newer steps. One process; the comm is SOLO."""
from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch

import omnickpt
from omnickpt.comm import SOLO, Comm
from omnickpt.errors import CheckpointLockedError
from omnickpt.lease import DEFAULT_TTL, OWNER_RECORD
from omnickpt.root import StepRoot, process_id


def _root(path, keep_last=None) -> StepRoot:
    return StepRoot(str(path), Comm(SOLO), keep_last=keep_last)


def _commit(root: StepRoot, step: int) -> None:
    """A committed checkpoint in step `step`'s folder (no manager involved)."""
    omnickpt.save(root.step_path(step), {"extra": {"step": step}, "w": torch.full((4,), float(step))})


def _other_live_job(path) -> None:
    doc = {"holder": "other-job", "host": "other-host", "boot_id": "b", "pid_ns": None, "pid": 4242,
           "started": time.time() - 10, "renewed": time.time(), "what": "checkpoint", "ttl": DEFAULT_TTL}
    os.makedirs(os.path.dirname(path / OWNER_RECORD), exist_ok=True)
    (path / OWNER_RECORD).write_text(json.dumps(doc))


def test_take_holds_the_lease_and_release_gives_it_back(tmp_path):
    root = _root(tmp_path / "run")
    assert not root.held and root.job_id == process_id()
    assert root.take() == root.job_id          # the coordinator's job id, agreed by every rank
    assert root.held and (tmp_path / "run" / OWNER_RECORD).exists()
    root.hold()                                 # once: a second hold takes nothing more
    root.release()
    assert not (tmp_path / "run" / OWNER_RECORD).exists()
    root.release()                              # a second release does nothing


def test_another_live_jobs_root_is_refused_and_nothing_is_held(tmp_path):
    _other_live_job(tmp_path / "run")
    root = _root(tmp_path / "run")
    with pytest.raises(CheckpointLockedError, match="'other-job'"):
        root.take()
    assert not root.held
    assert json.loads((tmp_path / "run" / OWNER_RECORD).read_text())["holder"] == "other-job"


def test_keep_last_is_checked_before_the_root_is_touched(tmp_path):
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_last"):
            _root(tmp_path / "run", keep_last=bad)
    assert not (tmp_path / "run").exists()


def test_after_commit_writes_latest_and_retires_older_steps_only(tmp_path):
    root = _root(tmp_path / "run", keep_last=2)
    root.take()
    for step in (1, 2, 3, 5):
        _commit(root, step)
    root.after_commit(3)      # steps up to 3 only: 5 (in flight, or another run's) is not this call's to retire
    assert root.steps() == [2, 3, 5] and (tmp_path / "run" / "latest").read_text().strip() == "3"
    root.after_commit(5)
    assert root.steps() == [3, 5] and root.latest_step() == 5
    root.release()


def test_a_step_being_loaded_is_kept_by_retention(tmp_path):
    root = _root(tmp_path / "run", keep_last=1)
    root.take()
    for step in (1, 2):
        _commit(root, step)
    with root.loading(1):
        root.after_commit(2)
        assert root.steps() == [1, 2]
    _commit(root, 3)
    root.after_commit(3)      # loading is over: 1 and 2 go
    assert root.steps() == [3]
    root.release()


def test_discard_failed_removes_an_uncommitted_folder_only_when_holding_the_lease(tmp_path):
    root = _root(tmp_path / "run")
    failed = tmp_path / "run" / "global_step_4"
    (failed / "data").mkdir(parents=True)
    (failed / "data" / "part.bin").write_bytes(b"half a save")
    root.discard_failed(4)    # no lease: not this job's root to clean
    assert failed.exists()
    root.take()
    _commit(root, 2)
    root.discard_failed(2)    # committed: kept
    root.discard_failed(4)
    assert not failed.exists() and root.steps() == [2]
    root.release()


def test_settle_gives_the_leases_back_when_a_rank_failed(tmp_path):
    root = _root(tmp_path / "run")
    root.take()
    with pytest.raises(ValueError, match="boom"):
        root.settle(ValueError("boom"), "a local step")
    assert not (tmp_path / "run" / OWNER_RECORD).exists()
    assert root.settle(None, "a local step", 7) == [7]


def test_the_first_save_warns_about_an_abandoned_runs_newer_steps(tmp_path):
    root = _root(tmp_path / "run")
    _commit(root, 9)
    with pytest.warns(RuntimeWarning, match=r"committed step\(s\) \[9\] newer than step 3"):
        root.warn_newer(3, stacklevel=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root.warn_newer(10, stacklevel=1)   # nothing newer: silent
