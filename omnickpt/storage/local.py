"""Local POSIX storage: parallel pwrite, preadv scatter reads, temp+fsync+rename commits.

Failures: every OSError becomes a StorageError that names the path and says what happened and what
to do (a full device with the bytes needed and free, a read-only file system, an I/O error, a
permission; see base.os_failure), with the OSError as its cause. A write_file that fails removes
its partial file, so a full device gets its space back at once; a commit that fails removes its
temp file and never touches the file it would have replaced.

Symlinks: a checkpoint is a directory of its own files, and may come from someone else. A symlink
in it that leads outside (to /etc/shadow, into another run's directory) is never followed: reads
refuse it with UnsafeCheckpointError, writes refuse a directory that leads outside, and listing
and garbage collection (list, children, delete, delete_tree) never enter a symlinked directory and
remove a link itself, never what it points to. "Inside" means under the root's real path, so the
root itself may be a symlink (a checkpoint directory kept on another disk), and links that stay
inside are followed by reads. Reads pay one realpath per file opened; a concurrent attacker who
swaps a directory for a link between that check and the open is out of scope.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import shutil
import stat
import sys
import time
import uuid
from concurrent.futures import Executor
from typing import Sequence

import numpy as np

from omnickpt.errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from omnickpt.storage.base import Segment, bytes_view, os_failure, run_all

# Large sequential writes: one task per 64 MiB keeps several workers busy without tiny syscalls.
_WRITE_CHUNK = 64 << 20
# O_DIRECT wants file offsets, lengths and memory addresses aligned to the logical block size
# (512 or 4096 bytes): a page covers both. Files below _DIRECT_MIN go through the page cache,
# where a small write costs less than opening a second descriptor.
_DIRECT_ALIGN = 4096
_DIRECT_MIN = 4 << 20
_IOV_MAX = 512
# Errors of os.link that mean "this file system has no hard links", not "you may not".
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})


class LocalStorage:
    """A checkpoint in a local (or mounted network) directory. Thread-safe."""

    def __init__(self, root: str, *, direct_io: bool | None = None):
        """direct_io: durable writes of large files go straight from memory to the device (O_DIRECT)
        where the file system allows it; None (default): yes unless $OMNICKPT_DIRECT_IO=0."""
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        self._real: str | None = None      # realpath(root), kept once the root exists
        self.direct_io = os.environ.get("OMNICKPT_DIRECT_IO", "1") != "0" if direct_io is None else direct_io

    def describe(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _failure(self, op: str, path: str, e: OSError, needed: int | None = None) -> StorageError:
        """The StorageError for `e` (ShmStorage gives its own advice for a full memory)."""
        return os_failure(op, path, e, needed=needed, device=path)

    # ------------------------------------------------------------------ staying inside the root
    def _real_root(self) -> str:
        if self._real is not None:
            return self._real
        real = os.path.realpath(self.root)
        if os.path.isdir(real):   # before the root exists, creating it (or a link there) could change it
            self._real = real
        return real

    def _readable(self, rel: str, what: str) -> str:
        """The real path of `rel`, to open; UnsafeCheckpointError if it leads outside the root."""
        path = self._path(rel)
        real = os.path.realpath(path)
        if not _under(real, self._real_root()) and not _hub_blob(self._real_root(), real):
            raise UnsafeCheckpointError(
                f"{what} {path} {_leads(path, real)} outside the checkpoint {self.root}; refusing to read it "
                "(a checkpoint must hold its own files: copy the file in instead of linking to it)")
        return real

    def _own_dir(self, rel: str) -> str | None:
        """The real path of directory `rel` when it is the root or lies under it with no symlink on
        the way; None otherwise (listing and deleting never enter a symlinked directory)."""
        want = os.path.join(self._real_root(), *(p for p in rel.split("/") if p))
        return want if os.path.realpath(want) == want else None

    def _real_parent(self, path: str) -> str | None:
        """`path` with its directory resolved, when that directory is inside the root; None when
        it leads outside through a symlink (then nothing there belongs to this checkpoint)."""
        parent = os.path.realpath(os.path.dirname(path))
        return os.path.join(parent, os.path.basename(path)) if _under(parent, self._real_root()) else None

    def _dir_for_writing(self, path: str, needed: int) -> None:
        """Make the directory of `path`, refusing one that leads outside the root through a
        symlink: the write would land in someone else's files."""
        parent = os.path.dirname(path)
        real = os.path.realpath(parent)
        if not _under(real, self._real_root()):
            raise UnsafeCheckpointError(
                f"refusing to write {path}: its directory {parent} {_leads(parent, real)} outside the checkpoint "
                f"{self.root}; remove that link or save to another path")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise self._failure("creating the directory of", path, e, needed) from e

    # ------------------------------------------------------------------ writes
    def write_file(self, rel: str, size: int, segments: Sequence[Segment], executor: Executor | None,
                   *, durable: bool) -> dict[str, float]:
        """A durable write of a large file sends its page-aligned bytes with O_DIRECT and the rest
        through the page cache, then one fsync: measured on this machine (bench/write_path.py) the
        page cache's write-back of a fresh 800 MB file runs at 0.3-1.1 GB/s with stalls of seconds,
        O_DIRECT at 2-2.6 GB/s, steadily, and it leaves the node's page cache to training."""
        path = self._path(rel)
        self._dir_for_writing(path, size)
        try:
            fd = _open_replacing_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as e:
            raise self._failure("creating", path, e, size) from e
        dfd = _open_direct(path) if durable and self.direct_io and size >= _DIRECT_MIN else None
        fsync_seconds = 0.0
        try:
            os.ftruncate(fd, size)
            pieces = [(seg.offset + s, seg.data[s:s + _WRITE_CHUNK])
                      for seg in segments for s in range(0, len(seg.data), _WRITE_CHUNK)]

            def put(off: int, mv: memoryview) -> None:
                _write_piece(fd, dfd, mv, off, path)
            if executor is None or len(pieces) <= 1:
                for off, mv in pieces:
                    put(off, mv)
            else:
                # Every write must have stopped before fd is closed: its number could be reused by
                # another open at once, and a late pwrite would land in that file.
                run_all(executor, put, pieces)
            if durable:
                t0 = time.perf_counter()
                os.fsync(fd)    # also flushes the device's cache for the O_DIRECT writes
                fsync_seconds = time.perf_counter() - t0
        except BaseException as e:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)
            # The partial file holds the device's space (a full device stays full) and is no
            # checkpoint's: the manifest that would name it is never written.
            _unlink_quietly(path)
            if isinstance(e, OSError):
                raise self._failure("writing", path, e, size) from e
            raise
        try:
            if dfd is not None:
                os.close(dfd)
            os.close(fd)     # network file systems report a failed write-back here
        except OSError as e:
            _unlink_quietly(path)
            raise self._failure("writing", path, e, size) from e
        return {"fsync": fsync_seconds}

    def commit(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        self._dir_for_writing(path, len(data))
        tmp = _temp_name(path)
        try:
            _write_new(tmp, data)
            os.replace(tmp, path)     # atomic, and replaces a link itself rather than its target
        except OSError as e:
            _unlink_quietly(tmp)
            raise self._failure("committing", path, e, len(data)) from e
        try:
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise self._failure("committing (fsync of the directory of)", path, e) from e

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` unless something is there: the bytes go to a temp file that is
        fsynced and then hard-linked to the name, which fails if the name exists (atomic, on NFS
        too), so a reader never sees a half-written file. On a file system without hard links it
        falls back to O_CREAT|O_EXCL on the name itself: still exclusive, but a reader may briefly
        find the file shorter than `data`."""
        path = self._path(rel)
        self._dir_for_writing(path, len(data))
        tmp = _temp_name(path)
        try:
            _write_new(tmp, data)
            try:
                os.link(tmp, path)
                created = True
            except FileExistsError:
                created = False
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
                try:
                    _write_new(path, data)
                    created = True
                except FileExistsError:
                    created = False
            if created:
                _fsync_dir(os.path.dirname(path))
            return created
        except OSError as e:
            raise self._failure("creating", path, e, len(data)) from e
        finally:
            _unlink_quietly(tmp)

    # ------------------------------------------------------------------ reads
    def read_into(self, rel: str, offset: int, buffers: Sequence[memoryview]) -> None:
        path = self._path(rel)
        try:
            fd = os.open(self._readable(rel, "data file"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {path} is missing; the checkpoint is incomplete") from None
        except OSError as e:
            raise self._failure("opening", path, e) from e
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
            raise self._failure("reading", path, e) from e
        finally:
            os.close(fd)

    def read_direct(self, rel: str, offset: int, buf: memoryview) -> None:
        """read_into of one buffer, from the device where the page cache does not hold the bytes:
        the leading bytes the cache holds (all of them in a warm load) are copied from it, the
        rest goes with O_DIRECT from the device straight into `buf` (its whole pages, where
        `buf`'s address and `offset` agree modulo a page; the ragged ends through the cache).

        Why: a cold buffered read costs the page cache's allocation and a copy per byte, and its
        readahead serves large parallel requests badly. Measured on this machine
        (bench/cold_load_probe.py): 2 processes reading 403 MB each cold, buffered 0.35-1.2 s and
        ~0.2-0.4 s of CPU each, O_DIRECT 0.28-0.30 s (dd's speed) and ~0.01 s of CPU. The engine
        calls this only for bytes no other process on the machine reads at the same time (those
        share the cache's one device read)."""
        n = len(buf)
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data if n else 0
        lo, hi = direct_part(offset, addr, n)
        if not self.direct_io or hi - lo < _DIRECT_MIN:
            self.read_into(rel, offset, [buf])
            return
        path = self._path(rel)
        real = self._readable(rel, "data file")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {path} is missing; the checkpoint is incomplete") from None
        except OSError as e:
            raise self._failure("opening", path, e) from e
        try:
            cached = _cached_prefix(fd, offset, n)
            done = n if cached is None else cached   # unknown: all through the cache, as read_into
            _pread_into(fd, buf[:done], offset, path)
            if done < n:
                # From the first page the cache lacks on, the device: the aligned middle with
                # O_DIRECT, what lies before and after it through the cache.
                start = max(lo, done + -(offset + done) % _DIRECT_ALIGN)
                if start < hi:
                    _pread_into(fd, buf[done:start], offset + done, path)
                    done = start + _read_uncached(real, buf[start:hi], offset + start)
                _pread_into(fd, buf[done:], offset + done, path)
        except OSError as e:
            raise self._failure("reading", path, e) from e
        finally:
            os.close(fd)

    def read_bytes(self, rel: str) -> bytes:
        path = self._path(rel)
        try:
            with open(self._readable(rel, "file"), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise self._failure("reading", path, e) from e

    def exists(self, rel: str) -> bool:
        """Whether `rel` exists; UnsafeCheckpointError if it is a symlink leading outside the root."""
        if not os.path.lexists(self._path(rel)):
            return False
        return os.path.exists(self._readable(rel, "file"))

    def size(self, rel: str) -> int:
        path = self._path(rel)
        try:
            return os.path.getsize(self._readable(rel, "data file"))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {path} is missing; the checkpoint is incomplete") from None
        except OSError as e:
            raise self._failure("getting the size of", path, e) from e

    # ------------------------------------------------------------------ listing and deleting
    def list(self, prefix: str = "") -> list[str]:
        """Files under the directory `prefix`, and symlinks as entries of their own (never
        followed, so garbage collection removes a link, not what it points to). A prefix that is
        (or goes through) a symlink lists nothing."""
        top = self._own_dir(prefix)
        if top is None:
            return []
        out: list[str] = []
        stack = [(top, "/".join(p for p in prefix.split("/") if p))]
        while stack:
            where, rel = stack.pop()
            try:
                with os.scandir(where) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise self._failure("listing", where, e) from e
            for entry in entries:
                name = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, name))
                else:
                    out.append(name)
        return sorted(out)

    def children(self, rel: str = "") -> list[str]:
        """Names directly under the directory `rel`; none if `rel` is (or goes through) a symlink."""
        where = self._own_dir(rel)
        if where is None:
            return []
        try:
            return sorted(os.listdir(where))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._failure("listing", self._path(rel), e) from e

    def delete(self, rel: str) -> None:
        """Remove the file or symlink `rel`. A path that leads out of the root through a symlinked
        directory names nothing of this checkpoint: nothing is deleted."""
        path = self._path(rel)
        target = self._real_parent(path)
        if target is None or not rel.strip("/"):
            return
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._failure("deleting", path, e) from e

    def delete_tree(self, rel: str) -> None:
        """Remove the directory `rel` and everything in it ("" = the root's real directory). A
        symlink at `rel` is removed itself; links inside are removed, never followed; a path
        leading outside the root through a symlinked directory, or a plain file, is left alone."""
        path = self._path(rel)
        target = self._real_root() if not rel.strip("/") else self._real_parent(path)
        if target is None:
            return
        try:
            mode = os.lstat(target).st_mode
            if stat.S_ISLNK(mode):
                os.unlink(target)
            elif stat.S_ISDIR(mode):
                _rmtree(target, lambda p, e: self._failure("deleting", p, e))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._failure("deleting", path, e) from e


# ---------------------------------------------------------------------- helpers
def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blob(root: str, real: str) -> bool:
    """Whether `real` is a file of the Hugging Face Hub cache repository that the checkpoint `root` is a snapshot
    of. The hub keeps a download as <cache>/<models|datasets|spaces>--<org>--<name>/{blobs/<hash>,
    snapshots/<revision>/<file> -> ../../blobs/<hash>, refs/<branch>}: the folder snapshot_download() returns
    holds only links into its own repository's blobs/, which is the layout, not an escape. Only a link from a
    root inside snapshots/<revision>/ to a file directly in that repository's blobs/ qualifies."""
    parts = root.split(os.sep)
    if "snapshots" not in parts:
        return False
    i = len(parts) - 1 - parts[::-1].index("snapshots")
    if i < 1 or i + 1 >= len(parts) or not parts[i - 1].startswith(("models--", "datasets--", "spaces--")):
        return False
    return os.path.dirname(real) == os.path.join(os.sep.join(parts[:i]), "blobs")


def _leads(path: str, real: str) -> str:
    """How `path` gets to `real`, for messages."""
    return f"is a symlink to {real}" if os.path.islink(path) else f"leads through a symlinked directory to {real}"


def _temp_name(path: str) -> str:
    # unique per call: two threads of one process may commit the same name at once
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _open_replacing_link(path: str, flags: int) -> int:
    """os.open for writing that replaces a symlink at `path` rather than writing into its target."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP or not os.path.islink(path):
            raise
    os.unlink(path)
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _write_new(path: str, data: bytes) -> None:
    """Create `path` (FileExistsError if anything, a link included, is there), write `data`, fsync;
    on any failure the file is removed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, bytes_view(data), 0, path)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    try:
        os.close(fd)
    except OSError:
        _unlink_quietly(path)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:   # already gone, or the device refuses even that: the original error matters
        pass


def _pwrite_all(fd: int, mv: memoryview, offset: int, path: str) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise StorageError(f"writing {path} made no progress at byte {offset}")
        mv, offset = mv[n:], offset + n


@functools.cache
def _mincore():
    """libc's mincore, or None where there is none (not Linux, no C library to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


def _cached_prefix(fd: int, offset: int, n: int) -> int | None:
    """How many of the `n` bytes from `offset` lie in leading pages the page cache holds; None
    where that cannot be asked. Asked with mincore on a mapping of the range, which does no I/O
    (a buffered read with RWF_NOWAIT would also tell, but on Linux 6 it starts readahead)."""
    mincore = _mincore()
    if mincore is None or n <= 0:
        return None
    first = offset // _DIRECT_ALIGN * _DIRECT_ALIGN
    length = offset + n - first
    try:
        with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=first) as mm:
            pages = (length + _DIRECT_ALIGN - 1) // _DIRECT_ALIGN
            vec = np.zeros(pages, dtype=np.uint8)
            view = np.frombuffer(mm, dtype=np.uint8)
            failed = mincore(view.ctypes.data, length, vec.ctypes.data)
            del view   # the mapping cannot close while a view of it lives
    except (OSError, ValueError, BufferError):
        return None
    if failed:
        return None
    missing = np.flatnonzero((vec & 1) == 0)
    if not len(missing):
        return n
    return max(0, int(missing[0]) * _DIRECT_ALIGN - (offset - first))


def _read_uncached(path: str, buf: memoryview, offset: int) -> int:
    """Bytes of `buf` (whole pages, aligned in the file and in memory) read with O_DIRECT; the
    caller reads the rest through the cache (a file system may refuse O_DIRECT, or the file end
    or a short read leave it unaligned)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return 0
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return 0
    done = 0
    try:
        while done < len(buf):
            got = os.preadv(dfd, [buf[done:]], offset + done)
            if got <= 0 or got % _DIRECT_ALIGN:
                return done   # the end of the file (or a partial page): the rest through the cache
            done += got
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(dfd)
    return done


def _pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill `buf` from `offset`; a file that ends first is a truncated data file."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise CorruptCheckpointError(f"data file {path} is truncated: needed bytes up to {offset + len(buf)}, "
                                         f"file ends at {os.fstat(fd).st_size}")
        done += got


def _open_direct(path: str) -> int | None:
    """A second descriptor of `path` for O_DIRECT writes, or None where the file system (tmpfs,
    some network and FUSE file systems) or the platform has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None


def direct_part(off: int, addr: int, n: int) -> tuple[int, int]:
    """The [lo, hi) bytes of an `n`-byte piece at file offset `off` and memory address `addr` that
    O_DIRECT can write: whole pages, aligned in the file and in memory ((0, 0) if none)."""
    if (addr - off) % _DIRECT_ALIGN:
        return 0, 0
    lo = -off % _DIRECT_ALIGN
    hi = lo + max(n - lo, 0) // _DIRECT_ALIGN * _DIRECT_ALIGN
    return (lo, hi) if hi > lo else (0, 0)


def _write_piece(fd: int, dfd: int | None, mv: memoryview, off: int, path: str) -> None:
    lo, hi = (0, 0)
    if dfd is not None and len(mv) >= _DIRECT_ALIGN:
        lo, hi = direct_part(off, np.frombuffer(mv, dtype=np.uint8).ctypes.data, len(mv))
    if hi == lo:
        _pwrite_all(fd, mv, off, path)
        return
    _pwrite_all(fd, mv[:lo], off + 0, path)
    done = _pwrite_direct(dfd, mv[lo:hi], off + lo)
    _pwrite_all(fd, mv[lo + done:], off + lo + done, path)


def _pwrite_direct(dfd: int, mv: memoryview, off: int) -> int:
    """Bytes of `mv` written with O_DIRECT; the caller writes the rest through the page cache (a
    short write leaves it unaligned, and a file system may refuse O_DIRECT writes it let us open)."""
    done = 0
    try:
        while done < len(mv):
            n = os.pwrite(dfd, mv[done:], off + done)
            if n <= 0 or n % _DIRECT_ALIGN:
                return done + max(n, 0)
            done += n
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return done


def _rmtree(path: str, failure) -> None:
    """shutil.rmtree (which removes links inside rather than following them), ignoring what a
    concurrent delete removed first and raising `failure(path, error)` for anything else."""
    def onexc(_func, where, exc):
        e = exc[1] if isinstance(exc, tuple) else exc
        if isinstance(e, FileNotFoundError):
            return
        raise failure(where, e) from e
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=onexc)
    else:
        shutil.rmtree(path, onerror=onexc)


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
