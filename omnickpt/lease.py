"""The owner lease: one live job at a time writes a checkpoint root (or a shared-memory job).

Two jobs pointed at one path by mistake overwrite each other's steps and garbage-collect each
other's files, silently. So the job that saves there first writes an owner record (OWNER_RECORD
under the root, created with Storage.create_exclusive: of two jobs starting at once exactly one
creates it), and a heartbeat thread renews it every ttl/3 seconds while the job lives. Any other
job that finds the record gets CheckpointLockedError naming the owner, unless the record is stale:

- its process is gone: the record comes from this machine (same hostname, boot id and pid
  namespace) and its pid no longer exists (or is a zombie), so a crash here frees the root at once;
- or it was last renewed longer ago than its ttl, so a job that died on another machine frees the
  root after ttl seconds (hosts' clocks must agree to well within ttl, as NTP keeps them);
- or its times cannot be believed: a ttl that is not a finite number of seconds up to MAX_TTL, or
  a renewal time that is not a finite number (no omnickpt writes them; a record with an infinite
  ttl would otherwise lock the root forever);
- or its renewal time lies ahead of this machine's clock (the two hosts' clocks disagree, so its
  age cannot be told) and it is not renewed while this job watches it for its ttl: the heartbeat of
  a live owner renews it every ttl/3, whatever the clocks say. Judging by the clocks instead would
  keep a dead job's record for as long as its host's clock was ahead.

A stale record is taken over, with a warning naming the old owner. Takeover is: check the record
is still the stale one, replace it (Storage.commit), pause, re-read. Of two jobs taking over one
stale record at once both re-read the last writer's record, so exactly one wins and the other
raises CheckpointLockedError. The pause (four times the replace's own latency, at least 0.25 s)
bounds how late a racing replace may land; a contender frozen for longer (SIGSTOP, a stalled VM)
is caught by the next heartbeat of one of the two, which then reports the lease lost(). This
guards against mistakes, it is not a fencing protocol: a job that lost its lease is told (lost(),
and a warning in the log), not stopped.

The holder is a job id, the same string on every rank (one process per job acquires). The record
belongs to the job, not to a process: the same job acquiring again (a second save, a Lease of the
manager and one of a save, a restarted job with the same id) takes it over as its own, and a
release leaves it to any other live Lease of the job (whose heartbeat writes it back). The record
is plain JSON: {holder, host, boot_id, pid_ns, pid, started, renewed, what, ttl, lease}.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import warnings

from omnickpt.errors import CheckpointLockedError
from omnickpt.storage import Storage, storage_for

OWNER_RECORD = ".omnickpt/owner.json"
DEFAULT_TTL = 30.0
# The longest ttl a lease may have (one day): a longer one, in a record, is damage.
MAX_TTL = 24 * 3600.0
# A renewal time up to this far ahead of this machine's clock is taken as clocks agreeing (NTP
# keeps them within milliseconds); further ahead, the record is watched instead (module docstring).
_SKEW_SLACK = 2.0
# A takeover re-reads the record this long after replacing it (at least; see the module docstring).
_SETTLE_MIN, _SETTLE_MAX = 0.25, 5.0
# A record that vanishes between a failed create and the read that follows (its owner released
# it) sends acquire round again; this many rounds means something keeps churning it.
_CLAIM_ROUNDS = 8
# An unparseable record may be one being written by a backend without atomic creation.
_UNREADABLE_RETRIES, _UNREADABLE_PAUSE = 3, 0.1


class Lease:
    """An owner record held by one job at a storage root, renewed by a heartbeat thread.

    Made by acquire(); release() (or leaving a `with` block) hands it back."""

    def __init__(self, storage: Storage, holder: str, what: str, ttl: float, record: str):
        self.storage, self.holder, self.what = storage, holder, what
        self.ttl, self.record = float(ttl), record
        self._me = _identity()
        self._id = uuid.uuid4().hex       # tells this Lease's own record from a rival's in a takeover
        self._started = time.time()
        self._lock = threading.Lock()     # one renewal, check or release at a time
        self._stop = threading.Event()
        self._lost: str | None = None
        self._released = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public
    def release(self) -> None:
        """Stop the heartbeat and delete the record if it is still this job's. Idempotent; never
        raises (it runs on the way out of errors): a record it cannot delete is logged and expires
        after ttl seconds."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._lost is not None:
                return
            try:
                doc = _read_record(self.storage, self.record)
                if doc and doc.get("holder") == self.holder:
                    self.storage.delete(self.record)
            except Exception as e:  # noqa: BLE001 - see the docstring
                logging.getLogger("omnickpt").warning(
                    "could not release the owner record %s of job %r (%s: %s); it expires %g s after its last "
                    "renewal", self.storage.describe(self.record), self.holder, type(e).__name__, e, self.ttl)

    def lost(self) -> str | None:
        """None while the record is this job's; else a sentence saying who took it over. Reads the
        record now (one small read) unless the heartbeat already found it lost."""
        with self._lock:
            if self._lost is None and not self._released:
                try:
                    doc = _read_record(self.storage, self.record)
                except Exception:  # noqa: BLE001 - cannot tell now; the heartbeat keeps checking
                    return None
                if doc is not None and doc.get("holder") != self.holder:
                    self._lose(doc)
            return self._lost

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self._lost else "held"
        return f"Lease({self.storage.describe()!r}, holder={self.holder!r}, {state})"

    # ------------------------------------------------------------------ acquiring
    def _doc(self, now: float) -> bytes:
        return json.dumps({"holder": self.holder, **self._me, "started": self._started, "renewed": now,
                           "what": self.what, "ttl": self.ttl, "lease": self._id}).encode()

    def _claim(self) -> tuple[dict, str] | None:
        """Make the record this job's. Returns (the stale record taken over, why it was stale), or
        None if there was none of another job; raises CheckpointLockedError if a live job has it."""
        for _ in range(_CLAIM_ROUNDS):
            if self.storage.create_exclusive(self.record, self._doc(time.time())):
                return None
            doc = _read_record(self.storage, self.record)
            if doc is None:
                continue                  # released between our create and our read: create again
            if doc.get("holder") == self.holder:
                # This job's own record (an earlier Lease, or this job before a restart): renew it as ours.
                self.storage.commit(self.record, self._doc(time.time()))
                return None
            why = _stale(doc, self._me, time.time())
            if why is None and _ahead(doc, time.time()):
                why = self._watch(doc)
                if why is None:
                    continue   # it changed: judge the record it is now
            if why is None:
                raise CheckpointLockedError(self._locked(doc))
            if self._take_over(doc):
                return doc, why
        raise CheckpointLockedError(
            f"{self.storage.describe()}: the owner record {self.storage.describe(self.record)} kept changing while "
            f"job {self.holder!r} tried to acquire it ({_CLAIM_ROUNDS} rounds); another job is starting or stopping "
            "there: stop it, or use another path")

    def _take_over(self, stale: dict) -> bool:
        """Replace the stale record, pause, re-read: True if ours stayed, False if the record
        changed before we replaced it (look again); CheckpointLockedError if a rival won."""
        if _read_record(self.storage, self.record) != stale:
            return False
        t0 = time.monotonic()
        self.storage.commit(self.record, self._doc(time.time()))
        time.sleep(min(max(_SETTLE_MIN, 4 * (time.monotonic() - t0)), _SETTLE_MAX))
        doc = _read_record(self.storage, self.record)
        if doc is not None and doc.get("lease") == self._id:
            return True
        if not doc or doc.get("holder") == self.holder:
            return False
        raise CheckpointLockedError(self._locked(doc) + " (it took over the stale owner record at the same time "
                                                        "as this job)")

    def _watch(self, doc: dict) -> str | None:
        """Watch a record whose renewal time lies ahead of this machine's clock for its ttl (local
        monotonic time): why it is stale if it stays unchanged, None if it changed (read it again).
        Raises CheckpointLockedError when it was renewed: its job is alive."""
        ttl = _times(doc)[1]
        skew = _finite(doc, "renewed") - time.time()
        logging.getLogger("omnickpt").warning(
            "%s: the owner record %s of job %r was renewed at a time %.1f s ahead of this machine's clock (the "
            "hosts' clocks disagree); watching it for up to %g s to tell whether that job is alive",
            self.storage.describe(), self.storage.describe(self.record), doc.get("holder"), skew, ttl)
        deadline = time.monotonic() + ttl
        while time.monotonic() < deadline:
            time.sleep(min(max(ttl / 12, 0.01), 1.0, max(0.0, deadline - time.monotonic())))
            now = _read_record(self.storage, self.record)
            if now != doc:
                if now and now.get("holder") == doc.get("holder") and now.get("lease") == doc.get("lease"):
                    raise CheckpointLockedError(self._locked(now, renewing=True))
                return None
        return (f"it was not renewed during the {ttl:g} s this job watched it (its renewal time lies {skew:.1f} s "
                "ahead of this machine's clock: the hosts' clocks disagree)")

    def _locked(self, doc: dict, renewing: bool = False) -> str:
        renewed, ttl, _ = _times(doc)
        age = time.time() - renewed
        if renewing or age < -_SKEW_SLACK:
            # A negative age is the other host's clock running ahead: no wait computed from it means anything.
            when = (f"was renewed while this job watched it, at times {-age:.1f} s ahead of this machine's clock "
                    "(the hosts' clocks disagree; fix their time sync)")
            dead = ("if it is dead, its record is taken over once it goes unrenewed for its ttl: try again in "
                    f"{ttl:g} s")
        else:
            age = max(age, 0.0)
            when = f"was last renewed {age:.1f} s ago (ttl {ttl:g} s)"
            dead = (f"if it is dead on another machine, its record expires {max(0.0, ttl - age):.0f} s from now: wait "
                    "that long and try again")
        return (f"{self.storage.describe()} is owned by another live job: {doc.get('holder')!r} on host "
                f"{doc.get('host')} (pid {doc.get('pid')}), whose owner record {self.storage.describe(self.record)} "
                f"{when}. Two jobs writing one {self.what} would overwrite and delete each other's files. Use another "
                f"path, or stop the other job; {dead}")

    # ------------------------------------------------------------------ heartbeat
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="omnickpt-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        log = logging.getLogger("omnickpt")
        failing = False
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl / 3):
            try:
                self._renew(late=time.monotonic() - last_ok > 0.9 * self.ttl)
                last_ok, failing = time.monotonic(), False
            except Exception as e:  # noqa: BLE001 - a storage hiccup: keep trying, say so once
                if not failing:
                    log.warning("renewing the owner record %s of job %r failed (%s: %s); retrying every %.1f s, "
                                "another job may take it over %g s after its last renewal",
                                self.storage.describe(self.record), self.holder, type(e).__name__, e,
                                self.ttl / 3, self.ttl)
                failing = True
            if self._lost is not None:
                log.warning("%s", self._lost)
                return

    def _renew(self, late: bool) -> None:
        with self._lock:
            if self._stop.is_set() or self._lost is not None:
                return
            doc = _read_record(self.storage, self.record)
            if doc is None:
                # Deleted: by another Lease of this job that was released, or by hand. The job
                # still holds the root, so the record comes back (unless another job was faster).
                self.storage.create_exclusive(self.record, self._doc(time.time()))
                return
            if doc.get("holder") != self.holder:
                self._lose(doc)
                return
            t0 = time.monotonic()
            self.storage.commit(self.record, self._doc(time.time()))
            if late:
                # Not renewed for about a ttl: another job may have judged the record stale and be
                # taking it over right now. Re-read as its takeover does, so one of the two yields.
                time.sleep(min(max(_SETTLE_MIN, 4 * (time.monotonic() - t0)), _SETTLE_MAX))
                doc = _read_record(self.storage, self.record)
                if doc is not None and doc.get("holder") != self.holder:
                    self._lose(doc)

    def _lose(self, doc: dict) -> None:
        self._stop.set()
        if not doc:
            self._lost = (f"the owner record {self.storage.describe(self.record)} of job {self.holder!r} was "
                          "replaced by an unreadable one; another process wrote there, so this job no longer owns "
                          f"{self.storage.describe()}")
            return
        when = _date(_finite(doc, "started"))
        self._lost = (f"{self.storage.describe()} was taken over by job {doc.get('holder')!r} on host "
                      f"{doc.get('host')} (pid {doc.get('pid')}, started {when}); job {self.holder!r} no longer owns "
                      f"it, and what it saves there may overwrite or be deleted by that job's saves")


