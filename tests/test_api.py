"""Engine and API behaviour on real gloo ranks: balanced writes, the plan cache, async snapshot
semantics, the ByteCheckpoint call shape, CheckpointManager."""
from __future__ import annotations

import json
import os

import pytest
import torch

import omnickpt
from dist import run_ranks
from omnickpt.storage import storage_for


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 48), torch.nn.Linear(48, 8))


def _ddp_scenarios(rank, world_size, root):
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    ckpt = omnickpt.Checkpointer()
    comm = ckpt.comm()

    # 1. balanced writes and the plan cache (sync saves)
    before = comm.collectives
    r1 = ckpt.save(f"{root}/a", {"model": model, "optimizer": opt}).wait()
    first = comm.collectives - before
    before = comm.collectives
    ckpt.save(f"{root}/b", {"model": model, "optimizer": opt}).wait()
    second = comm.collectives - before
    out["bytes_per_rank"] = r1["bytes_per_rank"]
    out["sync_collectives"] = (first, second)

    # 2. async saves: the checkpoint holds the values at the time of the call, even though the
    # parameters change right after it returns and a second save starts before the first commits.
    before = comm.collectives
    h1 = ckpt.save(f"{root}/c1", {"model": model, "optimizer": opt}, async_save=True,
                   snapshot="eager")   # the parameters are edited by hand right after: the eager contract
    async_first = comm.collectives - before
    snap1 = {k: v.clone() for k, v in model.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = comm.collectives
    h2 = ckpt.save(f"{root}/c2", {"model": model, "optimizer": opt}, async_save=True, snapshot="eager")
    async_second = comm.collectives - before
    snap2 = {k: v.clone() for k, v in model.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    rep1, _ = h1.wait(), h2.wait()
    out["async_collectives"] = (async_first, async_second)
    out["async_reports"] = (rep1["save_id"] if rank == 0 else None, "stall" in rep1["phases"])
    for path, snap in ((f"{root}/c1", snap1), (f"{root}/c2", snap2)):
        fresh = _mlp(seed=1)
        ckpt.load(path, {"model": fresh}, strict=False)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, snap[k]), (path, k)

    # 3. a structure change invalidates the cache: the planning exchange runs again
    model2 = DDP(torch.nn.Linear(3, 3))
    before = comm.collectives
    ckpt.save(f"{root}/d", {"model": model2}).wait()
    out["changed_collectives"] = comm.collectives - before
    ckpt.close()
    return out


def test_ddp_balanced_writes_plan_cache_and_async_snapshots(tmp_path):
    res = run_ranks(2, _ddp_scenarios, str(tmp_path))
    r0 = res[0]
    # Replicas are written once and the work is split: each rank writes about half.
    b = r0["bytes_per_rank"]
    total = sum(b)
    manifest = omnickpt.read_manifest(omnickpt.storage.storage_for(str(tmp_path / "a")))
    biggest = max(t.nbytes for t in manifest.tensors.values())
    tensor_bytes = sum(t.nbytes for t in manifest.tensors.values())
    object_bytes = sum(e.nbytes for es in manifest.objects.values() for e in es)
    n_pieces = sum(len(t.boxes) for t in manifest.tensors.values()) + 4
    # every tensor byte written exactly once (plus alignment padding and the per-rank objects)
    assert tensor_bytes <= total <= tensor_bytes + 2 * object_bytes + 64 * n_pieces
    assert all(x > 0 for x in b) and abs(b[0] - b[1]) <= biggest, b
    # Sync save: all_gather(digest; a small job's records ride along while no cached plan can match,
    # and every rank plans from them) + gather(results) + broadcast. No gather or scatter of the plan
    # (test_a_small_jobs_first_save_plans_with_the_agreement has the large-job path).
    first, second = r0["sync_collectives"]
    assert first == second == 3, r0["sync_collectives"]
    # Async save on a cache hit: one small all_gather in the call, nothing else on the training
    # thread's process group (the commit goes through storage).
    assert r0["async_collectives"] == (1, 1), r0["async_collectives"]
    assert r0["changed_collectives"] == first
    assert res[0]["async_reports"][1]


def test_single_process_async_and_report(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    h = omnickpt.save(tmp_path / "ck", {"model": model, "optimizer": opt}, async_save=True)
    report = h.wait()
    assert h.done()
    for phase in ("plan", "snapshot", "stall", "checksum", "write", "fsync", "commit"):
        assert phase in report["phases"], phase
    on_disk = json.loads((tmp_path / "ck" / "report.json").read_text())
    assert on_disk["save_id"] == report["save_id"]
    assert report["bytes_per_rank"][0] == sum(os.path.getsize(tmp_path / "ck" / "data" / f)
                                              for f in os.listdir(tmp_path / "ck" / "data"))
    fresh = _mlp(seed=3)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1)
    res = omnickpt.load(tmp_path / "ck", {"model": fresh, "optimizer": opt2})
    assert res.differences == []
    assert "read" in res.report["phases"]
    assert opt2.param_groups[0]["lr"] == 0.1 and opt2.param_groups[0]["momentum"] == 0.9
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_bytecheckpoint_call_shape(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt, "extra_state": {"step": 7, "note": "x"}}
    h = omnickpt.save(str(tmp_path), state, framework="plain", fast_saving=True, global_steps=7)
    assert isinstance(h, omnickpt.SaveHandle)
    h.wait()
    assert (tmp_path / "global_step_7" / "manifest.json").exists()
    assert (tmp_path / "latest").read_text().strip() == "7"
    target = {"model": _mlp(seed=5), "optimizer": torch.optim.Adam(_mlp(seed=5).parameters()), "extra_state": {}}
    target["optimizer"] = torch.optim.Adam(target["model"].parameters())
    omnickpt.load(str(tmp_path / "global_step_7"), target, framework="plain", fast_loading=True)
    assert target["extra_state"] == {"step": 7, "note": "x"}
    with pytest.raises(omnickpt.UnsupportedError, match="fsdp2"):
        omnickpt.save(str(tmp_path), state, framework="fsdp2", global_steps=8)
    with pytest.raises(omnickpt.UnsupportedError, match="not one of"):
        omnickpt.save(str(tmp_path), state, framework="jax", global_steps=8)


def test_manager_retention_latest_and_async(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    mgr = omnickpt.CheckpointManager(tmp_path, keep_last=2)
    values = {}
    for step in range(1, 6):
        with torch.no_grad():
            model[0].weight.fill_(float(step))
        values[step] = model[0].weight.clone()
        mgr.save(step, {"model": model, "optimizer": opt, "extra": {"step": step}}, async_save=True)
    mgr.wait()
    assert mgr.steps() == [4, 5]
    assert mgr.latest_step() == 5
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step_")) == \
        ["global_step_4", "global_step_5"]
    # An interrupted save (no manifest) is never latest and never loaded.
    (tmp_path / "global_step_9" / "data").mkdir(parents=True)
    (tmp_path / "global_step_9" / "data" / "x-r00000.bin").write_bytes(b"partial")
    assert mgr.latest_step() == 5
    fresh = _mlp(seed=9)
    state = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters()), "extra": {}}
    mgr.load_latest(state)
    assert torch.equal(fresh[0].weight, values[5]) and state["extra"] == {"step": 5}


