"""Untrusted pickles of a DCP folder, decoded without running anything.

- `_RestrictedUnpickler`: Python's own unpickler (no memo table sized by the pickle), BUILD on records only;
- `_MetadataUnpickler`: a `.metadata` into inert `_Record`s (DCP's metadata classes, nothing else);
- `_TensorPickle`: a tensor's data.pkl into a `_StoredTensor` (storage key, offset, shape, strides);
- `_unzip_bounded` / `_decode_value`: a torch.save'd value (DCP's BytesStorageMetadata items, Megatron's
  common.pt) unzipped within a `_Budget` of MAX_INLINE_BYTES, then read by torch's weights-only unpickler.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import reprlib
import struct
import zipfile
from typing import Any, Callable

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format.manifest import _MAX_DIMS

_MAX_INT = 1 << 62
# What the reader holds in memory while it reads the metadata is bounded by this: the stored bytes of the
# non-tensor values (a scheduler's state, a step count), and, separately, what they decode to (every zip
# entry of their torch.save archives) plus the tensors inside plain values (not a module's or an optimizer's),
# which are read when the manifest is built and carried in the value. Real ones are small (a step counter,
# an RNG state); a value past this is refused, and a zip entry is never inflated past it.
MAX_INLINE_BYTES = 256 << 20
_INFLATE_PIECE = 1 << 20        # a compressed zip entry is inflated this much at a time, counted as it goes

# torch's dtypes by name: names from a checkpoint are looked up here, never with getattr.
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# The legacy typed-storage classes torch.save names for a tensor's storage (UntypedStorage: bytes).
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16, "CharStorage": torch.int8,
    "ByteStorage": torch.uint8, "BoolStorage": torch.bool, "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64, "UntypedStorage": None,
}


# ---------------------------------------------------------------------- restricted unpicklers
_brief = reprlib.Repr()      # untrusted values in messages: depth- and length-limited (a deep list cannot recurse)
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlist, _brief.maxtuple = 3, 60, 60, 8, 8


class _RestrictedUnpickler(pickle._Unpickler):
    """Base of the unpicklers of untrusted DCP pickles. Python's own implementation (pickle._Unpickler),
    not the C one: the C unpickler sizes its memo table by the largest index a PUT names, so a 9-byte
    pickle (`LONG_BINPUT 2**26`) makes it allocate and zero 1 GiB; this one keeps the memo in a dict.
    It is also the one whose opcodes can be overridden: BUILD (set an object's state) is allowed on
    `_Record`s only. On anything else the pickle could reach (a global function's __defaults__, a dtype,
    a storage type) it would change objects that this process shares, not build a record.
    Subclasses set find_class and persistent_load; the cost is ~1.5x the C unpickler's time."""
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def _load_build(self):
        if not isinstance(self.stack[-2] if len(self.stack) > 1 else None, _Record):
            raise pickle.UnpicklingError("a BUILD (set state) of something that is not a record of the checkpoint's metadata")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


# ---------------------------------------------------------------------- .metadata: the restricted unpickler
class _Record:
    """An inert stand-in for one of DCP's metadata classes: the fields the pickle set, nothing run.

    Dataclasses are pickled as "new object of class C, then set its state", so a record is made with
    no arguments and receives its fields as a dict (or, for TensorProperties, as the tuple its
    __getstate__ returns); a record called with positional arguments takes them as its FIELDS in order.
    """
    FIELDS: tuple[str, ...] = ()

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.fields = dict(zip(cls.FIELDS, args))
        obj.fields.update({k: v for k, v in kwargs.items() if isinstance(k, str)})
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, dict):
            parts = [state]
        elif isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            parts = [s for s in state if s]     # (instance dict, slots dict)
        elif isinstance(state, tuple):
            parts = [dict(zip(self.FIELDS, state))]
        else:
            raise pickle.UnpicklingError(f"{type(self).__name__[1:]} with a state of type {type(state).__name__}")
        for part in parts:
            self.fields.update({k: v for k, v in part.items() if isinstance(k, str)})

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


class _Metadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class _TensorStorageMetadata(_Record):
    FIELDS = ("properties", "size", "chunks")


