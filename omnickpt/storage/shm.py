"""Host shared memory as storage: `shm://NAME/rest` is the directory /dev/shm/omnickpt/NAME/rest.

Files under /dev/shm live in RAM (tmpfs): they outlive the process that wrote them (kill -9
included) but not the machine, and they are POSIX shared memory, the same pages every process on
the machine can map. So the memory tier is a LocalStorage rooted there; what differs is that
"durable" means nothing in RAM (no fsync), that the memory must be handed back explicitly
(`clear_memory`), and that names are checked strictly, because `clear_memory(name)` deletes a tree.

The base directory is /dev/shm/omnickpt, or $OMNICKPT_SHM_DIR when set (a container whose
/dev/shm is too small can point it at another tmpfs). It is read at each call, never cached.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from concurrent.futures import Executor
from typing import Sequence

from omnickpt.errors import StorageError
from omnickpt.storage.base import Segment, os_failure
from omnickpt.storage.local import LocalStorage

SHM_SCHEME = "shm://"
SHM_DIR_ENV = "OMNICKPT_SHM_DIR"
_DEFAULT_DIR = "/dev/shm/omnickpt"
# A job name is one path component: clear_memory(name) must never reach outside the base.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def shm_dir() -> str:
    """The directory holding every job's shared memory (one sub-directory per job name)."""
    return os.environ.get(SHM_DIR_ENV) or _DEFAULT_DIR


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ValueError(f"shared-memory job name {name!r} is not valid: use 1-128 characters of letters, digits, "
                         "'.', '_' and '-', starting with a letter or digit")
    return name


def parse_shm_url(url: str) -> tuple[str, str]:
    """'shm://job/a/b' -> ('job', 'a/b')."""
    if not url.startswith(SHM_SCHEME):
        raise ValueError(f"{url!r} is not a shared-memory URL (shm://NAME/...)")
    name, _, rest = url[len(SHM_SCHEME):].strip("/").partition("/")
    check_name(name)
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{url!r}: '.' and '..' are not allowed in a shared-memory path")
    return name, "/".join(parts)


def shm_path(url: str) -> str:
    """The local directory behind a shm:// URL."""
    name, rest = parse_shm_url(url)
    return os.path.join(shm_dir(), name, *rest.split("/")) if rest else os.path.join(shm_dir(), name)


class ShmStorage(LocalStorage):
    """Checkpoint storage in host shared memory (see the module docstring)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        base = os.path.dirname(shm_dir().rstrip("/")) or "/"
        if not os.path.isdir(base):
            raise StorageError(f"{self.url}: {base} does not exist, so there is no shared memory to save to; "
                               f"mount a tmpfs there or set {SHM_DIR_ENV} to a directory on one")
        super().__init__(shm_path(url))

    def describe(self, rel: str = "") -> str:
        return f"{self.url}/{rel} ({os.path.join(self.root, rel)})" if rel else f"{self.url} ({self.root})"

    def write_file(self, rel: str, size: int, segments: Sequence[Segment], executor: Executor | None,
                   *, durable: bool) -> dict[str, float]:
        # RAM is not durable whatever we do; an fsync on tmpfs only costs a syscall per file.
        return super().write_file(rel, size, segments, executor, durable=False)

    def read_direct(self, rel: str, offset: int, buf: memoryview) -> None:
        # Memory has no device behind it to read from: every byte is "cached".
        self.read_into(rel, offset, [buf])

    def _failure(self, op: str, path: str, e: OSError, needed: int | None = None) -> StorageError:
        hint = ""
        if e.errno == errno.ENOSPC:   # the advice differs: this "device" is the host's shared memory
            try:
                st = os.statvfs(self.root if os.path.isdir(self.root) else shm_dir())
                total = f" ({st.f_blocks * st.f_frsize} bytes in all)"
            except OSError:
                total = ""
            hint = (f"this is the shared memory under {shm_dir()}{total}: enlarge that tmpfs (docker: --shm-size), "
                    f"keep fewer steps in memory, or set {SHM_DIR_ENV} to a larger tmpfs")
        return os_failure(op, path, e, needed=needed, device=path, hint=hint)


def memory_usage(name: str | None = None) -> dict[str, int]:
    """Bytes held in shared memory per job name (only `name` when given)."""
    base = shm_dir()
    names = [check_name(name)] if name is not None else sorted(os.listdir(base)) if os.path.isdir(base) else []
    out = {}
    for n in names:
        total = 0
        for dirpath, _, files in os.walk(os.path.join(base, n)):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:
                    pass
        if os.path.isdir(os.path.join(base, n)):
            out[n] = total
    return out


def clear_memory(name: str) -> int:
    """Remove everything job `name` keeps in shared memory (its memory-tier checkpoints and peer
    replicas on this machine); returns the bytes freed. Safe to call when there is nothing.

    Do not call it while a process of that job is running on this machine."""
    freed = memory_usage(name).get(name, 0)
    path = os.path.join(shm_dir(), check_name(name))
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StorageError(f"could not remove the shared memory of job {name!r} at {path}: {e}") from e
    return freed


__all__ = ["SHM_DIR_ENV", "ShmStorage", "clear_memory", "memory_usage", "parse_shm_url", "shm_dir", "shm_path"]
