"""Step folders: `global_step_N` naming and parsing, finding the committed ones, the `latest`
pointer and which steps retention retires. One module, used by both managers, the memory tier
(whose node folders hold step folders too) and the readers that point a user at a root's steps.

A step folder is a checkpoint once its manifest is there (the manifest is written last); removing
one removes its manifest first, so a removal that stops halfway never leaves a folder that looks
loadable but is not. An incremental checkpoint's manifest names data files of older sibling step
folders ("base" records): retention never deletes a file that a kept checkpoint names, but strips
such a folder to those files (manifest first) and removes it whole on a later pass, once no kept
checkpoint names any of them; if a kept checkpoint's references cannot be read, it removes nothing.
"""
from __future__ import annotations

import json
import logging
import re
import struct
from typing import Callable, Iterable

from omnickpt.errors import CheckpointError, CorruptCheckpointError
from omnickpt.format import FORMAT_VERSION, MAGIC, MANIFEST_NAME
from omnickpt.storage import Storage

STEP_DIR = re.compile(r"^global_step_(\d+)$")   # a CheckpointManager's (and ByteCheckpoint's) step folders
LATEST_NAME = "latest"
# The version-3 manifest's prelude (format/manifest.py): magic, version, header bytes, array bytes, crc, reserved.
_PRELUDE = struct.Struct("<8sIIQII")
_log = logging.getLogger("omnickpt")


def step_dir(step: int) -> str:
    """The folder name of step `step`."""
    return f"global_step_{int(step)}"


