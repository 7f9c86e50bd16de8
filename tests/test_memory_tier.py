"""The memory tier: shm:// storage, TieredCheckpointManager(memory=...) saving to shared memory and
persisting to the durable root in the background, restore after a real kill -9 without reading the
durable root, every fallback (memory missing, stale, incomplete, corrupt), peer replicas across
simulated nodes, and persist-on-failure (a real SIGTERM, an exception leaving `with manager:`).

Cost: two child processes (one killed with SIGKILL, one with SIGTERM) and one 4-rank launch; the
rest runs in this process.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

import omnickpt
from dist import run_ranks
from omnickpt.format import Manifest
from omnickpt.storage import storage_for
from omnickpt.storage.shm import ShmStorage, clear_memory, memory_usage, shm_dir, shm_path
from omnickpt.tiers import choose_restore

TESTS = os.path.dirname(os.path.abspath(__file__))
SIZE = 768   # a Linear(768, 768): 2.4 MB, big enough that a kill often lands inside a save


@pytest.fixture
def job():
    """A job name of its own, and its shared memory given back whatever the test did."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    clear_memory(name)


def _model(step: int) -> torch.nn.Linear:
    """The model as it is after `step` steps: every value is a function of the step, so a load of
    anything but one whole saved step (a partial or mixed checkpoint) is detected."""
    m = torch.nn.Linear(SIZE, SIZE)
    with torch.no_grad():
        m.weight.copy_(torch.arange(SIZE * SIZE, dtype=torch.float32).reshape(SIZE, SIZE) / 7 + step)
        m.bias.fill_(-step)
    return m


def _check_step(model: torch.nn.Linear, extra: dict, step: int) -> None:
    want = _model(step)
    assert extra == {"step": step}
    assert torch.equal(model.weight, want.weight) and torch.equal(model.bias, want.bias), f"not step {step}"


def _blank() -> tuple[torch.nn.Linear, dict]:
    m = torch.nn.Linear(SIZE, SIZE)
    with torch.no_grad():
        m.weight.fill_(float("nan"))
    return m, {"model": m, "extra": {}}


def _manager(root, job, **kw) -> omnickpt.TieredCheckpointManager:
    return omnickpt.TieredCheckpointManager(str(root), memory=f"shm://{job}", **kw)


