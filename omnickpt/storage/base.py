"""The storage protocol: what the engine needs from any place checkpoints live, and the one
translation of an operating system's failure (full device, read-only file system, I/O error,
permission) into a StorageError that says what happened and what to do."""
from __future__ import annotations

import errno
import os
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from typing import NamedTuple, Protocol, Sequence

from omnickpt.errors import CorruptCheckpointError, StorageError


class Segment(NamedTuple):
    """`data` goes to byte `offset` of a file."""
    offset: int
    data: memoryview


class Storage(Protocol):
    """All paths are relative to the checkpoint root, '/'-separated."""

    root: str

    def write_file(self, rel: str, size: int, segments: Sequence[Segment], executor: Executor | None,
                   *, durable: bool) -> dict[str, float]:
        """Create `rel` (replacing any old one) of `size` bytes from non-overlapping segments,
        in parallel on `executor`; durable=True returns only once the bytes are on stable storage.
        Returns seconds spent in named sub-phases (e.g. {"fsync": 0.1})."""

    def read_into(self, rel: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers`, in order, from the contiguous byte range starting at `offset`."""

    def read_bytes(self, rel: str) -> bytes: ...

    def exists(self, rel: str) -> bool: ...

    def size(self, rel: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of the files under `prefix` (recursively)."""

    def children(self, rel: str = "") -> list[str]:
        """Names directly under `rel` (files and sub-directories / common prefixes)."""

    def delete(self, rel: str) -> None:
        """Remove the file `rel` (nothing if there is none). A symlink is removed itself, never its target."""

    def delete_tree(self, rel: str) -> None:
        """Remove everything under the directory `rel` (nothing if there is none; a file at `rel`
        is not "under" it and stays). Never reaches outside the checkpoint through a symlink."""

    def commit(self, rel: str, data: bytes) -> None:
        """Write `rel` atomically and durably: readers see the old file or the whole new one. A
        commit that fails leaves the old file as it was and no temporary file behind."""

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data` only if nothing is there yet: True if this call created it,
        False if it existed. Of several processes racing to create one name, exactly one gets True
        (each backend's docstring says how, and where its guarantee is weaker)."""

    def describe(self, rel: str = "") -> str:
        """A human-readable location for error messages."""


def run_all(executor: Executor, fn, calls: Sequence[tuple]) -> list:
    """[fn(*args) for args in calls], run on `executor`. On the first failure the calls not started
    are cancelled and the running ones awaited before its error is raised, and so they are when the
    waiting thread itself is interrupted (KeyboardInterrupt, a signal handler's exception): none
    may still be writing into a buffer, an address or a file descriptor the caller frees when this
    returns (a memmove between raw addresses into freed memory corrupts the heap, and the process
    crashes later somewhere else)."""
    futures = []
    try:
        for args in calls:   # inside: an interrupt between submits still awaits those submitted
            futures.append(executor.submit(fn, *args))
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        for f in futures:
            f.cancel()
        wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


# Helpers for backends that upload or stream a file assembled from segments.
def bytes_view(mv) -> memoryview:
    """A flat byte view of any buffer (tensor views from numpy may be typed or shaped)."""
    mv = memoryview(mv)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def cover(size: int, segments: Sequence[Segment], where: str) -> list[tuple[int, memoryview | int]]:
    """The file as (offset, piece) in order: the segments' bytes, and zero-length counts for the gaps
    between them (those bytes are zeros, as in a sparse local file)."""
    out: list[tuple[int, memoryview | int]] = []
    pos = 0
    for off, data in sorted(((s.offset, bytes_view(s.data)) for s in segments if len(s.data)), key=lambda s: s[0]):
        if off < pos or off + len(data) > size:
            raise StorageError(f"writing {where}: segment at byte {off} ({len(data)} bytes) overlaps another or "
                               f"runs past the file's {size} bytes (a bug in the caller)")
        if off > pos:
            out.append((pos, off - pos))
        out.append((off, data))
        pos = off + len(data)
    if pos < size:
        out.append((pos, size - pos))
    return out


def split(bufs: list[memoryview], chunk: int) -> list[tuple[int, list[memoryview]]]:
    """Cut a run of buffers into consecutive ranges of `chunk` bytes: (offset in the run, views)."""
    out: list[tuple[int, list[memoryview]]] = []
    pos, cur, room = 0, [], chunk
    for b in bufs:
        while len(b):
            take = min(room, len(b))
            cur.append(b[:take])
            b, room = b[take:], room - take
            if not room:
                out.append((pos, cur))
                pos, cur, room = pos + chunk, [], chunk
    if cur:
        out.append((pos, cur))
    return out


# What an OSError's errno means for a checkpoint, and what the user can do about it. ENOSPC and
# EDQUOT also get the bytes asked for and the bytes free (see os_failure).
_MEANING = {
    errno.ENOSPC: ("the device is full", ""),
    errno.EDQUOT: ("the disk quota of this user (uid {uid}) is used up", ""),
    errno.EROFS: ("the file system is read-only (mounted read-only, or switched to read-only by the kernel after an "
                  "error)", "save to a writable path, or remount it read-write"),
    errno.EIO: ("the device reported an I/O error (a failing disk, controller or network file system), so nothing "
                "written or read there can be trusted", "check the kernel log (dmesg) and the device, and save to "
                                                        "another path"),
    errno.EACCES: ("permission denied to this process (uid {uid}): the mode or owner of the file or its directory, or "
                   "a security policy, forbids it", "fix the permissions or use another path"),
    errno.EPERM: ("the operation is not permitted to this process (uid {uid}): e.g. an immutable or append-only file "
                  "or directory (chattr +i/+a, see lsattr) or a security policy", "remove the attribute or use "
                                                                                   "another path"),
    errno.EFBIG: ("the file would be larger than this process may write (the file-size limit, `ulimit -f`, or the "
                  "file system's largest file)", "raise the limit or use another file system"),
}
_FULL = (errno.ENOSPC, errno.EDQUOT)
# The errnos os_failure explains (other backends send these through it, the rest their own way).
KNOWN_ERRNOS = frozenset(_MEANING)


def os_failure(op: str, path: str, e: OSError, *, needed: int | None = None, device: str | None = None,
               hint: str = "") -> StorageError:
    """A StorageError for `e`, raised while `op` (e.g. "writing") `path`: it names the path and
    says in words what happened (with the errno's name and the system's words) and what to do.
    For a full device (ENOSPC, EDQUOT) it adds the `needed` bytes and the bytes free on the device
    holding the local path `device` (None: a remote path, nothing to measure), measured now, so
    call it after removing what the failed write left behind; `hint` replaces the generic advice
    for a full device (e.g. the memory tier's). Raise it `from e` to keep the cause."""
    code = e.errno
    name = errno.errorcode.get(code, "?") if code is not None else "?"
    said = f"({name}: {e.strerror})" if e.strerror else f"({name})"
    if code not in _MEANING:
        return StorageError(f"{op} {path} failed: {e.strerror or e} {said}")
    what, advice = _MEANING[code]
    what = what.format(uid=os.geteuid() if hasattr(os, "geteuid") else "?")
    if code in _FULL:
        st, where = _statvfs(device) if device is not None else (None, path)
        asked = f"the write needed {needed} bytes and " if needed is not None else ""
        if st is None:
            sizes = f"{asked}the free space there is unknown"
        else:
            sizes = f"{asked}{st.f_bavail * st.f_frsize} bytes are free on the device holding {where}"
            if st.f_files and not st.f_favail:   # full of files, not of bytes: a different remedy
                sizes += " but no free inodes (it holds as many files as it can)"
        what = f"{what} {said}: {sizes}"
        advice = hint or ("free space there (delete old checkpoints, or keep fewer), "
                          + ("raise the quota, " if code == errno.EDQUOT else "") + "or save to another path")
    else:
        what = f"{what} {said}"
    return StorageError(f"{op} {path} failed: {what}; {advice}")


def _statvfs(path: str) -> tuple[os.statvfs_result | None, str]:
    """statvfs of the nearest existing ancestor of `path` (the file itself may be gone), and that
    directory; (None, path) if it fails."""
    where = os.path.abspath(path)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        return os.statvfs(where), where
    except OSError:
        return None, where


def require_length(storage: "Storage", rel: str, size: int, ends: Sequence[tuple[int, str]], source: str) -> None:
    """Raise CorruptCheckpointError when a file of `size` bytes is shorter than what `source` (the
    manifest, the DCP metadata) says lies in it: `ends` holds (end byte, what lies there)."""
    beyond = [what for end, what in ends if end > size]
    if beyond:
        raise CorruptCheckpointError(
            f"data file {storage.describe(rel)} is truncated: it has {size} bytes but the {source} needs "
            f"{max(end for end, _ in ends)}; past its end: {', '.join(beyond[:5])}"
            + (f" and {len(beyond) - 5} more" if len(beyond) > 5 else "")
            + ". Restore the file or load an earlier checkpoint")