def _dedup_load(rank, world_size, root):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    omnickpt.save(f"{root}/a", {"model": model, "optimizer": opt}).wait()
    out = {}
    for dedup in (False, True):
        fresh = DDP(_mlp(seed=7))
        opt2 = torch.optim.Adam(fresh.parameters())
        res = omnickpt.load(f"{root}/a", {"model": fresh, "optimizer": opt2}, dedup_reads=dedup)
        for (k, a), b in zip(model.module.state_dict().items(), fresh.module.state_dict().values()):
            assert torch.equal(a, b), (dedup, k)
        for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a)
        out[dedup] = res.report["bytes_per_rank"]
    return out


def test_zero_redundancy_load_reads_each_replica_once(tmp_path):
    res = run_ranks(2, _dedup_load, str(tmp_path))
    every_rank = res[0][False]
    dedup = res[0][True]
    # Without dedup every rank reads everything; with it the two ranks split the reading.
    assert every_rank[0] == every_rank[1]
    assert sum(dedup) < 0.6 * sum(every_rank) and min(dedup) > 0, (every_rank, dedup)


def _shardspec(rank, world_size, root):
    import torch.distributed as dist
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    bias = torch.linspace(0, 1, 5)
    # Save from ranks {0, 1} of the 3 (a sub-group): uneven row split 4 + 3, bias replicated.
    saver = dist.new_group([0, 1])
    if rank < 2:
        rows = [(0, 4), (4, 7)][rank]
        state = {"w": omnickpt.ShardSpec(full[rows[0]:rows[1]].clone(), (rows[0], 0), (7, 5)),
                 "extra": {"b": omnickpt.ShardSpec(bias.clone(), (0,), (5,), replicated=True)}}
        omnickpt.save(f"{root}/spec", state, process_group=saver).wait()
    dist.barrier()
    # Load on all 3 ranks with a column split (2 + 2 + 1): boxes cross the saved ones.
    cols = [(0, 2), (2, 4), (4, 5)][rank]
    w = torch.zeros(7, cols[1] - cols[0])
    b = torch.zeros(5)
    omnickpt.load(f"{root}/spec", {"w": omnickpt.ShardSpec(w, (0, cols[0]), (7, 5)),
                                   "extra": {"b": omnickpt.ShardSpec(b, (0,), (5,))}})
    assert torch.equal(w, full[:, cols[0]:cols[1]]), rank
    assert torch.equal(b, bias)
    return True


