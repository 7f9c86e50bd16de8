"""The Hugging Face `Trainer` saving and resuming through omnickpt: a mixin overriding the Trainer's
checkpoint methods, the one seam the Trainer offers (as DeepSpeed, FSDP and SageMaker paths do inside
it). Imported on its own: `import omnickpt` never imports transformers.

    from omnickpt.integrations.hf_trainer import OmnickptTrainer
    trainer = OmnickptTrainer(model=model, args=args, train_dataset=ds)      # Trainer's arguments
    trainer.train(resume_from_checkpoint=True)

What a checkpoint is. `output_dir/checkpoint-<step>/` holds one omnickpt checkpoint (manifest.json,
data/) with the model, optimizer, LR scheduler, gradient scaler and every rank's RNG streams, each rank
writing its own shards (replicas once), next to the Trainer's own small files: config.json (and the
generation config), the processing class, training_args.bin and trainer_state.json. The folder counts
as a checkpoint once trainer_state.json is there: it is written by the coordinator after the omnickpt
save committed (atomically, by rename), removed first when a save replaces a folder and first when
retention removes one. `trainer.train(resume_from_checkpoint=True)` resumes from the newest such
folder, skipping an interrupted save's; an explicit path to an interrupted one is refused
(NotCommittedError). A folder written by the plain Trainer (model.safetensors, optimizer.pt) still
resumes through the Trainer's own code, so a running job can switch.

Who calls what. The Trainer calls `_save_checkpoint` on every rank at a save step; every rank joins the
omnickpt save (collectives inside), only the main process writes the Trainer's files. The loads are
called by the Trainer on every rank at the points where it loads its own files: the model before
`accelerator.prepare` (after it under FSDP), the optimizer and scheduler after the optimizer exists,
the RNG streams at the start of the resumed epoch (after the skipped batches were drawn).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import shutil
from typing import Any

import torch

from omnickpt.adapters.rng import RNGState
from omnickpt.api import Checkpointer, SaveHandle, default_checkpointer, is_committed
from omnickpt.errors import NotCommittedError, UnsupportedError
from omnickpt.formats import read_manifest
from omnickpt.saving import SaveOptions
from omnickpt.storage import storage_for

from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

log = logging.getLogger("omnickpt")

CHECKPOINT_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")   # the Trainer's own folder naming


def is_complete(folder: str) -> bool:
    """A folder the Trainer can resume from: its trainer_state.json is there (written last)."""
    return os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME))


def is_omnickpt_checkpoint(folder: str) -> bool:
    """A checkpoint folder this integration wrote (committed or not): it holds omnickpt's manifest or
    an omnickpt save's files, as opposed to the plain Trainer's model.safetensors / optimizer.pt."""
    return is_committed(folder) or os.path.isdir(os.path.join(folder, "data"))


def checkpoint_folders(run_dir: str) -> list[tuple[int, str]]:
    """Every `checkpoint-<step>` folder of `run_dir`, complete or not, as (step, path) by step."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        m = CHECKPOINT_DIR.match(name)
        if m and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def last_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint folder of `run_dir` (None if there is none): what
    transformers' `get_last_checkpoint` returns, but never an interrupted save's folder."""
    complete = [path for _, path in checkpoint_folders(run_dir) if _resumable(path)]
    return complete[-1] if complete else None


def _resumable(folder: str) -> bool:
    return is_complete(folder) and (not is_omnickpt_checkpoint(folder) or is_committed(folder))


def remove_checkpoint(folder: str) -> None:
    """Remove a checkpoint folder so that a removal stopped halfway never leaves one that looks
    resumable: trainer_state.json first, then omnickpt's manifest, then the rest."""
    for name in (TRAINER_STATE_NAME, "manifest.json"):
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    shutil.rmtree(folder, ignore_errors=True)


def saved_keys(folder: str) -> set[str]:
    """The state keys an omnickpt checkpoint holds ("model", "optimizer", "rng"...): a checkpoint saved
    with save_only_model=True has the model alone."""
    manifest = read_manifest(storage_for(folder))
    return {name.partition("/")[0] for name in [*manifest.tensors, *manifest.objects]}


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _StateOnly:
    """An object's state_dict()/load_state_dict() and nothing else. The Trainer's scheduler holds
    Accelerate's optimizer wrapper as `.optimizer`; the torch optimizer it wraps is in the state
    already, under its own key, so the scheduler is saved as the Stateful it is and nothing else of it
    is looked into (omnickpt's fence follows such wrappers to the optimizer that steps anyway)."""

    def __init__(self, obj: Any):
        self._obj = obj

    def state_dict(self) -> dict:
        return self._obj.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self._obj.load_state_dict(sd)


