"""A DeepSpeed checkpoint's pickles, decoded without running anything.

DeepSpeed's files are whole `torch.save` archives whose data.pkl holds nested dicts and lists of
tensors, numbers and text, plus a few of DeepSpeed's own classes (`LossScaler`, `ZeroStageEnum`,
`fragment_address`). DeepSpeed loads them with `weights_only=False`, which runs any global a pickle
names. `_DeepSpeedPickle` admits only the globals in `_GLOBALS` (exact module and name), turns
DeepSpeed's classes into inert records and every tensor into a `_StoredTensor` (storage key, offset,
shape, strides: nothing of torch's is called), so that the reader can point boxes at the tensors'
bytes inside the archive. Anything else raises UnsafeCheckpointError before it is looked up.
"""
from __future__ import annotations

import pickle
from typing import Any

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from omnickpt.formats.dcp.unpickle import (_STORAGE_DTYPES, _TORCH_DTYPES, _brief, _enum_value, _Record,
                                           _RestrictedUnpickler, _size, _StorageType, _StoredTensor, _TensorPickle, _rebuild_v2,
                                           _rebuild_v3)

# A data.pkl is metadata: names, shapes, counters, small values. DeepSpeed's largest (a model file of a
# model with 10^5 parameters) are a few MiB; more than this is not a file DeepSpeed wrote.
MAX_PICKLE_BYTES = 256 << 20


class LossScaler(_Record):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler: its fields (cur_scale...)."""


class FragmentAddress(_Record):
    """deepspeed.utils.tensor_fragment.fragment_address: `numel` elements of a parameter at `start` of a
    rank's flat partition."""
    FIELDS = ("numel", "start")


class _TensorType:
    """`torch.Tensor` named as the type of `_rebuild_from_type_v2`: a plain tensor (the only type admitted)."""


def _rebuild_from_type(func, new_type, args, state):
    """torch._tensor._rebuild_from_type_v2: a tensor pickled with Python attributes (DeepSpeed's flat
    fp32 groups carry some). Only a plain tensor rebuilt by the recorders is admitted; the attributes
    are dropped (they are DeepSpeed's bookkeeping, not data)."""
    if new_type is not _TensorType or func not in (_rebuild_v2, _rebuild_v3) or not isinstance(args, tuple):
        raise pickle.UnpicklingError("a tensor of a type other than torch.Tensor")
    if state is not None and not isinstance(state, (dict, tuple)):
        raise pickle.UnpicklingError("a tensor with a state that is not a dict")
    return func(*args)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is read as its data."""
    if not isinstance(data, _StoredTensor):
        raise pickle.UnpicklingError("a Parameter without tensor data")
    return data


def _namespace(**kwargs):
    """argparse.Namespace (DeepSpeed saves a run's args in some checkpoints): its fields as a dict."""
    return dict(kwargs)


_DS = "deepspeed.runtime"
_GLOBALS: dict[tuple[str, str], Any] = {
    **_TensorPickle.GLOBALS,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TensorType,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _size,
    ("collections", "OrderedDict"): dict,
    ("argparse", "Namespace"): _namespace,
    **{("builtins", c.__name__): c for c in (dict, list, tuple, set, frozenset)},
    (f"{_DS}.fp16.loss_scaler", "LossScaler"): LossScaler,
    (f"{_DS}.fp16.loss_scaler", "DynamicLossScaler"): LossScaler,
    (f"{_DS}.zero.config", "ZeroStageEnum"): _enum_value,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
    **{("torch", name): dtype for name, dtype in _TORCH_DTYPES.items()},
}


class _DeepSpeedPickle(_RestrictedUnpickler):
    """Unpickles a DeepSpeed data.pkl into plain containers, records and `_StoredTensor`s."""

    def find_class(self, module: str, name: str):
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name, _STORAGE_DTYPES[name])
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle the global {module}.{name}: a DeepSpeed checkpoint file holds "
            "tensors, plain values and DeepSpeed's LossScaler, ZeroStageEnum and fragment_address only, so this "
            "file was tampered with or holds a value omnickpt cannot read without running code from it (as "
            "DeepSpeed's own load_checkpoint would, with weights_only=False). Do not load it with DeepSpeed or "
            "torch.load unless you trust its origin; restore the checkpoint from a trusted copy")

    persistent_load = _TensorPickle.persistent_load
    dispatch = dict(_RestrictedUnpickler.dispatch)

    def _load_build(self):
        # A module's state dict is an OrderedDict carrying `_metadata` (per-module versions) as its
        # state: read as a plain dict, that state is dropped. BUILD on anything else but a record is refused.
        if len(self.stack) > 1 and type(self.stack[-2]) is dict:
            self.stack.pop()
            return
        _RestrictedUnpickler._load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def unpickle(raw: bytes, where: str) -> Any:
    """The value a DeepSpeed file's data.pkl holds, tensors as `_StoredTensor`s. UnsafeCheckpointError for
    a global outside `_GLOBALS`; CorruptCheckpointError naming `where` for a pickle that does not decode."""
    if len(raw) > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"{where}: its data.pkl has {len(raw)} bytes, more than the "
                                     f"{MAX_PICKLE_BYTES >> 20} MiB of any DeepSpeed metadata; the file is damaged")
    try:
        return _DeepSpeedPickle(raw, where).load()
    except CheckpointError:
        raise
    except Exception as e:   # a damaged or hostile pickle fails in any of pickle's ways
        raise CorruptCheckpointError(f"{where}: its data.pkl does not decode ({type(e).__name__}: "
                                     f"{_brief.repr(str(e))}); the file is damaged: restore it from a good copy") from None


def fields(value: Any) -> Any:
    """A decoded value with DeepSpeed's records as dicts of their fields (for objects the manifest carries)."""
    if isinstance(value, _Record):
        return {k: fields(v) for k, v in value.fields.items()}
    if isinstance(value, dict):
        return {k: fields(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fields(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fields(v) for v in value)
    return value


__all__ = ["MAX_PICKLE_BYTES", "FragmentAddress", "LossScaler", "fields", "unpickle"]
