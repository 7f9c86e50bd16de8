"""CheckpointManager: step directories, a `latest` pointer, retention, and async saves that the
next save waits for."""
from __future__ import annotations

import re
from typing import Any

from omnickpt.api import Checkpointer, LoadResult, SaveHandle, default_checkpointer
from omnickpt.errors import NotCommittedError
from omnickpt.format import MANIFEST_NAME
from omnickpt.storage import storage_for

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointManager:
    """Saves `root/global_step_N` checkpoints; keeps the newest `keep_last` committed ones.

    A step directory without a committed manifest is never reported as latest. Retention runs on
    the coordinator right after a commit and never touches the step just written, a step this
    manager is loading, or any step newer than the newest committed one (it may be in flight).
    """

    def __init__(self, root: str, *, keep_last: int | None = None, checkpointer: Checkpointer | None = None,
                 process_group: Any = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self._ckpt = checkpointer or default_checkpointer()
        self._group = process_group
        self._storage = storage_for(self.root)
        self._pending: SaveHandle | None = None
        self._loading: int | None = None

    def step_path(self, step: int) -> str:
        return f"{self.root}/global_step_{int(step)}"

    def save(self, step: int, state: dict, *, async_save: bool = False, **kwargs) -> SaveHandle:
        """Save step `step`; first waits for the previous async save to commit."""
        self.wait()
        handle = self._ckpt.save(self.step_path(step), state, async_save=async_save, process_group=self._group,
                                 on_commit=lambda _m, step=int(step): self._after_commit(step), **kwargs)
        self._pending = handle if async_save else None
        return handle

    def wait(self) -> dict | None:
        """Wait for the in-flight async save, if any; returns its report."""
        handle, self._pending = self._pending, None
        return handle.wait() if handle is not None else None

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        out = []
        for name in self._storage.children(""):
            m = _STEP_DIR.match(name)
            if m and self._storage.exists(f"{name}/{MANIFEST_NAME}"):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load_latest(self, state: dict, **kwargs) -> LoadResult:
        step = self.latest_step()
        if step is None:
            raise NotCommittedError(f"{self.root} holds no committed checkpoint (no global_step_N/{MANIFEST_NAME})")
        return self.load(step, state, **kwargs)

    def load(self, step: int, state: dict, **kwargs) -> LoadResult:
        self._loading = int(step)
        try:
            return self._ckpt.load(self.step_path(step), state, process_group=self._group, **kwargs)
        finally:
            self._loading = None

    def _after_commit(self, step: int) -> None:
        self._storage.commit("latest", f"{step}\n".encode())
        if self.keep_last is None:
            return
        committed = self.steps()
        keep = set(committed[-self.keep_last:]) | {step}
        if self._loading is not None:
            keep.add(self._loading)
        newest = max(committed) if committed else step
        for name in self._storage.children(""):
            m = _STEP_DIR.match(name)
            if not m:
                continue
            s = int(m.group(1))
            if s in keep or s > newest:
                continue
            # Manifest first: from that moment the step is no longer a checkpoint, so a crash
            # halfway through deleting never leaves something that looks loadable but is not.
            self._storage.delete(f"{name}/{MANIFEST_NAME}")
            self._storage.delete_tree(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()