class _BytesStorageMetadata(_Record):
    FIELDS = ()


class _ChunkStorageMetadata(_Record):
    FIELDS = ("offsets", "sizes")


class _TensorProperties(_Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class _MetadataIndex(_Record):
    FIELDS = ("fqn", "offset", "index")


class _StorageInfo(_Record):
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class _StorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class _Unused(_Record):
    """A record the reader never looks at: the save plans Megatron-core keeps in its metadata
    (`all_local_plans`: MCoreSavePlan, WriteItem, TensorWriteData) to reuse them on its next save."""


def _size(values=()) -> tuple[int, ...]:
    """torch.Size(values), as a plain tuple of sane integers."""
    values = tuple(values)
    if len(values) > _MAX_DIMS or any(type(v) is not int or not 0 <= v <= _MAX_INT for v in values):
        raise pickle.UnpicklingError(f"torch.Size{_brief.repr(values)} is not a shape")
    return values


def _layout(name) -> str:
    """torch.serialization._get_layout: only the dense layout is of use (others are refused later)."""
    if not isinstance(name, str):
        raise pickle.UnpicklingError("a layout name that is not text")
    return name


def _shape(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape or offsets (a tuple of at most 64 integers in [0, 2**62]), or None: pickles can hold
    plain tuples, not only the ones `_size` checked."""
    if (isinstance(value, tuple) and len(value) <= _MAX_DIMS
            and all(type(v) is int and 0 <= v <= _MAX_INT for v in value)):
        return value
    return None


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT


def _enum_value(value) -> int:
    """An enum of DCP's (_MEM_FORMAT_ENCODING, WriteItemType) called with its value: the value."""
    if type(value) is not int:
        raise pickle.UnpicklingError("an enum value that is not an integer")
    return value


def _path(*parts) -> str:
    """pathlib.PosixPath(...) in StorageMeta.checkpoint_id: informational, kept as text."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path made of something other than text")
    return "/".join(parts)


_M = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (_M, "Metadata"): _Metadata, (_M, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_M, "BytesStorageMetadata"): _BytesStorageMetadata, (_M, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_M, "TensorProperties"): _TensorProperties, (_M, "MetadataIndex"): _MetadataIndex,
    (_M, "StorageMeta"): _StorageMeta, (_M, "_MEM_FORMAT_ENCODING"): _enum_value,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): _Unused,
    ("torch.distributed.checkpoint.planner", "SavePlan"): _Unused,
    ("torch.distributed.checkpoint.planner", "WriteItem"): _Unused,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): _Unused,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _enum_value,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): _Unused,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): dict,
    **{("builtins", c.__name__): c for c in (dict, list, tuple, set, frozenset)},
    **{("pathlib", c): _path for c in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                       "PureWindowsPath")},
    # a dtype is pickled as the global itself (never called)
    **{("torch", name): dtype for name, dtype in _TORCH_DTYPES.items()},
}


class _MetadataUnpickler(_RestrictedUnpickler):
    """Unpickles a DCP `.metadata` into `_Record`s. Every global the pickle names is looked up in
    `_METADATA_GLOBALS` (exact module and name: no dotted attribute paths); anything else raises
    UnsafeCheckpointError, before it is imported or resolved."""

    def find_class(self, module: str, name: str):
        found = _METADATA_GLOBALS.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.where}: refusing to unpickle the global {module}.{name}: a DCP .metadata holds only DCP's "
                "metadata classes, so this file was not written by torch.distributed.checkpoint or was tampered "
                "with, and unpickling it (as torch's own reader does) would run that code. Do not load it with "
                "dcp.load, torch.load or pickle; restore the checkpoint from a trusted copy")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id, which DCP metadata never holds")


# ---------------------------------------------------------------------- a tensor's torch.save archive
@dataclasses.dataclass(frozen=True)
class _StorageType:
    """What a `torch.<X>Storage` global in a data.pkl stands for: the dtype of its elements (None: bytes)."""
    name: str
    dtype: torch.dtype | None


@dataclasses.dataclass(frozen=True)
class _StorageRef:
    """A storage the data.pkl refers to by persistent id ("storage", type, key, location, numel): only
    `_TensorPickle.persistent_load` makes one, so a tensor cannot name a storage the pickle built itself."""
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    """What a tensor's data.pkl says: storage `key` holding `numel` elements of `storage_dtype` (bytes
    when None), and the tensor as (offset, shape, strides) over it."""
    key: str
    storage_dtype: torch.dtype | None
    numel: int
    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype | None


def _stored_tensor(storage, storage_offset, size, stride, dtype, metadata) -> _StoredTensor:
    if not isinstance(storage, _StorageRef) or metadata or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("not a plain tensor (a subclass, a conjugate or negative bit, or no storage)")
    if type(storage_offset) is not int or not 0 <= storage_offset <= _MAX_INT:
        raise pickle.UnpicklingError(f"storage offset {_brief.repr(storage_offset)}")
    return _StoredTensor(storage.key, storage.dtype, storage.numel, storage_offset, _size(size), _size(stride), dtype)


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2's arguments, recorded (a typed storage: its dtype is the tensor's)."""
    return _stored_tensor(storage, storage_offset, size, stride,
                          storage.dtype if isinstance(storage, _StorageRef) else None, metadata)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    """torch._utils._rebuild_tensor_v3's arguments, recorded (an untyped storage and the tensor's dtype)."""
    return _stored_tensor(storage, storage_offset, size, stride, dtype, metadata)


class _TensorPickle(_RestrictedUnpickler):
    """Parses a tensor's data.pkl into a `_StoredTensor` without calling anything of torch's: the
    rebuild functions are replaced by recorders and the storage by a `_StorageRef`."""
    GLOBALS: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("collections", "OrderedDict"): collections.OrderedDict,   # the (empty) backward hooks
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.GLOBALS:
            return self.GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name, _STORAGE_DTYPES[name])
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle the global {module}.{name} in a tensor's data.pkl: a tensor item "
            "written by DCP names only torch's tensor rebuild function and storage classes, so this file was "
            "not written by torch.distributed.checkpoint or was tampered with. Do not load it with dcp.load or "
            "torch.load; restore the checkpoint from a trusted copy")

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and type(pid[2]) is str and type(pid[4]) is int and 0 <= pid[4] <= _MAX_INT):
            return _StorageRef(pid[2], pid[1].dtype, pid[4])
        raise pickle.UnpicklingError(f"a persistent id that is not a tensor storage: {_brief.repr(pid)}")