def acquire(storage: Storage | str, holder: str, *, what: str = "checkpoint", ttl: float = DEFAULT_TTL,
            record: str = OWNER_RECORD) -> Lease:
    """Make job `holder` the owner of `storage` (a Storage, or a path/URL) and start renewing the
    owner record every ttl/3 seconds. `what` names the thing owned in messages ("checkpoint",
    "memory job"); `record` is the record's path under the root.

    Succeeds if there is no record, if the record is this job's own, or if it is stale (then the
    takeover is logged on the "omnickpt" logger and warned as a RuntimeWarning, naming the old
    owner). Raises CheckpointLockedError if another live job owns it, or won a takeover race;
    StorageError if the storage fails."""
    if isinstance(storage, str):
        storage = storage_for(storage)
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"the lease holder must be a non-empty job id string, not {holder!r}")
    if not 0 < ttl <= MAX_TTL:
        raise ValueError(f"the lease ttl must be a positive number of seconds up to {MAX_TTL:g}, not {ttl!r}")
    lease = Lease(storage, holder, what, ttl, record)
    taken = lease._claim()
    lease._start()
    if taken is not None:
        old, why = taken
        msg = (f"{storage.describe()}: job {holder!r} took over the stale owner record of job {old.get('holder')!r} "
               f"(host {old.get('host')}, pid {old.get('pid')}, {_age_text(old, time.time())}): {why}")
        logging.getLogger("omnickpt").warning("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return lease


def record_is_live(storage: Storage, record: str) -> bool | None:
    """Whether the lease record at `record` (an owner record, or a reference record of a save in
    flight) still protects what it names: True while its holder is alive and renewing it, False
    once it is stale (unreadable or damaged, its process gone on this machine, or not renewed
    within its ttl), None when there is none. Judged as `acquire` judges another job's record."""
    doc = _read_record(storage, record)
    if doc is None:
        return None
    return _stale(doc, _identity(), time.time()) is None


# ---------------------------------------------------------------------- helpers
def _identity() -> dict:
    """What tells this process from any other: host, boot (a rebooted or other machine reuses
    pids), pid namespace (containers on one machine reuse pids too), pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id: str | None = f.read().strip() or None
    except OSError:
        boot_id = None
    try:
        pid_ns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid_ns": pid_ns, "pid": os.getpid()}


def _read_record(storage: Storage, record: str) -> dict | None:
    """The owner record; None if there is none; {} if it stays unparseable (treated as stale)."""
    for attempt in range(_UNREADABLE_RETRIES):
        try:
            raw = storage.read_bytes(record)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and isinstance(doc.get("holder"), str):
                return doc
        except ValueError:
            pass
        if attempt + 1 < _UNREADABLE_RETRIES:
            time.sleep(_UNREADABLE_PAUSE)
    return {}


def _stale(doc: dict, me: dict, now: float) -> str | None:
    """Why another job's record `doc` no longer protects anything, or None while it does."""
    if not doc:
        return "the record is unreadable"
    host, pid = doc.get("host"), doc.get("pid")
    here = (host == me["host"] and doc.get("boot_id") is not None and doc.get("boot_id") == me["boot_id"]
            and doc.get("pid_ns") == me["pid_ns"])
    if here and isinstance(pid, int) and not _alive(pid):
        return f"its process {pid} on {host} is gone"
    renewed, ttl, damage = _times(doc)
    if damage:
        return f"the record is damaged ({damage})"
    age = now - renewed
    if age > ttl:
        return f"it was last renewed {age:.1f} s ago, longer than its ttl of {ttl:g} s"
    return None


def _times(doc: dict) -> tuple[float, float, str | None]:
    """(renewed, ttl, what is wrong with them or None). A record is untrusted input: a ttl that is
    inf or NaN never expires, a renewal time of inf never ages."""
    renewed, ttl = _finite(doc, "renewed"), _finite(doc, "ttl", DEFAULT_TTL)
    if renewed is None:
        return 0.0, DEFAULT_TTL, f"its renewal time {doc.get('renewed')!r:.40} is not a time"
    if ttl is None or not 0 < ttl <= MAX_TTL:
        return renewed, DEFAULT_TTL, f"its ttl {doc.get('ttl')!r:.40} is not a number of seconds up to {MAX_TTL:g}"
    return renewed, ttl, None


def _ahead(doc: dict, now: float) -> bool:
    """Whether the record's renewal time lies ahead of this machine's clock by more than clocks
    that agree would put it."""
    renewed, _, damage = _times(doc)
    return damage is None and renewed - now > _SKEW_SLACK


def _age_text(doc: dict, now: float) -> str:
    renewed, _, damage = _times(doc)
    if damage:
        return "its times are damaged"
    age = now - renewed
    return (f"last renewed {age:.1f} s ago" if age >= -_SKEW_SLACK
            else f"renewed at a time {-age:.1f} s ahead of this machine's clock")


def _date(t: float | None) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else "at an unknown time"
    except (OverflowError, ValueError, OSError):
        return "at an unknown time"


def _alive(pid: int) -> bool:
    """Whether process `pid` of this machine still runs (True when that cannot be told)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:       # EPERM: it exists, and belongs to someone else
        return True
    try:                  # a zombie has exited; only its parent has not collected it yet
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _finite(doc: dict, key: str, default: float | None = None) -> float | None:
    """doc[key] as a finite float (`default` when absent); None when it is anything else."""
    value = doc.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:   # an integer past float's range
        return None
    return value if math.isfinite(value) else None


__all__ = ["DEFAULT_TTL", "MAX_TTL", "OWNER_RECORD", "Lease", "acquire"]
