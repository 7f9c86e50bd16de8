"""StepRoot: a checkpoint root as the one manager that writes it owns it. Both managers own one
(CheckpointManager, and TieredCheckpointManager for its durable side).

What it holds, and nothing else: the root's owner lease (omnickpt/lease.py: one live job per root),
the `latest` pointer and retention after each commit (omnickpt/steps.py: naming, listing and the
retention rule, reference records included), the removal of a failed save's step folder, and the
exit hook that finishes a manager nobody closed. Where steps come from (a Checkpointer save, a
durable copy out of shared memory) is the manager's business.

    root/global_step_N/            a step folder (a checkpoint once its manifest is there)
    root/latest                    the newest step this run committed
    root/.omnickpt/owner.json      the owner lease of the job writing root

Who calls what: every rank builds one and calls settle(); the coordinator alone writes (hold,
after_commit, discard_failed, warn_newer do nothing elsewhere). No collective except settle().
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import warnings
import weakref
from typing import Any, Callable

from omnickpt.api import at_shutdown
from omnickpt.errors import CheckpointError
from omnickpt.lease import Lease, acquire
from omnickpt.steps import committed_steps, discard_folder, retire, step_dir, write_latest
from omnickpt.storage import storage_for

log = logging.getLogger("omnickpt")


class StepRoot:
    """The step folders of `root` as one job's manager owns them.

    keep_last: committed steps kept by retention (None: all). `comm`: the manager's process group
    (its coordinator is the one that writes). `job_id` names this job in its leases (default: this
    process; a manager agreeing on the coordinator's sets `job_id`)."""

    def __init__(self, root: str, comm: Any, *, keep_last: int | None = None):
        check_keep_last(keep_last)
        self.path = str(root).rstrip("/")
        self.keep_last = keep_last
        self.comm = comm
        self.storage = storage_for(self.path)
        self.job_id = process_id()   # the coordinator's: the one that holds the root
        # Leases go back in release(), or when an unclosed manager (and this root) is collected or the
        # interpreter ends.
        self._leases: list[Lease] = []
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._release = weakref.finalize(self, _release_all, self._leases)
        self._loading: int | None = None   # a step being loaded: retention never retires it
        self.loaded: int | None = None     # the last step this run loaded (it resumed, or rolled back)

    # ------------------------------------------------------------------ steps
    def step_path(self, step: int) -> str:
        return f"{self.path}/{step_dir(step)}"

    def steps(self) -> list[int]:
        """Committed steps in root, oldest first (reads storage only)."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @contextlib.contextmanager
    def loading(self, step: int):
        """While the block runs, retention keeps step `step` (it is being loaded)."""
        self._loading = int(step)
        try:
            yield
            self.loaded = int(step)
        finally:
            self._loading = None

    # ------------------------------------------------------------------ the owner lease
    @property
    def held(self) -> bool:
        """Whether this process holds the root's owner lease (the coordinator, after hold())."""
        return self._lease is not None

    def hold(self) -> None:
        """Coordinator, before its first write to root: make this job the root's owner (once)."""
        with self._lock:
            if self._lease is None:
                self._lease = acquire(self.storage, self.job_id, what=f"checkpoint root {self.path}")
                self._leases.append(self._lease)

    def keep(self, lease: Lease) -> None:
        """A lease of the same job given back with the root's (the memory tier's, per machine)."""
        self._leases.append(lease)

    def take(self) -> str:
        """Every rank, at construction: the coordinator takes the owner lease; a refusal raises on
        every rank (one all-gather with several ranks), the leases given back. Returns the
        coordinator's job id."""
        def local() -> str:
            if self.comm.is_coordinator:
                self.hold()
            return self.job_id

        return self.comm.run_step(f"taking the checkpoint root {self.path}", local,
                                  on_failure=lambda _error: self.release())[0]

    def settle(self, error: BaseException | None, what: str, payload: Any = None) -> list:
        """Every rank: raise on all ranks (the same class) if any failed, the leases taken given back
        first. Returns every rank's payload."""
        try:
            return self.comm.settle(what, error, payload)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give every lease back (once; later calls do nothing)."""
        self._release()

    # ------------------------------------------------------------------ after a save
    def after_commit(self, step: int) -> None:
        """Coordinator, once step `step` is committed in root: `latest`, then retention among the
        steps up to `step` only (an abandoned run's newer steps are not this run's to retire)."""
        write_latest(self.storage, step)
        retire(self.storage, self.keep_last, step, pinned=() if self._loading is None else (self._loading,))

    def discard_failed(self, step: int) -> None:
        """Coordinator, once every rank is done with a failed save of `step`: its folder goes unless
        it holds a committed checkpoint (an earlier save of that number), so that failed folders do
        not pile up (a full disk gets its space back); but not the files that checkpoints next to it
        reference (a retired step stripped to them, saved into again after a rollback: steps.py).
        Best effort: the storage may be what failed."""
        if not self.comm.is_coordinator or self._lease is None:
            return
        name = step_dir(step)
        try:
            discard_folder(self.storage, name)
        except Exception as e:
            log.warning("omnickpt: could not remove %s of the failed save of step %d: %s",
                        self.storage.describe(name), step, e)

    def first_save(self, step: int, overwrite: bool, stacklevel: int = 6) -> None:
        """Every rank, before this run's first save (of step `step`), when this run loaded no step:
        committed steps it did not expect are refused, never overwritten: step `step` itself, or steps
        newer than it (a restarted job that did not resume would save over, or beside, the steps it
        should have resumed from). A run that loaded a step has seen root (a resume, or a rollback to
        an older step whose later saves replace the newer ones); `overwrite=True` (the manager's
        option) says the run knowingly starts over in root. Either way newer steps only warn. Raised
        on every rank."""
        def local() -> None:
            if not self.comm.is_coordinator:
                return
            if not overwrite and self.loaded is None:
                try:
                    steps = self.steps()
                except (CheckpointError, OSError):
                    return   # root unreachable: the save itself will say so
                newer = [s for s in steps if s > step]
                if step in steps:
                    raise CheckpointError(
                        f"{self.step_path(step)} is a committed checkpoint that this run did not write: saving step "
                        f"{step} would overwrite it. Resume from it (load_latest(state) or load({step}, state)) before "
                        f"saving later steps, save to another root, or pass overwrite=True to the manager to replace it")
                if newer and self.loaded is None:
                    raise CheckpointError(
                        f"{self.path} holds committed step(s) {newer[-8:]} newer than step {step}, this run's first "
                        f"save, and this run resumed from none of them (a restarted job that did not find them?). "
                        f"Resume with load_latest(state) first, save to another root, or pass overwrite=True to the "
                        f"manager to start over beside them (they are kept)")
            self.warn_newer(step, stacklevel=stacklevel + 2)

        self.comm.run_step(f"first save to {self.path}", local)

    def warn_newer(self, step: int, stacklevel: int = 5) -> None:
        """Coordinator, at this run's first save: root's committed steps newer than it are another run's.
        `stacklevel` points the warning at the caller of save()."""
        if not self.comm.is_coordinator:
            return
        try:
            newer = [s for s in committed_steps(self.storage) if s > step]
        except (CheckpointError, OSError):
            return   # root unreachable: the save itself will say so
        if newer:
            warnings.warn(f"omnickpt: {self.path} holds committed step(s) {newer} newer than step {step}, this run's "
                          f"first save: another (abandoned?) run's. They are kept (retention only retires steps older "
                          f"than the one just saved), and latest_step()/load_latest() pick step {newer[-1]} until this "
                          f"run passes it: remove them, or save to another root, if they are not to be resumed from",
                          RuntimeWarning, stacklevel=stacklevel)

    # ------------------------------------------------------------------ the exit hook
    def finish_at_exit(self, close: Callable[[], None]) -> None:
        """Call `close` (a bound method of the manager owning this root: it does nothing once the
        manager is closed) at interpreter exit: registered with threading's exit hooks, which run
        before concurrent.futures stops taking work (as the Checkpointer's; this one runs first,
        being registered later). If it cannot finish, the error goes to stderr and the process
        exits with status 1, never 0 with a step lost. A weak reference: the hook never keeps a
        manager alive."""
        ref, path = weakref.WeakMethod(close), self.path

        def finish() -> None:
            method = ref()
            if method is None:
                return
            try:
                method()
            except BaseException as e:
                print(f"omnickpt: ERROR: the CheckpointManager of {path}, still open at exit, could not finish: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
                for h in logging.getLogger().handlers + log.handlers:
                    try:
                        h.flush()
                    except Exception:
                        pass
                sys.stdout.flush()
                os._exit(1)

        at_shutdown(finish)


def check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}: must be an integer of at least 1 (or None to keep everything)")


def _release_all(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()


def process_id() -> str:
    """This process as the holder of owner leases. One process is one job: a second manager in
    it (a restore check, a notebook cell run again) takes the first one's record over as its own,
    while another process, on this machine or any other, is another job."""
    try:
        with open("/proc/self/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]   # the process's start time: pids are reused
    except (OSError, IndexError):
        start = "0"
    return f"{socket.gethostname()}-{os.getpid()}-{start}"
