"""omnickpt for a live DeepSpeedEngine: the whole training state of an engine as one state dict.

    state = engine_state(engine, client_state={"epoch": 3})
    omnickpt.save("ckpt/step_100", state, async_save=True)      # or CheckpointManager(...).save(step, state)
    ...
    state = engine_state(engine, client_state={"epoch": 0})
    omnickpt.load("ckpt/step_100", state)                        # state["epoch"] == 3 again

The engine and its optimizer go through the DeepSpeed adapters (omnickpt/adapters/deepspeed.py):
each rank saves its fp32 partitions, no gather, and a checkpoint loads at another data-parallel
size, another ZeRO stage, or into FSDP2 / a plain module and torch optimizer. The rest of what
engine.save_checkpoint keeps is here: the lr scheduler, the engine's step counters and the loss
scaler (`EngineCounters`), and the user's client state. `save_checkpoint` / `load_checkpoint` are
the engine's own two calls with omnickpt underneath. Importing this module does not import deepspeed.
"""
from __future__ import annotations

from typing import Any

from omnickpt.adapters.deepspeed import is_engine
from omnickpt.errors import UnsupportedError

# The keys engine_state gives the engine's own parts; client state may use any other key.
RESERVED = ("model", "optimizer", "lr_scheduler", "deepspeed")

_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# FP16_UnfusedOptimizer (ZeRO-0 with bf16/fp16) keeps its loss scaling in its own attributes, not in a loss_scaler
_UNFUSED_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_loss_scale")


class EngineCounters:
    """A Stateful over what engine.save_checkpoint records of the engine itself: its step counters
    and the loss scaler's state (scale, iteration, hysteresis...: its plain scalar attributes)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def _scaler(self) -> tuple[Any, tuple[str, ...] | None]:
        """(object holding the loss-scaling state, the attributes that are it; None: every scalar one)."""
        opt = getattr(self.engine, "optimizer", None)
        scaler = getattr(opt, "loss_scaler", None)
        if scaler is not None:
            return scaler, None
        if opt is not None and hasattr(opt, "cur_scale"):
            return opt, _UNFUSED_SCALER
        return None, ()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self.engine, k) for k in _COUNTERS if hasattr(self.engine, k)}
        scaler, names = self._scaler()
        if scaler is not None:
            items = vars(scaler).items() if names is None else ((n, getattr(scaler, n, None)) for n in names)
            out["loss_scaler"] = {k: v for k, v in items if isinstance(v, (bool, int, float)) and not k.startswith("_")}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in _COUNTERS:
            if k in sd:
                setattr(self.engine, k, sd[k])
        scaler, _ = self._scaler()
        if scaler is not None:
            for k, v in (sd.get("loss_scaler") or {}).items():
                if hasattr(scaler, k):
                    setattr(scaler, k, v)


def engine_state(engine: Any, client_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict of a DeepSpeedEngine for omnickpt.save / load / CheckpointManager: {"model":
    engine, "optimizer": engine.optimizer (if any), "lr_scheduler": engine.lr_scheduler (if set),
    "deepspeed": EngineCounters(engine)} plus the entries of `client_state`. Loading the same dict
    restores all of it; client values that are plain values are written back into the returned dict
    (read them from it, not from `client_state`)."""
    if not is_engine(engine):
        raise TypeError(f"engine_state takes a DeepSpeedEngine, got {type(engine).__name__}")
    state: dict[str, Any] = {"model": engine}
    if getattr(engine, "optimizer", None) is not None:
        state["optimizer"] = engine.optimizer
    if getattr(engine, "lr_scheduler", None) is not None:
        state["lr_scheduler"] = engine.lr_scheduler
    state["deepspeed"] = EngineCounters(engine)
    clash = sorted(set(client_state or {}) & set(RESERVED))
    if clash:
        raise UnsupportedError(f"client_state key(s) {clash} are the engine's own entries ({', '.join(RESERVED)}); "
                               "rename them")
    state.update(client_state or {})
    return state


def save_checkpoint(engine: Any, path: str, client_state: dict[str, Any] | None = None, **save_kwargs: Any):
    """engine.save_checkpoint through omnickpt: every rank calls it; returns omnickpt.save's handle
    (save_kwargs such as async_save=True go to omnickpt.save)."""
    from omnickpt.api import save
    return save(path, engine_state(engine, client_state), **save_kwargs)


def load_checkpoint(engine: Any, path: str, **load_kwargs: Any) -> dict[str, Any]:
    """engine.load_checkpoint through omnickpt: loads the engine, its optimizer, scheduler and counters
    in place and returns the client state saved with them (as a dict). Every rank calls it."""
    from omnickpt.api import load
    from omnickpt.reader import CheckpointReader
    reader = CheckpointReader(path)
    try:
        keys = {name.split("/", 1)[0] for name in list(reader.manifest.objects) + list(reader.manifest.tensors)}
    finally:
        close = getattr(reader, "close", None)
        if callable(close):
            close()
    client = {k: None for k in sorted(keys - set(RESERVED))}
    state = engine_state(engine, client)
    load(path, state, **load_kwargs)
    return {k: state[k] for k in client}


__all__ = ["EngineCounters", "RESERVED", "engine_state", "load_checkpoint", "save_checkpoint"]