def _child(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


# ---------------------------------------------------------------------- shm:// storage
def test_shm_urls_save_load_and_clear(job, tmp_path):
    store = storage_for(f"shm://{job}/a/b")
    assert isinstance(store, ShmStorage) and store.root == os.path.join(shm_dir(), job, "a", "b")
    for bad in ("shm://../etc", "shm://a/../../b", "shm://", "shm://.hidden", "shm://a b"):
        with pytest.raises(ValueError):
            storage_for(bad)
    # An ordinary checkpoint can live in shared memory too.
    model = _model(3)
    omnickpt.save(f"shm://{job}/ckpt", {"model": model, "extra": {"step": 3}})
    fresh, state = _blank()
    omnickpt.load(f"shm://{job}/ckpt", state)
    _check_step(fresh, state["extra"], 3)
    used = memory_usage(job)[job]
    assert used >= SIZE * SIZE * 4
    assert clear_memory(job) == used
    assert not os.path.exists(shm_path(f"shm://{job}")) and memory_usage(job) == {}
    assert clear_memory(job) == 0   # nothing left: still fine


def test_choose_restore():
    # views[k] = (steps complete in node k's memory, steps of node k-1 kept as replicas by node k)
    assert choose_restore([([4, 5], []), ([5], [])], None, peers=False) == (5, [])
    assert choose_restore([([4, 5], []), ([4], [])], 3, peers=False) == (4, [])       # newest common step
    assert choose_restore([([4, 5], []), ([4, 5], [])], 6, peers=False) == (None, [])  # stale: root is newer
    assert choose_restore([([4, 5], []), ([4, 5], [])], 5, peers=False) == (5, [])    # a tie goes to memory
    # Node 1 lost its memory; node 0 keeps node 1's replica.
    assert choose_restore([([5], [5]), ([], [])], 2, peers=True) == (5, [1])
    assert choose_restore([([5], [5]), ([], [])], 2, peers=False) == (None, [])
    # Both copies of node 1 gone (its own memory and node 0 that kept its replica).
    assert choose_restore([([5], []), ([], [5])], 2, peers=True) == (None, [])


# ---------------------------------------------------------------------- kill -9 and the fallbacks
def _train_forever(root: str, job: str) -> None:
    """The killed training process: saves every step to the memory tier (async), every third to
    the durable root, and says which steps are committed in memory."""
    import itertools
    mgr = _manager(root, job, persist_every=3, keep_last=2)
    prev = None
    for step in itertools.count(1):
        model = _model(step)
        handle = mgr.save(step, {"model": model, "extra": {"step": step}}, async_save=True)
        if prev is not None:
            prev.wait_memory()
            print(f"committed {prev.step}", flush=True)
        prev = handle
        time.sleep(0.005)


def test_kill9_restores_from_memory_without_durable_and_falls_back(job, tmp_path):
    root = tmp_path / "durable"
    child = _child(f"from test_memory_tier import _train_forever; _train_forever({str(root)!r}, {job!r})")
    committed = []
    try:
        for line in child.stdout:
            committed.append(int(line.split()[1]))
            if committed[-1] >= 7:
                break
        assert committed, child.stderr.read()
        time.sleep(random.uniform(0, 0.1))   # anywhere in the next save: snapshot, memory write, durable copy
    finally:
        child.kill()   # SIGKILL: no handler, no flush, no cleanup
        rest, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err
    committed += [int(n) for n in rest.split()[1::2]]   # lines printed before the kill, not read yet
    newest_committed = max(committed)

    mem_dir = shm_path(f"shm://{job}")
    backup = tmp_path / "shm-backup"
    shutil.copytree(mem_dir, backup)
    durable_backup = tmp_path / "durable-backup"
    shutil.copytree(root, durable_backup)

    def reset():
        shutil.rmtree(mem_dir, ignore_errors=True)
        shutil.copytree(backup, mem_dir)
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(durable_backup, root)

    def restore(**kw):
        # persist_on_failure=False / keep_latest: these checks must not change the tiers they read
        mgr = _manager(root, job, persist_on_failure=False, on_close="keep_latest", **kw)
        fresh, state = _blank()
        res = mgr.load_latest(state)
        _check_step(fresh, state["extra"], res.report["step"])   # one whole saved step, nothing partial
        return mgr, res

    durable_steps = omnickpt.CheckpointManager(str(root)).steps()
    mem_steps = sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(os.path.join(mem_dir, "node0"))
                       if n.startswith("global_step_") and os.path.exists(os.path.join(mem_dir, "node0", n, "manifest.json")))
    assert mem_steps and max(mem_steps) >= newest_committed

    # 1. From memory, with the durable root gone: nothing of it is read (it is not there).
    shutil.rmtree(root)
    mgr, res = restore()
    assert res.report["tier"] == "memory" and res.report["step"] >= newest_committed   # no data lost
    assert mgr.restored == ("memory", res.report["step"])
    newest_in_memory = res.report["step"]
    # 2. From memory, with every durable data file overwritten by garbage: a read of any of them
    #    would fail its checksum; restoring from memory does not notice them.
    reset()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".bin"):
                p = os.path.join(dirpath, f)
                with open(p, "r+b") as fh:
                    fh.write(os.urandom(os.path.getsize(p)))
    mgr, res = restore()
    assert (res.report["tier"], res.report["step"]) == ("memory", newest_in_memory)

    # 3. Memory missing: the newest durable step.
    reset()
    clear_memory(job)
    mgr, res = restore()
    assert (res.report["tier"], res.report["step"]) == ("durable", durable_steps[-1])

    # 4. Memory incomplete: its newest step has no manifest (a save killed before its commit), or
    #    a truncated data file. An older complete memory step that is not older than root may win.
    for damage in ("manifest", "truncate"):
        reset()
        step_dir = os.path.join(mem_dir, "node0", f"global_step_{newest_in_memory}")
        if damage == "manifest":
            os.unlink(os.path.join(step_dir, "manifest.json"))
        else:
            data = os.path.join(step_dir, "data")
            victim = os.path.join(data, os.listdir(data)[0])
            os.truncate(victim, os.path.getsize(victim) // 2)
        older = [s for s in mem_steps if s < newest_in_memory and s >= durable_steps[-1]]
        mgr, res = restore()
        assert res.report["step"] == (older[-1] if older else durable_steps[-1]), damage
        assert res.report["tier"] == ("memory" if older else "durable")
        # Never the damaged memory step itself; root may hold that same step (when the kill came
        # after its durable copy committed), and then it is restored from there.
        assert res.report["step"] < newest_in_memory or res.report["tier"] == "durable"

    # 5. Memory corrupt (same size, bytes changed): the checksum catches it, root takes over.
    reset()
    data = os.path.join(mem_dir, "node0", f"global_step_{newest_in_memory}", "data")
    victim = os.path.join(data, os.listdir(data)[0])
    with open(victim, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff" * 64)
    with pytest.warns(RuntimeWarning, match="from shared memory failed"):
        mgr, res = restore()
    assert (res.report["tier"], res.report["step"]) == ("durable", durable_steps[-1])

    # 6. Memory stale: a later run elsewhere saved a newer step to root; memory must not win.
    reset()
    newer = newest_in_memory + 10
    omnickpt.CheckpointManager(str(root)).save(newer, {"model": _model(newer), "extra": {"step": newer}})
    mgr, res = restore()
    assert (res.report["tier"], res.report["step"]) == ("durable", newer)
    # ... and the stale memory steps are gone: they could otherwise mix with the new run's saves.
    assert mgr.memory_steps() == []

    # 7. After a restore from memory the run goes on. Closing copies the newest memory step to
    #    root if root lacks it: the restored step itself when nothing newer was saved...
    reset()
    shutil.rmtree(root)
    mgr = _manager(root, job)
    fresh, state = _blank()
    assert mgr.load_latest(state).report["tier"] == "memory"
    mgr.close()
    assert mgr.steps() == [newest_in_memory] and not os.path.exists(mem_dir)
    # ... or the steps saved after it (root keeps everything here: keep_last=None).
    reset()
    shutil.rmtree(root)
    with _manager(root, job, persist_every=2) as mgr:
        assert mgr.load_latest(_blank()[1]).report["tier"] == "memory"
        for step in range(newest_in_memory + 1, newest_in_memory + 4):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}}, async_save=True)
    assert mgr.steps() == [newest_in_memory + 2, newest_in_memory + 3]
    fresh, state = _blank()
    mgr.load(newest_in_memory + 3, state)
    _check_step(fresh, state["extra"], newest_in_memory + 3)