def _unpickle_tensor(raw: bytes, where: str, bad: Callable[[str], CheckpointError]) -> Any:
    try:
        return _TensorPickle(raw, where).load()
    except CheckpointError:
        raise
    except Exception as e:   # a hostile pickle fails in any of pickle's ways (UnpicklingError, EOFError, ...)
        raise bad(f"its data.pkl is not a plain tensor ({type(e).__name__}: {str(e)[:200]})") from None


class _Budget:
    """The bytes the reader may still decode into memory while it reads a checkpoint's metadata (values, the
    tensors inside plain values): MAX_INLINE_BYTES in all, whatever the files claim."""

    def __init__(self, total: int = MAX_INLINE_BYTES):
        self.left = total

    def take(self, n: int) -> bool:
        """Spend `n` bytes; False (and nothing spent) when fewer are left."""
        if n > self.left:
            return False
        self.left -= n
        return True


def _unzip_bounded(raw: bytes, where: str, what: str, budget: _Budget) -> io.BytesIO:
    """The torch.save archive `raw` rewritten with every entry stored (uncompressed), for torch.load to read.

    torch's own reader inflates whatever an archive says: a 1 MB deflated entry becomes 1 GiB before a
    single check runs. Here each entry is read through zipfile, whose reads stop at the entry's declared
    size and check its CRC, in pieces of _INFLATE_PIECE: the declared sizes must fit in `budget` before
    anything is inflated, and the bytes inflated are counted against it as they come, so nothing past it
    is ever produced. torch.save writes stored entries only: such an archive is handed over as it is
    (`_stored_as_is`), with no copy. CorruptCheckpointError naming `where` and `what` (e.g. "value 'sched'")
    for a damaged or inflating archive; UnsupportedError when stored values alone exceed the budget.
    """
    def bad(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {what}: {detail}; the file is damaged or was not written by "
                                      "torch.save: restore it from a good copy")

    out = io.BytesIO()
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
            infos = zin.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise bad(f"its zip names an entry twice ({_brief.repr(twice)})")
            for i in infos:
                if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise bad(f"zip entry {i.filename!r} is compressed with method {i.compress_type}, which torch's "
                              "reader does not read")
            declared = sum(i.file_size for i in infos)
            stored = _stored_as_is(raw, zin, infos)
            if declared > budget.left:
                if stored:
                    raise UnsupportedError(
                        f"{where}: {what} takes {declared} bytes, and with what was read before it exceeds the "
                        f"{MAX_INLINE_BYTES >> 20} MiB omnickpt decodes while reading a DCP checkpoint's metadata; "
                        "load this checkpoint with dcp.load (and save it with omnickpt)")
                raise bad(f"its zip entries declare {declared} bytes uncompressed ({len(raw)} stored), past the "
                          f"{MAX_INLINE_BYTES >> 20} MiB omnickpt decodes while reading a DCP checkpoint's metadata "
                          f"({budget.left} bytes of it left); torch.save stores its entries uncompressed, so this "
                          "is no value DCP wrote")
            if stored:
                budget.take(declared)
                return io.BytesIO(raw)
            for i in infos:
                got = 0
                with zin.open(i) as src, zout.open(i.filename, "w") as dst:
                    while piece := src.read(_INFLATE_PIECE):
                        got += len(piece)
                        if got > i.file_size or not budget.take(len(piece)):
                            raise bad(f"zip entry {i.filename!r} inflates past its declared {i.file_size} bytes or "
                                      f"the {MAX_INLINE_BYTES >> 20} MiB omnickpt decodes with the metadata")
                        dst.write(piece)
    except CheckpointError:
        raise
    except Exception as e:   # zipfile and zlib fail on hostile bytes in many ways (BadZipFile, zlib.error, EOFError...)
        raise bad(f"not a readable torch.save archive ({type(e).__name__}: {str(e)[:200]})") from None
    out.seek(0)
    return out


