"""`omnickpt.dcp`: save, async_save and load shaped as `torch.distributed.checkpoint`'s, so that code
written for DCP switches with one import and can switch back:

    import torch.distributed.checkpoint as dcp        ->        from omnickpt import dcp

The calls take what DCP's take (a state dict whose values may be Stateful, `checkpoint_id=`,
`process_group=`; async_save's return types) and keep DCP's key semantics on both sides:

- save: each Stateful value's `state_dict()` is saved (a module's, an optimizer's, an
  `AppState` calling `get_state_dict`), under the caller's keys: tensors named by their path
  (`model/layers.0.wq.weight`, `optimizer/state/fc.weight/exp_avg`), DTensors as their shards, plain
  tensors taken to be the same on every rank and saved once (DCP's rule), everything else as values.
  The data is omnickpt's format: checksummed, committed all or nothing, resharded on load.
- load: fills the caller's state dict in place (DTensors and tensors copied into, other values
  written back, each Stateful's `load_state_dict` called with what was loaded into its
  `state_dict()`), at any world size and layout. It reads checkpoints written by `omnickpt.dcp.save`,
  PyTorch DCP folders as they are (`.metadata`: under DCP's own keys, so the very state dict
  `dcp.load` accepts loads them), omnickpt checkpoints saved with modules and optimizers (their
  tensors are named as `get_model_state_dict` / `get_optimizer_state_dict` name them) and Hugging
  Face folders (`{"model": {name: tensor}}`).
- back to DCP: `omnickpt convert CKPT OUT --to dcp` (omnickpt.export.export_dcp) writes a DCP
  folder with the same keys, which `dcp.load` reads exactly.

What differs from DCP, on purpose: storage writers, readers and planners are omnickpt's own (a DCP
`FileSystemWriter`/`FileSystemReader` given instead of `checkpoint_id` is accepted for its path; other
storage layers and custom planners are refused by name), `checkpoint_id` may be any URL omnickpt writes
(`s3://`, `shm://`, fsspec), an async save's futures resolve to omnickpt's save report, and an async
save copies what it saves before it returns (the staging-complete signal is then already set), since a
state dict of tensors holds no optimizer whose step could wait for a lazy copy.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

# The names DCP code reaches through its module besides the three calls, so that `dcp.FileSystemWriter(path)`,
# `dcp.DefaultLoadPlanner(allow_partial_load=True)` or `dcp.stateful.Stateful` keep working after the switch:
# torch's own classes (save and load accept them as described).
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader,  # noqa: F401
                                          FileSystemWriter, stateful)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse  # noqa: F401
from torch.distributed.checkpoint.stateful import Stateful  # noqa: F401

from omnickpt.adapters.generic import GenericAdapter
from omnickpt.api import Checkpointer, LoadResult, default_checkpointer
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.loading import LoadOptions
from omnickpt.saving import SaveOptions

# DCP's rule for what is not a DTensor: the same on every rank, saved once. Modules and optimizers are
# Stateful here, as in DCP: their state_dict() is what is saved.
ADAPTERS = (GenericAdapter(replicated=True),)


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None, storage_writer: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False, use_collectives: bool = True,
         checkpointer: Checkpointer | None = None) -> dict:
    """`dcp.save`: every rank of `process_group` saves `state_dict` to `checkpoint_id`, committed when
    this returns. Returns the save's report (DCP returns its Metadata; `omnickpt.open(path).manifest`
    is ours). `checkpointer=` (omnickpt's): the threads and staging memory to use (default: the
    process's)."""
    path = _path(checkpoint_id, storage_writer, "storage_writer")
    group = _group(process_group, no_dist, planner, "save")
    handle = (checkpointer or default_checkpointer()).save(
        path, state_dict, options=SaveOptions(process_group=group, adapters=ADAPTERS))
    return handle.wait()


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None, no_dist: bool = False,
               use_collectives: bool = True, checkpointer: Checkpointer | None = None) -> Any:
    """`dcp.async_save`: returns once `state_dict` is copied to host memory; the checkpoint is written and
    committed in the background. Returns a `concurrent.futures.Future` that resolves to the save's
    report once committed (and raises the save's error), or, when `async_stager` is given (DCP's way of
    asking for the staging signal), DCP's `AsyncSaveResponse(staging_completion, upload_completion)`.
    `async_checkpointer_type` is accepted and ignored: omnickpt writes from background threads of this
    process. The future is resolved by the training process's own thread pool: call `result()` before
    the next save of the same path, and before the process exits."""
    path = _path(checkpoint_id, storage_writer, "storage_writer")
    group = _group(process_group, no_dist, planner, "save")
    ckpt = checkpointer or default_checkpointer()
    handle = ckpt.save(path, state_dict, options=SaveOptions(async_save=True, snapshot="eager", process_group=group,
                                                             adapters=ADAPTERS))
    upload = _future_of(handle)
    if async_stager is None:
        return upload
    staged: Future = Future()
    staged.set_result(None)    # an eager snapshot: everything is copied when async_save returns
    return AsyncSaveResponse(staging_completion=staged, upload_completion=upload)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None, storage_reader: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False,
         checkpointer: Checkpointer | None = None) -> LoadResult:
    """`dcp.load`: every rank of `process_group` loads the checkpoint at `checkpoint_id` into `state_dict`
    in place, resharding to this layout. An entry of `state_dict` the checkpoint lacks, or one of another
    shape or dtype, is a MismatchError naming it (DCP's default); entries of the checkpoint the state
    dict does not ask for are left (as DCP does). A planner with `allow_partial_load=True` loads what
    matches and reports the rest in the result's `.differences`. Returns omnickpt's LoadResult (DCP
    returns None)."""
    path = _path(checkpoint_id, storage_reader, "storage_reader")
    group = _group(process_group, no_dist, planner, "load")
    partial = bool(getattr(planner, "allow_partial_load", False))
    options = LoadOptions(process_group=group, adapters=ADAPTERS, names="as_saved", strict=not partial)
    return (checkpointer or default_checkpointer()).load(path, state_dict, options=options)


