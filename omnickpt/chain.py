"""The base of an incremental save: which committed checkpoint a save compares against (the
coordinator, choose_base, holding reference records on the folders it will reference), and each
rank's part of the save (incremental_job: its tensors' block hashes against the base's). The save
job (omnickpt/saving.py) calls these in its collect and plan phases; docs/design.md, "Incremental
checkpoints", says why references are held before a base's manifest is read."""
from __future__ import annotations

import logging
from typing import Callable

from omnickpt.engine.incremental import BLOCK_BYTES, Base, WriteMeta
from omnickpt.engine.save import Incremental
from omnickpt.errors import CheckpointError, NotCommittedError, UnsafeCheckpointError
from omnickpt.format import MANIFEST_NAME, Manifest, dtype_name
from omnickpt.steps import References
from omnickpt.storage import Storage, storage_for
from omnickpt.storage.linked import LinkedStorage, check_sibling_name, sibling_path, split_reference

log = logging.getLogger("omnickpt")


def choose_base(path: str, base: str | None, full_every: int | None, block_bytes: int = BLOCK_BYTES,
                previous: str | None = None, holder: str = "omnickpt") -> tuple[tuple, References | None]:
    """Coordinator of an incremental save: ((the base's manifest, the base's folder name (None: the
    checkpoint at `path` itself), this save's place in the chain: 0 for a full save, the block
    size), the reference records it holds or None). Without `base`: the checkpoint at `path` if
    there is one, else `previous` (the last one this Checkpointer committed) if it lies next to
    `path`. A full save when there is no base yet, the base holds no block hashes (an ordinary
    save) or hashes of another block size, or the chain has reached full_every; a base given but
    absent, damaged, hidden or not next to `path` is an error (nothing is written).

    Before the base's manifest is read, a reference record (steps.References, of job `holder`) goes
    into the base's folder, then into every folder next to it whose files the manifest names, so
    that no save, garbage collection or retention removes what this save is about to reference
    (given back once it ends; each rank then checks the files it references: Base.drop_unreadable)."""
    full = (None, None, 0, block_bytes)
    if base is None and previous is not None and not storage_for(path).exists(MANIFEST_NAME):
        base = _implied_base(path, previous)
    where = path if base is None else str(base)
    name = None if base is None else _base_folder(path, base, where)
    named = name is not None   # a base folder named (or the last save's): what goes wrong with it is an error
    store = storage_for(where)
    if not store.exists(MANIFEST_NAME):
        if named:
            raise NotCommittedError(f"base={base!r}: no checkpoint there ({store.describe(MANIFEST_NAME)} is missing); "
                                    f"the base of an incremental save must be a committed checkpoint folder next to "
                                    f"{path}")
        return full, None
    held = References(holder, f"incremental save to {path}")
    try:
        found = _read_base(held, store, path, base, name)
        if found is None or not _continues(found[1], block_bytes, full_every) \
                or not _hold_siblings(held, found[2] - {name, _folder_name(path)}, path):
            held.release()
            return full, None
        return (found[0], name, found[1].chain + 1, block_bytes), held
    except BaseException:
        held.release()
        raise


def _implied_base(path: str, previous: str) -> str | None:
    """`previous` (the last checkpoint this Checkpointer committed) when it is a committed
    checkpoint next to `path` in a folder a reference may name."""
    found = _next_to(path, previous)
    if found and _base_name(found) and storage_for(previous).exists(MANIFEST_NAME):
        return previous
    return None


def _base_folder(path: str, base: str, where: str) -> str | None:
    """The folder name of `base` next to `path` (None: `path` itself); an error for a base that is
    not next to `path` or that a reference may not name."""
    found = _next_to(path, where)
    if found is None:
        raise ValueError(f"base={base!r}: an incremental checkpoint references data of a checkpoint folder next "
                         f"to it; {path} and {base} are not in the same folder")
    if found and not _base_name(found):
        raise UnsafeCheckpointError(
            f"base={base!r}: {storage_for(where).describe()} is not a folder a checkpoint may reference (a hidden "
            f"folder, or a name with ':' or '\\'); the base of an incremental save must be a committed omnickpt "
            f"checkpoint folder next to {path}")
    return found or None   # "": the checkpoint this save replaces


