"""CheckpointManager safety: what it does when things go wrong around it.

- corrupt shared memory: a flipped byte falls back to root with a warning naming step, rank/node,
  file and error, the corrupt step is removed (no crash loop); without root: CorruptCheckpointError;
- latest_step() counts memory steps (the README's restart pattern restores a memory-only step);
- close() never removes the only copy of a step; a new run's steps are not retired in favour of an
  abandoned run's newer ones (warned about instead);
- memory saved at another world size or node layout is resharded from, or root is used with a
  message when the data does not allow it;
- owner leases: a second live job on the same root or memory job is refused, a kill -9'd one is
  taken over (and its memory still restored), close() gives the leases back;
- save() input, failed step folders, background failures logged when they happen;
- interpreter exit with an unclosed manager: the save in flight is committed (status 0), or the
  process fails loudly (status 1, error on stderr).

Real processes: children killed with SIGKILL or ending without close(), gloo ranks (tests/dist.py).
Every test has its own $OMNICKPT_SHM_DIR.
"""
from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
import warnings

import numpy as np
import pytest
import torch

import omnickpt
from omnickpt.errors import CheckpointError
from dist import run_ranks
from omnickpt.storage.shm import clear_memory, shm_path

TESTS = os.path.dirname(os.path.abspath(__file__))
SIZE = 64


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job name of its own, in a shared-memory directory of this test's own."""
    monkeypatch.setenv("OMNICKPT_SHM_DIR", str(tmp_path / "shm"))
    name = f"safety-{uuid.uuid4().hex[:8]}"
    yield name
    clear_memory(name)


def _model(step: int) -> torch.nn.Linear:
    """The model after `step` steps: every value depends on the step, so a mixed or partial load shows."""
    m = torch.nn.Linear(SIZE, SIZE)
    with torch.no_grad():
        m.weight.copy_(torch.arange(SIZE * SIZE, dtype=torch.float32).reshape(SIZE, SIZE) / 7 + step)
        m.bias.fill_(-step)
    return m


def _state(step: int) -> dict:
    return {"model": _model(step), "extra": {"step": step}}


def _blank() -> tuple[torch.nn.Linear, dict]:
    m = torch.nn.Linear(SIZE, SIZE)
    with torch.no_grad():
        m.weight.fill_(float("nan"))
        m.bias.fill_(float("nan"))
    return m, {"model": m, "extra": {}}


def _is_step(model: torch.nn.Linear, extra: dict, step: int) -> bool:
    want = _model(step)
    return extra == {"step": step} and torch.equal(model.weight, want.weight) and torch.equal(model.bias, want.bias)


def _manager(root, job, **kw) -> omnickpt.TieredCheckpointManager:
    return omnickpt.TieredCheckpointManager(str(root), memory=f"shm://{job}", **kw)


_PRELUDE = textwrap.dedent("""
    import os, sys, time
    import torch, omnickpt
    from test_manager_safety import _manager, _state
""")