def _path(checkpoint_id: Any, storage: Any, argument: str) -> str:
    """The checkpoint's location: `checkpoint_id`, or the path of a DCP FileSystemWriter/Reader."""
    if storage is not None:
        found = getattr(storage, "path", None) or getattr(storage, "checkpoint_id", None)
        name = type(storage).__name__
        if found is None or name not in ("FileSystemWriter", "FileSystemReader"):
            raise UnsupportedError(
                f"{argument}={name}: omnickpt.dcp writes and reads with omnickpt's own storage (local paths, "
                "s3://, shm://, fsspec URLs); pass checkpoint_id=<path or URL> instead, or use "
                "torch.distributed.checkpoint for this storage layer")
        if checkpoint_id is not None and os.fspath(checkpoint_id) != os.fspath(found):
            raise ValueError(f"checkpoint_id={os.fspath(checkpoint_id)!r} and {argument}'s path {os.fspath(found)!r} "
                             "differ; give one of them")
        checkpoint_id = found
    if checkpoint_id is None:
        raise ValueError("checkpoint_id is required: the folder or URL of the checkpoint")
    return os.fspath(checkpoint_id)


def _group(process_group: Any, no_dist: bool, planner: Any, action: str) -> Any:
    """The process group to use; refuses what omnickpt.dcp cannot honour, by name."""
    if planner is not None:
        kind = type(planner).__name__
        if kind not in ("DefaultSavePlanner", "DefaultLoadPlanner"):
            raise UnsupportedError(f"planner={kind}: omnickpt plans {action}s itself (and reshards on load); a custom "
                                   "DCP planner cannot run inside it. Transform the state dict before the call, "
                                   "or use torch.distributed.checkpoint with this planner")
    if no_dist:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise UnsupportedError(f"no_dist=True with {dist.get_world_size()} initialised ranks: omnickpt.dcp "
                                   f"{action}s with the process group; pass process_group= for a subset of ranks")
    return process_group


def _future_of(handle: Any) -> Future:
    """A Future that resolves to the save's report once committed (or to its error)."""
    out: Future = Future()

    def settle() -> None:
        try:
            out.set_result(handle.wait())
        except CheckpointError as e:
            out.set_exception(e)
        except BaseException as e:   # never leave the caller's result() waiting forever
            out.set_exception(e)

    import threading
    # wait() from another thread leaves the lazy-snapshot hooks alone (there are none: eager) and waits
    # for the commit; the caller's result() then returns it.
    threading.Thread(target=settle, name="omnickpt-dcp-future", daemon=True).start()
    return out


__all__ = ["ADAPTERS", "AsyncCheckpointerType", "AsyncSaveResponse", "DefaultLoadPlanner", "DefaultSavePlanner",
           "FileSystemReader", "FileSystemWriter", "Stateful", "async_save", "load", "save"]
