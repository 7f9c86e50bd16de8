"""The fence of a lazy snapshot: training goes on while a save copies the state in the background,
and whatever would change a tensor not yet copied waits for the copy first.

What changes a training state's tensors, and when:
- parameters and optimizer moments: only an optimizer's step() (forward and backward read
  parameters and write gradients and activations, which a checkpoint does not hold). A step
  pre-hook on every optimizer of the state holds the step until the copy is done;
- buffers (BatchNorm running statistics), plain tensors in user dicts, small values: anything, at
  any time, including forward. They are copied before save() returns (eagerly), as is any tensor
  whose storage is not a parameter's or an optimizer state's;
- the user's own code that edits parameters in place outside the optimizer (weight surgery, EMA
  written into the model, `p.data.copy_`): nothing can see it. Such code calls `handle.fence()` first,
  or saves with snapshot="eager".

The fence is released from the snapshot's thread; the hooks stay registered until the training
thread removes them (at the next save or load, or in wait()/fence()), because removing a hook from
another thread could change the hook dict while an optimizer iterates it.
"""
from __future__ import annotations

import threading
from typing import Any, Iterable

import torch
from torch import nn

from omnickpt.errors import CheckpointError


def optimizers_in(state: dict) -> list[torch.optim.Optimizer]:
    """Every torch optimizer in `state` (top level and in dicts/lists), and the torch optimizer
    inside wrappers that hold one as `.optimizer` (Megatron's), each once."""
    found: dict[int, torch.optim.Optimizer] = {}

    def visit(v: Any, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(v, torch.optim.Optimizer):
            found.setdefault(id(v), v)
        elif isinstance(getattr(v, "optimizer", None), torch.optim.Optimizer):
            found.setdefault(id(v.optimizer), v.optimizer)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x, depth + 1)
    visit(state, 0)
    return list(found.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, else `t`. The shard itself, not to_local()/detach(): those
    dispatch through DTensor (tens of microseconds each, seconds for 10^4 parameters), and only the
    storage's address is wanted."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _modules_in(state: dict) -> Iterable[nn.Module]:
    for v in state.values():
        if isinstance(v, nn.Module):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (m for m in v if isinstance(m, nn.Module))


def step_stable_storages(state: dict) -> set[int]:
    """Addresses of the storages that only an optimizer step changes: the local data of every
    parameter of the state's modules and every tensor of its optimizers' states. A saved shard whose
    storage is one of these may be copied lazily; anything else is copied before save() returns."""
    out: set[int] = set()
    for module in _modules_in(state):
        for p in module.parameters():
            out.add(_local(p).untyped_storage().data_ptr())
    for opt in optimizers_in(state):
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:   # a step count changes every step: eager
                    out.add(_local(v).untyped_storage().data_ptr())
    return out


class SnapshotFence:
    """Holds every optimizer's step() until `release()`; `wait()` waits for the same thing."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], what: str):
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.wait()

    def release(self, error: BaseException | None = None) -> None:
        """The snapshot's thread: the copy is done (or failed: the step may go on either way, the
        save reports its own failure)."""
        self._error = error
        self._done.set()

    @property
    def released(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise CheckpointError(f"{self.what}: the background snapshot did not finish within {timeout:.0f} s; "
                                  "the storage or the host may be stalled (see the save's error, or raise timeout=)")

    def remove(self, timeout: float | None = None) -> None:
        """The training thread, once released: take the hooks off the optimizers."""
        self.wait(timeout)
        for h in self._hooks:
            h.remove()
        self._hooks = []
