"""What a floating-point dtype cast loses beyond rounding, counted per tensor, refused unless allowed.

A cast to a narrower dtype rounds every value (expected: that is what the cast is for) but can also
turn a finite value into inf (overflow: 1e6 in float16; NaN in float8_e4m3fn, which has no inf) or a
non-zero value into 0 (flush: 1e-9 in float16, float32 subnormals in bfloat16). Those two change what
a model computes, not how precisely, so the exporters (convert --to omnickpt / hf) refuse them by
default, naming the tensor, and with `allow=True` cast anyway and report the counts.

    losses = CastLosses(allow=False)
    out = losses.cast(t, torch.float16, "model/w")   # UnsupportedError when something overflows or flushes
    losses.counts                                    # with allow=True: {"model/w": {"overflow": 3, "flush": 0}}

A cast of a whole checkpoint never touches an optimizer's bookkeeping (`keeps_dtype`): its step
counts and its other 0-dim state stay as saved, only weights and per-element floating state are cast.

Thread-safe (the exporters cast on worker threads); no module state.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from omnickpt.errors import UnsupportedError

ALLOW_FLAG = "allow_lossy_cast=True (--allow-lossy-cast)"


class CastLosses:
    """Casts tensors and counts, per tensor name, the values a cast overflowed or flushed."""

    def __init__(self, allow: bool = False):
        self.allow = allow
        self.counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def cast(self, t: torch.Tensor, dtype: torch.dtype, name: str, where: str = "") -> torch.Tensor:
        """`t` cast to `dtype`, checked (see `check`)."""
        out = t.to(dtype)
        self.check(t, out, name, where)
        return out

    def check(self, before: torch.Tensor, after: torch.Tensor, name: str, where: str = "") -> None:
        """Count what the cast `before` -> `after` overflowed (finite -> inf) and flushed (non-zero ->
        0). Raises UnsupportedError naming `name` (and `where`, the part of it, when given) unless
        constructed with allow=True; with it, the counts add up in `counts`."""
        if after.dtype == before.dtype or not (before.dtype.is_floating_point and after.dtype.is_floating_point):
            return
        overflow, flush = lost(before, after)
        if not (overflow or flush):
            return
        if not self.allow:
            raise UnsupportedError(f"{name}{f' ({where})' if where else ''}: casting {_short(before.dtype)} to "
                                   f"{_short(after.dtype)} would {describe(overflow, flush)}; keep the dtype, or pass "
                                   f"{ALLOW_FLAG} to cast anyway (the summary lists what was lost)")
        with self._lock:
            seen = self.counts.setdefault(name, {"overflow": 0, "flush": 0})
            seen["overflow"] += overflow
            seen["flush"] += flush


def keeps_dtype(name: str, shape: Sequence[int]) -> bool:
    """Whether a dtype cast of a checkpoint (convert --dtype) leaves tensor `name` of `shape` as saved:
    an optimizer's step count (state key "step", whatever its shape) or any other 0-dim optimizer
    state. Every reader names optimizer state "<key>/state/<parameter>/<state key>" (the optimizer
    adapter, DCP, Megatron); a module's tensor is "<key>/<dotted name>", and is cast."""
    # torch.optim keeps `step` as a float tensor, and counts are what a narrow float cannot hold:
    # float16 counts past 2048 by 2, bfloat16 past 256, so Adam's bias correction 1 - beta ** step
    # would resume from another step (torch's own Optimizer.load_state_dict never casts `step`).
    # The other scalars (ASGD's eta / mu, NAdam's mu_product, a product over every step so far)
    # carry precision the update formulas need, and casting a scalar saves nothing.
    parts = name.split("/")
    if len(parts) < 4 or parts[-3] != "state":
        return False
    return parts[-1] == "step" or len(shape) == 0


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def lost(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """(finite values of `before` that are not finite in `after`, non-zero values that are 0 in it)."""
    # Counts, not masks: a cast never makes a non-finite value finite nor a zero non-zero, so the
    # differences of the counts are the values lost (and no mask the size of the tensor is kept).
    overflow = int((~torch.isfinite(after)).sum()) - int((~torch.isfinite(before)).sum())
    flush = int((after == 0).sum()) - int((before == 0).sum())
    return overflow, flush


def describe(overflow: int, flush: int) -> str:
    parts = ([f"turn {overflow} finite value(s) into inf (overflow)"] if overflow else []) + (
        [f"turn {flush} non-zero value(s) into 0 (flush)"] if flush else [])
    return " and ".join(parts)


__all__ = ["ALLOW_FLAG", "CastLosses", "describe", "keeps_dtype", "lost"]
