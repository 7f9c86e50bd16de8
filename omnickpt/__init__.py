"""omnickpt: save and load the whole training state of PyTorch models at any parallel layout.

Reading and checking checkpoints needs no model; each command of the `omnickpt` command line is one
of these functions (the command only parses arguments and prints):

    omnickpt.open(path)         the reader of tensors, boxes and objects (its type: CheckpointReader)
    omnickpt.describe(path)     what a checkpoint holds, as data            `omnickpt inspect --json`
    omnickpt.verify(path)       completeness and every checksum             `omnickpt verify`
    omnickpt.diff(a, b)         what differs between two checkpoints        `omnickpt diff`
    omnickpt.read_report(path)  a save's per-rank phase timings             `omnickpt report`
"""
from omnickpt.version import __version__  # noqa: E402,F401

from omnickpt.adapters.rng import RNGState  # noqa: E402
from omnickpt.data import DataParallelStateful, PackedTokenLoader, ReshardableSampler  # noqa: E402
from omnickpt.api import (Checkpointer, LoadResult, SaveHandle, SaveHandleProtocol, is_committed, load,  # noqa: E402
                          read_manifest, save)
from omnickpt.saving import SaveOptions  # noqa: E402
from omnickpt.loading import LoadOptions  # noqa: E402
from omnickpt.errors import (  # noqa: E402
    CheckpointError, CheckpointLockedError, CheckpointTimeoutError, CorruptCheckpointError, MismatchError,
    NotCommittedError, PlanError,
    StorageError, UnsafeCheckpointError, UnsupportedError)
from omnickpt.manager import CheckpointManager, ManagerOptions  # noqa: E402
from omnickpt.memory.manager import MemoryTierOptions, TieredCheckpointManager  # noqa: E402
from omnickpt.reader import CheckpointReader, read_report  # noqa: E402
# `omnickpt.open(path)` is the reader class itself, as safetensors.safe_open is: one concept, called `open`,
# typed `CheckpointReader`. Left out of __all__ so that `import *` never shadows the builtin open.
from omnickpt.reader import CheckpointReader as open  # noqa: E402,A001,F401
from omnickpt.spec import ShardSpec  # noqa: E402
from omnickpt.storage.shm import clear_memory, memory_usage  # noqa: E402
from omnickpt.contents import describe  # noqa: E402
from omnickpt.compare import diff  # noqa: E402
from omnickpt.integrity import verify  # noqa: E402

__all__ = [
    # saving and loading in a training job
    "Checkpointer", "CheckpointManager", "LoadOptions", "LoadResult", "ManagerOptions", "MemoryTierOptions",
    "SaveHandle", "SaveHandleProtocol", "SaveOptions", "ShardSpec",
    "TieredCheckpointManager", "clear_memory", "is_committed", "load", "memory_usage", "read_manifest", "save",
    # state that is not a module or an optimizer
    "DataParallelStateful", "PackedTokenLoader", "RNGState", "ReshardableSampler",
    # reading and checking a checkpoint (`omnickpt.open` is CheckpointReader, kept out of __all__: see above)
    "CheckpointReader", "describe", "diff", "read_report", "verify",
    # errors
    "CheckpointError", "CheckpointLockedError", "CheckpointTimeoutError", "CorruptCheckpointError", "MismatchError",
    "NotCommittedError", "PlanError", "StorageError", "UnsafeCheckpointError", "UnsupportedError",
]