class OmnickptTrainerMixin:
    """Put before `Trainer` (or a Trainer subclass such as `Seq2SeqTrainer`, TRL's trainers) in the bases:
    `class MyTrainer(OmnickptTrainerMixin, SFTTrainer)`. Checkpoints are then saved and loaded through
    omnickpt; everything else is the Trainer's.

    omnickpt_options: the omnickpt SaveOptions of every checkpoint save (`SaveOptions(async_save=True)`
    for async saves, `compression=...`, `quantize_optimizer=...`); its `on_commit` is called after this
    integration's own. omnickpt_checkpointer: the Checkpointer to save and load with (its threads,
    staging memory, timeout); by default omnickpt's module-level one.

    Async saves: the save returns after the snapshot; trainer_state.json and retention follow its
    commit. The next save, the end of training (before the best model is loaded or checkpoints
    deleted) and `wait_for_checkpoint()` wait for it.
    """

    def __init__(self, *args: Any, omnickpt_options: SaveOptions | None = None,
                 omnickpt_checkpointer: Checkpointer | None = None, **kwargs: Any):
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(model, "is_distributed_loading_by_transformers", False) and training_args is not None \
                and not training_args.save_only_model:
            # The Trainer refuses checkpoints with optimizer state for a model sharded at load time
            # (`from_pretrained(distributed_config=...)`: FSDP2 / TP DTensors) because its own code
            # cannot save that state; omnickpt's does. It sees save_only_model=True during its
            # checks, a copy of the arguments; the caller's arguments are the ones used after.
            checked = copy.copy(training_args)
            checked.save_only_model = True
            if "args" in kwargs:
                kwargs["args"] = checked
            else:
                args = (args[0], checked, *args[2:])
            super().__init__(*args, **kwargs)
            self.args = training_args
        else:
            super().__init__(*args, **kwargs)
        self.omnickpt_options = omnickpt_options or SaveOptions()
        self._omnickpt = omnickpt_checkpointer
        self._omnickpt_pending: SaveHandle | None = None
        if self.is_deepspeed_enabled or self.is_fsdp_xla_enabled:
            raise UnsupportedError(
                f"{type(self).__name__}: DeepSpeed and XLA FSDP keep their state in their own engines, which "
                "omnickpt does not save; use the plain Trainer's checkpoints with them")
        if getattr(self.args, "save_on_each_node", False):
            raise UnsupportedError(
                "save_on_each_node=True: omnickpt writes one checkpoint whose shards every rank writes, so "
                f"{self.args.output_dir} must be one file system all nodes share; set save_on_each_node=False")

    # ------------------------------------------------------------------ helpers
    @property
    def checkpointer(self) -> Checkpointer:
        return self._omnickpt if self._omnickpt is not None else default_checkpointer()

    def wait_for_checkpoint(self) -> dict | None:
        """Every rank: wait until the last async checkpoint save is committed (its trainer_state.json
        written, retention applied); returns its report, None if no save is in flight. Raises the
        save's failure."""
        handle, self._omnickpt_pending = self._omnickpt_pending, None
        return handle.wait() if handle is not None else None

    def _omnickpt_optimizer(self) -> torch.optim.Optimizer | None:
        # Accelerate's wrapper delegates to the optimizer it holds; the step hooks of a lazy
        # snapshot and the state installed by a load belong on that one.
        opt = self.optimizer
        return opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt

    def _omnickpt_state(self, model: torch.nn.Module | None = None, training: bool = True) -> dict:
        """What one checkpoint holds, as omnickpt state keys. The model is always there: the
        optimizer's state is keyed by its parameters' names."""
        state: dict[str, Any] = {"model": model if model is not None else self.model}
        if training:
            if self.optimizer is not None:
                state["optimizer"] = self._omnickpt_optimizer()
            if self.lr_scheduler is not None:
                state["scheduler"] = _StateOnly(self.lr_scheduler)
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = RNGState()
        return state

    def _omnickpt_load(self, folder: str, state: dict, keys: list[str]) -> None:
        self.wait_for_checkpoint()   # a save still writing the folder we read
        self.checkpointer.load(folder, state, include=keys)

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Every rank, at a save step (replaces the Trainer's): one omnickpt save of model, optimizer,
        scheduler, scaler and RNG into `checkpoint-<step>`; the main process writes the Trainer's
        files, trainer_state.json once the save committed."""
        self.wait_for_checkpoint()   # one save in flight at a time: retention never races a save
        if self.hp_search_backend is None and trial is None:
            self.store_flos()   # a collective, as in the Trainer
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._note_best_checkpoint(run_dir)
        main = self.args.should_save
        if main:
            os.makedirs(output_dir, exist_ok=True)
            # Replacing a folder (a run resumed from an older step saves the same step again): it
            # stops counting as a checkpoint until this save commits.
            try:
                os.remove(os.path.join(output_dir, TRAINER_STATE_NAME))
            except FileNotFoundError:
                pass
            self._save_trainer_files(output_dir)
            trainer_state = self._trainer_state_json()
        state = self._omnickpt_state(training=not self.args.save_only_model)
        user_on_commit = self.omnickpt_options.on_commit
        best = self.state.best_model_checkpoint
        limit = self.args.save_total_limit

        def on_commit(manifest) -> None:   # the coordinator, once every rank's shards are committed
            if main:
                _write_atomically(os.path.join(output_dir, TRAINER_STATE_NAME), trainer_state)
                rotate(run_dir, limit, keep=[output_dir, best])
            if user_on_commit is not None:
                user_on_commit(manifest)

        options = dataclasses.replace(self.omnickpt_options, on_commit=on_commit)
        handle = self.checkpointer.save(output_dir, state, options=options)
        if options.async_save:
            self._omnickpt_pending = handle

    def _note_best_checkpoint(self, run_dir: str) -> None:
        # As the Trainer does after saving: the best step's folder is recorded once it exists (this
        # save's own folder counts, it is being written).
        if (self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and self.state.best_global_step):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best

    def _save_trainer_files(self, output_dir: str) -> None:
        """The main process: the small files users expect in a checkpoint folder (from_pretrained's
        config, the tokenizer or processor, the training arguments). The weights are omnickpt's."""
        inner = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        generation_config = getattr(inner, "generation_config", None)
        if generation_config is not None and hasattr(inner, "can_generate") and inner.can_generate():
            generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _trainer_state_json(self) -> str:
        """trainer_state.json's text as of this save (the Trainer's state moves on while an async
        save writes), with the stateful callbacks' states, as the Trainer records them."""
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    # ------------------------------------------------------------------ resume
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        """Trainer.train, with `resume_from_checkpoint=True` meaning the newest complete checkpoint of
        `output_dir` (an interrupted save's folder is skipped), an explicit folder checked to be
        complete, and the last async save committed before it returns."""
        if resume_from_checkpoint is True:
            found = last_checkpoint(self.args.output_dir)
            if found is None:
                raise NotCommittedError(
                    f"resume_from_checkpoint=True: no complete checkpoint-<step> folder in {self.args.output_dir} "
                    f"(folders there: {[p for _, p in checkpoint_folders(self.args.output_dir)]}); start without "
                    "resume_from_checkpoint or pass a folder")
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, str) and not _resumable(resume_from_checkpoint):
            raise NotCommittedError(
                f"{resume_from_checkpoint} is not a complete checkpoint (no {TRAINER_STATE_NAME}, or its omnickpt "
                "save never committed: an interrupted save); the newest complete one in its folder is "
                f"{last_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))}")
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self.wait_for_checkpoint()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if not is_omnickpt_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._omnickpt_load(resume_from_checkpoint, {"model": model if model is not None else self.model}, ["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_omnickpt_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = self._omnickpt_state()
        # As the Trainer does when optimizer.pt is missing (save_only_model=True): nothing to load.
        keys = [k for k in ("optimizer", "scheduler", "scaler") if k in state and k in saved_keys(checkpoint)]
        if keys:
            self._omnickpt_load(checkpoint, state, keys)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_omnickpt_checkpoint(checkpoint):
            return super()._load_scaler(checkpoint)
        # loaded with the optimizer (_load_optimizer_and_scheduler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_omnickpt_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)
        if "rng" not in saved_keys(checkpoint):
            log.info("omnickpt: %s holds no RNG state (saved with save_only_model=True); resuming without it",
                     checkpoint)
            return
        self._omnickpt_load(checkpoint, {"rng": RNGState()}, ["rng"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not is_omnickpt_checkpoint(best):
            return super()._load_best_model()
        self._omnickpt_load(best, {"model": self.model}, ["model"])

    def _finalize_training(self, *args: Any, **kwargs: Any):
        # It loads the best model and may delete the last checkpoint: that save must be committed first.
        self.wait_for_checkpoint()
        return super()._finalize_training(*args, **kwargs)


def rotate(run_dir: str, limit: int | None, keep: list[str | None]) -> None:
    """The coordinator, after a commit: `save_total_limit` as the Trainer applies it, counting
    complete checkpoints only (an interrupted save's folder is left for the save of its step to
    replace), by step, never removing `keep` (this save's folder, the best model's)."""
    if limit is None or limit <= 0:
        return
    protected = {os.path.abspath(p) for p in keep if p}
    complete = [path for _, path in checkpoint_folders(run_dir) if is_complete(path)]
    excess = len(complete) - max(limit, len(protected))
    for path in complete:
        if excess <= 0:
            break
        if os.path.abspath(path) not in protected:
            remove_checkpoint(path)
            excess -= 1


class OmnickptTrainer(OmnickptTrainerMixin, Trainer):
    """transformers.Trainer whose checkpoints are omnickpt's (see OmnickptTrainerMixin)."""
