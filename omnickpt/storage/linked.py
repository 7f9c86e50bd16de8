"""Reading an incremental checkpoint: its manifest may name data files that lie in a sibling
checkpoint (the folder next to it, under the same root), written "../<sibling>/<path inside it>".
LinkedStorage serves those paths from the sibling's own storage and every other path from the
checkpoint's storage, so the reader needs no notion of siblings. A checkpoint never writes into a
sibling: writes and deletes of "../" paths are refused. A reference read from a manifest is
untrusted: it may only name a data file ("data/<file>") of a sibling folder that is not hidden, so
no manifest can make a load open (and show the size of) anything else next to it, such as ~/.ssh.

    storage = with_siblings(storage_for(path), path, manifest.files)
"""
from __future__ import annotations

import os
import posixpath
import threading
from typing import Iterable, Sequence

from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from omnickpt.storage.base import Storage

_UP = "../"
# The folder of a checkpoint's data files (format.DATA_DIR: the storage layer imports nothing above it).
_DATA = "data"


def parent_path(path: str) -> str:
    """The path (or URL) of the folder that holds the checkpoint `path`: where its siblings lie
    ("" for a relative path of one component: the working directory). ValueError if `path` has no
    parent to go up from: a file system's root, or a URL with nothing under its bucket / job / host
    ("s3://bucket" alone), whose parent is no folder of the same storage."""
    path = str(path)
    if "::" in path:
        # fsspec chained URLs ("simplecache::s3://b/ck/step"): a leading pure protocol wraps the
        # rest, which holds the path; where a layer carries a path of its own ("zip://m::s3://..."),
        # which one is the checkpoint's folder is not ours to guess.
        outer, _, inner = path.partition("::")
        if "://" in outer or "/" in outer:
            raise ValueError(f"{path}: cannot tell the parent folder of a chained URL whose outer layer has a path")
        return f"{outer}::{parent_path(inner)}"
    if path.startswith("file://"):
        return "file://" + _local_parent(path[len("file://"):], path)
    if "://" in path:
        scheme, _, rest = path.partition("://")
        # The first component is the bucket (s3://), the job (shm://) or the host / top folder
        # (other URLs): the storage of a sibling must stay under it.
        parts = [p for p in rest.split("/") if p]
        if len(parts) < 2:
            raise ValueError(f"{path}: no parent folder to go up from (a checkpoint URL needs a folder under "
                             f"{scheme}://{parts[0] if parts else ''})")
        if parts[-1] in (".", ".."):
            raise ValueError(f"{path}: ends in {parts[-1]!r}; name the checkpoint folder itself")
        # "fsspec+file:///abs/ck": the path is absolute, and stays so
        return f"{scheme}://{'/' if rest.startswith('/') else ''}{'/'.join(parts[:-1])}"
    return _local_parent(path, path)


def sibling_path(path: str, name: str) -> str:
    """The path (or URL) of the folder `name` next to the checkpoint `path`: same parent, same
    scheme. ValueError as parent_path, or if `name` is not one folder name."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a folder name (one path component)")
    return _child(parent_path(path), name)


def _child(parent: str, name: str) -> str:
    if "::" in parent:
        outer, _, inner = parent.partition("::")
        return f"{outer}::{_child(inner, name)}"
    if parent.startswith("file://"):
        return "file://" + _child(parent[len("file://"):], name)
    if "://" in parent:
        return f"{parent}/{name}"
    return posixpath.join(parent, name) if parent else name


def _local_parent(local: str, said: str) -> str:
    """parent_path of a local path: relative paths stay relative (the storage resolves them the
    same way), unless the last component is ".", ".." or "~", which only the file system can name."""
    p = local.rstrip("/")
    if not p:
        raise ValueError(f"{said}: the file system's root has no parent folder")
    head, tail = posixpath.split(p)
    if tail in (".", "..") or (tail.startswith("~") and not head):
        p = os.path.abspath(os.path.expanduser(p))
        head, tail = posixpath.split(p)
        if not tail:
            raise ValueError(f"{said}: the file system's root has no parent folder")
    return head


def check_sibling_name(name: str, rel: str) -> str:
    """`name` when it can name a sibling checkpoint folder (one path component, not hidden: no
    checkpoint lives in ".ssh" or ".omnickpt"); else UnsafeCheckpointError: a manifest must not
    reach anywhere but the checkpoints next to its own folder."""
    if not name or name.startswith(".") or any(c in name for c in ("/", "\\", ":", "\x00")):
        raise UnsafeCheckpointError(
            f"data file path {rel!r} names {name!r} as its sibling checkpoint, which is not the name of a checkpoint "
            "folder (one folder name, not hidden); refusing to read it (a manifest may only name files of its own "
            "or data files of a sibling checkpoint)")
    return name


def split_reference(rel: str) -> tuple[str, str] | None:
    """(sibling name, path inside it) of a "../<name>/data/<file>" path; None for a path of the
    checkpoint's own; UnsafeCheckpointError for any other "../" path (a hidden or odd folder, a
    file that is not one of the sibling's data files)."""
    if not rel.startswith(_UP):
        return None
    name, _, rest = rel[len(_UP):].partition("/")
    check_sibling_name(name, rel)
    parts = rest.split("/")
    # The rest is one of the sibling's data files: no "..", ".", hidden, empty or odd components.
    if (len(parts) != 2 or parts[0] != _DATA or not parts[1] or parts[1].startswith(".")
            or any("\\" in p or "\x00" in p for p in parts)):
        raise UnsafeCheckpointError(
            f"data file path {rel!r} does not name a data file of the sibling checkpoint {name!r} ({name}/{_DATA}/"
            "<file>); refusing to read it (a manifest may only reference the data files of a sibling checkpoint)")
    return name, rest