# ---------------------------------------------------------------------- persist on failure
def _train_until_sigterm(root: str, job: str) -> None:
    mgr = _manager(root, job, persist_every=1000)   # nothing reaches root in the normal course
    for step in range(1, 5):
        mgr.save(step, {"model": _model(step), "extra": {"step": step}}, async_save=True).wait_memory()
    print("ready", flush=True)
    while True:   # "training"
        torch.ones(64, 64) @ torch.ones(64, 64)
        time.sleep(0.001)


def test_sigterm_flushes_newest_memory_step(job, tmp_path):
    root = tmp_path / "durable"
    child = _child(f"from test_memory_tier import _train_until_sigterm; _train_until_sigterm({str(root)!r}, {job!r})")
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        assert omnickpt.CheckpointManager(str(root)).steps() == []
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    # The handler flushed, then gave SIGTERM its default meaning: the process died of it.
    assert child.returncode == -signal.SIGTERM, err
    assert "copied memory step 4" in err
    mgr = omnickpt.CheckpointManager(str(root))
    assert mgr.steps() == [4]
    fresh, state = _blank()
    mgr.load_latest(state)
    _check_step(fresh, state["extra"], 4)
    # After a failure the newest memory step stays for a restart on this machine.
    assert os.path.exists(os.path.join(shm_path(f"shm://{job}"), "node0", "global_step_4", "manifest.json"))