def test_shardspec_hand_sharded_tensors_reshard(tmp_path):
    assert run_ranks(3, _shardspec, str(tmp_path)) == [True] * 3


def _cache_per_group(rank, world_size, root):
    import torch.distributed as dist
    ckpt = omnickpt.Checkpointer()
    solo = dist.new_group([0])
    both = {"m": torch.nn.Linear(2, 2)}
    ckpt.save(f"{root}/a", both).wait()
    if rank == 0:
        # Saves on another group must not evict the plan the two ranks share.
        for i in range(6):
            ckpt.save(f"{root}/solo{i}", {"m": torch.nn.Linear(i + 2, 3)}, process_group=solo).wait()
    before = ckpt.comm().collectives
    ckpt.save(f"{root}/b", both).wait()
    return ckpt.comm().collectives - before


def test_plan_cache_is_per_process_group(tmp_path):
    # Both ranks hit the cache: digest all_gather + result gather + broadcast, no planning exchange.
    assert run_ranks(2, _cache_per_group, str(tmp_path)) == [3, 3]


def _restart_in_process(rank, world_size, root):
    """run_ranks made the first process group; the job tears it down and starts a new one (an
    in-process restart), then saves and loads again through the module-level API."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    omnickpt.save(f"{root}/before", {"model": model})
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root}/store-again", rank=rank, world_size=world_size)
    with torch.no_grad():
        model.weight.add_(1.0)
    omnickpt.save(f"{root}/after", {"model": model})
    fresh = torch.nn.Linear(8, 4)
    omnickpt.load(f"{root}/after", {"model": fresh})
    return torch.equal(fresh.weight, model.weight)


def test_module_level_saves_and_loads_after_the_process_group_is_made_anew(tmp_path):
    # The module-level Checkpointer lives for the process; its coordination must follow the job's
    # current process group, not keep the destroyed one (a ValueError naming a group "not
    # initialized in the world group map").
    assert run_ranks(2, _restart_in_process, str(tmp_path)) == [True, True]
    assert omnickpt.read_manifest(storage_for(str(tmp_path / "after"))).world_size == 2


def _save_before_init(rank, world_size, root):
    """A rank that used the module-level API before joining the job (a single-process warm-up)
    must not keep saving as if it were alone once the job's process group exists."""
    import torch.distributed as dist
    dist.destroy_process_group()
    omnickpt.save(f"{root}/warmup{rank}", {"x": torch.zeros(2)})
    dist.init_process_group("gloo", init_method=f"file://{root}/store-job", rank=rank, world_size=world_size)
    omnickpt.save(f"{root}/job", {"model": torch.nn.Linear(2, 2)})
    return omnickpt.read_manifest(storage_for(f"{root}/job")).world_size


def test_a_save_before_init_process_group_does_not_make_later_saves_solo(tmp_path):
    assert run_ranks(2, _save_before_init, str(tmp_path)) == [2, 2]


def _in_forked_child(ckpt, root, queue):
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4)
    try:
        omnickpt.save(f"{root}/child-module-level", {"model": model}, async_save=True).wait()
        ckpt.save(f"{root}/child-own", {"model": model}, async_save=True).wait()
        fresh = torch.nn.Linear(8, 4)
        ckpt.load(f"{root}/child-own", {"model": fresh})
        ckpt.close()
        queue.put(torch.equal(fresh.weight, model.weight))
    except BaseException as e:
        queue.put(repr(e))


