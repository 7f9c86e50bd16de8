"""Safe encoding of non-tensor state (RNG states, schedulers, dataloaders, user dicts).

msgpack plus a few extension types; decoding never executes code. Arbitrary Python objects are
encoded with pickle only when the caller opts in, and decoding such a value needs the opt-in too.
"""
from __future__ import annotations

import pickle

import msgpack
import numpy as np
import torch

from omnickpt.errors import UnsafeCheckpointError, UnsupportedError

_TENSOR, _TUPLE, _NDARRAY, _PICKLE, _SET, _NPSCALAR, _DTYPE, _SHARDREF = range(1, 9)


class ShardRef:
    """Stands in an encoded value for a tensor stored as boxes under `name` (a DTensor inside a
    dict, say): the loader puts the target's own tensor back in its place."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, ShardRef) and other.name == self.name

    def __hash__(self):
        return hash(("ShardRef", self.name))

    def __repr__(self):
        return f"ShardRef({self.name!r})"


def encode_object(value, *, allow_pickle: bool = False, where: str = "object") -> bytes:
    """Encode `value`; `where` names it in errors (the state key)."""

    def default(obj):
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise UnsupportedError(f"{where}: cannot encode a {type(obj).__name__} inside a plain value")
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return msgpack.ExtType(_TENSOR, _pack([str(t.dtype).removeprefix("torch."), list(t.shape), raw]))
        if isinstance(obj, dict):   # OrderedDict and other mappings from state_dict()s
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            # before the subclass branch below: np.float64 is a float subclass, and would come back
            # as a plain float
            return msgpack.ExtType(_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
        if isinstance(obj, (int, float, str, bytes)) and type(obj) not in (int, float, str, bytes):
            if isinstance(obj, int) and not isinstance(obj, bool):
                return int(obj)
            return {float: float, str: str, bytes: bytes}[next(t for t in (float, str, bytes) if isinstance(obj, t))](obj)
        if isinstance(obj, tuple):
            return msgpack.ExtType(_TUPLE, _pack(list(obj)))
        if isinstance(obj, (set, frozenset)):
            return msgpack.ExtType(_SET, _pack(sorted(obj, key=repr)))
        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
            # tobytes() is row-major for any strides; obj.shape, not ascontiguousarray's, which
            # turns a 0-d array into a 1-d one
            return msgpack.ExtType(_NDARRAY, _pack([obj.dtype.str, list(obj.shape), obj.tobytes(order="C")]))
        if isinstance(obj, ShardRef):
            return msgpack.ExtType(_SHARDREF, obj.name.encode())
        if isinstance(obj, torch.dtype):
            return msgpack.ExtType(_DTYPE, _pack(str(obj).removeprefix("torch.")))
        if allow_pickle:
            return msgpack.ExtType(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise UnsupportedError(
            f"{where}: a value of type {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
            "without pickle; convert it to dicts/lists/numbers/tensors, or pass allow_pickle=True "
            "(loading it will then need allow_pickle=True as well)")

    def _pack(v):
        return msgpack.packb(v, default=default, use_bin_type=True, strict_types=True)

    return _pack(value)


def decode_object(data: bytes, *, allow_pickle: bool = False, where: str = "object"):
    """Decode bytes made by `encode_object`. Pickled values need `allow_pickle=True`."""
    from omnickpt.format.manifest import dtype_from_name

    def ext_hook(code, payload):
        if code == _TENSOR:
            dtype, shape, raw = _unpack(payload)
            dt = dtype_from_name(dtype)
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return t.view(dt).reshape(shape).clone() if raw else torch.empty(shape, dtype=dt)
        if code == _TUPLE:
            return tuple(_unpack(payload))
        if code == _SET:
            return set(_unpack(payload))
        if code == _NDARRAY:
            dtype, shape, raw = _unpack(payload)
            dt = np.dtype(dtype)
            if dt.kind not in "biufc":
                raise UnsafeCheckpointError(f"{where}: refusing numpy dtype {dtype!r}")
            return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
        if code == _NPSCALAR:
            dtype, raw = _unpack(payload)
            dt = np.dtype(dtype)
            if dt.kind not in "biufc":
                raise UnsafeCheckpointError(f"{where}: refusing numpy dtype {dtype!r}")
            return np.frombuffer(raw, dtype=dt)[0]
        if code == _DTYPE:
            return dtype_from_name(_unpack(payload))
        if code == _SHARDREF:
            return ShardRef(payload.decode())
        if code == _PICKLE:
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{where}: this value was saved with pickle; loading it would execute code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust the checkpoint's source")
            return pickle.loads(payload)
        raise UnsafeCheckpointError(f"{where}: unknown extension type {code}")

    def _unpack(b):
        return msgpack.unpackb(b, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)

    return _unpack(data)
