"""The options of a TieredCheckpointManager's memory tier (MemoryTierOptions: one frozen value,
checked when built) and how the manager's keywords split into them and the manager's own
ManagerOptions (tiered_options)."""
from __future__ import annotations

import dataclasses

from omnickpt.errors import UnsupportedError
from omnickpt.manager import MANAGER_OPTIONS, ManagerOptions

ON_CLOSE = ("remove", "keep_latest")


@dataclasses.dataclass(frozen=True)
class MemoryTierOptions:
    """The memory tier of a TieredCheckpointManager (checked when built):

    - url: `shm://JOB`, the job's memory (letters, digits, `.`, `_`, `-`).
    - memory_keep: complete steps kept in memory per node (plus one still being copied to `root`).
    - persist_every: copy every N-th save to `root`. A save due for copying first waits for the
      previous copy (so at most one is in flight): pick N so that a copy finishes within N saves.
    - ranks_per_node: ranks per machine (default $LOCAL_WORLD_SIZE, else the whole group). Each
      node keeps a complete checkpoint of its own ranks, so a restore reads tensors from local
      memory only.
    - peer_replicas: also send each node's snapshot to the next node (rank r -> r + ranks_per_node),
      which keeps it in its memory; a node whose memory is lost restores from that peer.
    - persist_on_failure: on SIGTERM (handler installed by the manager, the previous one restored
      by close()) or an exception leaving `with manager:`, the newest memory step is copied to
      `root` first.
    - on_close: what a clean close() leaves in shared memory once `root` holds the newest step:
      "remove" (nothing) or "keep_latest" (the newest step, for a restart on the same machine).
      A step `root` lacks is always kept. omnickpt.storage.shm.clear_memory("JOB")
      (`omnickpt clear-memory JOB`) removes it all.
    - flush_timeout: seconds a flush on failure waits for the other ranks' copies.
    """
    url: str
    memory_keep: int = 1
    persist_every: int = 1
    ranks_per_node: int | None = None
    peer_replicas: bool = False
    persist_on_failure: bool = True
    on_close: str = "remove"
    flush_timeout: float = 120.0

    def __post_init__(self):
        if not str(self.url).startswith("shm://"):
            raise ValueError(f"memory={self.url!r}: the memory tier is host shared memory, give it as shm://JOBNAME")
        if self.memory_keep < 1 or self.persist_every < 1:
            raise ValueError("memory_keep and persist_every must be at least 1")
        if self.on_close not in ON_CLOSE:
            raise ValueError(f"on_close={self.on_close!r}: must be one of {ON_CLOSE}")


def tiered_options(memory: str | MemoryTierOptions, options: ManagerOptions | None,
                   keywords: dict) -> tuple[MemoryTierOptions, ManagerOptions]:
    """A TieredCheckpointManager's keywords split: the memory tier's (MemoryTierOptions' fields, or
    `memory` itself as one) and the manager's (ManagerOptions' fields, or `options`); each given
    one way only. Incremental saves and read_only are refused."""
    mine = {k: keywords.pop(k) for k in list(keywords) if k in MANAGER_OPTIONS}
    if (mine.pop("incremental", False) or {"full_every", "block_bytes"} & set(mine)
            or (options is not None and options.incremental)):
        raise UnsupportedError("incremental=True with a memory tier: the memory tier keeps whole steps in shared "
                               "memory; use incremental saves on a CheckpointManager without memory=")
    if isinstance(memory, MemoryTierOptions):
        if keywords:
            raise TypeError(f"memory=MemoryTierOptions(...) carries the memory tier's options; do not also pass "
                            f"{sorted(keywords)}")
    else:
        memory = MemoryTierOptions(url=memory, **keywords)
    if options is not None and mine:
        raise TypeError(f"options=ManagerOptions(...) carries the manager's options; do not also pass {sorted(mine)}")
    manager = options if options is not None else ManagerOptions(**mine)
    if manager.read_only:
        raise ValueError("read_only=True cannot have a memory tier (it writes shared memory); list or load the "
                         "durable root with a read-only manager of its own")
    return memory, manager
