"""The memory tier: host shared memory in front of a durable checkpoint root (docs/memory_tier.md).

    manager.py    TieredCheckpointManager: the policy (when to save to memory, copy to root, flush,
                  what to leave at close), composed of a StepRoot, a SaveLoop and the parts below
    options.py    MemoryTierOptions: the tier's options, one frozen value
    handle.py     TieredSave: the handle of a save to the tier (done, wait, fence, wait_memory)
    tier.py       MemoryTier: one rank's view of the job's shared memory (folders, scanning, retention,
                  the merged restore view, peer replicas)
    layout.py     NodeLayout: which node a rank is on, the ring of peer replicas
    transfer.py   transfer_files: node files sent between ranks, straight into mapped memory
    restore.py    Candidate, restore_candidates, choose_restore: what load_latest() restores from (pure);
                  MemoryRestore: the restore itself, from memory or root
    durable.py    persist_rank, copy_file, commit_durable, merge_node_manifests: the durable copy
"""
from omnickpt.memory.durable import commit_durable, copy_file, merge_node_manifests, persist_rank  # noqa: F401
from omnickpt.memory.layout import NodeLayout  # noqa: F401
from omnickpt.memory.handle import TieredSave  # noqa: F401
from omnickpt.memory.manager import TieredCheckpointManager  # noqa: F401
from omnickpt.memory.options import MemoryTierOptions  # noqa: F401
from omnickpt.memory.restore import Candidate, MemoryRestore, choose_restore, restore_candidates  # noqa: F401
from omnickpt.memory.tier import MemoryTier  # noqa: F401
from omnickpt.memory.transfer import transfer_files  # noqa: F401

__all__ = ["Candidate", "MemoryRestore", "MemoryTier", "MemoryTierOptions", "NodeLayout", "TieredCheckpointManager",
           "TieredSave", "choose_restore", "commit_durable", "copy_file", "merge_node_manifests", "persist_rank",
           "restore_candidates", "transfer_files"]
