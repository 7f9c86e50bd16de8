"""Checkpoint at failure (CheckpointManager.guard, omnickpt/failure.py): when one rank of a
data-parallel job raises mid-step, the survivors that hold a complete replica save the newest step,
and that checkpoint loads exactly at another world size; where no complete replica survives
(FSDP over the whole job), nothing is saved and the newest committed step stays latest."""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_ranks
from omnickpt.failure import Replicas, cannot_save, peer_failure, pick_savers

FAIL_RANK, FAIL_STEP = 2, 3


def test_the_first_replica_group_whose_ranks_all_survive_saves():
    ddp = Replicas(((0,), (1,), (2,), (3,)))
    assert pick_savers(ddp, [0, 1, 3]) == (0,)
    assert pick_savers(ddp, [1, 3]) == (1,)
    hsdp = Replicas(((0, 1), (2, 3)))
    assert pick_savers(hsdp, [0, 2, 3]) == (2, 3)
    assert pick_savers(hsdp, [0, 3]) is None
    assert pick_savers(Replicas(()), [0, 1, 2]) is None


def test_a_survivor_whose_own_group_lost_a_rank_leaves_without_waiting():
    hsdp = Replicas(((0, 1), (2, 3)))
    failed, alive = {"survivor": False}, {"survivor": True}
    assert cannot_save(hsdp, 3, {2: failed})            # its group lost rank 2: it will never save
    assert not cannot_save(hsdp, 1, {2: failed, 3: alive})   # its group is whole so far: it waits
    assert not cannot_save(hsdp, 1, {})
    assert cannot_save(Replicas(()), 0, {})                # FSDP: no group could ever save
    assert cannot_save(Replicas(((0,), (1,))), 0, {0: failed})


def test_errors_from_a_peer_that_went_away_are_told_from_a_ranks_own():
    assert peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not peer_failure(ValueError("bad batch"))
    assert not peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _model(layout: str, mesh):
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:   # hsdp (2-D mesh: replicate x shard) or fsdp (1-D)
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _mesh(layout: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,))
    return None


def _values(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    inner = getattr(model, "module", model)
    out = {f"model/{k}": full(v) for k, v in inner.state_dict().items()}
    names = {id(p): n for n, p in inner.named_parameters()}
    for p, st in opt.state.items():
        out[f"optim/{names[id(p)]}/exp_avg"] = full(st["exp_avg"])
    return out


def _job(rank: int, world: int, root: str, layout: str):
    import omnickpt
    mesh = _mesh(layout, world)
    model, opt = _model(layout, mesh)
    state = {"model": model, "optimizer": opt}
    mgr = omnickpt.CheckpointManager(root, every=100)      # only step 0 is saved by the cadence
    gen = torch.Generator().manual_seed(5)
    expected, role = None, None
    try:
        with mgr.guard(state, grace=5):
            for step in range(6):
                x = torch.randn(4, 8, generator=gen)
                if rank == FAIL_RANK and step == FAIL_STEP:
                    raise ValueError(f"rank {rank}: a bad batch at step {step}")
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if layout != "ddp" and step == FAIL_STEP - 1:
                    expected = _values(model, opt)    # collective: before anyone failed
                mgr.save(step, state)
    except ValueError:
        role = "failed"
    except RuntimeError:
        role = "survivor"
    if layout == "ddp" and role == "survivor":
        expected = _values(model, opt)               # local: every rank holds the whole state
    return role, mgr.failure_save, expected


def _load(rank: int, world: int, root: str, step: int):
    import omnickpt
    model, opt = _model("ddp", None)
    omnickpt.load(os.path.join(root, f"global_step_{step}"), {"model": model, "optimizer": opt})
    return _values(model, opt)


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_survivors_save_the_newest_step_and_it_loads_exactly_elsewhere(tmp_path, layout):
    import omnickpt
    out = run_ranks(4, _job, str(tmp_path), layout, timeout=300)
    roles = [o[0] for o in out]
    assert roles[FAIL_RANK] == "failed" and roles.count("survivor") == 3, roles
    saved = [o[1] for o in out if o[1] and o[1].get("saved")]
    # one replica group saved: DDP one surviving rank; HSDP a whole shard group ({0, 1}: {2, 3} lost rank 2)
    groups = {tuple(s["savers"]) for s in saved}
    assert len(groups) == 1, [o[1] for o in out]
    savers = list(groups.pop())
    assert FAIL_RANK not in savers and len(saved) == len(savers)
    assert (len(savers) == 1) if layout == "ddp" else (savers == [0, 1]), savers
    step = FAIL_STEP - 1
    assert saved[0]["step"] == step
    mgr = omnickpt.CheckpointManager(str(tmp_path), read_only=True)
    assert mgr.steps() == [0, step] and mgr.latest_step() == step
    expected = out[0][2]
    for got in run_ranks(3, _load, str(tmp_path), step, timeout=300):
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected), "not the state of the newest step"


def test_without_a_complete_replica_nothing_is_saved_and_latest_stays(tmp_path):
    import omnickpt
    out = run_ranks(4, _job, str(tmp_path), "fsdp", timeout=300)
    assert [o[0] for o in out].count("survivor") == 3
    survivors = [o[1] for o in out if o[0] == "survivor"]
    assert all(s["saved"] is False and s["reason"] == "no complete replica survives" for s in survivors)
    assert omnickpt.CheckpointManager(str(tmp_path), read_only=True).steps() == [0]
