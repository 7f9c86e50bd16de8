"""Local POSIX storage: parallel pwrite, preadv scatter reads, temp+fsync+rename commits."""
from __future__ import annotations

import errno
import os
import time
from concurrent.futures import Executor
from typing import Sequence

from omnickpt.errors import CorruptCheckpointError, StorageError
from omnickpt.storage.base import Segment

# Large sequential writes: one task per 64 MiB keeps several workers busy without tiny syscalls.
_WRITE_CHUNK = 64 << 20
_IOV_MAX = 512


class LocalStorage:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(str(root)))

    def describe(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def write_file(self, rel: str, size: int, segments: Sequence[Segment], executor: Executor | None,
                   *, durable: bool) -> dict[str, float]:
        path = self._path(rel)
        fsync_seconds = 0.0
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e}") from e
        try:
            os.ftruncate(fd, size)
            pieces = [(seg.offset + s, seg.data[s:s + _WRITE_CHUNK])
                      for seg in segments for s in range(0, len(seg.data), _WRITE_CHUNK)]
            if executor is None or len(pieces) <= 1:
                for off, mv in pieces:
                    _pwrite_all(fd, mv, off, path)
            else:
                for f in [executor.submit(_pwrite_all, fd, mv, off, path) for off, mv in pieces]:
                    f.result()
            if durable:
                t0 = time.perf_counter()
                os.fsync(fd)
                fsync_seconds = time.perf_counter() - t0
        except OSError as e:
            raise StorageError(f"writing {path} failed: {e}") from e
        finally:
            os.close(fd)
        return {"fsync": fsync_seconds}

    def read_into(self, rel: str, offset: int, buffers: Sequence[memoryview]) -> None:
        path = self._path(rel)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {path} is missing; the checkpoint is incomplete") from None
        except OSError as e:
            raise StorageError(f"cannot open {path}: {e}") from e
        try:
            pos = offset
            bufs = [b for b in buffers if len(b)]
            while bufs:
                batch = bufs[:_IOV_MAX]
                want = sum(len(b) for b in batch)
                got = os.preadv(fd, batch, pos)
                if got == want:
                    bufs = bufs[_IOV_MAX:]
                    pos += got
                    continue
                if got == 0:
                    raise CorruptCheckpointError(
                        f"data file {path} is truncated: needed bytes up to {pos + want}, file ends at "
                        f"{os.fstat(fd).st_size}")
                # short read: drop what was filled and go on from there
                pos += got
                rest = []
                for b in bufs:
                    if got >= len(b):
                        got -= len(b)
                    else:
                        rest.append(b[got:])
                        got = 0
                bufs = rest
        except OSError as e:
            raise StorageError(f"reading {path} failed: {e}") from e
        finally:
            os.close(fd)

    def read_bytes(self, rel: str) -> bytes:
        path = self._path(rel)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"cannot read {path}: {e}") from e

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def size(self, rel: str) -> int:
        try:
            return os.path.getsize(self._path(rel))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {self._path(rel)} is missing; the checkpoint is incomplete") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                out.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
        return sorted(out)

    def children(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(rel)))
        except FileNotFoundError:
            return []

    def delete_tree(self, rel: str) -> None:
        import shutil
        shutil.rmtree(self._path(rel), ignore_errors=True)

    def delete(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass

    def commit(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"committing {path} failed: {e}") from e


def _pwrite_all(fd: int, mv: memoryview, offset: int, path: str) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise StorageError(f"writing {path} made no progress at byte {offset}")
        mv, offset = mv[n:], offset + n


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
