"""Coordination over torch.distributed: the few object collectives the planner and the commit need.

Works without a process group too (one process = rank 0 of 1). Every collective is counted, so
tests can prove that a cached plan skips the planning exchange.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


class Comm:
    def __init__(self, group: Any = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None else (dist.group.WORLD if self.distributed else None)
        if self.distributed:
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the process group it was given")
        else:
            self.rank, self.world_size = 0, 1
        self.collectives = 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` at the coordinator (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """The coordinator's objs[r] on rank r."""
        if self.world_size == 1:
            return objs[0]
        self.collectives += 1
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, group=self.group, group_src=0)
        return out[0]

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        self.collectives += 1
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            self.collectives += 1
            dist.barrier(group=self.group)
