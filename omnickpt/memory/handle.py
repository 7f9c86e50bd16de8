"""TieredSave: the handle of a save to the memory tier (a SaveHandleProtocol, omnickpt/api.py)."""
from __future__ import annotations

import threading
from concurrent.futures import Future

from omnickpt.api import SaveHandle


class TieredSave:
    """A save to the memory tier; a SaveHandleProtocol (omnickpt/api.py) like every save handle.
    wait_memory() returns once the step is committed in shared memory (its report: the stall and the
    snapshot timings); wait() also waits for the step's durable copy when this step is one that is
    persisted (report["durable"] is then the durable manifest's save id).

    fence() waits for the memory save's snapshot: that save is an async Checkpointer save, so its
    snapshot is lazy unless save() was given snapshot="eager" (then fence() returns at once, the data
    having been copied before save() returned; so does it after a save without async_save, which
    fenced before returning). The durable copy reads shared memory, never the state, so it is no
    part of the fence."""

    def __init__(self, step: int, memory: Future, handle: SaveHandle):
        self.step = step
        self._memory = memory
        self._handle = handle   # the Checkpointer's save into shared memory: its fence is this save's
        self._training_thread = threading.get_ident()   # the one that called save()

    def fence(self) -> None:
        """The training thread: wait until the snapshot is complete and take its step hooks off the
        optimizers; after it the state may change without reaching the checkpoint. Raises nothing
        about the save itself: wait() / wait_memory() do."""
        self._handle.fence()

    def staged(self) -> bool:
        """Never blocks: whether the snapshot into shared memory is complete (SaveHandle.staged)."""
        return self._handle.staged()

    def done(self) -> bool:
        if not self._memory.done():
            return False
        if self._memory.exception() is not None:
            return True
        durable = self._memory.result()[1]
        return durable is None or durable.done()

    def wait_memory(self, timeout: float | None = None) -> dict:
        self._fence_here()
        return self._memory.result(timeout)[0]

    def wait(self, timeout: float | None = None) -> dict:
        self._fence_here()
        report, durable = self._memory.result(timeout)
        report = dict(report)
        if durable is not None:
            report["durable"] = durable.result(timeout)
        return report

    def _fence_here(self) -> None:
        # As SaveHandle.wait(): the training thread also takes the hooks off (the memory lane's
        # wait leaves them, being another thread); any other thread leaves them alone.
        if threading.get_ident() == self._training_thread:
            self.fence()