class LinkedStorage:
    """The storage of the checkpoint `path`, with "../<name>/..." paths read from the sibling
    `name`'s storage (made on first use, one per sibling). Thread-safe when the storages are."""

    def __init__(self, storage: Storage, path: str):
        self._storage = storage
        self._path = str(path)
        self._siblings: dict[str, Storage] = {}
        self._lock = threading.Lock()   # reads run on many threads: one storage per sibling

    @property
    def root(self) -> str:
        return self._storage.root

    def sibling(self, name: str) -> Storage:
        """The storage of the sibling checkpoint `name`."""
        with self._lock:
            st = self._siblings.get(name)
            if st is None:
                # imported here: omnickpt.storage's __init__ may import this module
                from omnickpt.storage import storage_for
                st = self._siblings[name] = storage_for(sibling_path(self._path, name))
            return st

    def _route(self, rel: str) -> tuple[Storage, str]:
        found = split_reference(rel)
        if found is None:
            return self._storage, rel
        return self.sibling(found[0]), found[1]

    # ------------------------------------------------------------------ reads
    def _missing(self, rel: str, error: BaseException) -> BaseException:
        """A referenced file that is gone: say whose it is and what to do (the sibling's storage only
        knows that one of its files is missing)."""
        found = split_reference(rel)
        if found is None or not isinstance(error, (FileNotFoundError, CorruptCheckpointError)):
            return error
        return CorruptCheckpointError(
            f"{error} (it belongs to checkpoint {found[0]!r} next to {self._path}, whose unchanged blocks this "
            f"incremental checkpoint references: restore that folder, or load an earlier full checkpoint)")

    def read_into(self, rel: str, offset: int, buffers: Sequence[memoryview]) -> None:
        st, r = self._route(rel)
        try:
            st.read_into(r, offset, buffers)
        except (FileNotFoundError, CorruptCheckpointError) as e:
            if st is self._storage or "missing" not in str(e) and not isinstance(e, FileNotFoundError):
                raise
            raise self._missing(rel, e) from None

    def read_direct(self, rel: str, offset: int, buf: memoryview) -> None:
        """See LocalStorage.read_direct; read_into where the file's storage has no such read."""
        st, r = self._route(rel)
        direct = getattr(st, "read_direct", None)
        if direct is None:
            self.read_into(rel, offset, [buf])
            return
        try:
            direct(r, offset, buf)
        except (FileNotFoundError, CorruptCheckpointError) as e:
            if st is self._storage or "missing" not in str(e) and not isinstance(e, FileNotFoundError):
                raise
            raise self._missing(rel, e) from None

    def read_bytes(self, rel: str) -> bytes:
        st, r = self._route(rel)
        return st.read_bytes(r)

    def exists(self, rel: str) -> bool:
        st, r = self._route(rel)
        return st.exists(r)

    def size(self, rel: str) -> int:
        st, r = self._route(rel)
        try:
            return st.size(r)
        except (FileNotFoundError, CorruptCheckpointError) as e:
            if st is self._storage:
                raise
            raise self._missing(rel, e) from None

    def describe(self, rel: str = "") -> str:
        """Never raises (it builds error messages): a path it cannot route is described as written."""
        try:
            st, r = self._route(rel)
            return st.describe(r)
        except Exception:  # noqa: BLE001 - an unsafe name or a backend that cannot be made: say the path
            return self._storage.describe(rel)

    # ------------------------------------------------------------------ writes and deletes
    def _own(self, rel: str, op: str) -> str:
        if rel.startswith(_UP):
            raise ValueError(f"refusing to {op} {rel!r}: it lies in a sibling checkpoint of {self._path}, "
                             "and a checkpoint never writes into another")
        return rel

    def write_file(self, rel: str, *args, **kwargs):
        return self._storage.write_file(self._own(rel, "write"), *args, **kwargs)

    def commit(self, rel: str, data: bytes) -> None:
        self._storage.commit(self._own(rel, "commit"), data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        return self._storage.create_exclusive(self._own(rel, "create"), data)

    def delete(self, rel: str) -> None:
        self._storage.delete(self._own(rel, "delete"))

    def delete_tree(self, rel: str) -> None:
        self._storage.delete_tree(self._own(rel, "delete"))

    def __getattr__(self, name: str):
        # Only reached for what is not defined here (list, children, backend extras): the
        # checkpoint's own storage. _storage itself is looked up normally, so no recursion.
        if name.startswith("__") or name in ("_storage", "_path", "_siblings", "_lock"):
            raise AttributeError(name)
        return getattr(self._storage, name)

    def __repr__(self) -> str:
        return f"LinkedStorage({self._storage!r}, {self._path!r})"


def with_siblings(storage: Storage, path: str, files: Iterable) -> Storage:
    """`storage` wrapped in a LinkedStorage when any of `files` (FileEntry) lies in a sibling
    checkpoint; `storage` itself otherwise, so a full checkpoint reads as before. Every reference
    is checked first (split_reference): UnsafeCheckpointError names one that may not be read."""
    refs = [f.path for f in files if f.path.startswith(_UP)]
    for rel in refs:
        split_reference(rel)   # refused before anything is opened, not at the first read of that file
    return LinkedStorage(storage, path) if refs else storage
