"""omnickpt inside PyTorch Lightning: strategies whose checkpoints are omnickpt folders.

Lightning hands a strategy the whole checkpoint dict (`Trainer.save_checkpoint` ->
`Strategy.save_checkpoint`); its `CheckpointIO` plugins only ever see rank 0's copy of it, and its
sharded strategies write DCP with a writer of their own. So the seam is the strategy: the classes
here are Lightning's own strategies with `save_checkpoint`, `load_checkpoint` and
`remove_checkpoint` going through omnickpt.

    trainer = L.Trainer(strategy=OmnickptDDPStrategy(async_save=True), accelerator="cpu", devices=2,
                        callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path="last")

What goes where in a checkpoint folder (a "file" to Lightning: `ckpts/last.ckpt/` is a directory):
- `"state_dict"` is the live LightningModule and `"optimizer_i"` the live optimizers: every rank
  saves its own shards (no gather to rank 0), and a load reshards them to the loading job's layout
  and world size (FSDP2 2 ranks -> one process, DDP -> FSDP2...);
- `"lightning"` holds everything else of Lightning's dict as a plain value (loops, callbacks with
  ModelCheckpoint's state, lr_schedulers, hyper_parameters, epoch, global_step, version, what
  `on_save_checkpoint` hooks added);
- the manifest's metadata says how many optimizers were saved (none for `save_weights_only`).
`load_checkpoint` loads module and optimizers in place (the strategy restores after setup, when the
optimizers exist) and gives Lightning back its dict: the plain part as saved, `"state_dict"` and
`"optimizer_states"` as the loaded objects' own state dicts.

An async save (async_save=True) returns after its snapshot; the strategy waits for it before its
next save, load or removal, and at teardown. This module imports Lightning; `import omnickpt` does not.
"""
from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from omnickpt.api import Checkpointer, SaveHandle, is_committed
from omnickpt.errors import CheckpointError, MismatchError, NotCommittedError, UnsupportedError, rebuild_error
from omnickpt.loading import LoadOptions
from omnickpt.reader import CheckpointReader
from omnickpt.saving import SaveOptions
from omnickpt.steps import remove_step
from omnickpt.storage import storage_for

__all__ = ["OmnickptCheckpointing", "OmnickptDDPStrategy", "OmnickptModelParallelStrategy",
           "OmnickptSingleDeviceStrategy"]

MODULE_KEY = "state_dict"          # Lightning's name for the model's entry, kept as the state key
PLAIN_KEY = "lightning"            # the rest of Lightning's dict, one plain value
METADATA_KEY = "lightning"         # in the manifest's metadata: {"optimizers": n}


def _optimizer_key(i: int) -> str:
    return f"optimizer_{i}"


