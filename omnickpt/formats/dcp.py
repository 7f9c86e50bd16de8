"""PyTorch Distributed Checkpoint (DCP) folders: read one as our manifest (so it loads into any parallel
layout, at any world size) and write one from any checkpoint omnickpt reads (`export_dcp`).

A DCP folder written by `FileSystemWriter` holds `.metadata`, a pickle of DCP's `Metadata` (every
flattened state-dict key: a tensor's global shape, dtype and chunks, or a non-tensor value; where each
item lies: file, offset, length), and `__<rank>_<n>.distcp` files. Each item in a .distcp file is one
`torch.save` archive (a zip). A tensor chunk's archive stores its storage uncompressed
(`<archive>/data/<key>`), so once the archive's zip headers and its `data.pkl` are read, the chunk is
one box pointing straight at its raw row-major bytes, and loading is the same planned, parallel,
ranged reading and resharding as for our own checkpoints.

Nothing in the folder is trusted or executed:
- `.metadata` is unpickled by `_MetadataUnpickler`, which admits only DCP's metadata classes and turns
  even those into inert records (no class or method of torch's runs); any other global is refused with
  UnsafeCheckpointError before it is looked up. A pickle that would call os.system runs nothing.
- a tensor's archive is read with the zipfile module (stored entries only, nothing is decompressed) and
  its `data.pkl` is parsed by `_TensorPickle`, which admits only the rebuild call of a plain tensor and
  records its storage key, offset, shape and strides instead of calling anything. Both unpicklers are
  Python's own (`_RestrictedUnpickler`: no memo table sized by the pickle, BUILD on records only).
- non-tensor values (DCP's BytesStorageMetadata items, written with torch.save) and Megatron's common.pt
  are unzipped by `_unzip_bounded` (never past MAX_INLINE_BYTES, whatever the archive declares) and only
  then decoded with `torch.load(weights_only=True)`, never with a full unpickle, and re-encoded with
  encode_object.
DCP stores no checksums we can use (the zip's CRC-32 covers a whole chunk, so a ranged read cannot
check it): boxes carry `sums=None`, and the tensor bytes of a DCP checkpoint are not verified on load.

Names: DCP flattens the nested state dict it was given, joining keys with "."; `Metadata.planner_data`
keeps each flat key's path (a tuple of keys), which `_entries` maps to omnickpt's names entry by entry
(docs/dcp.md has the table): a module's state dict `model/<fqn>`, an optimizer's state dict from
`get_optimizer_state_dict` as omnickpt's optimizer adapter saves one (`<key>/state/<fqn>/<state key>`
tensors and one object with the param groups naming their parameters), any other entry as one object.
A Megatron-core `torch_dist` checkpoint (DCP underneath, flat ShardedTensor keys) maps its keys as
omnickpt's Megatron adapter names them.

Writing (`export_dcp`): the folder is written here in DCP's format rather than by dcp.save, which
needs the whole state in memory at once: each tensor chunk (the source's boxes, big ones cut into
rows) is read, torch.save'd into `__0_0.distcp` as FileSystemWriter would, and dropped; `.metadata`
is pickled last from DCP's own classes. Memory stays near one chunk.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import io
import json
import math
import os
import pickle
import re
import reprlib
import struct
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format import FileEntry, Manifest, ObjectEntry, SavedBox, ShardRef, TensorEntry, encode_object
from omnickpt.format.manifest import _MAX_DIMS, dtype_from_name, dtype_name, overlap_problem, safe_relative_path
from omnickpt.storage import Storage
from omnickpt.storage.base import require_length

METADATA_NAME = ".metadata"
# Megatron-core writes this beside a dist_checkpointing save ({"sharded_backend": "torch_dist", ...}).
MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"      # its non-sharded state, torch.save'd
DATA_SUFFIX = ".distcp"
_DCP_VERSION = "1.0.0"          # what export writes: the Metadata.version of torch 2.4 and later
_DISTCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_MAX_INT = 1 << 62
# A tensor item's zip headers and data.pkl lie in its first ~700 bytes and its central directory in
# its last ~800: these windows are read up front, coalesced over the items of a file, so that locating
# a chunk's bytes costs no request of its own (a read outside them goes to storage). Every rank reads
# them for every chunk: about 2 KiB per chunk.
_WINDOW = 1024
_COALESCE_GAP = 64 << 10
_MAX_DATA_PKL = 1 << 20         # a tensor's data.pkl is ~200 bytes; more is not a tensor
# What the reader holds in memory while it reads the metadata is bounded by this: the stored bytes of the
# non-tensor values (a scheduler's state, a step count), and, separately, what they decode to (every zip
# entry of their torch.save archives) plus the tensors inside plain values (not a module's or an optimizer's),
# which are read when the manifest is built and carried in the value. Real ones are small (a step counter,
# an RNG state); a value past this is refused, and a zip entry is never inflated past it.
MAX_INLINE_BYTES = 256 << 20
_INFLATE_PIECE = 1 << 20        # a compressed zip entry is inflated this much at a time, counted as it goes
# Export: a box larger than this is written as several DCP chunks of whole rows, so that memory stays
# near this size (or one row) whatever the tensor's size.
EXPORT_CHUNK_BYTES = 64 << 20
_MEGATRON_OPTIMIZER = "optimizer.state."

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
            raise pickle.UnpicklingError("a BUILD (set state) of something that is not a DCP metadata record")
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


# ---------------------------------------------------------------------- .metadata: validated records
@dataclasses.dataclass(frozen=True)
class _Item:
    """Where one stored item lies: bytes [offset, offset + length) of `path`."""
    path: str
    offset: int
    length: int


@dataclasses.dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: _Item | None     # None for a chunk with no elements (nothing is stored for it)


@dataclasses.dataclass
class _DcpTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[_Chunk]


@dataclasses.dataclass
class _Parsed:
    """What `.metadata` says, validated: flat key -> tensor record or value item, paths, extras."""
    tensors: dict[str, _DcpTensor]
    values: dict[str, _Item]
    paths: dict[str, tuple]
    version: str
    save_id: str
    mcore_data: dict


def _unpickle_metadata(raw: bytes, where: str) -> _Metadata:
    try:
        md = _MetadataUnpickler(raw, where).load()
    except CheckpointError:
        raise
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: nested too deeply to be DCP metadata; the file is damaged") from None
    except Exception as e:   # pickle's errors for damaged bytes are of many classes (EOFError, ValueError, ...)
        raise CorruptCheckpointError(f"{where}: not a readable DCP .metadata ({type(e).__name__}: {e}); the file is "
                                     "truncated or damaged: restore it from a good copy") from None
    if not isinstance(md, _Metadata):
        raise CorruptCheckpointError(f"{where}: holds a {type(md).__name__}, not DCP's Metadata; the file is damaged")
    return md


def _parse_metadata(md: _Metadata, where: str) -> _Parsed:
    """Check every record of `md` (types, shapes inside bounds, chunks that do not overlap, a stored
    item for every chunk, safe file names) before anything is read from the files it names."""
    def bad(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {detail}; the DCP metadata is damaged (or was not written by "
                                      "torch.distributed.checkpoint): restore it from a good copy")

    entries, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("state_dict_metadata or storage_data is missing")
    items: dict[tuple[str, tuple | None], _Item] = {}
    for index, info in storage.items():
        if not isinstance(index, _MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage_data holds a {type(index).__name__} -> {type(info).__name__} record")
        fqn, offset = index.get("fqn"), index.get("offset")
        path, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(fqn, str) or not (offset is None or _shape(offset) is not None):
            raise bad(f"a storage record with key {_brief.repr(fqn)} and offsets {_brief.repr(offset)}")
        if not (_count(start) and _count(length)):
            raise bad(f"{fqn!r}: a stored item at offset {_brief.repr(start)} with length {_brief.repr(length)}")
        transforms = info.get("transform_descriptors")
        if transforms:
            raise UnsupportedError(
                f"{where}: {fqn!r} was written through DCP stream transforms {_brief.repr(transforms)} (e.g. "
                "compression, via FileSystemWriter(_extensions=...)); omnickpt reads only untransformed DCP files: "
                "load it with dcp.load and save it again without extensions (or with omnickpt)")
        items[(fqn, offset)] = _Item(safe_relative_path(path, where), start, length)
    tensors: dict[str, _DcpTensor] = {}
    values: dict[str, _Item] = {}
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise bad(f"a key of type {type(fqn).__name__}")
        if isinstance(entry, _BytesStorageMetadata):
            if (fqn, None) not in items:
                raise bad(f"value {fqn!r} has no stored item")
            values[fqn] = items[(fqn, None)]
            continue
        if not isinstance(entry, _TensorStorageMetadata):
            raise bad(f"{fqn!r} is described by a {type(entry).__name__}")
        tensors[fqn] = _tensor_record(fqn, entry, items, bad, where)
    planner = md.get("planner_data")
    paths = {}
    if isinstance(planner, dict):
        for key, path in planner.items():
            if (isinstance(key, str) and isinstance(path, tuple) and 0 < len(path) <= 64
                    and all(type(p) in (str, int) for p in path) and ".".join(map(str, path)) == key):
                paths[key] = path
    meta = md.get("storage_meta")
    save_id = meta.get("save_id") if isinstance(meta, _StorageMeta) else None
    mcore = md.get("mcore_data")
    version = md.get("version")
    return _Parsed(tensors, values, paths, version if isinstance(version, str) else "",
                   save_id if isinstance(save_id, str) else "",
                   mcore if isinstance(mcore, dict) else {})


def _tensor_record(fqn: str, entry: _TensorStorageMetadata, items: dict, bad: Callable, where: str) -> _DcpTensor:
    props, shape, chunks = entry.get("properties"), _shape(entry.get("size")), entry.get("chunks")
    if not isinstance(props, _TensorProperties) or shape is None or not isinstance(chunks, list):
        raise bad(f"tensor {fqn!r} has an incomplete record")
    dtype = props.get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise bad(f"tensor {fqn!r} has dtype {_brief.repr(dtype)}")
    layout = props.get("layout", "torch.strided")
    if layout not in ("torch.strided", None):
        raise UnsupportedError(f"{where}: tensor {fqn!r} has layout {_brief.repr(layout)}; omnickpt loads dense "
                               "(strided) tensors only")
    try:
        dtype_name(dtype)
    except CheckpointError:
        raise UnsupportedError(f"{where}: tensor {fqn!r} has dtype {dtype}, which omnickpt cannot load; load it with "
                               "dcp.load, or convert it before saving") from None
    out: list[_Chunk] = []
    for c in chunks:
        offsets, sizes = (_shape(c.get("offsets")), _shape(c.get("sizes"))) if isinstance(c, _ChunkStorageMetadata) \
            else (None, None)
        if (offsets is None or sizes is None or len(offsets) != len(shape)
                or len(sizes) != len(shape) or any(o + s > n for o, s, n in zip(offsets, sizes, shape))):
            raise bad(f"tensor {fqn!r} of shape {list(shape)} has a chunk {_brief.repr(offsets)}+{_brief.repr(sizes)} "
                      "outside it")
        if not math.prod(sizes):
            out.append(_Chunk(offsets, sizes, None))
            continue
        item = items.get((fqn, offsets))
        if item is None:
            raise bad(f"tensor {fqn!r}: chunk at offsets {list(offsets)} has no stored item")
        out.append(_Chunk(offsets, sizes, item))
    boxes = [SavedBox(c.offsets, c.sizes, 0, 0, 0, None) for c in out]
    problem = overlap_problem(shape, boxes)
    if problem:
        raise bad(f"tensor {fqn!r}: {problem}")
    return _DcpTensor(shape, dtype, out)


# ---------------------------------------------------------------------- reading the items' bytes
class _Windows:
    """Byte ranges of the data files read up front (coalesced, in parallel), and reads served from them;
    a read that falls outside them goes to storage."""

    def __init__(self, storage: Storage, executor: ThreadPoolExecutor):
        self.storage, self.executor = storage, executor
        self.ranges: dict[str, list[tuple[int, bytearray]]] = {}

    def prefetch(self, wanted: dict[str, list[tuple[int, int]]]) -> None:
        jobs = []
        for path, spans in wanted.items():
            merged: list[list[int]] = []
            for lo, hi in sorted(spans):
                if merged and lo <= merged[-1][1] + _COALESCE_GAP:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            jobs += [(path, lo, hi) for lo, hi in merged if hi > lo]
        for path, lo, buf in self.executor.map(lambda j: (j[0], j[1], self._fetch(*j)), jobs):
            self.ranges.setdefault(path, []).append((lo, buf))
        for spans in self.ranges.values():
            spans.sort(key=lambda s: s[0])

    def _fetch(self, path: str, lo: int, hi: int) -> bytearray:
        buf = bytearray(hi - lo)
        self.storage.read_into(path, lo, [memoryview(buf)])
        return buf

    def read(self, path: str, lo: int, hi: int) -> memoryview:
        spans = self.ranges.get(path, [])
        i = bisect.bisect_right(spans, lo, key=lambda s: s[0]) - 1
        if i >= 0 and hi <= spans[i][0] + len(spans[i][1]):
            start, buf = spans[i]
            return memoryview(buf)[lo - start:hi - start]
        return memoryview(self._fetch(path, lo, hi))


class _ItemFile(io.RawIOBase):
    """One stored item as a read-only file (bytes [start, start + length) of a data file), for zipfile."""

    def __init__(self, windows: _Windows, item: _Item):
        super().__init__()
        self.windows, self.item, self.pos = windows, item, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.item.length}[whence]
        if base + offset < 0:
            raise ValueError("seek before the start of the item")
        self.pos = base + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.item.length if n is None or n < 0 else min(self.item.length, self.pos + n)
        if end <= self.pos:
            return b""
        data = self.windows.read(self.item.path, self.item.offset + self.pos, self.item.offset + end)
        self.pos = end
        return bytes(data)


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


def _locate(windows: _Windows, fqn: str, t: _DcpTensor, chunk: _Chunk, describe: Callable[[str], str]) -> int:
    """The file offset of `chunk`'s raw row-major bytes inside its torch.save archive. Refuses (naming the
    file and tensor) anything that is not one plain, dense, little-endian, uncompressed tensor of the
    metadata's dtype and chunk shape."""
    item = chunk.item
    where = f"{describe(item.path)} bytes [{item.offset}, {item.offset + item.length}) (tensor {fqn!r} chunk at " \
            f"offsets {list(chunk.offsets)})"

    def bad(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {detail}; the DCP data file is damaged (or the item was not written "
                                      "by torch.distributed.checkpoint): restore it from a good copy")

    f = _ItemFile(windows, item)
    if bytes(windows.read(item.path, item.offset, item.offset + min(4, item.length))) != b"PK\x03\x04":
        raise UnsupportedError(
            f"{where}: the item is not a torch.save archive (a DCP checkpoint written with "
            "serialization_format=SAFETENSORS, or by another storage writer); omnickpt reads FileSystemWriter's "
            "default torch.save items only: load it with dcp.load and save it with omnickpt")
    try:
        with zipfile.ZipFile(f) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            pkl = next((n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")), None)
            if pkl is None:
                raise bad("the archive has no data.pkl")
            prefix = pkl[:-len("data.pkl")]
            order = infos.get(f"{prefix}byteorder")
            if order is not None and (order.file_size > 16 or _stored(zf, order) != b"little"):
                raise UnsupportedError(f"{where}: the tensor was saved on a big-endian machine; omnickpt reads "
                                       "little-endian data only")
            if infos[pkl].file_size > _MAX_DATA_PKL:
                raise bad(f"its data.pkl has {infos[pkl].file_size} bytes, far more than a tensor's")
            ref = _unpickle_tensor(_stored(zf, infos[pkl]), where, bad)
            if not isinstance(ref, _StoredTensor):
                raise bad(f"its data.pkl holds a {type(ref).__name__}, not a tensor")
            entry = infos.get(f"{prefix}data/{ref.key}")
            if entry is None:
                raise bad(f"the archive has no storage {ref.key!r}")
            if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
                raise bad("the tensor's storage is compressed")
            start = _entry_data_start(f, entry)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, struct.error, EOFError, ValueError, KeyError, TypeError,
            IndexError, OverflowError, NotImplementedError, RuntimeError, RecursionError) as e:
        raise bad(f"not a readable torch.save archive ({type(e).__name__}: {e})") from None
    dtype = ref.dtype
    if dtype != t.dtype:
        raise bad(f"it holds a {dtype} tensor but the metadata says {t.dtype}")
    if ref.shape != chunk.sizes:
        raise bad(f"it holds a tensor of shape {list(ref.shape)} but the metadata says {list(chunk.sizes)}")
    expected = 1
    for n, s in reversed(list(zip(ref.shape, ref.stride))):
        if n > 1 and s != expected:
            raise UnsupportedError(f"{where}: the tensor is stored with strides {list(ref.stride)} (not row-major: "
                                   "e.g. channels-last or transposed); omnickpt maps row-major chunks only: load "
                                   "it with dcp.load and save it with omnickpt")
        expected *= n
    itemsize = dtype.itemsize
    storage_bytes = ref.numel * (ref.storage_dtype.itemsize if ref.storage_dtype is not None else 1)
    if ref.storage_dtype is not None and ref.storage_dtype != dtype:
        raise bad(f"its storage holds {ref.storage_dtype} elements for a {dtype} tensor")
    lo = ref.offset * itemsize
    if (storage_bytes != entry.file_size or lo + math.prod(chunk.sizes) * itemsize > storage_bytes
            or start + entry.file_size > item.length):
        raise bad(f"its storage of {entry.file_size} bytes does not hold the tensor (storage offset {ref.offset}, "
                  f"{math.prod(chunk.sizes)} elements of {itemsize} bytes)")
    return item.offset + start + lo


def _unpickle_tensor(raw: bytes, where: str, bad: Callable[[str], CheckpointError]) -> Any:
    try:
        return _TensorPickle(raw, where).load()
    except CheckpointError:
        raise
    except Exception as e:   # a hostile pickle fails in any of pickle's ways (UnpicklingError, EOFError, ...)
        raise bad(f"its data.pkl is not a plain tensor ({type(e).__name__}: {str(e)[:200]})") from None


def _stored(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """An entry's bytes, read only when stored uncompressed (nothing is ever inflated)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"entry {info.filename} is compressed")
    return zf.read(info)


def _entry_data_start(f: _ItemFile, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start inside the archive: after its local header (whose name and extra
    field lengths may differ from the central directory's: torch pads the extra field to align data)."""
    f.seek(info.header_offset)
    header = f.read(30)
    sig, *_, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", header)
    if sig != 0x04034B50:
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    if f.read(name_len) != info.filename.encode():
        raise zipfile.BadZipFile(f"the local header of {info.filename} names another file")
    return info.header_offset + 30 + name_len + extra_len


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


# ---------------------------------------------------------------------- reading a folder
def read_manifest(storage: Storage) -> Manifest | None:
    """The manifest of the PyTorch DCP checkpoint at `storage`, or None when it is not one (no
    `.metadata` there; a folder that does not exist is not one: one failed read decides).

    Every tensor chunk becomes a box at its raw bytes inside its `.distcp` file, with `sums=None` (DCP
    stores no checksums omnickpt can use). Names and objects follow omnickpt's adapters (see the module
    docstring and docs/dcp.md): a checkpoint written by `dcp.save({"model": get_model_state_dict(m),
    "optimizer": get_optimizer_state_dict(m, o)})` loads with `omnickpt.load(path, {"model": m,
    "optimizer": o})` at any world size. `layout` holds {"format": "dcp", "world_size": the saving
    ranks, "dcp_version"}; "implied_keys" lists the state keys the reader chose because the checkpoint
    has none ("model" for a model state dict saved at the top level; "model" and "optimizer" for a
    Megatron torch_dist checkpoint); and, for Megatron, {"megatron": its metadata.json, "skipped": ...}.

    Raises UnsafeCheckpointError for a `.metadata` or tensor pickle naming anything but DCP's own
    classes, or a value torch's weights-only unpickler refuses (nothing is executed either way);
    CorruptCheckpointError (naming the file, and the tensor) for damaged metadata, a missing or
    truncated data file, or an item that is not what the metadata says; UnsupportedError for what
    omnickpt cannot map (stream transforms such as compression, safetensors-serialised items,
    non-row-major or big-endian tensors, dtypes the omnickpt format lacks).
    """
    try:
        raw = storage.read_bytes(METADATA_NAME)
    except FileNotFoundError:
        return None
    where = storage.describe(METADATA_NAME)
    parsed = _parse_metadata(_unpickle_metadata(raw, where), where)
    megatron = _megatron_info(storage)
    files, index = _files(storage, parsed)
    _check_value_bytes(parsed, storage)
    budget = _Budget()
    with ThreadPoolExecutor(8, thread_name_prefix="omnickpt-dcp") as pool:
        windows = _Windows(storage, pool)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in parsed.values.values():
            wanted.setdefault(item.path, []).append((item.offset, item.offset + item.length))
        for t in parsed.tensors.values():
            for it in (c.item for c in t.chunks if c.item is not None):
                head, tail = min(it.length, _WINDOW), max(0, it.length - _WINDOW)
                wanted.setdefault(it.path, []).extend([(it.offset, it.offset + head),
                                                       (it.offset + tail, it.offset + it.length)])
        windows.prefetch(wanted)
        located: dict[str, list[tuple[_Chunk, int]]] = {
            fqn: [(c, _locate(windows, fqn, t, c, storage.describe) if c.item is not None else -1) for c in t.chunks]
            for fqn, t in parsed.tensors.items()}
        values = {fqn: _decode_value(fqn, bytes(windows.read(it.path, it.offset, it.offset + it.length)),
                                     storage.describe(it.path), budget)
                  for fqn, it in parsed.values.items()}
        if megatron is not None:
            tensors, objects = _megatron_entries(parsed, located, values, index, storage.describe(""))
            objects.update(_megatron_common(storage, megatron, budget))
        else:
            tensors, objects = _entries(_paths(parsed), parsed, located, values, index, windows, storage.describe(""),
                                        budget)
    world = 1 + max((f.rank for f in files), default=0)
    layout: dict[str, Any] = {"format": "dcp", "world_size": world, "dcp_version": parsed.version}
    # State keys the checkpoint does not hold but this reader chose (like "model" for a Hugging Face
    # folder), so that the api may bind them to the state's own keys.
    if megatron is not None:
        implied = sorted({n.split("/", 1)[0] for n in [*tensors, *objects]} & {"model", "optimizer"})
    elif "model" not in _top_keys(parsed) and any(n.startswith("model/") for n in tensors):
        implied = ["model"]
    else:
        implied = []
    if implied:
        layout["implied_keys"] = implied
    if megatron is not None:
        layout["megatron"] = megatron
    return Manifest(save_id=parsed.save_id or "dcp", world_size=world, files=files, tensors=tensors,
                    objects={k: [_inline(v, k)] for k, v in objects.items()}, layout=layout)


def _check_value_bytes(parsed: _Parsed, storage: Storage) -> None:
    """Refuse, before reading them, non-tensor values whose stored bytes (read into memory with the metadata)
    exceed MAX_INLINE_BYTES in all."""
    stored = sum(it.length for it in parsed.values.values())
    if stored > MAX_INLINE_BYTES:
        fqn, it = max(parsed.values.items(), key=lambda kv: kv[1].length)
        raise UnsupportedError(
            f"{storage.describe()}: the checkpoint's non-tensor values take {stored} bytes (the largest, {fqn!r}, "
            f"{it.length} bytes in {storage.describe(it.path)}), which omnickpt reads into memory with the metadata; "
            f"more than {MAX_INLINE_BYTES >> 20} MiB is refused: load this checkpoint with dcp.load (and save it "
            "with omnickpt, the large tensors as tensors of their own)")


def _files(storage: Storage, parsed: _Parsed) -> tuple[list[FileEntry], dict[str, int]]:
    """The data files the metadata names, with their sizes (one query each); a file that is missing or
    shorter than an item in it fails here, naming what lies past its end."""
    ends: dict[str, list[tuple[int, str]]] = {}
    for fqn, it in parsed.values.items():
        ends.setdefault(it.path, []).append((it.offset + it.length, f"value {fqn!r}"))
    for fqn, t in parsed.tensors.items():
        for c in t.chunks:
            if c.item is not None:
                ends.setdefault(c.item.path, []).append((c.item.offset + c.item.length,
                                                         f"tensor {fqn!r} chunk at offsets {list(c.offsets)}"))
    files, index = [], {}
    for path in sorted(ends):
        size = storage.size(path)
        require_length(storage, path, size, ends[path], "DCP metadata")
        m = _DISTCP_FILE.fullmatch(path.rsplit("/", 1)[-1])
        index[path] = len(files)
        files.append(FileEntry(path, int(m.group(1)) if m else 0, size))
    return files, index


def _inline(value: Any, key: str) -> ObjectEntry:
    data = encode_object(value, where=key)
    return ObjectEntry(ranks=[0], file=-1, offset=0, nbytes=len(data), checksum=0, inline=data)


# ---------------------------------------------------------------------- names
def _top_keys(parsed: _Parsed) -> set[str]:
    return {str(p[0]) for p in _paths(parsed).values()}


def _paths(parsed: _Parsed) -> dict[str, tuple]:
    """Each flat key's path in the state dict DCP was given: planner_data's, or (without it: a planner
    that did not flatten) the key itself as a top-level key."""
    return {fqn: parsed.paths.get(fqn, (fqn,)) for fqn in [*parsed.tensors, *parsed.values]}


def _megatron_info(storage: Storage) -> dict | None:
    """Megatron-core's metadata.json beside a torch_dist save, or None when there is none."""
    try:
        doc = json.loads(storage.read_bytes(MEGATRON_METADATA))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):
        return None     # not Megatron's file: the folder reads as plain DCP
    if not isinstance(doc, dict) or doc.get("sharded_backend") != "torch_dist":
        return None
    return {k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _megatron_entries(parsed: _Parsed, located: dict, values: dict, index: dict[str, int],
                      where: str) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """A Megatron torch_dist checkpoint's items, named as omnickpt's Megatron adapter names them.

    Its keys are Megatron's ShardedTensor keys, with no state key above them: tensors are the model's
    (`model/<key>`), except `optimizer.state.<state key>.<param key>` (`optimizer/state/<param key>/<state
    key>`); ShardedObjects (`<key>/shard_<offset>_<shape>`, e.g. extra states) are objects `model/<key>`, or
    `optimizer/<key>` for keys starting with "optimizer.". A tensor saved with a `flattened_range`
    (distributed-optimizer state) is stored as Megatron's "N-D flattened" reformulation, global shape
    [X // x, Y // y, ..., x * y * ...] with the original shape in `mcore_data`: each chunk, a flat range of
    one local block, becomes the boxes of that range in the original tensor (layout.flat_range_to_boxes).
    """
    from omnickpt.layout import flat_range_to_boxes
    tensors: dict[str, TensorEntry] = {}
    for fqn, t in parsed.tensors.items():
        name = f"model/{fqn}"
        if fqn.startswith(_MEGATRON_OPTIMIZER):
            state_key, _, param = fqn[len(_MEGATRON_OPTIMIZER):].partition(".")
            if state_key and param:
                name = f"optimizer/state/{param}/{state_key}"
        itemsize = t.dtype.itemsize
        orig = (parsed.mcore_data.get(fqn) or {}).get("nd_reformulated_orig_global_shape") \
            if isinstance(parsed.mcore_data.get(fqn), dict) else None
        if orig is None:
            boxes = [SavedBox(c.offsets, c.sizes, index[c.item.path], at, math.prod(c.sizes) * itemsize, None)
                     for c, at in located[fqn] if c.item is not None]
            tensors[name] = TensorEntry(t.shape, dtype_name(t.dtype), boxes)
            continue
        try:
            shape = _size(orig)
        except pickle.UnpicklingError:
            shape = ()
        n = len(shape)
        if (not n or len(t.shape) != n + 1 or any(f < 1 or s % f for s, f in zip(shape, t.shape))
                or math.prod(s // f for s, f in zip(shape, t.shape)) != t.shape[n]):
            raise CorruptCheckpointError(
                f"{where}: Megatron tensor {fqn!r} is stored flattened as shape {list(t.shape)}, which is no regular "
                f"grid of its original shape {_brief.repr(orig)}; the checkpoint's metadata is damaged")
        block = tuple(s // f for s, f in zip(shape, t.shape))
        boxes = []
        for c, at in located[fqn]:
            if c.item is None:
                continue
            if any(size != 1 for size in c.sizes[:n]):
                raise CorruptCheckpointError(
                    f"{where}: Megatron tensor {fqn!r}: chunk {list(c.offsets)}+{list(c.sizes)} spans several local "
                    "blocks of a flattened tensor; the metadata is damaged")
            origin = tuple(o * b for o, b in zip(c.offsets[:n], block))
            done = 0
            for box in flat_range_to_boxes(block, c.offsets[n], c.sizes[n]):
                offsets = tuple(o + b for o, b in zip(origin, box.offsets))
                boxes.append(SavedBox(offsets, box.lengths, index[c.item.path], at + done * itemsize,
                                      box.numel * itemsize, None))
                done += box.numel
        problem = overlap_problem(shape, boxes)
        if problem:
            raise CorruptCheckpointError(f"{where}: Megatron tensor {fqn!r}: {problem}; the metadata is damaged")
        tensors[name] = TensorEntry(shape, dtype_name(t.dtype), boxes)
    objects = {f"{'optimizer' if fqn.startswith('optimizer.') else 'model'}/{fqn}": v for fqn, v in values.items()}
    return tensors, objects


def _megatron_common(storage: Storage, info: dict, budget: _Budget) -> dict[str, Any]:
    """The top-level entries of Megatron's common.pt (its non-sharded state: an optimizer's param groups and
    step, the iteration, ...), each one object, read with torch's weights-only unpickler (argparse.Namespace
    admitted, read as a dict) after `_unzip_bounded` (a damaged or inflating archive is CorruptCheckpointError).
    What cannot be read without running code, or encoded, is left out and named in `info["skipped"]`; so is
    a common.pt larger than MAX_INLINE_BYTES (it is not read)."""
    import argparse
    if not storage.exists(MEGATRON_COMMON):
        return {}
    size = storage.size(MEGATRON_COMMON)
    if size > MAX_INLINE_BYTES:
        info["skipped"] = {MEGATRON_COMMON: f"{size} bytes, more than the {MAX_INLINE_BYTES >> 20} MiB omnickpt reads "
                                            "with the metadata; not read"}
        return {}
    archive = _unzip_bounded(storage.read_bytes(MEGATRON_COMMON), storage.describe(MEGATRON_COMMON),
                             "Megatron's non-sharded state", budget)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(archive, weights_only=True, map_location="cpu")
    except Exception as e:
        info["skipped"] = {MEGATRON_COMMON: f"not readable without running code ({type(e).__name__}: "
                                            f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"}
        return {}
    if not isinstance(common, dict):
        return {}
    out = {}
    for key, value in common.items():
        value = _namespaces_as_dicts(value)
        try:
            encode_object(value, where=str(key))
        except CheckpointError as e:
            info.setdefault("skipped", {})[str(key)] = str(e)[:200]
            continue
        if isinstance(key, str) and key and "/" not in key:
            out[key] = value
    return out


def _namespaces_as_dicts(value: Any, depth: int = 0) -> Any:
    import argparse
    if depth > 32:
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: _namespaces_as_dicts(v, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_namespaces_as_dicts(v, depth + 1) for v in value)
    return value


def _entries(paths: dict[str, tuple], parsed: _Parsed, located: dict, values: dict, index: dict[str, int],
             windows: _Windows, where: str, budget: _Budget) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """omnickpt's tensors and objects for the DCP items, top-level key by top-level key.

    - an optimizer (sub-paths `state/<fqn>/<k>` and `param_groups/<i>/<field>`, or flattened
      `state.<fqn>.<k>` and `param_groups.<fqn>.<field>`): tensors `<key>/state/<fqn>/<k>`, one object
      {"param_groups": [{..., "params": [fqn, ...]}], "state": {fqn: {k: non-tensor value}}};
    - a module (one level of names, tensors and `*_extra_state` values only): tensors `<key>/<name>`,
      its extra states as the object {name: value};
    - top-level tensors, when one of their names holds a "." or is a parameter an optimizer entry's state
      names (a model's state dict saved flat): the module "model" (unless the state dict has a "model" entry);
    - anything else: one object, the nested value rebuilt, its tensors read into it.
    """
    groups: dict[str, list[tuple[tuple, str]]] = {}
    # A model's state dict saved flat (dcp.save(model.state_dict()), torchtitan) puts its tensors at the top
    # level: parameter names hold dots, or (a model with no submodules, an nn.Linear's "weight") are the names
    # the optimizer saved beside it keys its state by. Once one is, every top-level tensor is the model's;
    # otherwise an optimizer beside them would be the checkpoint's only entry with tensors.
    params = _optimizer_params(paths)
    flat_model = "model" not in {str(p[0]) for p in paths.values()} and any(
        len(p) == 1 and ("." in fqn or fqn in params) for fqn, p in paths.items() if fqn in parsed.tensors)
    for fqn, path in paths.items():
        top, sub = path[0], path[1:]
        if flat_model and not sub and (fqn in parsed.tensors or fqn.endswith("_extra_state")):
            top, sub = "model", (fqn,)
        groups.setdefault(str(top), []).append((sub, fqn))
    if any("/" in k or not k for k in groups):
        bad = next(k for k in groups if "/" in k or not k)
        raise UnsupportedError(f"{where}: the DCP state dict has a top-level key {bad!r}; omnickpt state keys are "
                               "non-empty and hold no '/'")
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}

    def add_tensor(name: str, fqn: str) -> None:
        t = parsed.tensors[fqn]
        boxes = [SavedBox(c.offsets, c.sizes, index[c.item.path], at, math.prod(c.sizes) * t.dtype.itemsize, None)
                 for c, at in located[fqn] if c.item is not None]
        tensors[name] = TensorEntry(t.shape, dtype_name(t.dtype), boxes)

    def leaf(fqn: str) -> Any:
        if fqn in values:
            return values[fqn]
        return _read_whole(fqn, parsed.tensors[fqn], located[fqn], windows, budget, where)

    for key, members in groups.items():
        subs = [s for s, _ in members]
        optimizer = _optimizer_form(subs)
        if optimizer is not None:
            objects[key] = _optimizer(key, members, optimizer, parsed, leaf, add_tensor)
        elif _module_form(members, parsed):
            extra = {}
            for (name,), fqn in members:
                if fqn in parsed.tensors:
                    add_tensor(f"{key}/{name}", fqn)
                else:
                    extra[name] = values[fqn]
            if extra:
                objects[key] = extra
        else:
            objects[key] = _nest([(s, leaf(f)) for s, f in members], key, where)
    return tensors, objects


def _optimizer_params(paths: dict[str, tuple]) -> set[str]:
    """The parameter names the state of the state dict's optimizer entries is keyed by."""
    subs: dict[str, list[tuple]] = {}
    for path in paths.values():
        subs.setdefault(str(path[0]), []).append(path[1:])
    names: set[str] = set()
    for members in subs.values():
        form = _optimizer_form(members)
        if form == "nested":
            names |= {s[1] for s in members if s[0] == "state"}
        elif form == "flat":
            names |= {s[0][len("state."):].rpartition(".")[0] for s in members if s[0].startswith("state.")}
    return names


def _module_form(members: list[tuple[tuple, str]], parsed: _Parsed) -> bool:
    """A module's state dict: one level of names, tensors and nothing else but `*_extra_state` values (all
    that nn.Module.state_dict holds). A dict that also holds other values is a plain value."""
    return (all(len(s) == 1 and isinstance(s[0], str) for s, _ in members)
            and any(f in parsed.tensors for _, f in members)
            and all(f in parsed.tensors or s[0].endswith("_extra_state") for s, f in members))


def _optimizer_form(subs: list[tuple]) -> str | None:
    """"nested" or "flat" when the sub-paths are those of get_optimizer_state_dict's output (nested, or
    with flatten_optimizer_state_dict=True), else None."""
    if not any(s and s[0] == "param_groups" or s and str(s[0]).startswith("param_groups.") for s in subs):
        return None
    if all(len(s) == 3 and s[0] in ("state", "param_groups") and isinstance(s[2], str)
           and isinstance(s[1], str if s[0] == "state" else int) for s in subs):
        return "nested"
    if all(len(s) == 1 and isinstance(s[0], str) and s[0].startswith(("state.", "param_groups.")) for s in subs):
        return "flat"
    return None


def _optimizer(key: str, members: list[tuple[tuple, str]], form: str, parsed: _Parsed, leaf: Callable[[str], Any],
               add_tensor: Callable[[str, str], None]) -> dict:
    """The object omnickpt's optimizer adapter saves, and its state tensors (through `add_tensor`)."""
    extra: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}    # flat form: each parameter's group fields
    for sub, fqn in members:
        if form == "nested":
            kind, owner, field = sub
        else:
            kind, _, rest = sub[0].partition(".")
            owner, _, field = rest.rpartition(".")
        if kind == "state":
            if fqn in parsed.tensors:
                add_tensor(f"{key}/state/{owner}/{field}", fqn)
            else:
                extra.setdefault(owner, {})[field] = leaf(fqn)
        elif form == "nested":
            groups.setdefault(owner, {})[field] = leaf(fqn)
        else:
            per_param.setdefault(owner, {})[field] = leaf(fqn)
    if form == "flat":
        # Flattened param groups repeat the group's fields per parameter: parameters with the same
        # fields are one group (two groups with identical fields cannot be told apart).
        merged: dict[str, dict[str, Any]] = {}
        for fqn, fields in per_param.items():
            sig = repr(sorted(fields.items()))
            merged.setdefault(sig, {**fields, "params": []})["params"].append(fqn)
        return {"param_groups": list(merged.values()), "state": extra}
    return {"param_groups": [groups[i] for i in sorted(groups)], "state": extra}


def _nest(leaves: list[tuple[tuple, Any]], key: str, where: str) -> Any:
    """The value DCP flattened into `leaves` (sub-path, value): dicts, and lists where the keys are indices."""
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]
    root: dict = {}
    for sub, value in leaves:
        if not sub:
            raise CorruptCheckpointError(f"{where}: state entry {key!r} is both a value and a container in the DCP "
                                         "metadata; the metadata is damaged")
        node = root
        for part in sub[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{where}: state entry {key!r} has a value where a container is; the "
                                             "DCP metadata is damaged")
        node[sub[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: lists(v) for k, v in node.items()}
        if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return lists(root)


def _read_whole(fqn: str, t: _DcpTensor, located: list[tuple[_Chunk, int]], windows: _Windows, budget: _Budget,
                where: str) -> torch.Tensor:
    """A tensor inside a plain value, assembled from its chunks' bytes."""
    nbytes = math.prod(t.shape) * t.dtype.itemsize
    if not budget.take(nbytes):
        raise UnsupportedError(
            f"{where}: tensor {fqn!r} is part of a plain value (not a module's or an optimizer's state dict), which "
            f"omnickpt reads into memory when it reads the checkpoint's metadata, and such tensors (with the values "
            f"read with them) exceed {MAX_INLINE_BYTES >> 20} MiB; load this entry with dcp.load, or save it as a "
            "module's state dict")
    out = torch.empty(t.shape, dtype=t.dtype)
    held = 0
    for c, at in located:
        if c.item is None:
            continue
        n = math.prod(c.sizes)
        raw = windows.read(c.item.path, at, at + n * t.dtype.itemsize)
        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(t.dtype).reshape(c.sizes)
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = src
        held += n
    if held != out.numel():
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r}: its chunks hold {held} of its {out.numel()} elements; "
                                     "the DCP metadata is damaged")
    return out


# ---------------------------------------------------------------------- export
@dataclasses.dataclass
class _TensorSlot:
    """A place in the exported state dict that holds manifest tensor `name`."""
    name: str


def export_dcp(src: str, dst: str, *, progress: bool = True, allow_pickle: bool = False) -> dict:
    """Write the checkpoint at `src` (anything omnickpt reads: an omnickpt checkpoint of any world size
    and layout, a Hugging Face folder, a DCP folder) as a DCP checkpoint at the local folder `dst`,
    which `torch.distributed.checkpoint.load` reads at any world size.

    Keys are those of `get_model_state_dict` / `get_optimizer_state_dict`, under the checkpoint's state
    keys: `model/fc1.weight` -> "model.fc1.weight"; an optimizer's `optim/state/fc1.weight/exp_avg` ->
    "optim.state.fc1.weight.exp_avg" and its param groups -> "optim.param_groups.<i>.<field>" (with
    "params" naming the parameters); other objects are written as DCP writes a nested value, each
    leaf torch.save'd. Load it with `sd = {"model": get_model_state_dict(m), "optim":
    get_optimizer_state_dict(m, o)}; dcp.load(sd, checkpoint_id=dst); set_state_dict(m, o,
    model_state_dict=sd["model"], optim_state_dict=sd["optim"])`. Per-rank objects (a dataloader's
    positions, RNG states) are written as the lowest saving rank's value. A tensor saved at the top level
    (a name with no "/") is the top-level key of that name, as `dcp.save({"w": t})` writes it.

    Every entry is keyed exactly as `dcp.save` would key the same nested state dict (its flatten rules:
    the path joined with "."), so two entries whose paths join to the same key (`{"a.b": x}` beside
    `{"a": {"b": y}}`), or a value where another entry needs a container, cannot both be written: they are
    refused (UnsupportedError naming both) before anything is written, as dcp.save refuses them.

    Streams: one file `__0_0.distcp`, written box by box in the source's own layout (a box above
    EXPORT_CHUNK_BYTES as several chunks of whole rows), each read (and verified against the source's
    checksums where it has them) just before it is written, so memory stays near the largest such
    chunk whatever the checkpoint's size; `.metadata` is written last, with DCP's own classes. `dst`
    must not hold a checkpoint yet. Returns {"path", "tensors", "chunks", "values", "bytes", "seconds"}.
    A failed export removes what it wrote (and `dst` itself when the export made it); a write that fails
    (a full disk, a read-only file system) raises StorageError naming the file and what to do.
    """
    # Export is an api-level flow over any checkpoint; read_manifest gives the errors for folders
    # holding none (imported here: api imports the readers of this package).
    from omnickpt.formats import read_manifest as read_any
    from omnickpt.engine.load import check_file_sizes, read_objects, read_tensors
    from omnickpt.formats.export import FULL_DISK_HINT, byte_progress, local_dir, make_destination, remove_written
    from omnickpt.layout import Box
    from omnickpt.monitor import PhaseTimer
    from omnickpt.planner import plan_reads
    from omnickpt.storage import storage_for
    from omnickpt.storage.base import os_failure
    from omnickpt.storage.linked import with_siblings

    t0 = time.perf_counter()
    out_dir = local_dir(str(dst))
    storage = storage_for(str(src))
    if os.path.isdir(out_dir) and os.path.realpath(out_dir) == os.path.realpath(storage.root):
        raise UnsupportedError(f"export destination {dst} is the source checkpoint itself; pass another folder")
    manifest = read_any(storage)
    storage = with_siblings(storage, str(src), manifest.files)   # an incremental checkpoint's referenced files
    objects = read_objects(storage, manifest, list(manifest.objects), 0, allow_pickle=allow_pickle, timer=PhaseTimer())
    state, owners = _export_state(manifest, objects, storage.describe())
    leaves: list[tuple[tuple, Any]] = []
    _traverse(state, leaves.append)
    _refuse_key_collisions(leaves, owners, storage.describe())
    values = [(".".join(map(str, path)), v) for path, v in leaves if not isinstance(v, (_TensorSlot, torch.Tensor))]
    # plain tensors inside objects are tensors to DCP too (one chunk each): dcp.load fills its target's in place
    plain = [(".".join(map(str, path)), v) for path, v in leaves if isinstance(v, torch.Tensor)]
    for flat, value in values:
        if _holds_slot(value):
            raise UnsupportedError(f"{storage.describe()}: {flat!r} holds a sharded tensor inside a tuple or set, "
                                   "which DCP stores as one pickled value; it cannot be exported")
    # (flat key, manifest tensor, dtype, box): the source's boxes, big ones cut into row pieces
    pieces: list[tuple[str, str, torch.dtype, Box]] = []
    for path, slot in leaves:
        if isinstance(slot, _TensorSlot):
            entry = manifest.tensors[slot.name]
            dtype = dtype_from_name(entry.dtype)
            boxes = [Box(b.offsets, b.lengths) for b in entry.boxes if math.prod(b.lengths)] or [Box.full(entry.shape)]
            flat = ".".join(map(str, path))
            pieces += [(flat, slot.name, dtype, p) for b in boxes for p in _row_pieces(b, dtype.itemsize)]
    # Plan every read before writing anything: a tensor the checkpoint does not fully hold fails now.
    items = plan_reads(manifest, [(name, box) for _, name, _, box in pieces])
    check_file_sizes(storage, manifest, items, [])
    by_piece: list[list] = [[] for _ in pieces]
    for it in items:
        by_piece[it.dest].append(dataclasses.replace(it, dest=0))
    _check_export_destination(out_dir)
    created = make_destination(out_dir)
    data_name = f"__0_0{DATA_SUFFIX}"
    written: list[str] = []
    total = sum(box.numel * dtype.itemsize for _, _, dtype, box in pieces)
    bar = byte_progress(total, progress)
    # (flat key, None for a value or (global shape, dtype, box) for a tensor chunk, offset, length)
    records: list[tuple[str, Any, int, int]] = []
    path = os.path.join(out_dir, data_name)
    sink: _Sink | None = None
    try:
        with open(path, "xb") as raw_file:
            written.append(path)
            f = sink = _Sink(raw_file)
            for flat, value in values:
                at = f.tell()
                torch.save(value, f)
                records.append((flat, None, at, f.tell() - at))
            for flat, t in plain:
                at = f.tell()
                torch.save(t.detach().cpu().contiguous(), f)
                records.append((flat, (tuple(t.shape), t.dtype, Box.full(t.shape)), at, f.tell() - at))
            for (flat, name, dtype, box), reads in zip(pieces, by_piece):
                t = torch.empty(box.lengths, dtype=dtype)
                if reads:
                    read_tensors(storage, manifest, reads, [box], [t], None, verify=True, timer=PhaseTimer())
                at = f.tell()
                torch.save(t, f)
                records.append((flat, (manifest.tensors[name].shape, dtype, box), at, f.tell() - at))
                if bar is not None:
                    bar.update(box.numel * dtype.itemsize)
                del t
            f.flush()
            os.fsync(raw_file.fileno())
        metadata = _export_metadata(leaves, records, data_name, out_dir)
        path = os.path.join(out_dir, f"{METADATA_NAME}.tmp")
        with open(path, "xb") as f:
            written.append(path)
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path, os.path.join(out_dir, METADATA_NAME))
        written[-1] = os.path.join(out_dir, METADATA_NAME)
    except BaseException as e:
        remove_written(written, out_dir if created else None)
        # torch.save reports a failed write as a RuntimeError ("unexpected pos"): the sink kept the OSError
        cause = e if isinstance(e, OSError) else sink.error if sink is not None else None
        if cause is not None:
            raise os_failure("writing the DCP export", path, cause, device=out_dir, hint=FULL_DISK_HINT) from cause
        raise
    finally:
        if bar is not None:
            bar.close()
    return {"path": out_dir, "tensors": len({name for _, name, _, _ in pieces}), "chunks": len(pieces),
            "values": len(values) + len(plain), "bytes": total, "seconds": time.perf_counter() - t0}


class _Sink:
    """The data file as torch.save sees it, keeping the OSError of a failed write: torch's zip writer turns
    that error into a RuntimeError ("unexpected pos 704 vs 598") that no longer says the disk is full."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def tell(self) -> int:
        return self.f.tell()


def _row_pieces(box, itemsize: int):
    """`box` cut along its first dimension into pieces of at most EXPORT_CHUNK_BYTES (one row at least)."""
    from omnickpt.layout import Box
    if not box.lengths or box.numel * itemsize <= EXPORT_CHUNK_BYTES:
        return [box]
    row = math.prod(box.lengths[1:]) * itemsize
    step = max(1, EXPORT_CHUNK_BYTES // max(row, 1))
    return [Box((box.offsets[0] + r,) + box.offsets[1:], (min(step, box.lengths[0] - r),) + box.lengths[1:])
            for r in range(0, box.lengths[0], step)]


def _check_export_destination(out_dir: str) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        shown = sorted(os.listdir(out_dir))
        raise CheckpointError(f"export destination {out_dir} is not empty (it holds {', '.join(shown[:3])}"
                              + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
                              + "); pass an empty or new folder")


def _export_state(manifest: Manifest, objects: dict[str, Any], where: str) -> tuple[dict, dict[tuple, str]]:
    """The nested state dict to write: what get_model_state_dict / get_optimizer_state_dict give, under
    the checkpoint's state keys, with `_TensorSlot`s where its tensors go; and, for messages, what filled
    each path ({path: "tensor 'model/w'" or "object 'sched'"}). Two entries that need the same place (a
    value where another needs a dict, or one path twice) are refused, naming both."""
    from omnickpt.adapters.generic import parse_per_rank_name   # export is an api-level flow (see export_dcp)
    state: dict[str, Any] = {}
    owners: dict[tuple, str] = {}
    claimed: set[str] = set()

    def slots(value: Any) -> Any:
        """`value` with every ShardRef (a DTensor stored as boxes) replaced by the tensor's slot."""
        if isinstance(value, ShardRef):
            if value.name in manifest.tensors:
                claimed.add(value.name)
                return _TensorSlot(value.name)
            return None
        if isinstance(value, dict):
            return {k: slots(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(slots(v) for v in value) if type(value) in (list, tuple) else value
        return value

    def place(path: tuple, value: Any, who: str) -> None:
        node = state
        for i, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise _collision(where, _owner(owners, path[:i + 1]), who, path[:i + 1],
                                 "the first is a value where the second needs a container")
        if path[-1] in node:
            raise _collision(where, _owner(owners, path), who, path, "both fill it")
        node[path[-1]] = value
        owners[path] = who

    for key, value in objects.items():
        top, _, rest = key.partition("/")
        value = slots(value)
        who = f"object {key!r}"
        if rest:     # a per-object key (Megatron's ShardedObjects: "<state key>/<unique key>")
            place((top, rest), value, who)
            continue
        if _is_optimizer_object(value):
            place((key,), {"state": {fqn: dict(v) for fqn, v in (value.get("state") or {}).items()},
                           "param_groups": value["param_groups"]}, who)
        elif isinstance(value, dict) and isinstance(state.get(key), dict):
            for k, v in value.items():
                place((key, k), v, who)
        else:
            place((key,), value, who)
    for name in manifest.tensors:
        if name in claimed:
            continue
        if parse_per_rank_name(name) is not None:
            continue   # another rank's copy of a plain value's tensor: values are written as the lowest rank's
        who = f"tensor {name!r}"
        top, _, rest = name.partition("/")
        if not rest:     # saved at the top level: DCP's key is the name itself (dcp.save({"w": t}) -> "w")
            place((name,), _TensorSlot(name), who)
            continue
        node = state.get(top)
        if isinstance(node, dict) and "state" in node and "param_groups" in node and rest.startswith("state/"):
            fqn, _, k = rest[len("state/"):].rpartition("/")
            place((top, "state", fqn, k), _TensorSlot(name), who)
        else:
            place((top, rest), _TensorSlot(name), who)
    return state, owners


def _owner(owners: dict[tuple, str], path: tuple) -> str:
    """What filled `path` or the nearest place above it (a value placed whole owns what lies inside it)."""
    return next((owners[path[:n]] for n in range(len(path), 0, -1) if path[:n] in owners), "an entry")


_RENAME_ONE = ("Nothing was written: rename one of them (a tensor: `omnickpt convert SRC NEW --to omnickpt --transform "
               "'Rename(...)'`, then export NEW; a value: in the state you save) and export again")


def _collision(where: str, first: str, second: str, path: tuple, how: str) -> UnsupportedError:
    return UnsupportedError(f"{where}: {first} and {second} both need the state dict entry {list(path)} ({how}); a "
                            f"DCP state dict holds one value per path, so one of them would be lost. {_RENAME_ONE}")


def _refuse_key_collisions(leaves: list[tuple[tuple, Any]], owners: dict[tuple, str], where: str) -> None:
    """Refuse two leaves whose paths join to the same DCP key (DCP joins a path with ".", so
    ("a.b",) and ("a", "b") are both "a.b"): the metadata can hold only one of them, and torch's own
    dcp.save raises "duplicated flatten key" for such a state dict."""
    seen: dict[str, tuple] = {}
    for path, value in leaves:
        flat = ".".join(map(str, path))
        if flat in seen:
            first = _leaf_owner(owners, *seen[flat])
            raise UnsupportedError(
                f"{where}: {first} at {list(seen[flat][0])} and {_leaf_owner(owners, path, value)} at {list(path)} "
                f"would both be written as the DCP key {flat!r} (DCP joins a path in the state dict with '.'); "
                f"torch's dcp.save refuses such a state dict and dcp.load could fill only one of them. {_RENAME_ONE}")
        seen[flat] = (path, value)


def _leaf_owner(owners: dict[tuple, str], path: tuple, value: Any) -> str:
    return f"tensor {value.name!r}" if isinstance(value, _TensorSlot) else _owner(owners, path)


def _is_optimizer_object(value: Any) -> bool:
    """The object omnickpt's optimizer adapter saves: {"param_groups": [{..., "params": [names]}], "state": {...}}."""
    return (isinstance(value, dict) and set(value) == {"param_groups", "state"}
            and isinstance(value["param_groups"], list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"]))


def _holds_slot(value: Any) -> bool:
    if isinstance(value, _TensorSlot):
        return True
    if isinstance(value, dict):
        return any(_holds_slot(v) for v in value.values())
    return isinstance(value, (list, tuple, set, frozenset)) and any(_holds_slot(v) for v in value)


def _traverse(state: dict, visit: Callable[[tuple[tuple, Any]], None]) -> None:
    """DCP's traverse_state_dict (torch 2.4+), with `_TensorSlot`s as tensors: dicts are always walked
    (keys as text), lists only when they hold a tensor or a container that does; every other value is
    a leaf. The paths are what DCP's flatten_state_dict records, so dcp.load maps them back."""
    def terminal(value: Any) -> bool:
        if isinstance(value, dict):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, (_TensorSlot, torch.Tensor)) or isinstance(v, (dict, list)) and not terminal(v)
                       for v in value)

    def walk(path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif terminal(value):
            visit((path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    for key, value in state.items():
        walk((str(key),), value)


def _export_metadata(leaves: list[tuple[tuple, Any]], records: list, data_name: str, out_dir: str):
    """DCP's Metadata for what was written, built with DCP's own classes (dcp.load unpickles it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    entries: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for flat, tensor, at, length in records:
        info = StorageInfo(relative_path=data_name, offset=at, length=length)
        if tensor is None:
            entries[flat] = BytesStorageMetadata()
            storage_data[MetadataIndex(flat)] = info
            continue
        shape, dtype, box = tensor
        md = entries.setdefault(flat, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), []))
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths)))
        storage_data[MetadataIndex(flat, box.offsets, len(md.chunks) - 1)] = info
    meta = StorageMeta(checkpoint_id=out_dir, save_id=str(uuid.uuid4()))
    return Metadata(state_dict_metadata=entries, planner_data={".".join(map(str, p)): p for p, _ in leaves},
                    storage_data=storage_data, storage_meta=meta, version=_DCP_VERSION)


__all__ = ["export_dcp", "read_manifest"]