def test_sigterm_chains_to_the_previous_handler(job, tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        mgr = _manager(tmp_path, job, persist_every=1000)
        for step in (1, 2):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)   # the handler runs in this (the main) thread at the next bytecode
        assert seen == [signal.SIGTERM]   # the handler that was there before still ran, after the flush
        assert mgr.steps() == [2]
        assert signal.getsignal(signal.SIGTERM) is not mgr._on_signal   # ours is gone after a signal
        mgr.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_exception_in_with_block_flushes_and_clean_close_reclaims(job, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="loss is nan"):
        with _manager(tmp_path / "a", job, persist_every=1000) as mgr:
            assert signal.getsignal(signal.SIGTERM) == mgr._on_signal
            for step in (1, 2, 3):
                mgr.save(step, {"model": _model(step), "extra": {"step": step}}, async_save=True)
            raise RuntimeError("loss is nan")
    assert signal.getsignal(signal.SIGTERM) == before   # restored on close
    assert mgr.steps() == [3]
    fresh, state = _blank()
    mgr.load(3, state)
    _check_step(fresh, state["extra"], 3)
    assert mgr.memory_steps() == [3]   # a failure keeps the newest memory step for a restart
    clear_memory(job)

    # A clean exit: retention keeps memory small while saving, close() copies the newest step to
    # root and removes everything from shared memory (on_close="remove", the default)...
    with _manager(tmp_path / "b", job, persist_every=2, memory_keep=1) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}}, async_save=True)
            assert len(os.listdir(os.path.join(shm_path(f"shm://{job}"), "node0"))) <= 4   # tier.json + kept + pinned + in flight
        mgr.wait()
        assert mgr.memory_steps()[-1] == 7 and len(mgr.memory_steps()) <= 2
    assert mgr.steps() == [2, 4, 6, 7]
    assert not os.path.exists(shm_path(f"shm://{job}")) and memory_usage(job) == {}
    # ... or keeps just the newest step for a restart on this machine (on_close="keep_latest").
    with _manager(tmp_path / "c", job, on_close="keep_latest") as mgr:
        for step in range(1, 4):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}})
    assert mgr.memory_steps() == [3] and mgr.steps() == [1, 2, 3]
    assert sorted(os.listdir(os.path.join(shm_path(f"shm://{job}"), "node0"))) == ["global_step_3", "tier.json"]
    # The same job name with another durable root: that memory is not this run's to restore from.
    with pytest.warns(RuntimeWarning, match="belongs to another job layout or durable root"):
        other = _manager(tmp_path / "d", job, persist_on_failure=False)
    assert other.memory_steps() == []
    with pytest.raises(omnickpt.NotCommittedError, match="nothing to restore"):
        other.load_latest(_blank()[1])
    other.close()


def test_memory_options_as_a_dataclass_or_keywords_build_the_tiered_manager(job, tmp_path):
    from omnickpt import MemoryTierOptions, TieredCheckpointManager
    for bad in (dict(url="/dev/shm/x"), dict(url=f"shm://{job}", memory_keep=0),
                dict(url=f"shm://{job}", persist_every=0), dict(url=f"shm://{job}", on_close="drop")):
        with pytest.raises(ValueError):
            MemoryTierOptions(**bad)
    assert not os.path.exists(shm_path(f"shm://{job}"))   # refused before anything touched shared memory
    options = MemoryTierOptions(f"shm://{job}", memory_keep=2, persist_every=2, persist_on_failure=False)
    with pytest.raises(TypeError, match="memory_keep"):
        TieredCheckpointManager(str(tmp_path / "a"), memory=options, memory_keep=3)
    with pytest.raises(TypeError, match=r"TieredCheckpointManager\(root, memory="):   # one way to build it
        omnickpt.CheckpointManager(str(tmp_path / "a"), memory=options)
    with TieredCheckpointManager(str(tmp_path / "a"), memory=options) as mgr:
        assert type(mgr) is TieredCheckpointManager and not isinstance(mgr, omnickpt.CheckpointManager)
        assert mgr.options == options
        for step in range(1, 5):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}})
        mgr.wait()
        assert mgr.memory_steps() == [3, 4]   # memory_keep=2 took effect
        assert mgr.steps() == [2, 4]          # persist_every=2 too
    # The keywords of TieredCheckpointManager(root, memory=...) build the same options.
    with _manager(tmp_path / "b", job, memory_keep=2, persist_every=2, persist_on_failure=False) as mgr:
        assert type(mgr) is TieredCheckpointManager and mgr.options == options
    with pytest.raises(TypeError, match="memory_keep"):   # no memory: refused (tests/test_handles.py)
        omnickpt.CheckpointManager(str(tmp_path / "c"), memory=None, memory_keep=2)
    with pytest.raises(TypeError, match="memory_kep"):
        omnickpt.CheckpointManager(str(tmp_path / "d"), memory_kep=2)


# ---------------------------------------------------------------------- peer replicas
ROWS = [(0, 3), (3, 5), (5, 8), (8, 9)]   # uneven row shards of a (9, 4) tensor on 4 ranks


