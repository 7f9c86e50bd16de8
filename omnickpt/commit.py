"""The one commit protocol through storage, used by every save that commits without a collective:
the Checkpointer's async saves (saving.py) and the memory tier's durable copies (memory/durable.py,
memory/manager.py); run_round is the choreography both run.

Why through storage: a background thread that ran a collective on the training process group could
interleave with the training loop's own collectives (docs/design.md, "Async commit through storage").
So the ranks talk through small files under the checkpoint's control folder:

    .omnickpt/<save id>/r<rank:05d>.json   a rank's record: {"rank": r, ...payload} once its part is
                                           written, or {"rank": r, "error": msg, "error_class": cls}
    .omnickpt/<save id>/status.json        the coordinator's verdict: {"state": "committed"} or
                                           {"state": "failed", "error": msg, "class": cls}

Every rank posts its record; the coordinator awaits all of them (ending early on a failure record,
naming the missing ranks on timeout), commits, then sets the status; the other ranks await the
status. An error crosses as (class name, message) and is raised again as the same class of the
hierarchy (errors.rebuild_error), as the collectives of comm.py do. What a record carries beside
"rank" and "error" is the caller's. All waits go through `poll`.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from omnickpt.errors import CheckpointError, CheckpointTimeoutError, rebuild_error
from omnickpt.format import CONTROL_DIR
from omnickpt.storage import LocalStorage, Storage

T = TypeVar("T")
POLL_FIRST = 0.001   # a commit usually follows within milliseconds: look again soon
POLL_MAX = 0.05      # but never list a remote store more than 20 times a second
_RECORD = re.compile(r"r(\d{5})\.json")   # temp files of a commit in progress do not match
STATUS_NAME = "status.json"
VERDICT_WAIT = 2     # a non-coordinator awaits the verdict this many timeouts (Round.verdict)
RECORD_READERS = 32  # records the coordinator reads at once (an object store: one round trip each)


def poll(probe: Callable[[], T | None], timeout: float, on_timeout: Callable[[], BaseException]) -> T:
    """Call `probe` until it returns something other than None, sleeping 1 ms, doubling up to
    50 ms, between calls; past `timeout` seconds raise `on_timeout()`. `probe` is always called
    at least once, and once more after the deadline, so a result that came at the last moment wins."""
    deadline, delay = time.monotonic() + timeout, POLL_FIRST
    while True:
        expired = time.monotonic() > deadline
        got = probe()
        if got is not None:
            return got
        if expired:
            raise on_timeout()
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX)


def record_path(save_id: str, rank: int) -> str:
    return f"{CONTROL_DIR}/{save_id}/r{rank:05d}.json"


def status_path(save_id: str) -> str:
    return f"{CONTROL_DIR}/{save_id}/{STATUS_NAME}"


def post_record(storage: Storage, save_id: str, rank: int, record: dict) -> None:
    """Every rank, once its part of save `save_id` is written: its record (raises if it cannot be
    written: the coordinator would otherwise wait for it until its timeout)."""
    storage.commit(record_path(save_id, rank), json.dumps(dict(record, rank=rank), default=str).encode())


def post_failure(storage: Storage, save_id: str, rank: int, error: BaseException | tuple[str, str]) -> None:
    """A rank whose part failed: a failure record, so that the coordinator stops waiting now and
    raises the same class. Best effort: the storage may be what failed."""
    cls, msg = (type(error).__name__, str(error)) if isinstance(error, BaseException) else error
    try:
        post_record(storage, save_id, rank, {"error": msg, "error_class": cls})
    except Exception:
        pass


def failure_of(record: dict) -> tuple[str, str] | None:
    """(class name, message) of a failure record, None for a rank that succeeded."""
    if not record.get("error"):
        return None
    return record.get("error_class") or CheckpointError.__name__, record["error"]


def await_records(storage: Storage, save_id: str, world_size: int, timeout: float, what: str) -> list[dict]:
    """Coordinator: every rank's record of `save_id`, by rank. A failure record ends the wait at
    once: the status is set failed and the rank's own class raised (message: every failure seen).
    After `timeout` s the status is set failed and CheckpointTimeoutError names the ranks whose
    records never came. `what` names the save in messages ("save to PATH")."""
    prefix = f"{CONTROL_DIR}/{save_id}"
    seen: dict[int, dict] = {}

    def probe() -> list[dict] | None:
        new = {}
        for p in storage.list(prefix):
            m = _RECORD.fullmatch(p.rsplit("/", 1)[-1])
            if m and int(m.group(1)) not in seen and int(m.group(1)) < world_size:
                new[int(m.group(1))] = p
        for r, raw in _read_all(storage, new).items():
            seen[r] = json.loads(raw)
        failed = [f for r in sorted(seen) if (f := failure_of(seen[r])) is not None]
        if failed:
            msg = "; ".join(m for _, m in failed) + " (nothing was committed; the previous checkpoint is untouched)"
            set_status(storage, save_id, (failed[0][0], msg))
            raise rebuild_error(failed[0][0], f"{what} failed: {msg}")
        return [seen[r] for r in range(world_size)] if len(seen) == world_size else None

    def missing() -> BaseException:
        gone = ", ".join(str(r) for r in range(world_size) if r not in seen)
        msg = (f"rank(s) {gone} did not report their part within {timeout:.0f} s (dead, or still writing); nothing "
               "was committed and the previous checkpoint is untouched")
        set_status(storage, save_id, (CheckpointTimeoutError.__name__, msg))
        return CheckpointTimeoutError(f"{what}: {msg}")

    return poll(probe, timeout, missing)


def _read_all(storage: Storage, paths: dict[int, str]) -> dict[int, bytes]:
    """{rank: bytes} of each record path; from a remote store RECORD_READERS at a time: each read is
    a round trip there, and a coordinator reading 8,192 records one after another waits minutes
    (docs/scale.md; 512 records through moto: 26 s serially, 3 s 32 at a time). A local file system
    (shared memory too) is read in this thread: threads only slowed it (512 records 0.05 -> 0.17 s)."""
    if len(paths) <= 4 or isinstance(storage, LocalStorage):
        return {r: storage.read_bytes(p) for r, p in paths.items()}
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(RECORD_READERS, len(paths)), thread_name_prefix="omnickpt-records") as pool:
        return dict(zip(paths, pool.map(storage.read_bytes, paths.values())))


def set_status(storage: Storage, save_id: str, error: tuple[str, str] | None = None) -> None:
    """Coordinator: the verdict on `save_id`. Committed (error None) raises if it cannot be
    written, since the other ranks wait for it; failed ((class name, message)) is best effort:
    the storage may be what failed, and the error being reported matters more."""
    if error is None:
        storage.commit(status_path(save_id), json.dumps({"state": "committed"}).encode())
        return
    try:
        doc = {"state": "failed", "error": error[1], "class": error[0]}
        storage.commit(status_path(save_id), json.dumps(doc, default=str).encode())
    except Exception:
        pass


def read_status(storage: Storage, save_id: str) -> dict | None:
    """The status of `save_id`, None while there is none."""
    try:
        return json.loads(storage.read_bytes(status_path(save_id)))
    except FileNotFoundError:
        return None


def await_status(storage: Storage, save_id: str, timeout: float, what: str) -> dict:
    """A rank other than the coordinator: wait for the verdict on `save_id`. Returns the status
    once committed; raises the coordinator's error class (rebuilt) when it failed, and
    CheckpointTimeoutError when no verdict came within `timeout` s."""
    status = poll(lambda: read_status(storage, save_id), timeout, lambda: CheckpointTimeoutError(
        f"{what}: the coordinator (rank 0) did not commit within {timeout:.0f} s: it is dead, cut off from "
        f"the storage, or stalled; nothing of this save may be relied on"))
    raise_failed(status, what)
    return status


def raise_failed(status: dict, what: str) -> None:
    """Raise the error a failed status carries (as its class), nothing for a committed one."""
    if status.get("state") != "committed":
        raise rebuild_error(status.get("class") or CheckpointError.__name__, f"{what} failed: {status.get('error')}")


# ---------------------------------------------------------------------- the choreography
@dataclass(frozen=True)
class Round:
    """One commit through storage: save `save_id` in `storage`, seen from `rank` of `world_size`
    (rank 0 coordinates). `timeout` bounds every wait; `what` names the save in messages
    ("save to PATH")."""
    storage: Storage
    save_id: str
    rank: int
    world_size: int
    timeout: float
    what: str

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def post(self, record: dict) -> None:
        post_record(self.storage, self.save_id, self.rank, record)

    def fail_early(self, error: tuple[str, str]) -> None:
        """This rank's part failed: the coordinator learns now (a failure record), and where this
        rank is the coordinator, the others do too (the failed status)."""
        post_failure(self.storage, self.save_id, self.rank, error)
        if self.coordinator:
            set_status(self.storage, self.save_id, error)

    def gather(self) -> list[dict]:
        """Coordinator: every rank's record (await_records: a failure or a timeout fails the round)."""
        return await_records(self.storage, self.save_id, self.world_size, self.timeout, self.what)

    def verdict(self) -> dict:
        """Another rank: the coordinator's status, its error raised when the round failed. Waited
        for twice as long as the coordinator waits for the records: its wait starts once its own
        part is written, maybe well after ours, and where a rank is missing its verdict (naming
        that rank) is the error to raise; only a coordinator that is itself gone or cut off leaves
        us to give up on our own."""
        return await_status(self.storage, self.save_id, VERDICT_WAIT * self.timeout, self.what)