class OmnickptCheckpointing:
    """The checkpoint methods of the Omnickpt*Strategy classes: put it before a Lightning strategy
    class in the bases (`class S(OmnickptCheckpointing, DDPStrategy)`).

    async_save: saves return after the snapshot and write in the background (omnickpt.save).
    allow_pickle: values of Lightning's dict that are not plain data (objects in hyper_parameters,
        a callback's custom state) are pickled; loading them then needs allow_pickle=True too.
    save_options / load_options: any other omnickpt option (compression, quantize_optimizer,
        cast, transforms...), as a SaveOptions / LoadOptions.
    checkpointer: an omnickpt Checkpointer to use (and leave open); by default the strategy makes
        one at its first save or load and closes it at teardown.
    """

    def __init__(self, *args: Any, async_save: bool = False, allow_pickle: bool = False,
                 save_options: SaveOptions | None = None, load_options: LoadOptions | None = None,
                 checkpointer: Checkpointer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_options = save_options or SaveOptions()
        self.async_save = async_save or self.save_options.async_save
        self.allow_pickle = allow_pickle or self.save_options.allow_pickle
        self.load_options = load_options or LoadOptions()
        self._own_checkpointer = checkpointer is None
        self._checkpointer = checkpointer
        self._pending: SaveHandle | None = None
        # The dict lightning_module_state_dict() last returned: save_checkpoint recognises it in the
        # checkpoint and saves the live module in its place.
        self._module_state: dict | None = None
        # True while the checkpoint being restored was loaded by omnickpt (module and optimizers are
        # in place already); False for a torch file, which Lightning's own restore handles.
        self._restored_by_omnickpt = False

    # ------------------------------------------------------------------ what Lightning's dict holds
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's own state_dict(): references to its (local shards of) tensors, no gather, no
        copy (ModelParallelStrategy's would gather or copy to CPU). save_checkpoint saves the module."""
        assert self.lightning_module is not None
        self._module_state = self.lightning_module.state_dict()
        return self._module_state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's own state_dict() (references, no consolidation): save_checkpoint saves the
        optimizer itself."""
        return getattr(optimizer, "_optimizer", optimizer).state_dict()

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank (Trainer.save_checkpoint calls it on all). Saves `checkpoint` as an omnickpt
        folder at `filepath` (rank 0's path): the module and optimizers through their adapters, each
        rank its own shards; the rest as one plain value. Waits first for this strategy's previous
        async save. Collectives: one broadcast (the path) and omnickpt.save's."""
        if storage_options is not None:
            raise UnsupportedError(f"{type(self).__name__}.save_checkpoint(storage_options=...): omnickpt does not "
                                   "use Lightning's CheckpointIO; pass omnickpt's options as "
                                   "save_options=SaveOptions(...)")
        path = str(self.broadcast(os.fspath(filepath)))
        self.finish_saves()
        state, optimizers = self._state_to_save(checkpoint, path)
        if self.is_global_zero and os.path.isfile(path):
            os.remove(path)   # a torch .ckpt file of an earlier run under the same name, replaced as Lightning does
        # Async only while a fit runs: a save after it (trainer.save_checkpoint("final.ckpt")) would
        # otherwise still be writing when the caller reads it, with no teardown left to wait for it.
        async_save = self.async_save and self.lightning_module.trainer.state.status == TrainerStatus.RUNNING
        self._pending = self._ckpt().save(path, state, options=self.save_options, async_save=async_save,
                                          allow_pickle=self.allow_pickle,
                                          metadata={**(self.save_options.metadata or {}),
                                                    METADATA_KEY: {"optimizers": optimizers}})
        if not async_save:
            self._pending.wait()
            self._pending = None

    def _state_to_save(self, checkpoint: dict[str, Any], path: str) -> tuple[dict[str, Any], int]:
        """omnickpt's state for Lightning's `checkpoint`, and how many optimizers it holds. The
        module's entry must be the dict this strategy produced: tensors a hook added to it or put in
        its place would be lost silently (the live module is what is saved), so that is refused."""
        plain = {k: v for k, v in checkpoint.items() if k not in (MODULE_KEY, "optimizer_states")}
        state: dict[str, Any] = {}
        if MODULE_KEY in checkpoint:
            module_state = checkpoint[MODULE_KEY]
            if module_state is not self._module_state or module_state.keys() != self._module_state_keys():
                raise UnsupportedError(
                    f"saving {path}: checkpoint['state_dict'] is not the dict this strategy's "
                    "lightning_module_state_dict() made for this save (an on_save_checkpoint hook replaced or changed "
                    "it, or the dict was not built by Trainer.save_checkpoint); omnickpt saves the live module, so "
                    "change the module itself, or keep extra tensors under another key of the checkpoint")
            state[MODULE_KEY] = self.lightning_module
        optimizer_states = checkpoint.get("optimizer_states", [])
        if optimizer_states and len(optimizer_states) != len(self.optimizers):
            raise UnsupportedError(f"saving {path}: checkpoint['optimizer_states'] holds {len(optimizer_states)} "
                                   f"entries for the strategy's {len(self.optimizers)} optimizers")
        for i, optimizer in enumerate(self.optimizers if optimizer_states else []):
            state[_optimizer_key(i)] = getattr(optimizer, "_optimizer", optimizer)
        state[PLAIN_KEY] = plain
        self._module_state = None   # the references it held are not kept past the save
        return state, len(optimizer_states)

    def _module_state_keys(self):
        return self.lightning_module.state_dict().keys()

    def finish_saves(self) -> None:
        """Every rank: wait for this strategy's async save still in flight (its failure is raised
        here, on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    # ------------------------------------------------------------------ load
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # omnickpt loads into the optimizers, which exist only after setup (and into the module as
        # wrapped or sharded for this job's layout)
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False if self._restored_by_omnickpt else super().lightning_restore_optimizer

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank. An omnickpt folder: loads the module and (when fitting) the optimizers in
        place, resharding to this job's layout, and returns Lightning's dict as saved (with
        "state_dict" and "optimizer_states" the loaded objects' state dicts). Anything else (a
        Lightning .ckpt file, a DCP folder of ModelParallelStrategy) is loaded by the Lightning
        strategy this one extends."""
        path = str(self.broadcast(os.fspath(checkpoint_path)))
        self.finish_saves()
        if not is_committed(path):
            self._restored_by_omnickpt = False
            if os.path.isdir(path) and not os.path.exists(os.path.join(path, "meta.pt")):
                # neither ours nor Lightning's DCP folder: say so before Lightning tries to unpickle a directory
                raise NotCommittedError(f"{path} is a folder without a committed omnickpt checkpoint (no manifest: an "
                                        "interrupted or failed save) and not a Lightning DCP checkpoint; resume "
                                        "from an earlier checkpoint")
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = self._saved_optimizers(path)
        state: dict[str, Any] = {MODULE_KEY: self.lightning_module, PLAIN_KEY: None}
        fitting = bool(self.optimizers) and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and saved:
            if saved != len(self.optimizers):
                raise MismatchError(f"{path} holds the state of {saved} optimizers; this LightningModule's "
                                    f"configure_optimizers() made {len(self.optimizers)}",
                                    [f"optimizers: {saved} saved, {len(self.optimizers)} here"])
            for i, optimizer in enumerate(self.optimizers):
                state[_optimizer_key(i)] = getattr(optimizer, "_optimizer", optimizer)
        # what this job does not restore (the optimizers when validating, testing, predicting)
        skipped = [_optimizer_key(i) for i in range(saved) if _optimizer_key(i) not in state]
        strict = self.lightning_module.strict_loading
        self._ckpt().load(path, state, options=self.load_options, allow_pickle=self.allow_pickle,
                          strict=strict, exclude=[*self.load_options.exclude, *skipped])
        self._restored_by_omnickpt = True
        checkpoint = dict(state[PLAIN_KEY])
        checkpoint[MODULE_KEY] = self.lightning_module.state_dict()
        if fitting and saved:
            checkpoint["optimizer_states"] = [o.state_dict() for o in (state[_optimizer_key(i)] for i in range(saved))]
        return checkpoint

    def _saved_optimizers(self, path: str) -> int:
        """How many optimizers the omnickpt folder at `path` holds, or UnsupportedError when it was not
        saved by these strategies. Read on rank 0 only (the manifest can be large); its outcome, a
        failure included, reaches every rank by one broadcast, and every rank raises the same class."""
        outcome: tuple = (None, None, None)
        if self.is_global_zero:
            try:
                with CheckpointReader(path) as reader:
                    meta = reader.layout.get("metadata") or {}
                    keys = set(reader.object_keys())
                count = (meta.get(METADATA_KEY) or {}).get("optimizers") if PLAIN_KEY in keys else None
                outcome = (count, None, None)
            except CheckpointError as e:
                outcome = (None, type(e).__name__, f"rank 0: {e}")
        count, error, message = self.broadcast(outcome)
        if error is not None:
            raise rebuild_error(error, message)
        if not isinstance(count, int):
            raise UnsupportedError(f"{path} is an omnickpt checkpoint but not one saved by a Lightning omnickpt "
                                   f"strategy (no {PLAIN_KEY!r} entry or metadata); load it with omnickpt.load into "
                                   "the module and optimizers yourself")
        return count

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._restored_by_omnickpt:
            super().load_model_state_dict(checkpoint, strict=strict)
        # else: load_checkpoint loaded the module in place already

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._restored_by_omnickpt:
            super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ remove, teardown
    def remove_checkpoint(self, filepath: Any) -> None:
        """Every rank (ModelCheckpoint's retention calls it on all): an async save still writing is
        finished first; rank 0 then removes the folder, manifest first (an interrupted removal leaves
        no folder that looks committed). A file is removed as Lightning would."""
        self.finish_saves()
        path = os.fspath(filepath)
        if not self.is_global_zero:
            return
        if os.path.islink(path):
            os.unlink(path)   # ModelCheckpoint(save_last="link"): the link goes, never what it points to
        elif os.path.isdir(path):
            parent, name = os.path.split(os.path.abspath(path))
            remove_step(storage_for(parent), name)
        else:
            super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Every rank, at the end of fit/validate/test: the async save in flight is committed (its
        failure raised) before Lightning tears the job down; a Checkpointer made here is closed."""
        try:
            self.finish_saves()
        finally:
            if self._own_checkpointer and self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None
            super().teardown()

    def _ckpt(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer()
        return self._checkpointer


class OmnickptDDPStrategy(OmnickptCheckpointing, DDPStrategy):
    """Lightning's DDPStrategy with omnickpt checkpoints (see OmnickptCheckpointing for the options;
    every other argument is DDPStrategy's)."""


class OmnickptModelParallelStrategy(OmnickptCheckpointing, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2 and tensor parallelism applied in configure_model)
    with omnickpt checkpoints: every rank saves its own shards, a load reshards. See
    OmnickptCheckpointing for the options; every other argument is ModelParallelStrategy's
    (save_distributed_checkpoint has no effect: omnickpt always saves shards)."""


class OmnickptSingleDeviceStrategy(OmnickptCheckpointing, SingleDeviceStrategy):
    """Lightning's SingleDeviceStrategy with omnickpt checkpoints: one process, e.g. resuming or
    evaluating a checkpoint saved by a multi-rank job."""