def _sampler(rank: int, step: int) -> tuple[omnickpt.ReshardableSampler, int]:
    """Rank `rank`'s sampler after `step` samples, and the sample it yields next."""
    sampler = omnickpt.ReshardableSampler(50, rank, 4, seed=1)
    it = iter(sampler)
    for _ in range(step):
        next(it)
    return sampler, int(omnickpt.ReshardableSampler(50, rank, 4, seed=1).permutation()[rank + 4 * step])


def _shard_state(rank: int, step: int) -> dict:
    lo, hi = ROWS[rank]
    full = torch.arange(36, dtype=torch.float32).reshape(9, 4) + 100 * step
    return {"w": omnickpt.ShardSpec(full[lo:hi].clone(), (lo, 0), (9, 4)),
            "b": omnickpt.ShardSpec(torch.full((4,), float(step)), (0,), (4,), replicated=True),
            "meta": {"rank": rank, "step": step},
            # saved per rank, loaded with every rank's value: the memory restore of one node needs
            # the other node's values too
            "sampler": _sampler(rank, step)[0]}


def _peer_scenarios(rank, world_size, root, job):
    import torch.distributed as dist
    from omnickpt.steps import step_dir
    kw = dict(ranks_per_node=2, peer_replicas=True, on_close="keep_latest", persist_on_failure=False)

    def restore(expect_step):
        mgr = _manager(root, job, **kw)
        st = _shard_state(rank, 0)
        res = mgr.load_latest(st)
        want = _shard_state(rank, expect_step)
        assert torch.equal(st["w"].local, want["w"].local) and torch.equal(st["b"].local, want["b"].local), rank
        assert st["meta"] == want["meta"]
        assert next(iter(st["sampler"])) == _sampler(rank, expect_step)[1]   # resumes at the saved position
        return mgr, res

    # Two simulated nodes of two ranks; ring: node 0 keeps node 1's replica and node 1 node 0's.
    mgr = _manager(root, job, persist_every=2, **kw)
    for step in (1, 2, 3):
        mgr.save(step, _shard_state(rank, step), async_save=True)
    mgr.wait()
    out = {"memory": mgr.memory_steps(), "durable": mgr.steps()}
    # (no close: the "crash" leaves memory as it is)
    node_dir = os.path.join(shm_path(f"shm://{job}"), f"node{rank // 2}")
    out["replica"] = sorted(os.listdir(os.path.join(node_dir, "replicas", f"node{1 - rank // 2}")))
    dist.barrier()
    # Machine 1 loses its memory (its own steps and the replica of node 0 it kept); root is
    # removed too, so the restore can only come from shared memory, node 1's from its peer.
    if rank == 0:
        shutil.rmtree(os.path.join(shm_path(f"shm://{job}"), "node1"))
        shutil.move(root, root + ".away")
    dist.barrier()
    mgr, res = restore(3)
    out["restored"] = (res.report["tier"], res.report["step"], res.report["repaired_nodes"])
    # node 1's memory is whole again (the repair wrote it back there).
    out["node1_repaired"] = os.path.exists(os.path.join(shm_path(f"shm://{job}"), "node1", step_dir(3), "manifest.json"))
    dist.barrier()
    if rank == 0:
        shutil.move(root + ".away", root)
        # Now both copies of node 1's step 3 are lost: its own and the replica node 0 keeps.
        shutil.rmtree(os.path.join(shm_path(f"shm://{job}"), "node1"))
        shutil.rmtree(os.path.join(shm_path(f"shm://{job}"), "node0", "replicas"))
    dist.barrier()
    mgr, res = restore(2)
    out["fallback"] = (res.report["tier"], res.report["step"])
    mgr.close()   # collective: waits for every rank before any node's memory is touched
    return out