class Verdict(Exception):
    """Raised by a round's `finish` to fail the save with its own (class name, message), set as the
    status and raised on every rank as that class. Never escapes run_round. `committed`: the
    failure came after the manifest was written (the checkpoint stands; nothing of it is removed)."""

    def __init__(self, outcome: tuple[str, str], committed: bool = False):
        super().__init__(outcome[1])
        self.outcome, self.committed = outcome, committed


def run_round(round: Round, local: Callable[[], dict], finish: Callable[[list[dict]], T], *,
              after: Callable[[T], None] | None = None, wait: bool = True,
              on_failure: Callable[[BaseException, list[dict] | None], None] | None = None) -> T | None:
    """The commit choreography, the same for every save that commits through storage.

    Every rank runs `local()` (its part: data written) and posts the record it returns (a record
    may itself say the part failed: {"error": msg, "error_class": cls}); if `local` raises, a
    failure record goes instead, the coordinator then also sets the failed status at once. A rank
    whose part failed raises its error (the coordinator once it has set the failed status). The
    coordinator awaits every record (a failure record, its own too, or a timeout: the status is set
    failed and the error raised), runs `finish(records)` (the commit),
    then sets the status committed and runs `after(value)` (what follows a commit: garbage
    collection, retention). If `finish` or `after` raises, the status is set failed (a Verdict's
    own outcome, else "rank 0: Class: message") and the error raised. The other ranks, with `wait`,
    await the verdict and raise the coordinator's error class. On any failure seen on this rank,
    `on_failure(error, records)` cleans up first (records: None unless every record came).
    Returns finish's value on the coordinator, None elsewhere."""
    try:
        try:
            record = local()
        except Exception as e:
            round.fail_early((type(e).__name__, f"rank {round.rank}: {type(e).__name__}: {e}"))
            raise
        own = failure_of(record)
        _post(round, record, own)
        if not round.coordinator:
            if own is not None:
                raise rebuild_error(*own)
            if wait:
                round.verdict()
            return None
        records = round.gather()
    except Exception as e:
        if on_failure is not None:
            on_failure(e, None)
        raise
    try:
        value = finish(records)
        set_status(round.storage, round.save_id)   # committed: the others go on now
        if after is not None:
            after(value)
    except Exception as e:
        outcome = e.outcome if isinstance(e, Verdict) else (type(e).__name__, f"rank 0: {type(e).__name__}: {e}")
        set_status(round.storage, round.save_id, outcome)
        if on_failure is not None:
            on_failure(e, records)
        if isinstance(e, Verdict):
            raise rebuild_error(*outcome) from None
        raise
    return value


def _post(round: Round, record: dict, own: tuple[str, str] | None) -> None:
    """Post this rank's record; if it cannot be written, raise the part's own failure (the first
    one, what the user must hear of) or else say that the coordinator cannot be told."""
    try:
        round.post(record)
    except Exception as e:
        if own is not None:
            raise rebuild_error(*own) from e
        raise CheckpointError(f"rank {round.rank}: could not report to the coordinator: {e}") from e
