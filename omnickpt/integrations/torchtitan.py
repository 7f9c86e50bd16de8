"""omnickpt as torchtitan's checkpointer: a manager for torchtitan 0.3's `BaseCheckpointManager` seam.

    from omnickpt.integrations.torchtitan import OmnickptCheckpointManager
    config.checkpoint = OmnickptCheckpointManager.Config(enable=True, interval=500, async_mode="async")

The trainer builds it exactly as it builds its DCP `CheckpointManager` (`config.checkpoint.build(
dataloader=..., model_parts=..., optimizers=..., lr_schedulers=..., states={"train_state": trainer},
sd_adapter=..., base_folder=...)`) and calls the same five methods: load(step), save(step, last_step),
maybe_wait_for_staging() (before every optimizer step), maybe_wait_for_saving(), close().

Layout of `<dump_folder>/<folder>` (docs/integrations/torchtitan.md):

    global_step_N/      omnickpt checkpoints this manager writes (an omnickpt CheckpointManager root:
                        `latest`, owner lease, retention of keep_latest_k among these folders only)
    step-N/             DCP checkpoints torchtitan's own manager wrote (never written nor deleted here),
                        and the Hugging Face export of the last step (last_save_in_hf)

Auto-resume (load(-1)) takes the newest committed step of either kind (omnickpt's on a tie): an
omnickpt folder counts once its manifest is there, a DCP folder once its `.metadata` is (DCP writes
it last). A job switching from torchtitan's manager to this one resumes from its DCP steps; its
next saves are omnickpt's.

The state saved is torchtitan's, under torchtitan's keys: "model" (the one model part: omnickpt
reshards its DTensors at load), "optimizer" (the OptimizersContainer: flat, FQN-keyed), "lr_scheduler",
"dataloader" (per data-parallel rank, by the loader's own dp_rank), "train_state" and whatever else
the trainer put in `states`. Importing this module imports torchtitan; importing omnickpt does not.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import os
import re
import time
from concurrent.futures import Future
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer.base import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, BaseCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP

import omnickpt
from omnickpt.errors import CheckpointError, NotCommittedError, UnsupportedError
from omnickpt.format import MANIFEST_NAME
from omnickpt.formats import read_manifest
from omnickpt.steps import committed_steps, step_dir
from omnickpt.storage import storage_for

log = logging.getLogger("omnickpt")

DCP_STEP = re.compile(r"^step-(\d+)$")   # torchtitan's DCP manager's step folders
DCP_METADATA = ".metadata"               # written last by DCP: its folder's commit
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


@dataclasses.dataclass(frozen=True)
class FoundStep:
    """A resumable step in the checkpoint folder: `kind` "omnickpt" (global_step_N) or "dcp" (step-N)."""
    step: int
    kind: str
    path: str


def find_steps(folder: str) -> list[FoundStep]:
    """Every committed step in `folder` (local or remote: omnickpt's storage), oldest first; where both
    kinds hold a step, omnickpt's only. Uncommitted folders (no manifest, no `.metadata`: a save that
    was interrupted) are never listed."""
    storage = storage_for(folder)
    found: dict[int, FoundStep] = {}
    for name in storage.children(""):
        m = DCP_STEP.match(name)
        if m and storage.exists(f"{name}/{DCP_METADATA}"):
            found[int(m.group(1))] = FoundStep(int(m.group(1)), "dcp", f"{folder}/{name}")
    for step in committed_steps(storage):
        found[step] = FoundStep(step, "omnickpt", f"{folder}/{step_dir(step)}")
    return [found[s] for s in sorted(found)]


class CastModel(nn.Module):
    """A model as its floating-point tensors in `dtype` (export_dtype), for a save: the same names, the
    same sharding (DTensors cast shard by shard), read through the module's own state_dict() (its
    hooks included). The model is not a submodule: names keep no prefix."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self._model, self._dtype = [model], dtype

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        return {k: v.to(self._dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self._model[0].state_dict(*args, **kwargs).items()}


class OmnickptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saved and loaded by omnickpt (see the module docstring).

    What differs from torchtitan's DCP CheckpointManager: steps are written as `global_step_N`
    (omnickpt checkpoints; DCP `step-N` folders in the same folder are found and loaded too, never
    deleted); async saves return after a memory copy of what training can change at any time, the
    parameters and optimizer state being copied in the background while the next optimizer step
    waits (maybe_wait_for_staging() waits for that copy); loads reshard to any world size and layout
    (the dataloader excepted); keep_latest_k retires only this manager's folders; the last step's
    model-only save is an omnickpt checkpoint too, and its HF export (last_save_in_hf) a
    safetensors folder at `step-N`.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"disabled": every save completes in save(). "async" and "async_with_pinned_mem" (the same here:
        omnickpt stages into its own reused host buffers): save() returns after the stall, the write
        and commit run in the background and the next save (or close()) waits for them."""

        timeout: float = 600.0
        """Seconds any rank waits for the others (a save's commit, a load's phases) before raising
        CheckpointTimeoutError naming the ranks that did not come."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = str(self.async_mode).lower()
            if mode not in ASYNC_MODES:
                raise ValueError(f"checkpoint.async_mode={self.async_mode!r}: expected one of {', '.join(ASYNC_MODES)}")
            self.async_mode = mode
            if self.initial_load_in_hf_quantized:
                raise ValueError("checkpoint.initial_load_in_hf_quantized: OmnickptCheckpointManager does not read "
                                 "quantized HF checkpoints; use torchtitan's CheckpointManager for that first load")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        if len(model_parts) != 1:
            raise UnsupportedError(
                f"OmnickptCheckpointManager: {len(model_parts)} model parts on this rank (pipeline parallel with "
                "several stages per rank); it saves one model part per rank. Use torchtitan's CheckpointManager "
                "for such schedules")
        self.model = model_parts[0]
        self.optimizers, self.lr_schedulers, self.dataloader = optimizers, lr_schedulers, dataloader
        self.states = states
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but the model has no state dict adapter (sd_adapter)")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.async_save = config.async_mode != "disabled"
        self._ckpt = omnickpt.Checkpointer(timeout=config.timeout)
        # keep_latest_k=0 keeps everything (torchtitan's meaning); retention retires global_step_N only
        self._manager = omnickpt.CheckpointManager(self.folder, checkpointer=self._ckpt,
                                                   keep_last=config.keep_latest_k or None,
                                                   read_only=config.load_only)
        self._handle = None   # the async save in flight, whose snapshot maybe_wait_for_staging() waits for
        self.loaded: FoundStep | None = None   # what the last load() restored (None: a fresh start)
        log.info("omnickpt: checkpointing active; checkpoints are loaded from and saved to %s", self.folder)

    def __del__(self):
        # as torchtitan's managers do; the trainer's own close() has normally run (then this does nothing)
        try:
            self.close()
        except Exception as e:  # noqa: BLE001  (nobody can catch it here; an omnickpt exit hook finishes saves)
            log.warning("omnickpt: closing the torchtitan checkpoint manager of %s at collection: %s",
                        getattr(self, "folder", "?"), e)

    # ------------------------------------------------------------------ the state
    def _state(self, model_only: bool = False, excluded: tuple[str, ...] = ()) -> dict[str, Any]:
        """torchtitan's state under torchtitan's keys (the DCP manager's), without `excluded`."""
        if model_only:
            return {MODEL: self.model}
        state = {MODEL: self.model, OPTIMIZER: self.optimizers, LR_SCHEDULER: self.lr_schedulers}
        if self.dataloader is not None:
            # a StatefulDataLoader: saved per data-parallel rank, by the loader's own dp_rank (adapters/dataloader.py)
            state[DATALOADER] = self.dataloader
        state.update(self.states)
        for key in excluded:
            if key not in state:
                raise ValueError(f"checkpoint.exclude_from_loading names {key!r}, which is not in the state "
                                 f"(its keys: {', '.join(sorted(state))})")
        return {k: v for k, v in state.items() if k not in excluded}

    # ------------------------------------------------------------------ saving
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Every rank, after each training step (torchtitan's trainer calls it): saves the steps due."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        if last_step and self.config.last_save_model_only:
            self._save_last_step(curr_step)
        else:
            # the last step saves synchronously, as torchtitan's: the job ends right after it
            asynchronous = self.async_save and not last_step
            handle = self._manager.save(curr_step, self._state(), async_save=asynchronous)
            if asynchronous:
                self._handle = handle
                self.save_future = Future()   # completed by maybe_wait_for_saving()
        log.info("omnickpt: %s step %d in %.2f s", "staged" if self._handle is not None else "saved", curr_step,
                 time.monotonic() - begin)
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The model only, in export_dtype, as global_step_N; with last_save_in_hf also a Hugging Face
        folder `step-N` made from it through the model's state dict adapter."""
        casts = any(t.is_floating_point() and t.dtype != self.export_dtype
                    for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        state = {MODEL: CastModel(self.model, self.export_dtype) if casts else self.model}
        self._manager.save(curr_step, state).wait()
        if self.config.last_save_in_hf:
            self._export_hf(self._manager.step_path(curr_step), f"{self.folder}/step-{curr_step}")

    def _export_hf(self, src: str, dst: str) -> None:
        """The coordinator writes `dst` from the model-only checkpoint `src`, each group of tensors renamed
        and laid out by the model's sd_adapter.to_hf (q/k rows permuted for RoPE, as HF stores them)."""
        from omnickpt.export import hf as hf_export
        if "mapping" not in inspect.signature(hf_export.export_hf).parameters:
            raise UnsupportedError(
                f"last_save_in_hf: this omnickpt's export_hf() takes no mapping= (a model's own name and layout "
                f"mapping), so {dst} cannot be written through the model's state dict adapter; the model-only "
                f"checkpoint is at {src} (convert it once omnickpt has it: `omnickpt convert {src} {dst} --to hf`)")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        error = None
        if rank == 0:
            try:
                hf_export.export_hf(src, dst, key=MODEL, mapping=self.sd_adapter.to_hf)
            except Exception as e:  # noqa: BLE001  (raised on every rank below, not left to hang the others)
                error = e
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            failed = [error is not None]
            torch.distributed.broadcast_object_list(failed, src=0)
            if failed[0] and error is None:
                raise CheckpointError(f"last_save_in_hf: rank 0 failed to export {src} to {dst} (see its log)")
        if error is not None:
            raise error

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Every rank, before training: resume from `step` of the folder (-1: the newest of either kind),
        else start from initial_load_path (omnickpt, DCP or, with initial_load_in_hf, Hugging Face),
        else a fresh start (False)."""
        found = {s.step: s for s in find_steps(self.folder)}
        if step != -1:
            if step not in found:
                raise NotCommittedError(
                    f"checkpoint.load_step={step}: {self.folder} holds no committed step {step} (committed: "
                    f"{sorted(found) or 'none'}; omnickpt's global_step_N with {MANIFEST_NAME}, DCP's step-N with "
                    f"{DCP_METADATA})")
            chosen = found[step]
        elif found:
            chosen = found[max(found)]
        else:
            return self._initial_load()
        begin = time.monotonic()
        # step 0 is torchtitan's seed checkpoint (the model only); a final model-only save holds no optimizer
        model_only = chosen.step == 0 or self._model_only(chosen)
        self._load_path(chosen.path, model_only, cast=model_only,
                        step=chosen.step if chosen.kind == "omnickpt" else None)
        self.loaded = chosen
        log.info("omnickpt: loaded step %d (%s, %s) in %.2f s", chosen.step, chosen.kind, chosen.path,
                 time.monotonic() - begin)
        return True

    def _model_only(self, found: FoundStep) -> bool:
        """Whether `found` holds the model and nothing else (a last step saved with last_save_model_only)."""
        manifest = read_manifest(storage_for(found.path))
        keys = set(manifest.objects) | {name.split("/", 1)[0] for name in manifest.tensors}
        return keys <= {MODEL}

    def _initial_load(self) -> bool:
        path = self.config.initial_load_path
        if path is None and self.config.initial_load_in_hf and self.sd_adapter is not None:
            path = self.sd_adapter.hf_assets_path   # torchtitan's fallback: the model's HF assets folder
        if not path:
            log.info("omnickpt: no checkpoint in %s and no initial_load_path: a fresh start", self.folder)
            return False
        if not storage_for(path).children(""):
            raise NotCommittedError(f"checkpoint.initial_load_path={path!r} is missing or empty (expected an "
                                    "omnickpt, DCP or, with initial_load_in_hf, Hugging Face checkpoint folder)")
        if self.config.initial_load_in_hf:
            self._load_hf(path)
        else:
            model_only = self.config.initial_load_model_only
            self._load_path(path, model_only, cast=model_only)
        self.loaded = FoundStep(-1, "hf" if self.config.initial_load_in_hf else "initial", path)
        return True

    def _load_path(self, path: str, model_only: bool, cast: bool, step: int | None = None) -> None:
        """Load `path` into the state (the model alone when `model_only`); `step`: it is this manager's
        global_step_N, loaded through the manager (which then knows the step this run resumed from)."""
        excluded = () if model_only else tuple(self.config.exclude_from_loading)
        state = self._state(model_only, excluded)
        # what the checkpoint holds beyond the state (the optimizer of a model-only load, excluded
        # entries) is left where it is; what the state has and the checkpoint lacks is an error
        selection = [f"{k}" for k in state] + [f"{k}/*" for k in state]
        try:
            if step is None:
                self._ckpt.load(path, state, include=selection, cast=cast)
            else:
                self._manager.load(step, state, include=selection, cast=cast)
        except UnsupportedError as e:
            if not str(e).startswith(f"{DATALOADER}:"):
                raise
            raise UnsupportedError(f"{e}. With torchtitan: checkpoint.exclude_from_loading=[{DATALOADER!r}] starts "
                                   "the data over") from e

    def _load_hf(self, path: str) -> None:
        """Hugging Face safetensors into the model, through its state dict adapter: the native state dict's
        tensors renamed by to_hf, filled from `path`, then mapped back by from_hf and loaded."""
        if self.sd_adapter is None:
            raise CheckpointError(f"checkpoint.initial_load_in_hf: the model has no state dict adapter to read "
                                  f"{path} with")
        hf_sd = self.sd_adapter.to_hf(self.model.state_dict())
        self._ckpt.load(path, {MODEL: hf_sd})   # a flat dict: each tensor filled from the one of its name
        self.model.load_state_dict(self.sd_adapter.from_hf(hf_sd))

    # ------------------------------------------------------------------ waiting and closing
    def _maybe_wait_for_staging(self) -> None:
        """The training thread, before the optimizer step: the async save's snapshot is complete (the
        lazy snapshot's fence: after it the step may change parameters and optimizer state)."""
        handle = self._handle
        if handle is not None:
            handle.fence()

    def _wait_for_saving(self) -> None:
        """The async save in flight is committed (its failure raised here)."""
        future, self.save_future, self._handle = self.save_future, None, None
        try:
            report = self._manager.wait()
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(report)

    def _close(self) -> None:
        """Every rank: the save in flight is committed (its failure raised), then the threads and the
        root's owner lease are given back. Later calls do nothing."""
        if getattr(self, "_manager", None) is None:
            return
        try:
            if self.save_future is not None:
                self._wait_for_saving()
            self._manager.close()
        finally:
            self._manager = None
            self._ckpt.close()
