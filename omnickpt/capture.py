"""The exact state of step N for checkpoint at failure (omnickpt/failure.py): StepCapture, taken at
every save() call that did not save inside guard(), and what makes a state fit to save at failure
(no optimizer step begun since, no version counter moved, no NaN or Inf: non_finite).
"""
from __future__ import annotations

import contextlib
import io
import logging
import pickle
from typing import Any

import torch
from torch import nn

from omnickpt.adapters import MIN_TENSOR_BYTES, adapter_for, collect_save
from omnickpt.adapters.base import is_dtensor
from omnickpt.adapters.generic import is_stateful
from omnickpt.adapters.module import unwrap
from omnickpt.errors import CheckpointError
from omnickpt.fence import StepWatch, optimizers_in, step_stable_tensors

log = logging.getLogger("omnickpt")


# Module buffers are copied at every capture up to this many bytes per rank. A state with more is
# refused at failure: a forward may have moved them, and nothing tells (BatchNorm's kernel updates
# its running statistics without moving their version counters).
BUFFER_BYTES = 64 << 20
_MISSING = object()
# save() options the failure save keeps (it is a full, synchronous save over the savers' group).
_FAILURE_SAVE_DROPS = frozenset({"async_save", "snapshot", "incremental", "base", "full_every", "block_bytes",
                                 "process_group", "on_commit", "check_replicas"})