def _child(code: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def _run(code: str) -> subprocess.CompletedProcess:
    proc = _child(code)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _crashed_run(root, job, steps, **kw) -> None:
    """A training process that saves `steps` and dies without closing anything (os._exit: no
    handler, no exit hook): its memory and lease records stay behind, as after kill -9."""
    proc = _run(f"""
        mgr = _manager({str(root)!r}, {job!r}, persist_on_failure=False, **{kw!r})
        for step in {list(steps)!r}:
            mgr.save(step, _state(step))
        mgr.wait()
        os._exit(0)
    """)
    assert proc.returncode == 0, proc.stderr


def _flip(job: str, step: int, node: int = 0, at: float = 0.5) -> str:
    """Flip a byte of node `node`'s first data file of memory step `step` (`at`: where, as a fraction
    of the file); returns the file."""
    victim = sorted(glob.glob(os.path.join(shm_path(f"shm://{job}"), f"node{node}", f"global_step_{step}", "data",
                                           "*.bin")))[0]
    with open(victim, "r+b") as f:
        f.seek(int(os.path.getsize(victim) * at))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


# ---------------------------------------------------------------------- 1. corrupt memory
def test_corrupt_memory_step_falls_back_to_root_says_why_and_is_removed(job, tmp_path):
    root = tmp_path / "root"
    _crashed_run(root, job, [1, 2, 3], persist_every=2)   # root: step 2; memory: step 3 only
    victim = _flip(job, 3)
    mgr = _manager(root, job, persist_on_failure=False)
    assert mgr.steps() == [2] and mgr.memory_steps()[-1] == 3 and mgr.latest_step() == 3
    fresh, state = _blank()
    with pytest.warns(RuntimeWarning) as seen:
        res = mgr.load_latest(state)
    said = [str(w.message) for w in seen if "from shared memory failed" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]
    # The step, the rank and node, the file, the error, and what happens instead.
    for part in ("restoring step 3", "rank 0 (node 0)", "CorruptCheckpointError", os.path.basename(victim),
                 "removed from shared memory", f"loading step 2 from {root}"):
        assert part in said[0], (part, said[0])
    assert (res.report["tier"], res.report["step"]) == ("durable", 2) and mgr.restored == ("durable", 2)
    assert _is_step(fresh, state["extra"], 2)   # exactly the durable step
    # The corrupt step is gone: a restart goes straight to root, with nothing to warn about.
    assert mgr.memory_steps() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _manager(root, job, persist_on_failure=False)
        assert again.latest_step() == 2
        fresh, state = _blank()
        assert again.load_latest(state).report["tier"] == "durable" and _is_step(fresh, state["extra"], 2)
    again.close()


def test_corrupt_memory_without_root_raises_naming_the_file_and_does_not_loop(job, tmp_path):
    root = tmp_path / "root"
    _crashed_run(root, job, [1, 2], persist_every=1000)   # nothing in root
    victim = _flip(job, 2)
    mgr = _manager(root, job, persist_on_failure=False)
    assert mgr.latest_step() == 2
    fresh, state = _blank()
    with pytest.warns(RuntimeWarning, match="from shared memory failed"):
        with pytest.raises(omnickpt.CorruptCheckpointError) as e:
            mgr.load_latest(state)
    msg = str(e.value)
    assert os.path.basename(victim) in msg and "step 2" in msg and "removed from shared memory" in msg, msg
    assert "no committed checkpoint to fall back to" in msg
    assert torch.isnan(fresh.weight).all() and state["extra"] == {}   # nothing of the corrupt step was installed
    # The next restart does not meet the corrupt step again: it starts from scratch, not a loop.
    again = _manager(root, job, persist_on_failure=False)
    assert again.latest_step() is None and again.memory_steps() == []
    with pytest.raises(omnickpt.NotCommittedError, match="nothing to restore"):
        again.load_latest(_blank()[1])
    again.close()


# ---------------------------------------------------------------------- 2. latest_step counts memory
def test_latest_step_counts_a_memory_only_step_for_the_readme_restart_pattern(job, tmp_path):
    root = tmp_path / "root"
    _crashed_run(root, job, [1, 2, 3], persist_every=1000)
    manager = _manager(root, job, persist_on_failure=False)
    assert manager.steps() == [] and manager.memory_steps() == [3]   # steps(): durable only
    fresh, state = _blank()
    if manager.latest_step() is not None:       # the README's restart pattern
        manager.load_latest(state)
    assert manager.restored == ("memory", 3) and _is_step(fresh, state["extra"], 3)
    manager.close()                             # root lacked step 3: close() copies it there
    assert manager.steps() == [3]
    assert omnickpt.CheckpointManager(str(root), read_only=True).latest_step() == 3


# ---------------------------------------------------------------------- 3. the only copy, abandoned runs
def test_close_never_removes_the_only_copy_of_a_step(job, tmp_path):
    root = tmp_path / "root"
    mgr = _manager(root, job, persist_every=1000, persist_on_failure=False)
    for step in (1, 2):
        mgr.save(step, _state(step))
    root.write_text("a file where the durable root's folder must go")   # root unwritable from now on
    with pytest.warns(RuntimeWarning, match=r"does not hold memory step 2; it is kept in shm://") as seen:
        with pytest.raises(omnickpt.CheckpointError):
            mgr.close()
    assert "global_step_2" in str([str(w.message) for w in seen])
    assert mgr.memory_steps() == [2]
    root.unlink()
    # The kept step is there for the next run; its clean close copies it to root, then gives memory back.
    mgr = _manager(root, job, persist_on_failure=False)
    fresh, state = _blank()
    assert mgr.load_latest(state).report["tier"] == "memory" and _is_step(fresh, state["extra"], 2)
    mgr.close()
    assert mgr.steps() == [2] and not os.path.exists(shm_path(f"shm://{job}"))
    # A manager that saved nothing does not give back memory holding a step root lacks either.
    _crashed_run(root, job, [5], persist_every=1000)
    with pytest.warns(RuntimeWarning, match="does not hold memory step 5"):
        _manager(root, job, persist_on_failure=False).close()
    assert _manager(root, job, persist_on_failure=False).memory_steps() == [5]


def test_a_new_run_does_not_lose_its_steps_to_an_abandoned_runs_newer_ones(job, tmp_path):
    root = tmp_path / "root"
    old = omnickpt.CheckpointManager(str(root), keep_last=2)
    for step in (100, 101):
        old.save(step, _state(step))
    old.close()                                   # an abandoned run: a new one starts over in the same root
    # A run that did not resume is refused (every rank, nothing written): it never saves over, or
    # beside, the steps it should have resumed from unless it says so (issue 19).
    restarted = omnickpt.CheckpointManager(str(root), keep_last=2)
    with pytest.raises(CheckpointError, match=r"holds committed step\(s\) \[100, 101\] newer than step 1.*"
                                              r"resumed from none of them.*overwrite=True"):
        restarted.save(1, _state(1))
    with pytest.raises(CheckpointError, match=r"global_step_100 is a committed checkpoint that this run did not "
                                              r"write: saving step 100 would overwrite it"):
        restarted.save(100, _state(7))
    assert restarted.steps() == [100, 101] and not (root / "global_step_1").exists()
    restarted.close()
    new = omnickpt.CheckpointManager(str(root), keep_last=2, overwrite=True)
    with pytest.warns(RuntimeWarning, match=r"holds committed step\(s\) \[100, 101\] newer than step 1"):
        new.save(1, _state(1))
    for step in (2, 3, 4):
        new.save(step, _state(step), async_save=True)
    new.wait()
    assert new.steps() == [3, 4, 100, 101]        # its own newest two, the abandoned ones untouched
    new.save(102, _state(102))                    # past them: they are retired like any older step
    assert new.steps() == [101, 102]
    new.close()

    # The memory tier's manager refuses the same way: its root holds committed steps it did not load.
    tiered_root = tmp_path / "tiered"
    with _manager(tiered_root, job, persist_every=1, persist_on_failure=False) as first:
        first.save(7, _state(7))
        first.wait()
    clear_memory(job)
    restarted_tier = _manager(tiered_root, job, persist_on_failure=False)
    with pytest.raises(CheckpointError, match=r"holds committed step\(s\) \[7\] newer than step 1"):
        restarted_tier.save(1, _state(1))
    restarted_tier.close()
    assert omnickpt.CheckpointManager(str(tiered_root), read_only=True).steps() == [7]

    # The same in memory: an earlier process of the job left step 50 (never in root); a new run
    # that saves without restoring must not have a restart pick step 50 over its own steps.
    other = tmp_path / "root2"
    _crashed_run(other, job, [49, 50], persist_every=1000)
    mgr = _manager(other, job, persist_on_failure=False, on_close="keep_latest")
    with pytest.warns(RuntimeWarning, match=r"held step\(s\) \[50\] of an earlier run"):
        mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.memory_steps() == [2] and mgr.latest_step() == 2
    mgr.close()


# ---------------------------------------------------------------------- 3. another layout: reshard
ROWS = 8


def _rows(rank: int, world: int, step: int) -> dict:
    """Rank `rank`'s rows of an (8, 4) tensor of step `step`, and a per-rank object."""
    per = ROWS // world
    full = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + 100 * step
    local = full[rank * per:(rank + 1) * per].clone()
    return {"w": omnickpt.ShardSpec(local, (rank * per, 0), (ROWS, 4)), "meta": {"step": step}}


def _save_two_nodes(rank, world, root, job):
    # Two simulated nodes of one rank each, with peer replicas; root gets every 2nd step.
    mgr = _manager(root, job, ranks_per_node=1, peer_replicas=True, persist_every=2, on_close="keep_latest",
                   persist_on_failure=False)
    for step in (1, 2, 3):
        mgr.save(step, _rows(rank, world, step))
    mgr.close()   # copies step 3 to root and keeps it in memory
    return mgr.memory_steps()


def _restore_other_layout(rank, world, root, job):
    mgr = _manager(root, job, ranks_per_node=world, persist_on_failure=False)   # one node of two ranks
    latest = mgr.latest_step()
    state = _rows(rank, world, 0)
    res = mgr.load_latest(state)
    ok = torch.equal(state["w"].local, _rows(rank, world, 3)["w"].local) and state["meta"] == {"step": 3}
    out = (latest, res.report["tier"], res.report["step"], res.report.get("resharded"), ok, mgr.memory_steps())
    mgr.close()
    return out


def test_memory_of_another_layout_is_resharded_or_root_is_used_with_a_message(job, tmp_path):
    root = str(tmp_path / "root")
    assert run_ranks(2, _save_two_nodes, root, job) == [[3], [3]]
    shutil.rmtree(f"{root}/global_step_3")        # root holds step 2 only: step 3 is memory's alone
    backup = str(tmp_path / "shm-backup")
    shutil.copytree(shm_path(f"shm://{job}"), backup)

    # The same world size with another number of ranks per node (2 nodes of 1 -> 1 node of 2).
    for r, out in enumerate(run_ranks(2, _restore_other_layout, root, job)):
        assert out == (3, "memory", 3, True, True, [3]), (r, out)
    assert omnickpt.CheckpointManager(root, read_only=True).steps() == [2, 3]   # re-saved, then copied by close()

    # Another world size (2 -> 1 rank, this process).
    shutil.rmtree(f"{root}/global_step_3")
    clear_memory(job)
    shutil.copytree(backup, shm_path(f"shm://{job}"))
    mgr = _manager(root, job, persist_on_failure=False)
    assert mgr.latest_step() == 3
    state = _rows(0, 1, 0)
    res = mgr.load_latest(state)
    assert (res.report["tier"], res.report["step"], res.report["resharded"]) == ("memory", 3, True)
    assert torch.equal(state["w"].local, _rows(0, 1, 3)["w"].local) and state["meta"] == {"step": 3}
    assert mgr.memory_steps() == [3] and not os.path.exists(os.path.join(shm_path(f"shm://{job}"), "previous"))
    mgr.close()
    assert mgr.steps() == [2, 3]

    # Where the data does not allow it (this machine lacks node 1's part, as a machine of a real
    # cluster holds only its own node's): root, with a message, and the memory is kept.
    shutil.rmtree(f"{root}/global_step_3")
    clear_memory(job)
    shutil.copytree(backup, shm_path(f"shm://{job}"))
    mgr = _manager(root, job, persist_on_failure=False)
    previous = os.path.join(shm_path(f"shm://{job}"), "previous")
    shutil.rmtree(os.path.join(previous, "node1"))
    shutil.rmtree(os.path.join(previous, "node0", "replicas"))
    assert mgr.latest_step() == 2
    state = _rows(0, 1, 0)
    with pytest.warns(RuntimeWarning, match=r"step\(s\) \[3\] .* world size 2 .* cannot be resharded from memory"):
        res = mgr.load_latest(state)
    assert (res.report["tier"], res.report["step"]) == ("durable", 2)
    assert torch.equal(state["w"].local, _rows(0, 1, 2)["w"].local)
    with pytest.warns(RuntimeWarning, match="keeps step 3, saved at world size 2"):
        mgr.close()
    assert os.path.exists(os.path.join(previous, "node0", "global_step_3", "manifest.json"))


def _corrupt_node(rank, world, root, job):
    import torch.distributed as dist
    kw = dict(ranks_per_node=2, persist_on_failure=False, on_close="keep_latest")
    mgr = _manager(root, job, persist_every=2, **kw)
    for step in (1, 2, 3):
        mgr.save(step, _rows(rank, world, step))
    mgr.wait()
    latest = mgr.latest_step()   # a collective with several nodes: memory step 3 on both nodes
    dist.barrier()
    if rank == 0:
        _flip(job, 3, node=1, at=0.0)   # a tensor's bytes (the objects come last in a file)
    dist.barrier()
    mgr = _manager(root, job, **kw)
    state = _rows(rank, world, 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = mgr.load_latest(state)
    said = [str(w.message) for w in seen if "from shared memory failed" in str(w.message)]
    ok = torch.equal(state["w"].local, _rows(rank, world, 2)["w"].local)
    out = (latest, res.report["tier"], res.report["step"], ok, said, mgr.memory_steps())
    mgr.close()
    return out


def test_a_corrupt_node_file_falls_back_on_every_rank_naming_the_node(job, tmp_path):
    for r, (latest, tier, step, ok, said, memory) in enumerate(run_ranks(4, _corrupt_node, str(tmp_path / "r"), job)):
        assert (latest, tier, step, ok, memory) == (3, "durable", 2, True, []), (r, tier, step, said)
        assert len(said) == 1 and "(node 1): CorruptCheckpointError" in said[0], said
        assert f"shm://{job}/node1/global_step_3/data/" in said[0], said   # the node's own file, not a view's


# ---------------------------------------------------------------------- 4. owner leases
_HOLDER = """
    plain = omnickpt.CheckpointManager(sys.argv[1] + "/plain")
    plain.save(1, _state(1))
    mem = _manager(sys.argv[1] + "/mem", sys.argv[2], persist_on_failure=False)
    mem.save(1, _state(1))
    print("ready", flush=True)
    sys.stdin.readline()
    with plain:
        pass                  # __exit__ gives the root back
    mem.close()
    print("closed", flush=True)
    sys.stdin.readline()
    mem = _manager(sys.argv[1] + "/mem", sys.argv[2], persist_every=1000, persist_on_failure=False)
    mem.save(2, _state(2))
    print("ready", flush=True)
    time.sleep(600)
"""


def test_leases_refuse_a_second_live_job_and_a_killed_ones_memory_is_taken_over(job, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(_HOLDER), str(tmp_path), job],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        # A second live job: refused at construction, naming the holder; nothing of the first touched.
        with pytest.raises(omnickpt.CheckpointLockedError, match=rf"owned by another live job.*pid {child.pid}"):
            omnickpt.CheckpointManager(str(tmp_path / "plain"))
        with pytest.raises(omnickpt.CheckpointLockedError, match=rf"shm://{job}.*pid {child.pid}"):
            _manager(tmp_path / "other-root", job)
        assert os.path.exists(os.path.join(shm_path(f"shm://{job}"), "node0", "global_step_1", "manifest.json"))
        # A reader needs no lease.
        assert omnickpt.CheckpointManager(str(tmp_path / "plain"), read_only=True).steps() == [1]
        # close() and leaving `with` give the leases back: no takeover needed afterwards.
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed", child.stderr.read()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            omnickpt.CheckpointManager(str(tmp_path / "plain")).close()
        assert not os.path.exists(os.path.join(shm_path(f"shm://{job}"), ".omnickpt", "owner.json"))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        child.kill()   # kill -9: the lease records stay behind
        child.communicate(timeout=60)
        # The next job takes the stale record over (same host, dead pid) and restores from memory.
        with pytest.warns(RuntimeWarning, match="took over the stale owner record"):
            mgr = _manager(tmp_path / "mem", job, persist_on_failure=False)
        fresh, state = _blank()
        res = mgr.load_latest(state)
        assert (res.report["tier"], res.report["step"]) == ("memory", 2) and _is_step(fresh, state["extra"], 2)
        mgr.close()
    finally:
        child.kill()
        child.communicate(timeout=60)


# ---------------------------------------------------------------------- 5. save input, failed saves
def test_step_folders_and_the_retention_rule():
    from omnickpt.steps import parse_step, retired, step_dir
    assert step_dir(12) == "global_step_12" and parse_step("global_step_12") == 12
    assert parse_step("global_step_") is None and parse_step("global_step_3.tmp") is None
    assert parse_step("latest") is None
    # keep the newest 2 committed steps up to the one just committed (5); never a newer step (7:
    # in flight, or an abandoned run's), never a pinned one (1: being loaded); uncommitted older
    # folders (2) go.
    assert retired({1, 2, 3, 4, 5, 7}, committed=[1, 3, 4, 5, 7], keep=2, upto=5, pinned=[1]) == {2, 3}
    assert retired({1, 2, 3}, committed=[1, 2, 3], keep=None, upto=3) == set()
    assert retired({1, 2, 3}, committed=[1, 2, 3], keep=1, upto=3) == {1, 2}


def test_restore_failures_are_classified_by_error_class():
    from omnickpt.tiered import _fatal_class
    for name in ("UnsafeCheckpointError", "TypeError"):
        assert _fatal_class(name), name        # root would not do better: raised
    # MismatchError: memory may lack what root holds (tests/test_multinode.py); root raises it again if not
    for name in ("MismatchError", "CorruptCheckpointError", "StorageError", "CheckpointTimeoutError",
                 "CheckpointError", "OSError"):
        assert not _fatal_class(name), name    # fall back to root


def test_save_rejects_bad_and_repeated_steps(job, tmp_path):
    for mgr in (omnickpt.CheckpointManager(str(tmp_path / "plain")), _manager(tmp_path / "mem", job)):
        for bad in (-1, 2.7, True, "3", None):
            with pytest.raises((TypeError, ValueError), match=repr(bad) if bad != -1 else "-1"):
                mgr.save(bad, _state(1))
        mgr.save(np.int64(5), _state(5))   # an int-like numpy integer is a step
        mgr.save(6, _state(6), async_save=True)
        for again in (5, 6):                # committed, and in flight
            with pytest.raises(ValueError, match=f"step {again} was already saved"):
                mgr.save(again, _state(again))
        mgr.save(4, _state(4))              # an older number is fine
        mgr.close()
        assert mgr.steps() == [4, 5, 6]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_leaves_no_step_folder_and_can_be_retried(tmp_path, async_save):
    root = tmp_path / "root"
    mgr = omnickpt.CheckpointManager(str(root), keep_last=2)
    mgr.save(1, _state(1))
    blocked = root / "global_step_2"
    blocked.mkdir()
    (blocked / "data").write_text("a file where the data folder must go")   # the save of step 2 fails
    with pytest.raises(omnickpt.CheckpointError):
        mgr.save(2, _state(2), async_save=async_save)
        mgr.wait()
    assert not blocked.exists()
    mgr.save(2, _state(2))                  # the same number again: nothing in its way
    mgr.save(3, _state(3))
    assert mgr.steps() == [2, 3] and sorted(os.listdir(root)) == [".omnickpt", "global_step_2", "global_step_3",
                                                                     "latest"]
    mgr.close()
    assert not (root / ".omnickpt" / "owner.json").exists()   # the lease is given back


def test_a_background_copy_failure_is_logged_when_it_happens(job, tmp_path, caplog):
    root = tmp_path / "root"
    mgr = _manager(root, job, persist_on_failure=False)
    root.write_text("a file where the durable root's folder must go")
    with caplog.at_level(logging.ERROR, logger="omnickpt"):
        mgr.save(1, _state(1), async_save=True)
        deadline = time.monotonic() + 60
        while not any("copying memory step 1" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the durable copy's failure was never logged"
            time.sleep(0.05)
    with pytest.raises(omnickpt.CheckpointError):
        mgr.wait()
    root.unlink()
    mgr.close()   # the step kept in memory is copied now that root is writable
    assert mgr.steps() == [1]


# ---------------------------------------------------------------------- 6. interpreter exit
def test_an_unclosed_manager_finishes_at_exit(job, tmp_path):
    # Memory tier: the save in flight is committed in memory and copied to root, memory given back.
    proc = _run(f"""
        mgr = _manager({str(tmp_path / "mem")!r}, {job!r})
        for step in (1, 2):
            mgr.save(step, _state(step), async_save=True)
        print("end of script", flush=True)
    """)
    assert proc.returncode == 0 and "end of script" in proc.stdout, proc.stderr
    mgr = omnickpt.CheckpointManager(str(tmp_path / "mem"), read_only=True)
    fresh, state = _blank()
    assert mgr.latest_step() == 2 and mgr.load_latest(state) and _is_step(fresh, state["extra"], 2)
    assert not os.path.exists(shm_path(f"shm://{job}"))
    # Plain manager: the async save in flight is committed, and the root's lease is given back.
    proc = _run(f"""
        mgr = omnickpt.CheckpointManager({str(tmp_path / "plain")!r})
        mgr.save(7, _state(7), async_save=True)
    """)
    assert proc.returncode == 0, proc.stderr
    assert omnickpt.CheckpointManager(str(tmp_path / "plain"), read_only=True).steps() == [7]
    assert not (tmp_path / "plain" / ".omnickpt" / "owner.json").exists()
    fresh, state = _blank()
    omnickpt.CheckpointManager(str(tmp_path / "plain"), read_only=True).load_latest(state)
    assert _is_step(fresh, state["extra"], 7)


def test_an_unclosed_manager_that_cannot_finish_fails_the_process_loudly(job, tmp_path):
    root = tmp_path / "root"
    proc = _run(f"""
        mgr = _manager({str(root)!r}, {job!r}, persist_every=1000)
        mgr.save(1, _state(1), async_save=True)
        open({str(root)!r}, "w").write("a file where the durable root's folder must go")
    """)
    assert proc.returncode == 1, proc.stderr
    assert "ERROR" in proc.stderr and "could not finish" in proc.stderr and str(root) in proc.stderr, proc.stderr
    # The step is not lost: it stays in shared memory, and the message says where.
    assert f"shm://{job}/node0/global_step_1" in proc.stderr, proc.stderr
    os.unlink(root)
    mgr = _manager(root, job, persist_on_failure=False)
    fresh, state = _blank()
    assert mgr.load_latest(state).report["tier"] == "memory" and _is_step(fresh, state["extra"], 1)
    mgr.close()
