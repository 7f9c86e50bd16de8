"""A DCP folder's `.metadata`: its names, and its records validated (types, shapes, chunks inside their
tensor and not overlapping, a stored item for every chunk, safe file names) before anything is read from
the files it names. The pickle itself is decoded by `unpickle._MetadataUnpickler`."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedError
from omnickpt.format import SavedBox
from omnickpt.format.manifest import dtype_name, overlap_problem, safe_relative_path
from omnickpt.formats.dcp.unpickle import (_brief, _BytesStorageMetadata, _ChunkStorageMetadata, _count, _Metadata,
                                           _MetadataIndex, _MetadataUnpickler, _shape, _StorageInfo, _StorageMeta,
                                           _TensorProperties, _TensorStorageMetadata)

METADATA_NAME = ".metadata"
# Megatron-core writes this beside a dist_checkpointing save ({"sharded_backend": "torch_dist", ...}).
MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"      # its non-sharded state, torch.save'd
DATA_SUFFIX = ".distcp"
_DISTCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


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
    # Every stored item is checked before any entry refers to one, so an entry's error names the entry.
    items = dict(_storage_item(index, info, bad, where) for index, info in storage.items())
    tensors, values = _entry_records(entries, items, bad, where)
    meta = md.get("storage_meta")
    save_id = meta.get("save_id") if isinstance(meta, _StorageMeta) else None
    mcore = md.get("mcore_data")
    version = md.get("version")
    return _Parsed(tensors, values, _planner_paths(md.get("planner_data")),
                   version if isinstance(version, str) else "", save_id if isinstance(save_id, str) else "",
                   mcore if isinstance(mcore, dict) else {})


def _storage_item(index: object, info: object, bad: Callable, where: str) -> tuple[tuple[str, tuple | None], _Item]:
    """One `storage_data` record as ((flat key, chunk offsets or None for a value), where its bytes lie)."""
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
    return (fqn, offset), _Item(safe_relative_path(path, where), start, length)


def _entry_records(entries: dict, items: dict[tuple[str, tuple | None], _Item], bad: Callable,
                   where: str) -> tuple[dict[str, _DcpTensor], dict[str, _Item]]:
    """`state_dict_metadata`'s entries split into tensor records and non-tensor values' stored items."""
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
    return tensors, values


def _planner_paths(planner: object) -> dict[str, tuple]:
    """planner_data's path of each flat key. It only names things, so a malformed path is dropped (the key
    then reads as a top-level key) rather than refused."""
    if not isinstance(planner, dict):
        return {}
    return {key: path for key, path in planner.items()
            if isinstance(key, str) and isinstance(path, tuple) and 0 < len(path) <= 64
            and all(type(p) in (str, int) for p in path) and ".".join(map(str, path)) == key}


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


