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

The same knowledge serves the checkpoint at failure (`StepWatch`, `step_stable_tensors`): the live
parameters and optimizer state are still those of the last save() call exactly when no optimizer
step began since (and no in-place edit moved a tensor's version counter).
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

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
        if isinstance(v, torch.optim.Optimizer) or isinstance(getattr(v, "optimizer", None), torch.optim.Optimizer):
            inner = innermost_optimizer(v)
            found.setdefault(id(inner), inner)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x, depth + 1)
    visit(state, 0)
    return list(found.values())


def innermost_optimizer(v: Any) -> torch.optim.Optimizer:
    """The optimizer that steps, behind wrappers holding it as `.optimizer` (Megatron's, Accelerate's
    AcceleratedOptimizer: an Optimizer subclass that skips Optimizer.__init__, so it has no step hooks
    of its own, and whose step() calls the inner one's)."""
    seen = set()
    while id(v) not in seen:
        seen.add(id(v))
        inner = getattr(v, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        v = inner
    return v


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
    parameter of the state's modules, every parameter its optimizers step (a ZeRO optimizer's inner
    optimizer steps fp32 master partitions that no module holds) and every tensor of its optimizers'
    states. A saved shard whose storage is one of these may be copied lazily; anything else is copied
    before save() returns."""
    out: set[int] = set()
    for module in _modules_in(state):
        for p in module.parameters():
            out.add(_local(p).untyped_storage().data_ptr())
    for opt in optimizers_in(state):
        # the parameters an optimizer steps: those of its groups, and those its state is kept for (ZeRO-3
        # puts each fp32 sub-group into its groups only for the length of its step)
        stepped = [p for group in opt.param_groups for p in group["params"]] + list(opt.state)
        for p in stepped:
            if isinstance(p, torch.Tensor):
                out.add(_local(p).untyped_storage().data_ptr())
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:   # a step count changes every step: eager
                    out.add(_local(v).untyped_storage().data_ptr())
    return out


def step_stable_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The tensors behind `step_stable_storages`, by a readable name ("model/0.weight",
    "model/0.weight/exp_avg"): the parameters of the state's modules and the tensors of its
    optimizers' states, DTensors as themselves (an in-place op on a DTensor moves the version
    counter of the DTensor, not that of its local shard)."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for key, value in state.items():
        modules = [(key, value)] if isinstance(value, nn.Module) else []
        if isinstance(value, (list, tuple)):
            modules = [(f"{key}/{i}", m) for i, m in enumerate(value) if isinstance(m, nn.Module)]
        for prefix, module in modules:
            for name, p in module.named_parameters():
                names.setdefault(id(p), f"{prefix}/{name}")
                out.setdefault(f"{prefix}/{name}", p)
    for i, opt in enumerate(optimizers_in(state)):
        for p, per_param in opt.state.items():
            where = names.get(id(p), f"optimizer{i}/param@{id(p):x}")
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor):
                    out[f"{where}/{k}"] = v
    return out


class StepWatch:
    """Counts the steps of the optimizers it watches that began and that completed (a step
    pre-hook and a post-hook on each). A step that raised never completes: `began > ended`.

    The hooks hold the watch weakly and stay on the optimizers for their life (a dead watch's
    hooks do nothing): removing them from a finalizer could change an optimizer's hook dict while
    it iterates it, the reason SnapshotFence removes its hooks from the training thread only."""

    def __init__(self):
        self.began = 0
        self.ended = 0
        self.last: str | None = None   # the class of the optimizer whose step began last
        self._watched: dict[int, weakref.ref] = {}

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Hook every optimizer not watched yet (cheap for those that are)."""
        for opt in optimizers:
            known = self._watched.get(id(opt))
            if known is not None and known() is opt:
                continue
            me = weakref.ref(self)
            opt.register_step_pre_hook(functools.partial(_step_began, me))
            opt.register_step_post_hook(functools.partial(_step_ended, me))
            self._watched[id(opt)] = weakref.ref(opt)

    def mark(self) -> tuple[int, int]:
        return self.began, self.ended

    def since(self, mark: tuple[int, int], what: str) -> str | None:
        """Why the parameters and optimizer state are no longer those of `mark`, taken at `what`
        (None: no optimizer step began since)."""
        began = self.began - mark[0]
        if began <= 0:
            return None
        if began > self.ended - mark[1]:
            return (f"an optimizer step ({self.last}.step()) began after {what} and did not complete: parameters and "
                    "optimizer state may be half updated")
        return (f"{began} optimizer step(s) ({self.last}.step()) ran after {what}: parameters and optimizer state "
                "are a later step's")


def _step_began(ref: weakref.ref, optimizer, args, kwargs) -> None:
    watch = ref()
    if watch is not None:
        watch.began += 1
        watch.last = type(optimizer).__name__


def _step_ended(ref: weakref.ref, optimizer, args, kwargs) -> None:
    watch = ref()
    if watch is not None:
        watch.ended += 1


class SnapshotFence:
    """Holds every optimizer's step() until `release()`; `wait()` waits for the same thing.

    What the training thread loses to a lazy snapshot is the save's stall plus the time an
    optimizer step waits here for the copy: a copy into staging memory touched for the first time,
    or one that meets a busy machine, moves the save's cost from the save() call to the next step.
    That wait is counted (`held_s`; `on_held(seconds, start)` as it ends), so that a report's stall
    is not a lazy snapshot's whole cost. It is measured up to the release: the snapshot's thread
    knows when the copy ended, and a waiter woken later is late by the scheduler, not by the save."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], what: str,
                 on_held: Callable[[float, float], None] | None = None):
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]
        self._pid = os.getpid()
        self.held_s = 0.0                      # seconds the training thread waited here
        self._waiting: float | None = None     # perf_counter when it began to wait, while it waits
        self._on_held = on_held

    def _before_step(self, optimizer, args, kwargs) -> None:
        # A child forked while the copy ran steps on its own copy of the memory, which the parent's
        # snapshot never reads, and no thread of the child would ever release the fence.
        if os.getpid() == self._pid:
            self._hold()

    def _hold(self) -> None:
        """An optimizer step waits for the copy (its wait counted at the release). Only a step's
        wait is counted: the next save's or load's wait for the copy is in its own stall, and
        fence() or wait() are the caller's choice to wait."""
        if not self._done.is_set():
            self._waiting = time.perf_counter()
        self.wait()

    def release(self, error: BaseException | None = None) -> None:
        """The snapshot's thread: the copy is done (or failed: the step may go on either way, the
        save reports its own failure). A step's wait is counted before it goes on, so that it is in
        the timer by the time the save's timings are taken."""
        self._error = error
        since, self._waiting = self._waiting, None
        if since is not None:
            held = max(time.perf_counter() - since, 0.0)
            self.held_s += held
            if self._on_held is not None:
                self._on_held(held, since)
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
