"""One DeepSpeed file (a whole `torch.save` archive) opened for the reader: its data.pkl decoded by the
restricted unpickler, and each tensor's raw bytes located inside the archive, so that a flat partition
becomes boxes pointing straight at its bytes. Only the archive's head (where torch.save puts data.pkl),
its central directory and one local header per storage are read; no tensor bytes, nothing inflated."""
from __future__ import annotations

import math
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor

import torch

from omnickpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedError
from omnickpt.formats.dcp.archive import _entry_data_start, _ItemFile, _require_little_endian, _stored, _Windows
from omnickpt.formats.dcp.metadata import _Item
from omnickpt.formats.dcp.unpickle import _StoredTensor
from omnickpt.formats.deepspeed.unpickle import MAX_PICKLE_BYTES, unpickle
from omnickpt.storage import Storage

# torch.save writes data.pkl first and the central directory last: these windows hold both for all but
# models with tens of thousands of parameters (a read outside them goes to storage).
_HEAD = 256 << 10
_TAIL = 256 << 10


class Archive:
    """A torch.save archive of the checkpoint: `value` (its data.pkl, tensors as `_StoredTensor`s) and
    where each tensor's bytes lie (`offset_of`)."""

    def __init__(self, storage: Storage, path: str, size: int, windows: _Windows):
        self.path, self.size = path, size
        self.where = storage.describe(path)
        self._file = _ItemFile(windows, _Item(path, 0, size))
        try:
            self._zip = zipfile.ZipFile(self._file)
            self._infos = {i.filename: i for i in self._zip.infolist()}
            pkl = next((n for n in self._infos if n == "data.pkl" or n.endswith("/data.pkl")), None)
            if pkl is None:
                raise self._bad("the archive has no data.pkl")
            self._prefix = pkl[:-len("data.pkl")]
            _require_little_endian(self._zip, self._infos.get(f"{self._prefix}byteorder"), self.where)
            if self._infos[pkl].file_size > MAX_PICKLE_BYTES:
                raise self._bad(f"its data.pkl declares {self._infos[pkl].file_size} bytes")
            raw = _stored(self._zip, self._infos[pkl])
        except CheckpointError:
            raise
        except Exception as e:   # zipfile fails on damaged bytes in many ways
            raise self._bad(f"not a readable torch.save archive ({type(e).__name__}: {str(e)[:200]})") from None
        self.value = unpickle(raw, self.where)
        self._starts: dict[str, tuple[int, int]] = {}

    def _bad(self, detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {detail}; the file is damaged or was not written by "
                                      "DeepSpeed's save_checkpoint (torch.save): restore it from a good copy")

    def _storage(self, key: str) -> tuple[int, int]:
        """(where storage `key`'s bytes start in the file, their length)."""
        if key not in self._starts:
            info = self._infos.get(f"{self._prefix}data/{key}")
            if info is None:
                raise self._bad(f"the archive has no storage {key!r}")
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise self._bad(f"storage {key!r} is compressed")
            try:
                start = _entry_data_start(self._file, info)
            except (zipfile.BadZipFile, struct.error, ValueError) as e:
                raise self._bad(f"storage {key!r}: {e}") from None
            if start + info.file_size > self.size:
                raise self._bad(f"storage {key!r} runs past the end of the file")
            self._starts[key] = (start, info.file_size)
        return self._starts[key]

    def offset_of(self, t: _StoredTensor, what: str, numel: int | None = None) -> int:
        """The file offset of tensor `t`'s first element, once its storage is known to hold `numel` (default:
        all of `t`'s) elements from there, row-major and of t's dtype. `what` names the tensor in errors."""
        if t.dtype is None or (t.storage_dtype is not None and t.storage_dtype != t.dtype):
            raise self._bad(f"{what}: its storage holds {t.storage_dtype} elements for a {t.dtype} tensor")
        expected = 1
        for n, s in reversed(list(zip(t.shape, t.stride))):
            if n > 1 and s != expected:
                raise UnsupportedError(f"{self.where}: {what} is stored with strides {list(t.stride)} (not "
                                       "row-major); omnickpt maps row-major tensors only")
            expected *= n
        numel = math.prod(t.shape) if numel is None else numel
        start, nbytes = self._storage(t.key)
        itemsize = t.dtype.itemsize
        storage_bytes = t.numel * (t.storage_dtype.itemsize if t.storage_dtype is not None else 1)
        if storage_bytes != nbytes or (t.offset + numel) * itemsize > nbytes:
            raise self._bad(f"{what}: storage {t.key!r} of {nbytes} bytes does not hold {numel} elements of "
                            f"{itemsize} bytes at element {t.offset}")
        return start + t.offset * itemsize

    def read_tensor(self, t: _StoredTensor, what: str) -> torch.Tensor:
        """A small tensor's values (a counter, a buffer inside a plain value), read now."""
        at = self.offset_of(t, what)
        n = math.prod(t.shape) * t.dtype.itemsize
        raw = bytearray(self._file.windows.read(self.path, at, at + n)) if n else bytearray()
        return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).reshape(t.shape).clone() if n \
            else torch.empty(t.shape, dtype=t.dtype)


def open_archives(storage: Storage, paths: list[str], pool: ThreadPoolExecutor) -> dict[str, Archive]:
    """Every file of `paths` opened (sizes queried and heads and tails read in parallel)."""
    sizes = dict(zip(paths, pool.map(storage.size, paths)))
    windows = _Windows(storage, pool)
    windows.prefetch({p: [(0, min(n, _HEAD)), (max(0, n - _TAIL), n)] for p, n in sizes.items()})
    return dict(zip(paths, pool.map(lambda p: Archive(storage, p, sizes[p], windows), paths)))


__all__ = ["Archive", "open_archives"]
