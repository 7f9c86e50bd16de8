"""Where a rank sits in the memory tier: its node, its local rank, and the ring of peer replicas
(NodeLayout, pure); which ranks share a machine's memory and the process groups a tiered manager
uses (Placement, learned at its construction).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, Sequence

from omnickpt.storage.shm import shm_dir


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where a rank sits: ranks [k * ranks_per_node, (k + 1) * ranks_per_node) of the manager's
    process group form node k. Peer replicas go around the ring of nodes: rank r's snapshot is kept
    by rank (r + ranks_per_node) % world_size, the same local rank on the next node."""
    world_size: int
    ranks_per_node: int
    rank: int

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} does not divide the world size {self.world_size}; "
                             "pass the number of ranks on each machine (all machines must have the same number)")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node

    def holder_of(self, rank: int) -> int:
        """The rank that keeps `rank`'s replica."""
        return (rank + self.ranks_per_node) % self.world_size

    def source_for(self, rank: int) -> int:
        """The rank whose replica `rank` keeps."""
        return (rank - self.ranks_per_node) % self.world_size


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the ranks of a TieredCheckpointManager sit, as its construction learned it (one
    all-gather): the node layout, the manager's process group and its node's (`node_group`), the
    background group of peer transfers (`side`, None without peer replicas), every rank's global
    rank, the lowest rank on each machine (`machine_leaders`: each owns the job's folder there),
    whether this rank is one, and the nodes whose memory this machine holds."""
    layout: NodeLayout
    group: Any
    node_group: Any
    side: Any
    global_ranks: tuple[int, ...]
    machine_leaders: tuple[int, ...]
    machine_leader: bool
    nodes_here: tuple[int, ...]


def machines(places: Sequence[str], rank: int, ranks_per_node: int) -> tuple[tuple[int, ...], bool, tuple[int, ...]]:
    """From every rank's memory_place() (pure): the machine leaders (the lowest rank of each
    machine), whether `rank` is one, and the nodes whose memory `rank`'s machine holds."""
    first: dict[str, int] = {}
    for r, p in enumerate(places):
        first.setdefault(p, r)
    leaders = tuple(sorted(first.values()))
    here = tuple(sorted({r // ranks_per_node for r, p in enumerate(places) if p == places[rank]}))
    return leaders, first[places[rank]] == rank, here


def memory_place() -> str:
    """Which shared memory this process sees: the same string for the processes of one machine
    (one tmpfs at $OMNICKPT_SHM_DIR or /dev/shm/omnickpt), another for any other machine."""
    base = shm_dir()
    os.makedirs(base, exist_ok=True)
    st = os.stat(base)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{st.st_dev}:{st.st_ino}"


def local_world_size(world: int) -> int:
    """Ranks per machine: $LOCAL_WORLD_SIZE when it divides the world, else the whole world."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return world
    return n if 0 < n <= world and world % n == 0 else world


def global_ranks(group: Any, world: int) -> list[int]:
    import torch.distributed as dist
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return list(range(world))
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def new_group(ranks: list[int], parent: Any, world: int, backend: str | None = None, *,
              timeout: float | None = None) -> Any:
    """A process group of `ranks`. Only its members call it (groups are made locally), so the
    manager's own group may be a sub-group of the world. `timeout` (seconds) bounds each of its
    operations: a peer behind a cut link sends no reset, and torch's default is 30 minutes."""
    import datetime

    import torch.distributed as dist
    if backend is None:
        backend = dist.get_backend(parent if parent is not None else dist.group.WORLD)
    limit = None if timeout is None else datetime.timedelta(seconds=timeout)
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True, timeout=limit)


def barrier(group: Any) -> None:
    import torch.distributed as dist
    if group is not None:
        dist.barrier(group=group)