def parse_step(name: str) -> int | None:
    """The N of a `global_step_N` folder name, None for any other name."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_folders(storage: Storage, rel: str = "") -> list[tuple[int, str]]:
    """(step, folder name) of every step folder in `rel`, committed or not, by step."""
    found = [(parse_step(name), name) for name in storage.children(rel)]
    return sorted((s, name) for s, name in found if s is not None)


def committed_steps(storage: Storage, rel: str = "", complete: Callable[[Storage, str], bool] | None = None) -> list[int]:
    """Steps in `rel` that hold a committed checkpoint (a manifest), oldest first. `complete`
    replaces that test (the memory tier also checks every file's size)."""
    def has_manifest(st: Storage, where: str) -> bool:
        return st.exists(f"{where}/{MANIFEST_NAME}")
    check = complete or has_manifest
    return sorted({s for s, name in step_folders(storage, rel) if check(storage, f"{rel}/{name}" if rel else name)})


def write_latest(storage: Storage, step: int) -> None:
    """The `latest` pointer of a root (ByteCheckpoint's tracker file too): the newest step committed."""
    storage.commit(LATEST_NAME, f"{int(step)}\n".encode())


def retired(present: Iterable[int], committed: Iterable[int], keep: int | None, upto: int,
            pinned: Iterable[int] = ()) -> set[int]:
    """Which of the `present` steps retention removes once step `upto` is committed (pure): of the
    committed steps up to `upto`, the newest `keep` stay (None: all), and so do `upto` and the
    `pinned` ones (being loaded, being copied); steps newer than `upto` are never retired (in
    flight, or an abandoned run's that this run has not passed yet)."""
    if keep is None:
        return set()
    kept = set([s for s in sorted(set(committed)) if s <= upto][-keep:]) | set(pinned) | {upto}
    return {s for s in present if s < upto and s not in kept}


def remove_step(storage: Storage, folder: str) -> None:
    """Remove a step folder (a path relative to `storage`), manifest first."""
    storage.delete(f"{folder}/{MANIFEST_NAME}")
    storage.delete_tree(folder)


def referenced_files(storage: Storage, folder: str) -> set[tuple[str, str]]:
    """(sibling folder name, path inside it) of every data file that the manifest in `folder` takes
    from a sibling step folder (its "base" records). Reads only the header of a version-3 manifest
    (two ranged reads: retention must not fetch every kept step's tensor arrays); a JSON manifest
    (versions 1, 2) has no such records, a missing one none at all. A header that cannot be read
    is a CorruptCheckpointError naming `folder`: the caller must then assume anything is named."""
    rel = f"{folder}/{MANIFEST_NAME}"
    if not storage.exists(rel):
        return set()
    where = storage.describe(folder)

    def corrupt(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {where}: {what}; cannot tell which files of other steps it "
                                      "uses: restore its manifest, or remove that checkpoint")
    size = storage.size(rel)
    if size == 0:
        raise corrupt("its manifest is empty")
    first = bytearray(min(size, _PRELUDE.size))
    storage.read_into(rel, 0, [memoryview(first)])
    if first[:1] == b"{":
        return set()
    if len(first) < _PRELUDE.size or bytes(first[:len(MAGIC)]) != MAGIC:
        raise corrupt(f"its manifest starts with {bytes(first[:len(MAGIC)])!r}, neither a version-3 prelude nor JSON")
    _, version, head_len, _, _, _ = _PRELUDE.unpack(first)
    if version < 3 or version > FORMAT_VERSION:
        # a newer format may name other steps' files in a way this code does not know
        raise corrupt(f"its manifest is of format version {version}; this omnickpt reads 3..{FORMAT_VERSION}")
    if _PRELUDE.size + head_len > size:
        raise corrupt(f"its manifest's header ({head_len} bytes) runs past its {size} bytes (truncated)")
    head = bytearray(head_len)
    storage.read_into(rel, _PRELUDE.size, [memoryview(head)])
    try:
        doc = json.loads(head.decode("utf-8"))
        found = set()
        for f in doc["files"]:
            if "base" not in f:
                continue
            base, path = f["base"], f["path"]
            if not isinstance(base, str) or not isinstance(path, str) or not base or not path:
                raise ValueError(f"file record {f!r:.120} has no valid base and path")
            found.add((base, path))
        return found
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise corrupt(f"its manifest's header is unreadable ({type(e).__name__}: {e})") from None


def retire(storage: Storage, keep: int | None, upto: int, pinned: Iterable[int] = (), rel: str = "",
           complete: Callable[[Storage, str], bool] | None = None) -> list[int]:
    """Apply `retired` to the step folders in `rel`; returns the steps removed or stripped. A step
    folder that a kept checkpoint (committed and not retired, newer steps included) takes files
    from loses its manifest and every other file, keeping just those; a later pass removes it once
    no kept checkpoint names them. If the references of a kept checkpoint cannot be read, nothing
    is removed (with a warning): whatever is removed might be what it names."""
    if keep is None:
        return []
    folders = step_folders(storage, rel)
    committed = committed_steps(storage, rel, complete)
    gone = retired({s for s, _ in folders}, committed, keep, upto, pinned)
    if not gone:
        return []

    def path(name: str) -> str:
        return f"{rel}/{name}" if rel else name
    kept = set(committed) - gone
    named: dict[str, set[str]] = {}    # sibling folder -> its files that kept checkpoints name
    for s, name in folders:
        if s not in kept:
            continue
        try:
            refs = referenced_files(storage, path(name))
        except (CheckpointError, OSError) as e:
            _log.warning("omnickpt: retention removes no checkpoint in %s this time: the files that step %d uses "
                         "from other steps cannot be read (%s)", storage.describe(rel), s, e)
            return []
        for base, inner in refs:
            named.setdefault(base, set()).add(inner)
    for s, name in folders:
        if s not in gone:
            continue
        if not named.get(name):
            remove_step(storage, path(name))
        else:
            _strip_step(storage, path(name), named[name])
    return sorted(gone)


def _strip_step(storage: Storage, folder: str, keep: set[str]) -> None:
    """Turn the step folder `folder` into a holder of the files `keep` (paths inside it) for the
    checkpoints that name them: its manifest goes first (it is no checkpoint any more, and a stop
    halfway leaves nothing that looks loadable), then every other file."""
    storage.delete(f"{folder}/{MANIFEST_NAME}")
    head = folder.rstrip("/") + "/"
    for f in storage.list(folder):
        # list() gives paths relative to the storage, `folder` included
        if f.startswith(head) and f[len(head):] not in keep:
            storage.delete(f)