class StepCapture:
    """What guard() needs to save step N, the last step given to save(), exactly: taken at every
    save() call that did not save (`take`, on the training thread, between two steps), each
    replacing the previous one.

    At failure the parameters and optimizer state saved are the live tensors: they are step N's
    only if no optimizer step began since save(N) (a StepWatch counts them) and no version counter
    of theirs moved (an in-place edit outside the optimizer; writes through `.data` move none, the
    limit the lazy snapshot's contract already states). What a step or a forward changes besides
    is taken from the capture:
    - the entries the adapters encode as objects (dataloaders and samplers, LR schedulers, RNG
      state, user values): frozen (pickled; small tensors inside copied, tensors the generic
      adapter saves as tensors of their own and DTensors kept by reference with their version
      counters), saved at failure in the entry's place;
    - module buffers (BatchNorm statistics: a forward moves them): copied, up to BUFFER_BYTES;
    - the hyperparameters of every optimizer's param groups (a schedule written at the top of the
      next step): frozen, put back in the groups while the failure save runs.
    Not captured (saved as they are at failure): a module's extra state (get_extra_state), tensors a
    module's state-dict hooks make, a Megatron optimizer wrapper's own objects.

    `state_to_save(step)` is the state to save, or why there is none: the state of another step,
    or a floating tensor holding NaN or Inf (a checkpoint to resume from must not)."""

    def __init__(self):
        self.step: int | None = None
        self.kwargs: dict = {}
        self.watch = StepWatch()
        self._state: dict = {}
        self._problem: str | None = None
        self._mark = (0, 0)
        self._shape: tuple | None = None        # the state's structure the cached lists below belong to
        self._stable: dict[str, torch.Tensor] = {}
        self._versions: list[int] = []
        self._buffers: list[tuple[Any, str, str]] = []   # (owner module, attribute, name)
        self._slots: list[tuple[dict, str]] = []          # (owner._buffers, attribute): fetched at each capture
        self._copies: list[torch.Tensor] | None = None   # None: over BUFFER_BYTES, not copied
        self._entries: dict[str, tuple[str, bytes, list]] = {}   # key -> (kind, pickled value, its tensors)
        self._groups: list[tuple[Any, bytes, list]] = []           # (optimizer, pickled hyperparameters, tensors)
        self._warned = False

    # ------------------------------------------------------------------ at save() calls
    def take(self, step: int, state: dict, kwargs: dict) -> None:
        """Capture `state` as step `step`. Never raises: a capture that failed is kept as the reason
        the failure save will give (and logged once)."""
        self.step, self._state, self._problem = step, state, None
        self.kwargs = {k: v for k, v in kwargs.items() if k not in _FAILURE_SAVE_DROPS}
        try:
            self._take(state)
        except Exception as e:
            self._problem = f"capturing the state at save({step}) failed: {type(e).__name__}: {e}"
            if not self._warned:
                self._warned = True
                log.warning("omnickpt: %s; a failure inside guard() will save nothing until a capture succeeds",
                            self._problem)

    def _take(self, state: dict) -> None:
        opts = optimizers_in(state)
        self.watch.watch(opts)
        self._mark = self.watch.mark()
        shape = (tuple((k, id(v)) for k, v in state.items()), tuple(len(o.state) for o in opts))
        if shape != self._shape:   # the lists below are rebuilt only when the state's structure changed
            self._stable = step_stable_tensors(state)
            self._list_buffers()
            self._shape = shape
        self._versions = _versions(self._stable.values())
        self._copy_buffers()
        self._groups = [(o, *_freeze([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]))
                        for o in opts]
        self._entries = self._freeze_entries(state, {id(o) for o in opts})

    @staticmethod
    def _freeze_entries(state: dict, held: set[int]) -> dict[str, tuple[str, bytes, list]]:
        """The entries the adapters encode as objects (dataloaders, generic values), frozen."""
        entries = {}
        for key, value in state.items():
            # modules and optimizers are the live tensors above (asking the adapters about them costs
            # a walk of the module per call)
            if isinstance(value, nn.Module) or id(value) in held or id(getattr(value, "optimizer", None)) in held:
                continue
            adapter = adapter_for(key, value, state)
            kind = getattr(adapter, "name", None)
            if kind == "dataloader":
                # the adapter's own object: the loader's (and its sampler's) position at this call
                entries[key] = (kind, *_freeze(adapter.save_items(key, value, state).objects[key]))
            elif kind == "generic" and not is_dtensor(value):   # a DTensor entry is checked by its version
                entries[key] = (kind, *_freeze(value.state_dict() if is_stateful(value) else value))
        return entries

    def _list_buffers(self) -> None:
        self._buffers = _buffers_of(self._state)
        self._slots = [(owner._buffers, attr) for owner, attr, _ in self._buffers]
        self._copies = None

    def _copy_buffers(self) -> None:
        """The buffers' values now into the capture's copies (one foreach copy; allocated again only
        when a buffer changed shape, dtype or presence)."""
        live = [slot[attr] for slot, attr in self._slots]
        if self._copies is not None and live:
            try:
                with torch.no_grad():
                    torch._foreach_copy_(self._copies, live)
                return
            except (RuntimeError, TypeError):   # a buffer replaced by one of another shape, or by None
                self._list_buffers()
                live = [slot[attr] for slot, attr in self._slots]
        if sum(b.nbytes for b in live) > BUFFER_BYTES:
            self._copies = None
            return
        with torch.no_grad():
            self._copies = [b.detach().clone() for b in live]

    # ------------------------------------------------------------------ at failure
    @contextlib.contextmanager
    def state_to_save(self, step: int):
        """Yields (state, None): the state to save as step `step`, the capture's parts in place
        (module buffers and param-group hyperparameters are swapped into the live objects while the
        block runs, and put back after it); or (None, why not). Never raises before the yield:
        the savers of a replica group exchange the outcome next, and a rank that raised instead
        would leave them waiting."""
        swaps: list[tuple[dict, Any, Any]] = []
        try:
            try:
                state, problem = self._prepare(step, swaps)
            except Exception as e:
                state, problem = None, f"preparing the state of step {step} failed: {type(e).__name__}: {e}"
            yield (None, problem) if problem else (state, None)
        finally:
            for where, k, old in reversed(swaps):
                if old is _MISSING:
                    where.pop(k, None)
                else:
                    where[k] = old

    def _prepare(self, step: int, swaps: list) -> tuple[dict | None, str | None]:
        problem = self._why_not(step)
        if problem is not None:
            return None, problem
        state = dict(self._state)
        for key, (kind, blob, tensors) in self._entries.items():
            value = _thaw(blob, tensors)
            state[key] = _FrozenDataParallel(value) if kind == "dataloader" else _FrozenStateful(value)
        for (owner, attr, _), copy in zip(self._buffers, self._copies or []):
            swaps.append((owner._buffers, attr, owner._buffers.get(attr, _MISSING)))
            owner._buffers[attr] = copy
        for opt, blob, tensors in self._groups:
            for group, frozen in zip(opt.param_groups, _thaw(blob, tensors)):
                for k, v in frozen.items():
                    swaps.append((group, k, group.get(k, _MISSING)))
                    group[k] = v
        # What the save will see, before asking which tensors the modules hold: FSDP2's state-dict
        # hook registers the sharded parameters again (after a forward the root holds unsharded ones).
        collected = collect_save(state)
        return state, self._replaced(step) or non_finite(collected)

    def taken_from_capture(self) -> list[str]:
        """What the failure save of the captured step takes from the capture (for failure_save)."""
        out = sorted(self._entries)
        if self._copies:
            out.append(f"{len(self._copies)} module buffer(s)")
        if self._groups:
            out.append("optimizer hyperparameters")
        return out

    def _why_not(self, step: int) -> str | None:
        if self.step != step:
            return f"the state of step {step} was not captured (the last capture is of step {self.step})"
        if self._problem is not None:
            return self._problem
        moved = self.watch.since(self._mark, f"save({step})")
        if moved is not None:
            return moved
        if self._buffers and self._copies is None:
            size = sum(owner._buffers[attr].nbytes for owner, attr, _ in self._buffers)
            return (f"the module buffers ({size / 2**20:.0f} MiB) exceed what a capture copies (BUFFER_BYTES, "
                    f"{BUFFER_BYTES >> 20} MiB): they may have moved since save({step})")
        return self._changed_since(step)

    def _changed_since(self, step: int) -> str | None:
        """_why_not's checks of the state against the capture of save(`step`): the first difference
        found, in the order the checks were always made (so the message stays the same)."""
        for (name, t), v in zip(self._stable.items(), self._versions):
            if v is not None and _version(t) != v:
                return f"{name} was changed in place since save({step}), outside an optimizer step"
        if [(id(o), a) for o, a, _ in _buffers_of(self._state)] != [(id(o), a) for o, a, _ in self._buffers]:
            return f"the state's module buffers are not those of save({step}) (added, removed or moved since)"
        for opt, blob, tensors in self._groups:
            if len(opt.param_groups) != len(_thaw(blob, tensors)):
                return f"a param group was added to {type(opt).__name__} since save({step})"
        return self._held_changed(step)

    def _held_changed(self, step: int) -> str | None:
        """A tensor the capture holds (state entries, param groups) changed in place since save(`step`)."""
        held = [(repr(key), tensors) for key, (_, _, tensors) in self._entries.items()]
        held += [(f"the param groups of {type(opt).__name__}", tensors) for opt, _, tensors in self._groups]
        for where, tensors in held:
            for t, v in tensors:
                if v is not None and _version(t) != v:
                    return f"a tensor of shape {tuple(t.shape)} in {where} was changed in place since save({step})"
        return None


    def _replaced(self, step: int) -> str | None:
        """A parameter or optimizer state tensor of the state that is not the one captured (replaced,
        or new) since save(`step`)."""
        now = step_stable_tensors(self._state)
        for name, t in now.items():
            if self._stable.get(name) is not t:
                return f"{name} was {'replaced' if name in self._stable else 'added'} since save({step})"
        return None


