"""Step folders: `global_step_N` naming and parsing, finding the committed ones, the `latest`
pointer and which steps retention retires. One module, used by both managers, the memory tier
(whose node folders hold step folders too) and the readers that point a user at a root's steps.

A step folder is a checkpoint once its manifest is there (the manifest is written last); removing
one removes its manifest first, so a removal that stops halfway never leaves a folder that looks
loadable but is not.

References. An incremental checkpoint's manifest names data files of folders next to it ("base"
records). What may be removed from a folder is decided here, for retention, the garbage collection
after a save into a folder (engine/save.py) and the removal of a failed save's folder, by one rule:
no data file is removed that the manifest of any committed checkpoint next to it names (any folder
with a manifest, step or not: read from its header), nor while a save in flight holds a reference
record in the folder (REFS_DIR: it may be about to reference any file there), nor in a folder that
another save is writing (a live owner record, omnickpt/lease.py). The reference record is a lease
record (renewed while the save runs, stale once its process is gone or its ttl passed), taken by an
incremental save on every folder it may reference before it reads the base's manifest, and given
back after its commit; a remover deletes a folder's manifest first and only then looks for records
and reads the references, so either the save sees no manifest (and does not take that base) or
the remover sees its record (or, once it committed, its manifest). If any manifest's references
cannot be read, the files stay (with a warning). A retired folder that still holds referenced files
is stripped to them (manifest first) and removed whole on a later pass, once nothing names them.
"""
from __future__ import annotations

import logging
import re
import uuid
import weakref
from typing import Callable, Iterable

from omnickpt.errors import CheckpointError, CorruptCheckpointError
from omnickpt.format import CONTROL_DIR, MANIFEST_NAME, read_header
from omnickpt.lease import OWNER_RECORD, Lease, acquire, record_is_live
from omnickpt.storage import Storage, storage_for
from omnickpt.storage.linked import parent_path

STEP_DIR = re.compile(r"^global_step_(\d+)$")   # a CheckpointManager's (and ByteCheckpoint's) step folders
LATEST_NAME = "latest"
# Reference records of saves in flight that may reference a folder's data: <folder>/.omnickpt/refs/<id>.json,
# each a lease record (omnickpt/lease.py) of the saving job.
REFS_DIR = f"{CONTROL_DIR}/refs"
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
    advice = "cannot tell which files of other steps it uses: restore its manifest, or remove that checkpoint"
    # a newer format may name other steps' files in a way this code does not know: read_header refuses it
    doc = read_header(storage, rel, f"checkpoint {where}", advice)
    if doc is None:
        return set()
    try:
        found = set()
        for f in doc["files"]:
            if "base" not in f:
                continue
            base, path = f["base"], f["path"]
            if not isinstance(base, str) or not isinstance(path, str) or not base or not path:
                raise ValueError(f"file record {f!r:.120} has no valid base and path")
            found.add((base, path))
        return found
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"checkpoint {where}: its manifest's header is unreadable "
                                     f"({type(e).__name__}: {e}); {advice}") from None


def retire(storage: Storage, keep: int | None, upto: int, pinned: Iterable[int] = (), rel: str = "",
           complete: Callable[[Storage, str], bool] | None = None) -> list[int]:
    """Apply `retired` to the step folders in `rel`; returns the steps removed or stripped. A step
    folder that a committed checkpoint next to it (kept steps, newer ones, any other folder with a
    manifest) takes files from loses its manifest and every other file, keeping just those; a later
    pass removes it once nothing names them. A folder another save is writing is left for a later
    pass; one that a save in flight holds a reference record in loses only its manifest. If the
    references of a committed checkpoint cannot be read, nothing is removed (with a warning):
    whatever is removed might be what it names."""
    if keep is None:
        return []
    folders = dict((s, name) for s, name in step_folders(storage, rel))
    committed = committed_steps(storage, rel, complete)
    # A folder another save is writing right now (another manager of this process, a save over an
    # old step): not this pass's to remove, whatever it holds.
    gone = sorted(s for s in retired(set(folders), committed, keep, upto, pinned)
                  if not _in_flight(storage, _join(rel, folders[s])))
    if not gone:
        return []
    leaving = {folders[s] for s in gone}
    try:
        references_among(storage, rel, skip=leaving)   # unreadable: remove nothing, manifests included
    except (CheckpointError, OSError) as e:
        _log.warning("omnickpt: retention removes no checkpoint in %s this time: %s", storage.describe(rel), e)
        return []
    for s in gone:
        # No checkpoint any more: a save that has not read its manifest yet will not take it as its base.
        storage.delete(f"{_join(rel, folders[s])}/{MANIFEST_NAME}")
    # Only now: records of saves that read a manifest before it went, and the references of saves
    # that committed since (they give their records back only after their commit).
    held = {s for s in gone if live_references(storage, _join(rel, folders[s]))}
    try:
        named = references_among(storage, rel, skip=leaving)
    except (CheckpointError, OSError) as e:
        _log.warning("omnickpt: retention keeps the data of step(s) %s in %s this time (their manifests are "
                     "removed): %s", gone, storage.describe(rel), e)
        return gone
    for s in gone:
        if s not in held:
            _release_folder(storage, _join(rel, folders[s]), named.get(folders[s], set()))
    return gone


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _release_folder(storage: Storage, folder: str, keep: set[str]) -> None:
    """Remove `folder` (no checkpoint any more), or strip it to the files `keep` that others name."""
    if keep:
        _strip_step(storage, folder, keep)
    else:
        remove_step(storage, folder)


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


