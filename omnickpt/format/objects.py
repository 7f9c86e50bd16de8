"""Safe encoding of non-tensor state (RNG states, schedulers, dataloaders, user dicts).

msgpack plus a few extension types; decoding never executes code. Arbitrary Python objects are
encoded with pickle only when the caller opts in, and decoding such a value needs the opt-in too.

An encoded value is untrusted input when it is read back: decoding checks every extension payload
(shapes against byte counts before anything is allocated, dtype names against a fixed table) and
raises CorruptCheckpointError naming the object for anything it did not write. Values are at most
MAX_DEPTH containers deep; encode_object refuses deeper ones. Nested extensions (a tuple inside a
tuple...) are decoded one level at a time, never by msgpack calling back into itself: every
nested level costs the C decoder tens of KB of stack, so a few hundred levels would crash the
process instead of raising. Decoding is linear in the bytes: the hashes of tuples and complex
numbers are not randomised, so distinct keys of one hash can be crafted by the thousand, and a set
or dict built from them would cost their square; such a value is refused (MAX_SAME_HASH).
"""
from __future__ import annotations

import collections
import math
import pickle

import msgpack
import numpy as np
import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format.records import _DTYPES

_TENSOR, _TUPLE, _NDARRAY, _PICKLE, _SET, _NPSCALAR, _DTYPE, _SHARDREF = range(1, 9)

# Containers (dicts, lists, tuples, sets) inside each other. Real state is a few levels deep; the
# bound keeps every recursive walk over a value (here and in the adapters) far from any stack limit.
MAX_DEPTH = 64
# A tensor or array read back has at most this many dimensions, and no dimension (nor the product
# of the non-zero ones: strides must fit in 64 bits) beyond _MAX_EXTENT.
_MAX_DIMS = 64
_MAX_EXTENT = 1 << 62
_INT_RANGE = (-(1 << 63), 1 << 64)   # what a msgpack integer holds
# Most keys of one dict (or items of one set) that may share a hash. Real values share one rarely
# ((-1,) and (-2,) do, as -1 and -2 do), crafted ones by the thousand; building a dict costs the
# square of the keys that share each hash, so this bounds the work to 64 comparisons a key.
MAX_SAME_HASH = 64
# Any torch dtype may appear as a *value* (a config's dtype=...); resolved from this table, never
# with getattr on a name from the checkpoint.
_ALL_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_STORABLE = frozenset(_DTYPES.values())
STORABLE_DTYPE_NAMES = ", ".join(_DTYPES)


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


def tensor_problem(t: torch.Tensor, *, loading: bool = False) -> str | None:
    """Why omnickpt cannot store (or, with `loading`, load into) tensor `t`; None when it can.

    The reason completes a sentence that starts with the tensor's name and says what to do.
    """
    if t.layout is not torch.strided:
        return (f"is a {str(t.layout).removeprefix('torch.')} tensor; omnickpt stores dense (strided) tensors only: "
                "use t.to_dense(), or keep its indices and values as two dense tensors")
    if t.is_meta:
        if loading:
            return ("is on the meta device and has no memory to load into; call module.to_empty(device=...) "
                    "before loading")
        return ("is on the meta device and holds no data; materialize it first (module.to_empty(device=...) and "
                "initialise or load its values), then save")
    if t.dtype not in _STORABLE:
        return (f"has dtype {t.dtype}, which the omnickpt format cannot store (it stores {STORABLE_DTYPE_NAMES}); "
                "convert it, e.g. t.to(torch.float32), or keep it as raw bytes (t.view(torch.uint8))")
    return None


def utf8_problem(name: str) -> str | None:
    """Why `name` cannot be stored as UTF-8 text (a lone surrogate, e.g. from os.fsdecode), or None."""
    if name.isascii():
        return None
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode text ({e.reason} at position {e.start}: {name[e.start:e.end]!r})"
    return None


