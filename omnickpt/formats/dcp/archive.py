"""Locating a tensor chunk inside its torch.save archive: the zip's headers and data.pkl are read (from
windows of the data files fetched up front, coalesced), checked, and the chunk becomes one box pointing
straight at its raw row-major bytes. Nothing is decompressed or executed."""
from __future__ import annotations

import bisect
import io
import math
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedError
from omnickpt.storage import Storage
from omnickpt.formats.dcp.metadata import _Chunk, _DcpTensor, _Item
from omnickpt.formats.dcp.unpickle import MAX_INLINE_BYTES, _Budget, _StoredTensor, _unpickle_tensor

# A tensor item's zip headers and data.pkl lie in its first ~700 bytes and its central directory in
# its last ~800: these windows are read up front, coalesced over the items of a file, so that locating
# a chunk's bytes costs no request of its own (a read outside them goes to storage). Every rank reads
# them for every chunk: about 2 KiB per chunk.
_WINDOW = 1024
_COALESCE_GAP = 64 << 10
_MAX_DATA_PKL = 1 << 20         # a tensor's data.pkl is ~200 bytes; more is not a tensor


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

    _require_torch_save(windows, item, where)
    ref, entry, start = _archive_tensor(_ItemFile(windows, item), where, bad)
    _check_tensor(ref, t, chunk, where, bad)
    return item.offset + start + _data_offset(ref, entry, start, chunk, item, bad)


def _require_torch_save(windows: _Windows, item: _Item, where: str) -> None:
    """Refuse an item that is no zip at all. DCP writes such items on purpose (safetensors serialisation,
    other storage writers), so this is UnsupportedError, not damage."""
    if bytes(windows.read(item.path, item.offset, item.offset + min(4, item.length))) != b"PK\x03\x04":
        raise UnsupportedError(
            f"{where}: the item is not a torch.save archive (a DCP checkpoint written with "
            "serialization_format=SAFETENSORS, or by another storage writer); omnickpt reads FileSystemWriter's "
            "default torch.save items only: load it with dcp.load and save it with omnickpt")


def _archive_tensor(f: _ItemFile, where: str,
                    bad: Callable[[str], CorruptCheckpointError]) -> tuple[_StoredTensor, zipfile.ZipInfo, int]:
    """The tensor record in the archive's data.pkl, its storage's zip entry, and where that entry's bytes
    start in the archive. Whatever a damaged zip makes zipfile raise becomes `bad(...)`; our own
    CheckpointErrors pass through with their class."""
    try:
        with zipfile.ZipFile(f) as zf:
            ref, entry = _tensor_entry(zf, where, bad)
            start = _entry_data_start(f, entry)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, struct.error, EOFError, ValueError, KeyError, TypeError,
            IndexError, OverflowError, NotImplementedError, RuntimeError, RecursionError) as e:
        raise bad(f"not a readable torch.save archive ({type(e).__name__}: {e})") from None
    return ref, entry, start


def _tensor_entry(zf: zipfile.ZipFile, where: str,
                  bad: Callable[[str], CorruptCheckpointError]) -> tuple[_StoredTensor, zipfile.ZipInfo]:
    """The tensor data.pkl describes and the stored (uncompressed) zip entry holding its storage."""
    infos = {i.filename: i for i in zf.infolist()}
    pkl = next((n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")), None)
    if pkl is None:
        raise bad("the archive has no data.pkl")
    prefix = pkl[:-len("data.pkl")]
    _require_little_endian(zf, infos.get(f"{prefix}byteorder"), where)
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
    return ref, entry


def _require_little_endian(zf: zipfile.ZipFile, order: zipfile.ZipInfo | None, where: str) -> None:
    """torch.save records the writing machine's byte order in a `byteorder` entry; the bytes are mapped as
    they lie, so only little-endian ones can be read."""
    if order is not None and (order.file_size > 16 or _stored(zf, order) != b"little"):
        raise UnsupportedError(f"{where}: the tensor was saved on a big-endian machine; omnickpt reads "
                               "little-endian data only")


def _check_tensor(ref: _StoredTensor, t: _DcpTensor, chunk: _Chunk, where: str,
                  bad: Callable[[str], CorruptCheckpointError]) -> None:
    """The stored tensor is the metadata's chunk (dtype, shape) and row-major, so its bytes are the box's."""
    if ref.dtype != t.dtype:
        raise bad(f"it holds a {ref.dtype} tensor but the metadata says {t.dtype}")
    if ref.shape != chunk.sizes:
        raise bad(f"it holds a tensor of shape {list(ref.shape)} but the metadata says {list(chunk.sizes)}")
    expected = 1
    for n, s in reversed(list(zip(ref.shape, ref.stride))):
        if n > 1 and s != expected:
            raise UnsupportedError(f"{where}: the tensor is stored with strides {list(ref.stride)} (not row-major: "
                                   "e.g. channels-last or transposed); omnickpt maps row-major chunks only: load "
                                   "it with dcp.load and save it with omnickpt")
        expected *= n


def _data_offset(ref: _StoredTensor, entry: zipfile.ZipInfo, start: int, chunk: _Chunk, item: _Item,
                 bad: Callable[[str], CorruptCheckpointError]) -> int:
    """Where the chunk's first element lies in its storage entry, once the entry is known to hold all of the
    chunk's bytes and to lie inside the item."""
    dtype = ref.dtype
    itemsize = dtype.itemsize
    storage_bytes = ref.numel * (ref.storage_dtype.itemsize if ref.storage_dtype is not None else 1)
    if ref.storage_dtype is not None and ref.storage_dtype != dtype:
        raise bad(f"its storage holds {ref.storage_dtype} elements for a {dtype} tensor")
    lo = ref.offset * itemsize
    if (storage_bytes != entry.file_size or lo + math.prod(chunk.sizes) * itemsize > storage_bytes
            or start + entry.file_size > item.length):
        raise bad(f"its storage of {entry.file_size} bytes does not hold the tensor (storage offset {ref.offset}, "
                  f"{math.prod(chunk.sizes)} elements of {itemsize} bytes)")
    return lo


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