def discard_folder(storage: Storage, folder: str) -> None:
    """Remove the folder `folder` (relative to `storage`, the root of its siblings) of a save that
    failed, unless it holds a committed checkpoint; the files that checkpoints next to it reference
    stay (a retired step stripped to them, saved into again), and all of them while a save in flight
    holds a reference record there or the references cannot be read."""
    if storage.exists(f"{folder}/{MANIFEST_NAME}"):
        return
    if live_references(storage, folder):
        return
    parent, _, name = folder.rstrip("/").rpartition("/")
    try:
        named = references_among(storage, parent, skip={name})
    except (CheckpointError, OSError) as e:
        _log.warning("omnickpt: %s of a failed save is kept: %s", storage.describe(folder), e)
        return
    _release_folder(storage, folder, named.get(name, set()))


# ---------------------------------------------------------------------- references between folders
def references_among(storage: Storage, rel: str = "", skip: Iterable[str] = ()) -> dict[str, set[str]]:
    """Folder name -> the files inside it that the committed checkpoints in `rel` take from it: every
    folder with a manifest (step folders or not) except the names in `skip`. A manifest that cannot
    be read raises CorruptCheckpointError (StorageError...: the storage's) naming its step or folder:
    the caller must then assume anything is named."""
    skip = set(skip)
    named: dict[str, set[str]] = {}
    for name in storage.children(rel):
        if name in skip or name == CONTROL_DIR:
            continue
        try:
            refs = referenced_files(storage, _join(rel, name))
        except (CheckpointError, OSError) as e:
            step = parse_step(name)
            raise CorruptCheckpointError(f"the files that {f'step {step}' if step is not None else repr(name)} uses "
                                         f"from other folders cannot be read ({e})") from e
        for base, inner in refs:
            named.setdefault(base, set()).add(inner)
    return named


def references_here(storage: Storage) -> set[str] | None:
    """The data files (paths inside it) of the checkpoint at `storage` that the committed
    checkpoints next to it reference, found by reading their manifests' headers. None when none of
    its files may go: a save in flight holds a reference record here (it may reference any of
    them), or a neighbour's references cannot be read (with a warning)."""
    if live_references(storage):
        return None
    root = str(storage.root).rstrip("/")
    try:
        parent = parent_path(root)
    except ValueError:
        return set()    # nothing holds it (a bucket's or file system's root): it has no neighbours
    name = root.rpartition("/")[2]
    try:
        return references_among(storage_for(parent), skip={name}).get(name, set())
    except (CheckpointError, OSError) as e:
        _log.warning("omnickpt: %s keeps the data files of its earlier saves: %s", storage.describe(), e)
        return None


class References:
    """The reference records one save in flight holds (REFS_DIR), one per folder whose data it may
    reference; release() gives them all back (also when the object is collected, or the process
    ends: the records go stale)."""

    def __init__(self, holder: str, what: str):
        self.holder, self.what = holder, what
        self._leases: list[Lease] = []
        self._release = weakref.finalize(self, _release_all, self._leases)

    def hold(self, storage: Storage) -> None:
        """Record in the folder of `storage`, before reading its manifest, that this save may use its
        data. Raises as the storage does (the caller must then not reference that folder)."""
        self._leases.append(acquire(storage, self.holder, what=self.what,
                                    record=f"{REFS_DIR}/{uuid.uuid4().hex}.json"))

    def release(self) -> None:
        self._release()


def _release_all(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()


def live_references(storage: Storage, folder: str = "") -> int:
    """How many saves in flight hold a reference record in `folder`. Records of saves that ended
    without giving them back (their process is gone, or they were not renewed within their ttl)
    are removed."""
    where = _join(folder, REFS_DIR)
    live = 0
    for name in storage.children(where):
        record = f"{where}/{name}"
        state = record_is_live(storage, record)
        if state:
            live += 1
        elif state is False:
            storage.delete(record)
    return live


def _in_flight(storage: Storage, folder: str) -> bool:
    """Whether a save into `folder` is under way: its owner record is live."""
    return bool(record_is_live(storage, f"{folder}/{OWNER_RECORD}"))