def test_peer_replicas_restore_a_lost_node_and_durable_copy_is_global(job, tmp_path):
    root = str(tmp_path / "durable")
    out = run_ranks(4, _peer_scenarios, root, job)
    for r, o in enumerate(out):
        assert o["memory"][-1] == 3 and o["durable"] == [2], (r, o)
        assert o["replica"][-1] == "global_step_3", (r, o)
        assert o["restored"] == ("memory", 3, [1]), (r, o)   # node 1 came back from node 0's replica
        assert o["node1_repaired"]
        assert o["fallback"] == ("durable", 2), (r, o)
    # The durable copy is one global checkpoint merged from the two nodes' manifests: a single
    # process loads the whole tensor; the replicated box is listed once.
    manifest = omnickpt.read_manifest(storage_for(f"{root}/global_step_2"))
    assert isinstance(manifest, Manifest) and manifest.world_size == 4
    assert len(manifest.tensors["b"].boxes) == 1 and len(manifest.tensors["w"].boxes) == 4
    assert sorted(r for e in manifest.objects["meta"] for r in e.ranks) == [0, 1, 2, 3]
    w, b = torch.zeros(9, 4), torch.zeros(4)
    state = {"w": omnickpt.ShardSpec(w, (0, 0), (9, 4)), "b": omnickpt.ShardSpec(b, (0,), (4,)), "meta": {}}
    omnickpt.load(f"{root}/global_step_2", state, strict=False)   # (the samplers are left out)
    assert torch.equal(w, torch.arange(36, dtype=torch.float32).reshape(9, 4) + 200) and torch.equal(b, torch.full((4,), 2.0))
    assert state["meta"] == {"rank": 0, "step": 2}


# ---------------------------------------------------------------------- an S3 durable root
def test_s3_durable_root_and_restore_while_s3_is_unreachable(job, monkeypatch):
    import importlib.util
    pytest.importorskip("boto3")
    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto[server] is not installed (pip install 'moto[server]')")
    import boto3
    from dist import free_port
    from s3server import AWS_ENV_TO_CLEAR, MotoServer, aws_env
    for k in AWS_ENV_TO_CLEAR:
        monkeypatch.delenv(k, raising=False)
    with MotoServer() as server:
        for k, v in aws_env(server.endpoint).items():
            monkeypatch.setenv(k, v)
        bucket = f"omnickpt-{uuid.uuid4().hex[:12]}"
        boto3.session.Session().client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
        root = f"s3://{bucket}/run"
        kw = dict(persist_on_failure=False, on_close="keep_latest")
        mgr = _manager(root, job, persist_every=2, keep_last=1, **kw)
        for step in (1, 2, 3):
            mgr.save(step, {"model": _model(step), "extra": {"step": step}}, async_save=True)
        mgr.wait()
        assert mgr.steps() == [2] and mgr.memory_steps()[-1] == 3
        # S3 unreachable (nothing listens there): the restore from memory does not need it.
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        fresh, state = _blank()
        res = _manager(root, job, **kw).load_latest(state)
        assert (res.report["tier"], res.report["step"]) == ("memory", 3)
        _check_step(fresh, state["extra"], 3)
        clear_memory(job)
        with pytest.raises(omnickpt.NotCommittedError, match="no complete step in shared memory"):
            _manager(root, job, **kw).load_latest(_blank()[1])
        # S3 back, memory gone: the durable step 2, read from S3.
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        fresh, state = _blank()
        res = _manager(root, job, **kw).load_latest(state)
        assert (res.report["tier"], res.report["step"]) == ("durable", 2)
        _check_step(fresh, state["extra"], 2)


def test_the_memory_tier_warms_released_staging_ahead_of_its_saves(tmp_path):
    """TieredCheckpointManager(every=6) on a Checkpointer with release_staging=True: its saves to
    shared memory go through the same staging, warmed ahead of each due save as CheckpointManager's."""
    import time
    job = f"warm{os.getpid()}"
    model = torch.nn.Sequential(*[torch.nn.Linear(SIZE, SIZE) for _ in range(8)])
    warmed = []
    with omnickpt.Checkpointer(release_staging=True) as ckpt:
        real = ckpt.warm_staging
        ckpt.warm_staging = lambda: (warmed.append(step), real())[1]
        with _manager(tmp_path / "root", job, every=6, checkpointer=ckpt) as mgr:
            for step in range(11):
                time.sleep(0.05)
                mgr.save(step, {"model": model})
                mgr.wait()
                ckpt._persist.submit(int).result(10)
                if step == 5:
                    assert ckpt._pool.idle_largest() >= ckpt._pool.expected   # warmed for the save at 6
            assert ckpt._pool.held > 0                 # warmed at 10 for a save at 12 that never comes
        ckpt._persist.submit(int).result(10)
        assert ckpt._pool.held == 0, "closing the manager keeps memory warmed for a save that will not come"
    assert warmed == [4, 10]
