"""omnickpt: save and load the whole training state of PyTorch models at any parallel layout."""
from omnickpt.version import __version__  # noqa: E402,F401

from omnickpt.adapters.rng import RNGState  # noqa: E402
from omnickpt.data import DataParallelStateful, PackedTokenLoader, ReshardableSampler  # noqa: E402
from omnickpt.api import Checkpointer, LoadResult, SaveHandle, is_committed, load, read_manifest, save  # noqa: E402
from omnickpt.errors import (  # noqa: E402
    CheckpointError, CheckpointLockedError, CheckpointTimeoutError, CorruptCheckpointError, MismatchError,
    NotCommittedError, PlanError,
    StorageError, UnsafeCheckpointError, UnsupportedError)
from omnickpt.manager import CheckpointManager  # noqa: E402
from omnickpt.tiered import MemoryTierOptions, TieredCheckpointManager  # noqa: E402
# `omnickpt.open(path)` (like safetensors.safe_open); left out of __all__ so `import *` never shadows the builtin.
from omnickpt.reader import CheckpointReader, open_checkpoint as open  # noqa: E402,A001,F401
from omnickpt.spec import ShardSpec  # noqa: E402
from omnickpt.storage.shm import clear_memory, memory_usage  # noqa: E402
from omnickpt.cli.verify import verify  # noqa: E402  (the CLI's `omnickpt verify PATH`, as a function)

__all__ = [
    "CheckpointError", "CheckpointLockedError", "CheckpointManager", "CheckpointReader", "CheckpointTimeoutError", "Checkpointer", "CorruptCheckpointError",
    "DataParallelStateful", "LoadResult", "MemoryTierOptions", "MismatchError", "NotCommittedError", "PackedTokenLoader", "PlanError", "RNGState",
    "ReshardableSampler", "SaveHandle", "ShardSpec", "StorageError", "TieredCheckpointManager",
    "UnsafeCheckpointError", "clear_memory", "memory_usage", "UnsupportedError", "is_committed", "load", "read_manifest", "save",
    "verify",
]
