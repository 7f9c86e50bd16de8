"""omnickpt: save and load the whole training state of PyTorch models at any parallel layout.

Reading and checking checkpoints needs no model; each command of the `omnickpt` command line is one
of these functions (the command only parses arguments and prints):

    omnickpt.open(path)         the reader of tensors, boxes and objects (its type: CheckpointReader)
    omnickpt.describe(path)     what a checkpoint holds, as data            `omnickpt inspect --json`
    omnickpt.verify(path)       completeness and every checksum             `omnickpt verify`
    omnickpt.diff(a, b)         what differs between two checkpoints        `omnickpt diff`
    omnickpt.read_report(path)  a save's per-rank phase timings             `omnickpt report`

The public names are imported on first use (PEP 562), not by `import omnickpt`: importing torch and
the save and load machinery takes seconds, and the command line (`omnickpt --help`, `clear-memory`)
or a tool that only names an error class should not pay for it. `from omnickpt import save`,
`omnickpt.save` and `import *` work as with plain imports; `_PUBLIC` says where each name lives.
"""
import importlib as _importlib

from omnickpt.version import __version__  # noqa: F401  (no imports of its own: cheap)

# public name -> (module, attribute there). Kept in the order of __all__'s groups.
_PUBLIC: dict[str, tuple[str, str]] = {
    # saving and loading in a training job
    "Checkpointer": ("omnickpt.api", "Checkpointer"),
    "CheckpointManager": ("omnickpt.manager", "CheckpointManager"),
    "LoadOptions": ("omnickpt.loading", "LoadOptions"),
    "LoadResult": ("omnickpt.api", "LoadResult"),
    "ManagerOptions": ("omnickpt.manager", "ManagerOptions"),
    "MemoryTierOptions": ("omnickpt.memory.manager", "MemoryTierOptions"),
    "SaveHandle": ("omnickpt.api", "SaveHandle"),
    "SaveHandleProtocol": ("omnickpt.api", "SaveHandleProtocol"),
    "SaveOptions": ("omnickpt.saving", "SaveOptions"),
    "ShardSpec": ("omnickpt.spec", "ShardSpec"),
    "TieredCheckpointManager": ("omnickpt.memory.manager", "TieredCheckpointManager"),
    "clear_memory": ("omnickpt.storage.shm", "clear_memory"),
    "is_committed": ("omnickpt.api", "is_committed"),
    "load": ("omnickpt.api", "load"),
    "memory_usage": ("omnickpt.storage.shm", "memory_usage"),
    "read_manifest": ("omnickpt.api", "read_manifest"),
    "save": ("omnickpt.api", "save"),
    # state that is not a module or an optimizer
    "DataParallelStateful": ("omnickpt.data", "DataParallelStateful"),
    "PackedTokenLoader": ("omnickpt.data", "PackedTokenLoader"),
    "RNGState": ("omnickpt.adapters.rng", "RNGState"),
    "ReshardableSampler": ("omnickpt.data", "ReshardableSampler"),
    # reading and checking a checkpoint
    "CheckpointReader": ("omnickpt.reader", "CheckpointReader"),
    "describe": ("omnickpt.contents", "describe"),
    "diff": ("omnickpt.compare", "diff"),
    "read_report": ("omnickpt.reader", "read_report"),
    "verify": ("omnickpt.integrity", "verify"),
    # errors
    "CheckpointError": ("omnickpt.errors", "CheckpointError"),
    "CheckpointLockedError": ("omnickpt.errors", "CheckpointLockedError"),
    "CheckpointTimeoutError": ("omnickpt.errors", "CheckpointTimeoutError"),
    "CorruptCheckpointError": ("omnickpt.errors", "CorruptCheckpointError"),
    "MismatchError": ("omnickpt.errors", "MismatchError"),
    "NotCommittedError": ("omnickpt.errors", "NotCommittedError"),
    "PlanError": ("omnickpt.errors", "PlanError"),
    "StorageError": ("omnickpt.errors", "StorageError"),
    "UnsafeCheckpointError": ("omnickpt.errors", "UnsafeCheckpointError"),
    "UnsupportedError": ("omnickpt.errors", "UnsupportedError"),
}

# `omnickpt.open(path)` is the reader class itself, as safetensors.safe_open is: one concept, called `open`,
# typed `CheckpointReader`. Left out of __all__ so that `import *` never shadows the builtin open.
_ALIASES: dict[str, tuple[str, str]] = {"open": ("omnickpt.reader", "CheckpointReader")}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    """Import a public name's module on first use and keep the value here, so later lookups are plain
    attribute reads. A name that is no public one is tried as a submodule (`omnickpt.export` after a
    bare `import omnickpt`, as the eager imports used to make it available)."""
    where = _PUBLIC.get(name) or _ALIASES.get(name)
    if where is not None:
        value = getattr(_importlib.import_module(where[0]), where[1])
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":   # the submodule exists and an import inside it failed
                raise
    raise AttributeError(f"module 'omnickpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_ALIASES))
