"""Dataloader state across DCP, and the loader's own data-parallel rank (issue 19).

torchtitan's ParallelAwareDataloader (a torchdata StatefulDataLoader) knows its dp rank and size; under
tensor/pipeline/context parallelism they are not the global rank and world size. Its state_dict() is
{"dp_rank_<r>": <pickled loader state>, "world_size": <dp size>}: DCP stores one value per key, so every
dp rank's position survives in one DCP value. These tests use the real torchtitan class.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

import omnickpt
from dist import run_ranks

torchtitan_dataloader = pytest.importorskip("torchtitan.components.dataloader")


class Numbers(IterableDataset):
    """0, 1, 2, ... for dp rank r of n: every n-th number from r (its own stream), resumable."""

    def __init__(self, dp_rank: int, dp_size: int):
        self.dp_rank, self.dp_size, self.i = dp_rank, dp_size, 0

    def __iter__(self):
        while True:
            self.i += 1    # before the yield: a snapshot taken after it counts the item as consumed
            yield torch.tensor([self.dp_rank + self.dp_size * (self.i - 1)])

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _loader(dp_rank: int, dp_size: int):
    return torchtitan_dataloader.ParallelAwareDataloader(Numbers(dp_rank, dp_size), dp_rank, dp_size, batch_size=2)


def _take(loader, it, n):
    return [next(it).tolist() for _ in range(n)]


def _tensor_parallel_pair(rank, world_size, path):
    """Two ranks of one tensor-parallel group: one data-parallel rank (0 of 1), the same batches."""
    loader = _loader(0, 1)
    it = iter(loader)
    _take(loader, it, 3)
    omnickpt.save(path, {"loader": loader}).wait()
    return _take(loader, it, 2)


def _resume_one_rank(rank, world_size, path):
    loader = _loader(0, 1)
    omnickpt.load(path, {"loader": loader})
    return _take(loader, iter(loader), 2)


def test_the_loaders_own_dp_rank_is_what_is_saved(tmp_path):
    path = str(tmp_path / "ckpt")
    following = run_ranks(2, _tensor_parallel_pair, path)
    assert following[0] == following[1]
    saved = omnickpt.open(path).objects(["loader"], all_ranks=True)["loader"]
    assert {(v["dp_rank"], v["dp_size"]) for v in saved.values()} == {(0, 1)}   # not the global ranks 0, 1 of 2
    # at 1 rank (DP size 1, as saved): the position carries over exactly
    assert run_ranks(1, _resume_one_rank, path)[0] == following[0]


def _across_dcp(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from omnickpt.export.dcp import export_dcp
    loader = _loader(rank, world_size)
    it = iter(loader)
    _take(loader, it, 3)
    dcp.save({"dataloader": loader}, checkpoint_id=f"{root}/dcp")
    omnickpt.save(f"{root}/omni", {"dataloader": loader}).wait()
    if rank == 0:
        export_dcp(f"{root}/omni", f"{root}/export", progress=False)
    torch.distributed.barrier()
    want = _take(loader, it, 2)
    # DCP -> omnickpt: torchtitan's DCP checkpoint resumed through omnickpt's DataLoaderAdapter
    from_dcp = _loader(rank, world_size)
    omnickpt.load(f"{root}/dcp", {"dataloader": from_dcp})
    # omnickpt -> DCP: the export loads with dcp.load into the loader (its load_state_dict picks its dp rank)
    from_export = _loader(rank, world_size)
    dcp.load({"dataloader": from_export}, checkpoint_id=f"{root}/export")
    return want, _take(from_dcp, iter(from_dcp), 2), _take(from_export, iter(from_export), 2)


def test_dataloader_state_crosses_to_and_from_dcp(tmp_path):
    for rank, (want, from_dcp, from_export) in enumerate(run_ranks(2, _across_dcp, str(tmp_path))):
        assert from_dcp == want, rank
        assert from_export == want, rank
        assert want[0][0][0] % 2 == rank   # each rank its own stream: the test can tell the ranks apart