# ------------------------------------------------------------------------------------ encoding
def encode_object(value, *, allow_pickle: bool = False, where: str = "object") -> bytes:
    """Encode `value`; `where` names it in errors (the state key).

    Raises UnsupportedError naming the part of `value` (e.g. 'extra/ema') that cannot be stored:
    nesting deeper than MAX_DEPTH, text that is not valid Unicode, a dict key that would not load
    back as a key, a tensor the format cannot hold, or (without allow_pickle) an object of another type.
    """
    _check_encodable(value, [where], 0, allow_pickle)

    def default(obj):
        if isinstance(obj, torch.Tensor):
            return _tensor_ext(obj, where, _pack)
        if isinstance(obj, dict):   # OrderedDict and other mappings from state_dict()s
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            # before the subclass branch below: np.float64 is a float subclass, and would come back
            # as a plain float
            return msgpack.ExtType(_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
        if isinstance(obj, (int, float, str, bytes)) and type(obj) not in (int, float, str, bytes):
            return _builtin_value(obj)
        ext = _record_ext(obj, _pack)
        if ext is not None:
            return ext
        if allow_pickle:
            return msgpack.ExtType(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise UnsupportedError(
            f"{where}: a value of type {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
            "without pickle; convert it to dicts/lists/numbers/tensors, or pass allow_pickle=True "
            "(loading it will then need allow_pickle=True as well)")

    def _pack(v):
        return msgpack.packb(v, default=default, use_bin_type=True, strict_types=True)

    return _pack(value)


def _tensor_ext(obj: torch.Tensor, where: str, pack) -> msgpack.ExtType:
    """A dense tensor inside a plain value, as its dtype, shape and bytes."""
    if obj.layout != torch.strided or type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
        raise UnsupportedError(f"{where}: cannot encode a {type(obj).__name__} inside a plain value")
    t = obj.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return msgpack.ExtType(_TENSOR, pack([str(t.dtype).removeprefix("torch."), list(t.shape), raw]))


def _builtin_value(obj):
    """A subclass of int, float, str or bytes (an IntEnum, a str enum) as the plain builtin value."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return int(obj)
    return {float: float, str: str, bytes: bytes}[next(t for t in (float, str, bytes) if isinstance(obj, t))](obj)


def _record_ext(obj, pack) -> msgpack.ExtType | None:
    """The extension record of a tuple, set, numeric ndarray, ShardRef or torch.dtype; None for any other object."""
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, pack(list(obj)))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(_SET, pack(sorted(obj, key=repr)))
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        # tobytes() is row-major for any strides; obj.shape, not ascontiguousarray's, which
        # turns a 0-d array into a 1-d one
        return msgpack.ExtType(_NDARRAY, pack([obj.dtype.str, list(obj.shape), obj.tobytes(order="C")]))
    if isinstance(obj, ShardRef):
        return msgpack.ExtType(_SHARDREF, obj.name.encode())
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(_DTYPE, pack(str(obj).removeprefix("torch.")))
    return None


def _path(parts: list) -> str:
    """'extra/ema' for the parts ['extra', 'ema']; keys that are not text show as [repr]. A deep
    path shows its first and last parts."""
    shown = [p if isinstance(p, str) else f"[{p!r}]" for p in (parts if len(parts) <= 8 else parts[:4] + parts[-3:])]
    if len(parts) > 8:
        shown.insert(4, f"...({len(parts) - 7} more)")
    return "/".join(shown)


def _check_encodable(value, path: list, depth: int, allow_pickle: bool) -> None:
    """Refuse, before msgpack sees it, anything that would fail to encode with an unnamed error
    or encode into bytes that could not be decoded. `path` is the list of keys down to `value`
    (formatted only for an error: a list of a million floats costs one type test per element)."""
    if _checked_leaf(value, path, allow_pickle):
        return
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return      # numpy values, ShardRefs, other objects: encode_object's default() decides
    if depth >= MAX_DEPTH:
        raise UnsupportedError(
            f"{_path(path)!r}: the value is nested more than {MAX_DEPTH} levels deep (dicts, lists, tuples, sets "
            "inside each other); omnickpt refuses deeper values: flatten it, or save it under several keys")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_key(k, path, depth, allow_pickle)
            path.append(k)
            _check_encodable(v, path, depth + 1, allow_pickle)
            path.pop()
        return
    if _plain_leaves(value, allow_pickle):
        return
    for i, v in enumerate(value):
        if type(v) in (float, bool, bytes) or v is None:
            continue
        path.append(i)
        _check_encodable(v, path, depth + 1, allow_pickle)
        path.pop()


def _checked_leaf(value, path: list, allow_pickle: bool) -> bool:
    """True when `value` is a leaf (text, number, bytes, None, tensor, dtype) that encodes;
    UnsupportedError when it is one that does not; False for anything else."""
    kind = type(value)
    if kind is str:
        problem = utf8_problem(value)
        if problem:
            raise UnsupportedError(f"{_path(path)!r}: the text {value!r} {problem}; it cannot be saved: fix or drop it")
        return True
    if kind is int:
        if not allow_pickle and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            raise UnsupportedError(f"{_path(path)!r}: the integer {value} does not fit in 64 bits; save it as text "
                                   "(str(n)), or pass allow_pickle=True")
        return True
    if kind in (float, bool, bytes) or value is None:
        return True
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem:
            raise UnsupportedError(f"tensor {_path(path)!r} {problem}")
        return True
    if isinstance(value, torch.dtype):
        if str(value).removeprefix("torch.") not in _ALL_DTYPES:
            raise UnsupportedError(f"{_path(path)!r}: {value} is not a dtype of this torch; it cannot be saved")
        return True
    return False


_LEAF_KINDS = frozenset({int, float, bool, bytes, str, type(None)})


def _plain_leaves(items, allow_pickle: bool) -> bool:
    """True when `items` (a list, tuple or set) holds only numbers, text, bytes and None that all
    encode: checked at C speed, since user state can hold lists of millions of numbers."""
    kinds = set(map(type, items))
    if not kinds <= _LEAF_KINDS:
        return False
    if int in kinds and not allow_pickle:
        ints = items if len(kinds) == 1 else [v for v in items if type(v) is int]
        if ints and not (_INT_RANGE[0] <= min(ints) and max(ints) < _INT_RANGE[1]):
            return False
    if str in kinds:
        strs = items if len(kinds) == 1 else [v for v in items if type(v) is str]
        if not all(map(str.isascii, strs)):
            return False     # the slow walk checks each text (and names the one that fails)
    return True


def _check_key(key, path: list, depth: int, allow_pickle: bool) -> None:
    """A dict key must load back as a key: a set anywhere inside it would load as a set, which is
    unhashable. A tuple key counts its own levels of nesting, as decoding does."""
    if isinstance(key, (set, frozenset)) or isinstance(key, tuple) and _holds_set(key, depth):
        raise UnsupportedError(
            f"{_path(path)!r}: the dict key {key!r} holds a set, which loads back as a set and cannot be a dict key; "
            "use a tuple (e.g. tuple(sorted(s))) as the key instead")
    if isinstance(key, str):
        problem = utf8_problem(key)
        if problem:
            raise UnsupportedError(f"{_path(path)!r}: the dict key {key!r} {problem}; it cannot be saved: rename it")
    elif isinstance(key, tuple):
        _check_encodable(key, path + [key], depth + 1, allow_pickle)


def _holds_set(value: tuple, depth: int) -> bool:
    if depth >= MAX_DEPTH:
        return False    # too deep: _check_encodable refuses it with that reason
    return any(isinstance(v, (set, frozenset)) or isinstance(v, tuple) and _holds_set(v, depth + 1) for v in value)


# ------------------------------------------------------------------------------------ decoding
class _Nested:
    """A tuple or set extension whose payload is decoded after the value holding it: decoding it
    inside msgpack's ext_hook would nest the C decoder once per level (see the module docstring)."""
    __slots__ = ("code", "payload")

    def __init__(self, code: int, payload: bytes):
        self.code, self.payload = code, payload


class _Complex:
    """A complex numpy scalar, held back from msgpack's dict building (see ext_hook)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


_CONTAINER_KINDS = frozenset({list, dict, _Nested, _Complex})


class _Pickled:
    """A pickled value left undecoded by validate_object."""
    __slots__ = ("payload",)

    def __init__(self, payload: bytes):
        self.payload = payload


def decode_object(data: bytes, *, allow_pickle: bool = False, where: str = "object"):
    """Decode bytes made by `encode_object`; `where` names the object (the state key) in errors.

    Raises CorruptCheckpointError for bytes encode_object would not have written (a malformed
    extension payload, a dtype outside the format's table, a shape that does not match its bytes,
    nesting deeper than MAX_DEPTH, invalid msgpack), UnsafeCheckpointError for a pickled value
    without allow_pickle=True or an unknown extension type. Never allocates from a declared shape
    before checking it against the bytes that are there.
    """
    return _Decoder(where, allow_pickle, unpickle=True).decode(data)


def validate_object(data: bytes, *, where: str) -> None:
    """Check that `data` decodes, exactly as decode_object would, without ever unpickling: a
    pickled value is accepted as opaque bytes. For `omnickpt verify`: it reports a damaged object
    that would make loading fail. Raises what decode_object raises, except for pickled values."""
    _Decoder(where, allow_pickle=True, unpickle=False).decode(data)


class _Decoder:
    def __init__(self, where: str, allow_pickle: bool, unpickle: bool):
        self.where, self.allow_pickle, self.unpickle = where, allow_pickle, unpickle

    def damaged(self, detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"object {self.where!r}: {detail}; the checkpoint's value is damaged (or was not written by omnickpt): "
            "restore the checkpoint from a good copy, or load an earlier one")

    def decode(self, data: bytes):
        return self.resolve(self.unpack(data, self.ext_hook), 1)

    def unpack(self, data: bytes, hook):
        # msgpack bounds every declared length by the bytes present, so it allocates nothing
        # from a lying header; its own container nesting is bounded too (StackError).
        try:
            return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True)
        except CheckpointError:
            raise
        except Exception as e:   # msgpack's errors, unhashable keys, bad UTF-8: all mean damage
            raise self.damaged(f"not valid msgpack ({type(e).__name__}: {e})") from None

    def leaf(self, payload: bytes):
        """The payload of a tensor/array/scalar/dtype extension: plain msgpack, no extensions."""
        return self.unpack(payload, self.no_ext_hook)

    def no_ext_hook(self, code, payload):
        raise self.damaged(f"an extension of type {code} inside a tensor, array or dtype payload")

    def ext_hook(self, code, payload):
        if code in (_TUPLE, _SET):
            return _Nested(code, payload)
        if code == _TENSOR:
            return self.tensor(payload)
        if code == _NDARRAY:
            return self.ndarray(payload)
        if code == _NPSCALAR:
            scalar = self.npscalar(payload)
            # a complex one is put in place after the value holding it, so that msgpack never hashes
            # it as a dict key (see MAX_SAME_HASH); other scalars hash as Python numbers do
            return _Complex(scalar) if isinstance(scalar, np.complexfloating) else scalar
        if code == _DTYPE:
            name = self.leaf(payload)
            if not isinstance(name, str) or name not in _ALL_DTYPES:
                raise self.damaged(f"unknown torch dtype {name!r}")
            return _ALL_DTYPES[name]
        if code == _SHARDREF:
            try:
                return ShardRef(payload.decode("utf-8"))
            except UnicodeDecodeError:
                raise self.damaged(f"a shard reference {payload[:40]!r} that is not UTF-8 text") from None
        if code == _PICKLE:
            return self.pickled(payload)
        raise UnsafeCheckpointError(f"object {self.where!r}: unknown extension type {code}; refusing to decode it "
                                    "(a newer omnickpt wrote it, or the checkpoint is damaged)")

    def pickled(self, payload: bytes):
        if not self.allow_pickle:
            raise UnsafeCheckpointError(
                f"object {self.where!r}: this value was saved with pickle; loading it would execute code from the "
                "checkpoint. Pass allow_pickle=True only if you trust the checkpoint's source")
        if not self.unpickle:
            return _Pickled(payload)
        try:
            return pickle.loads(payload)
        except Exception as e:
            # not damage as far as we can tell: most often a class that is no longer importable
            raise CheckpointError(f"object {self.where!r}: its pickled value could not be unpickled "
                                  f"({type(e).__name__}: {e}); if it names a class that moved or is not importable "
                                  "here, make it importable; otherwise the value is damaged") from e

    def shape(self, shape, what: str) -> tuple[int, ...]:
        if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
                or not all(type(n) is int and 0 <= n <= _MAX_EXTENT for n in shape)
                or math.prod(max(n, 1) for n in shape) > _MAX_EXTENT):
            raise self.damaged(f"{what} with an impossible shape {str(shape)[:80]}")
        return tuple(shape)

    def fields(self, payload: bytes, what: str, types: tuple) -> list:
        value = self.leaf(payload)
        if not isinstance(value, list) or len(value) != len(types) or not all(
                isinstance(v, t) for v, t in zip(value, types)):
            layout = ", ".join(t.__name__ for t in types)
            raise self.damaged(f"{what} payload is {str(value)[:80]}, not [{layout}]")
        return value

    def check_size(self, what: str, shape: tuple, itemsize: int, raw: bytes) -> None:
        # before anything is allocated: a shape is a claim, the byte count is what is there
        need = math.prod(shape) * itemsize
        if need != len(raw):
            raise self.damaged(f"{what} of shape {list(shape)} needs {need} bytes but holds {len(raw)}")

    def tensor(self, payload: bytes) -> torch.Tensor:
        name, shape, raw = self.fields(payload, "a tensor", (str, list, bytes))
        dt = _DTYPES.get(name)
        if dt is None:
            raise self.damaged(f"a tensor of unknown dtype {name!r}")
        shape = self.shape(shape, "a tensor")
        self.check_size(f"a {name} tensor", shape, dt.itemsize, raw)
        if not raw:
            return torch.empty(shape, dtype=dt)
        # bytearray: a private, writable copy that the tensor keeps alive
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)

    def numpy_dtype(self, name: str) -> np.dtype:
        try:
            dt = np.dtype(name)
        except Exception:
            raise self.damaged(f"a numpy value of unknown dtype {name[:40]!r}") from None
        if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
            # an object dtype would let numpy unpickle
            raise UnsafeCheckpointError(f"object {self.where!r}: refusing numpy dtype {name[:40]!r}")
        return dt

    def ndarray(self, payload: bytes) -> np.ndarray:
        name, shape, raw = self.fields(payload, "a numpy array", (str, list, bytes))
        dt = self.numpy_dtype(name)
        shape = self.shape(shape, "a numpy array")
        self.check_size(f"a numpy {name} array", shape, dt.itemsize, raw)
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()

    def npscalar(self, payload: bytes):
        name, raw = self.fields(payload, "a numpy scalar", (str, bytes))
        dt = self.numpy_dtype(name)
        self.check_size(f"a numpy {name} scalar", (), dt.itemsize, raw)
        return np.frombuffer(raw, dtype=dt)[0]

    def spread(self, items: list, what: str) -> None:
        """Refuse `items` (keys of a dict, items of a set) when more than MAX_SAME_HASH share a hash:
        building the container would cost their square. TypeError for an unhashable item."""
        if len(items) > MAX_SAME_HASH:
            worst = max(collections.Counter(map(hash, items)).values())
            if worst > MAX_SAME_HASH:
                raise self.damaged(f"a {what} of {len(items)} items, {worst} of which share one hash value (crafted "
                                   "to make decoding take quadratic time)")

    def resolve(self, value, depth: int):
        """`value` with every _Nested decoded, checking that containers nest at most MAX_DEPTH deep."""
        kind = type(value)
        if kind is not list and kind is not dict and kind is not _Nested:
            return value.value if kind is _Complex else value
        if depth > MAX_DEPTH:
            raise self.damaged(f"the value is nested more than {MAX_DEPTH} levels deep")
        if kind is dict:
            return self._resolve_dict(value, depth)
        return self._resolve_items(value, kind, depth)

    def _resolve_dict(self, value: dict, depth: int) -> dict:
        if any(type(k) is _Nested or type(k) is _Complex for k in value):
            keys = [self.resolve(k, depth + 1) for k in value]
            try:
                self.spread(keys, "dict")
                return dict(zip(keys, (self.resolve(v, depth + 1) for v in value.values())))
            except TypeError as e:      # a set as a key
                raise self.damaged(f"a dict key that cannot be a key ({e})") from None
        for k, v in value.items():
            if type(v) in _CONTAINER_KINDS:
                value[k] = self.resolve(v, depth + 1)
        return value

    def _resolve_items(self, value, kind: type, depth: int):
        """A list, or a tuple or set (_Nested), with its items resolved."""
        items = value
        if kind is _Nested:
            items = self.unpack(value.payload, self.ext_hook)
            if not isinstance(items, list):
                raise self.damaged(f"a {'tuple' if value.code == _TUPLE else 'set'} payload that is not a list")
        if not _CONTAINER_KINDS.isdisjoint(map(type, items)):    # at C speed: lists of numbers are common
            for i, v in enumerate(items):
                if type(v) in _CONTAINER_KINDS:
                    items[i] = self.resolve(v, depth + 1)
        if kind is list:
            return items
        if value.code == _TUPLE:
            return tuple(items)
        try:
            self.spread(items, "set")
            return set(items)
        except TypeError as e:              # a list inside a set
            raise self.damaged(f"a set that holds an unhashable value ({e})") from None
