"""The memory tier's mechanics, kept under this name for code that imports it from here. They live in
the omnickpt.memory package now: NodeLayout in omnickpt/memory/layout.py; MemoryTier, is_complete and
the folder names (NODE_DIR, TIER_FILE, REPLICAS, RESTORE, PREVIOUS) in memory/tier.py; transfer_files
in memory/transfer.py; Candidate, restore_candidates and choose_restore in memory/restore.py;
persist_rank, copy_file, commit_durable and merge_node_manifests in memory/durable.py.
"""
from omnickpt.memory.durable import commit_durable, copy_file, merge_node_manifests, persist_rank  # noqa: F401
from omnickpt.memory.layout import NodeLayout  # noqa: F401
from omnickpt.memory.restore import Candidate, choose_restore, restore_candidates  # noqa: F401
from omnickpt.memory.tier import (NODE_DIR, PREVIOUS, REPLICAS, RESTORE, TIER_FILE, MemoryTier,  # noqa: F401
                                  is_complete)
from omnickpt.memory.transfer import transfer_files  # noqa: F401

__all__ = ["NODE_DIR", "PREVIOUS", "REPLICAS", "RESTORE", "TIER_FILE", "Candidate", "MemoryTier", "NodeLayout",
           "choose_restore", "commit_durable", "copy_file", "is_complete", "merge_node_manifests", "persist_rank",
           "restore_candidates", "transfer_files"]