def test_a_checkpointer_made_before_a_fork_saves_and_loads_in_the_child(tmp_path):
    # A forked child has none of the parent's threads: a save through a Checkpointer (or the
    # module-level API) used before the fork waited forever for a persist thread that was not there.
    import multiprocessing
    model = torch.nn.Linear(8, 4)
    ckpt = omnickpt.Checkpointer()
    ckpt.save(f"{tmp_path}/parent", {"model": model}, async_save=True).wait()
    omnickpt.save(f"{tmp_path}/parent-module-level", {"model": model}).wait()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(ckpt, str(tmp_path), queue))
    child.start()
    try:
        outcome = queue.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert outcome is True, outcome
    assert child.exitcode == 0
    # The parent's Checkpointer still works: the child made its own.
    ckpt.save(f"{tmp_path}/parent-again", {"model": model}, async_save=True).wait()
    ckpt.close()
    assert omnickpt.is_committed(f"{tmp_path}/child-own") and omnickpt.is_committed(f"{tmp_path}/parent-again")


def _first_and_second_save(rank, world_size, root, inline_limit):
    import omnickpt.saving
    if inline_limit is not None:
        omnickpt.saving.INLINE_PLAN_BYTES = inline_limit
    ckpt = omnickpt.Checkpointer()
    torch.manual_seed(0)   # replicas (as DDP's): the plan has each tensor written by one rank, spread over both
    state = {"model": torch.nn.Linear(16, 8), "extra": torch.nn.Linear(8, 2)}
    counts = []
    for i in range(2):
        before = ckpt.comm().collectives
        ckpt.save(f"{root}/s{i}", state).wait()
        counts.append(ckpt.comm().collectives - before)
    fresh = {"model": torch.nn.Linear(16, 8), "extra": torch.nn.Linear(8, 2)}
    ckpt.load(f"{root}/s0", fresh)
    ckpt.close()
    same = all(torch.equal(a, b) for k in state for a, b in zip(state[k].parameters(), fresh[k].parameters()))
    return counts, same


@pytest.mark.parametrize("inline_limit, first", [(None, 3), (0, 5)], ids=["inline", "gathered"])
def test_a_small_jobs_first_save_plans_with_the_agreement(tmp_path, inline_limit, first):
    # Every rank sends its records with the agreement's all-gather and plans from them itself: the
    # first save makes as many collectives as a cached one (the agreement, the sync commit's gather
    # and broadcast), not a gather and a scatter more. Past INLINE_PLAN_BYTES the coordinator plans.
    # Either way the checkpoint loads back what was saved.
    out = run_ranks(2, _first_and_second_save, str(tmp_path), inline_limit)
    assert [o[0] for o in out] == [[first, 3], [first, 3]]
    assert [o[1] for o in out] == [True, True]


def _shapes_differ(rank, world_size, root, inline_limit):
    import omnickpt.saving
    if inline_limit is not None:
        omnickpt.saving.INLINE_PLAN_BYTES = inline_limit
    try:
        omnickpt.save(f"{root}/bad", {"model": torch.nn.Linear(4, 4 + rank)})
    except omnickpt.PlanError as e:
        return str(e)
    return None


@pytest.mark.parametrize("inline_limit", [None, 0], ids=["inline", "gathered"])
def test_ranks_that_disagree_on_a_shape_fail_the_first_save_on_every_rank(tmp_path, inline_limit):
    messages = run_ranks(2, _shapes_differ, str(tmp_path), inline_limit)
    for m in messages:
        assert m is not None and "planning the save" in m and "'model/weight'" in m and "rank 1" in m, m
    assert not omnickpt.is_committed(str(tmp_path / "bad"))


def _manager_across_restart(rank, world_size, root):
    import torch.distributed as dist
    model = torch.nn.Linear(4, 4)
    mgr = omnickpt.CheckpointManager(f"{root}/run", incremental=True)   # its ranks agree on each save's base
    mgr.save(1, {"model": model})
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root}/store-again", rank=rank, world_size=world_size)
    try:
        mgr.save(2, {"model": model})
    except omnickpt.CheckpointError as e:
        message = str(e)
    else:
        message = None
    # A manager made under the new process group saves there.
    omnickpt.CheckpointManager(f"{root}/run", incremental=True).save(3, {"model": model})
    return message


def test_a_manager_made_before_the_process_group_was_made_anew_says_so(tmp_path):
    # Its own collectives (here: the incremental base) are on the destroyed group: a clear error
    # naming what to do, not torch's "not initialized in the world group map" from inside one.
    for message in run_ranks(2, _manager_across_restart, str(tmp_path)):
        assert message is not None and "process group this was made with is gone" in message, message
        assert "anew after init_process_group" in message
    steps = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("global_step_"))
    assert steps == ["global_step_1", "global_step_3"]
