"""Step folders: `global_step_N` naming and parsing, finding the committed ones, the `latest`
pointer and which steps retention retires. One module, used by both managers, the memory tier
(whose node folders hold step folders too) and the readers that point a user at a root's steps.

A step folder is a checkpoint once its manifest is there (the manifest is written last); removing
one removes its manifest first, so a removal that stops halfway never leaves a folder that looks
loadable but is not.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

from omnickpt.format import MANIFEST_NAME
from omnickpt.storage import Storage

STEP_DIR = re.compile(r"^global_step_(\d+)$")   # a CheckpointManager's (and ByteCheckpoint's) step folders
LATEST_NAME = "latest"


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


def retire(storage: Storage, keep: int | None, upto: int, pinned: Iterable[int] = (), rel: str = "",
           complete: Callable[[Storage, str], bool] | None = None) -> list[int]:
    """Apply `retired` to the step folders in `rel`; returns the steps removed."""
    if keep is None:
        return []
    folders = step_folders(storage, rel)
    gone = retired({s for s, _ in folders}, committed_steps(storage, rel, complete), keep, upto, pinned)
    for s, name in folders:
        if s in gone:
            remove_step(storage, f"{rel}/{name}" if rel else name)
    return sorted(gone)