class _FrozenStateful:
    """Stands in a state to save for an entry as it was captured: the generic adapter saves
    `state_dict()`'s value, as it saved the live entry's."""

    def __init__(self, value: Any):
        self._value = value

    def state_dict(self) -> Any:
        return self._value

    def load_state_dict(self, state: Any) -> None:
        raise CheckpointError("a captured state entry is only ever saved, never loaded into")


class _FrozenDataParallel:
    """Stands in a state to save for a dataloader (or sampler) as it was captured: the dataloader
    adapter saves `dp_state_dict()`, as it saved the live one's."""

    def __init__(self, value: dict):
        self._value = value

    def dp_state_dict(self) -> dict:
        return self._value

    def load_dp_state_dict(self, replicated: Any, shards: dict, saved_dp_size: int) -> None:
        raise CheckpointError("a captured dataloader state is only ever saved, never loaded into")


def _buffers_of(state: dict) -> list[tuple[Any, str, str]]:
    """(owner module, attribute, name) of every persistent buffer of the state's modules."""
    out, seen = [], set()
    for key, value in state.items():
        if not isinstance(value, nn.Module):
            continue
        for prefix, module in unwrap(value).named_modules():
            for attr, b in module._buffers.items():
                if b is None or attr in module._non_persistent_buffers_set or id(b) in seen:
                    continue
                seen.add(id(b))
                out.append((module, attr, f"{key}/{prefix + '.' if prefix else ''}{attr}"))
    return out