def _read_base(held: References, store: Storage, path: str, base: str | None,
               name: str | None) -> tuple[bytes, Manifest, set[str]] | None:
    """(the base's manifest bytes, its header, the folders its files lie in), read after a
    reference record went into its folder (the protocol of omnickpt/steps.py); None when there is
    no usable base after all (a full save). A named base that vanished or is damaged is an error."""
    if name is not None and not _hold(held, store, path):
        return None
    try:
        data = store.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:   # retired since: no base after all
        if name is not None:
            raise NotCommittedError(f"base={base!r}: its checkpoint was removed as this save started "
                                    f"({store.describe(MANIFEST_NAME)} is gone)") from None
        return None
    try:
        head = Manifest.decode(data, store.describe(MANIFEST_NAME), names=set())
        return data, head, _base_folders(head, name)
    except CheckpointError as e:
        if name is not None:
            raise
        # The checkpoint this save replaces is damaged: nothing of it can be trusted, so all is written.
        log.warning("omnickpt: incremental save over %s: its manifest cannot be used (%s); saving in full", path, e)
        return None


def _continues(head: Manifest, block_bytes: int, full_every: int | None) -> bool:
    """Whether a save may continue the chain of the checkpoint whose header is `head`: it holds
    block hashes of this block size, uncompressed, and the chain is shorter than full_every."""
    return not (head.block_bytes != block_bytes or head.compression
                or (full_every is not None and head.chain + 1 >= full_every))


def _hold_siblings(held: References, folders: set[str], path: str) -> bool:
    """A reference record in every other folder the base's files lie in; False (a full save) when
    one cannot be written."""
    return all(_hold(held, storage_for(sibling_path(path, other)), path) for other in sorted(folders))


def _next_to(path: str, other: str) -> str | None:
    """The folder name of checkpoint `other` if it lies next to `path` (the storage layer's
    sibling_path of its name is the same location), "" if it is `path` itself, else None."""
    where = storage_for(other).describe()
    if where == storage_for(path).describe():
        return ""
    name = str(other).rstrip("/").rpartition("/")[2]
    try:
        return name if storage_for(sibling_path(path, name)).describe() == where else None
    except ValueError:   # no parent folder to go up from, or not a folder name
        return None


def _hold(held: References, storage: Storage, path: str) -> bool:
    """Put a reference record of the save to `path` into the folder of `storage`; if that fails (a
    read-only or vanished folder), give back every record held and say False: data that nothing
    protects is not referenced, the save writes it in full (and still succeeds)."""
    try:
        held.hold(storage)
        return True
    except (CheckpointError, OSError) as e:
        log.warning("omnickpt: incremental save to %s: cannot record in %s that it references data there (%s: %s); "
                    "saving in full", path, storage.describe(), type(e).__name__, e)
        held.release()
        return False


def _folder_name(path: str) -> str:
    return str(path).rstrip("/").rpartition("/")[2]


def _base_name(name: str) -> bool:
    """Whether a reference may name the folder `name` (storage.linked.check_sibling_name: not hidden)."""
    try:
        check_sibling_name(name, name)
        return True
    except UnsafeCheckpointError:
        return False


def _base_folders(head: Manifest, name: str | None) -> set[str]:
    """The folders next to the new checkpoint whose data files a base's manifest (untrusted) names,
    as the new checkpoint will reference them; UnsafeCheckpointError for a file a reference may not
    name (storage.linked.split_reference: not a data file, a hidden folder)."""
    folders = set()
    for f in head.files:
        rel = f.path if name is None or f.path.startswith("../") else f"../{name}/{f.path}"
        found = split_reference(rel)
        if found is not None:
            folders.add(found[0])
    return folders


def incremental_job(chain: tuple, shards: list, writes, path: str) -> Callable[[], tuple]:
    """This rank's part of an incremental save, made in the background persist (the base's
    manifest is decoded there, for the tensors this rank writes only, not on the stall path)."""
    data, name, depth, block_bytes = chain

    def make() -> tuple:
        metas = [WriteMeta(s.name, tuple(s.shape), dtype_name(s.dtype), tuple(s.box.offsets), tuple(s.box.lengths),
                           s.dtype.itemsize) for s in (shards[w.index] for w in writes)]
        base = None
        if data is not None:
            manifest = Manifest.decode(data, f"base {name or 'checkpoint'} manifest", names={m.name for m in metas})
            # Reads the sizes of the base files this rank references (through the folders next to `path`).
            base = Base(manifest, name, LinkedStorage(storage_for(path), path), own=_folder_name(path))
        return (Incremental(metas, base, block_bytes),
                {"block_bytes": block_bytes, "base": name if data is not None else None, "chain": depth})
    return make