def _stored_as_is(raw: bytes, zin: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> bool:
    """Whether torch's reader may be given the archive `raw` itself: every entry stored (nothing to inflate),
    and the central directory zipfile read is the one the end record points at. torch's reader (miniz) reads
    the directory at that offset, while zipfile also accepts bytes prepended to an archive and then reads the
    directory just before the end record: a crafted archive could show zipfile a stored directory and torch
    a deflated one. (Repacking every value instead costs 2.5x the decode time: 600 us per value, and a
    torchtitan optimizer saves thousands of param_groups values.)"""
    if any(i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size for i in infos):
        return False
    end = raw.rfind(b"PK\x05\x06", max(0, len(raw) - 22 - 0xFFFF))
    if end < 0 or end + 22 > len(raw):
        return False
    directory = struct.unpack_from("<I", raw, end + 16)[0]
    return directory != 0xFFFFFFFF and directory == zin.start_dir


def _decode_value(fqn: str, raw: bytes, where: str, budget: _Budget) -> Any:
    """A BytesStorageMetadata item: torch.save bytes, unzipped within `budget` and decoded by torch's weights-only
    unpickler only."""
    archive = _unzip_bounded(raw, where, f"value {fqn!r}", budget)
    try:
        return torch.load(archive, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CorruptCheckpointError(f"{where}: value {fqn!r} is not a readable torch.save archive ({e}); the data "
                                         "file is damaged") from None
        lines = str(e).strip().splitlines()
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0])
        raise UnsafeCheckpointError(
            f"{where}: value {fqn!r} cannot be decoded without running code from the checkpoint (torch's "
            f"weights-only unpickler refused it: {reason.strip()[:200]}); omnickpt never unpickles fully, so it cannot "
            "read this checkpoint. If you trust its origin, load it with dcp.load and save it with omnickpt") from None
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: value {fqn!r} is not a readable torch.save archive "
                                     f"({type(e).__name__}: {e}); the data file is damaged") from None