def _versions(tensors) -> list[int | None]:
    try:
        return [t._version for t in tensors]   # ~0.1 us a tensor: this runs at every capture
    except RuntimeError:
        return [_version(t) for t in tensors]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except (RuntimeError, AttributeError):   # an inference tensor keeps no version counter
        return None


class _Freezer(pickle.Pickler):
    """Pickles a value with its tensors kept aside: copied when small, by reference (with the
    version counter) when the generic adapter would save them as tensors of their own (large
    ones) or as boxes (DTensors), which the capture must not copy at every step.

    reducer_override, not persistent_id: pickle asks it only for objects that are not ints,
    floats, strings or plain containers, so the 625 ints of Python's RNG state cost no Python call."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int | None]] = []

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        version = _version(obj)
        if version is not None and (is_dtensor(obj) or obj.nbytes >= MIN_TENSOR_BYTES):
            self.tensors.append((obj, version))
        else:
            with torch.no_grad():
                self.tensors.append((obj.detach().clone(), None))
        return _held_tensor, (len(self.tensors) - 1,)   # pickle memoises obj: a tensor twice stays one


def _held_tensor(index: int) -> torch.Tensor:
    raise AssertionError("resolved by _Thawer.find_class, never called")


class _Thawer(pickle.Unpickler):
    def __init__(self, file, tensors: list):
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module: str, name: str):
        if module == __name__ and name == "_held_tensor":
            return lambda index: self._tensors[index][0]
        return super().find_class(module, name)


def _freeze(value: Any) -> tuple[bytes, list]:
    buf = io.BytesIO()
    freezer = _Freezer(buf)
    freezer.dump(value)
    return buf.getvalue(), freezer.tensors


def _thaw(blob: bytes, tensors: list) -> Any:
    return _Thawer(io.BytesIO(blob), tensors).load()


def non_finite(collected: list) -> str | None:
    """The first floating tensor of a state as the adapters save it (`collect_save`'s shards and
    tensors inside objects) that holds NaN or Inf, named; None when every one is finite."""
    for key, items in collected:
        for s in items.shards:
            if not _finite(s.local):
                return f"tensor {s.name!r} holds NaN or Inf"
        for name, value in items.objects.items():
            bad = _non_finite_inside(value, name)
            if bad is not None:
                return f"tensor {bad!r} (inside an object) holds NaN or Inf"
    return None


def _finite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    # in pieces: a bool mask of a whole multi-GB tensor would be a large allocation at a bad moment
    parts = t.reshape(-1).split(1 << 24) if t.is_contiguous() else (t,)
    return all(bool(torch.isfinite(p).all()) for p in parts)


def _non_finite_inside(value: Any, path: str, depth: int = 0) -> str | None:
    if isinstance(value, torch.Tensor):
        return None if _finite(value) else path
    if depth > 64:
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        bad = _non_finite_inside(v, f"{path}/{k}", depth + 1)
        if bad is not None:
            return bad
    return None
