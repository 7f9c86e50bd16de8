"""The load flow: one load on one rank (_LoadJob) in three phases, each ended by one all-gather
that settles every rank's outcome: plan (match, plan reads, read objects), read (land and verify
every byte), install. The Checkpointer (omnickpt.api) owns the resources it uses (threads, staging
pool, communicators); the save side is omnickpt.saving."""
from __future__ import annotations

import dataclasses
import hashlib
import socket
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from omnickpt.adapters import ADAPTERS, as_registry, collect_load
from omnickpt.comm import Comm
from omnickpt.engine import read_objects
from omnickpt.engine import load as engine_load
from omnickpt.engine.load import check_file_sizes, forward_replicas, land_tensors
from omnickpt.engine.staging import WARM_SLACK, gc_paused
from omnickpt.errors import MismatchError
from omnickpt.fence import optimizers_in
from omnickpt.format import MANIFEST_NAME, Manifest
from omnickpt.formats import NAMES, bind_keys, read_manifest
from omnickpt.layout import Box
from omnickpt.monitor import PhaseTimer, summarize
from omnickpt.planner import ReadPlan, plan_reads
from omnickpt.planner.load_plan import assign_readers, item_key
from omnickpt.planner.match import LoadMatch, Selection, match_targets
from omnickpt.saving import _same_path
from omnickpt.storage import Storage, storage_for
from omnickpt.storage.linked import with_siblings

if TYPE_CHECKING:
    from omnickpt.api import Checkpointer


@dataclasses.dataclass
class LoadResult:
    """What load() returns: the differences it skipped (strict=False) and the timing report."""
    differences: list[str]
    report: dict


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """Everything a load may vary, checked once here (see omnickpt.load for what each does), as
    SaveOptions is for a save. Adding an option: a field here and the one phase that uses it."""
    strict: bool = True
    allow_pickle: bool = False
    process_group: Any = dataclasses.field(default=None, compare=False)
    verify: bool = True
    dedup_reads: bool = False
    transforms: Sequence[Any] = ()
    cast: bool = False
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    # The adapter registry the state goes through (omnickpt.adapters.ADAPTERS when None).
    adapters: Sequence[Any] | None = dataclasses.field(default=None, compare=False)
    # How a foreign folder is named: "adapters" (as omnickpt's adapters name modules and optimizers),
    # or "as_saved" (the foreign library's own keys: a DCP folder as dcp.load sees it; omnickpt.dcp).
    names: str = "adapters"

    def __post_init__(self) -> None:
        self.selection   # include= and exclude= are glob patterns: a TypeError names a bad one now
        if self.adapters is not None:
            object.__setattr__(self, "adapters", as_registry(self.adapters))
        if self.names not in NAMES:
            raise ValueError(f"names={self.names!r}: expected one of {', '.join(NAMES)}")

    @classmethod
    def of(cls, options: LoadOptions | None, keywords: Mapping[str, Any]) -> LoadOptions:
        """`options` with `keywords` (load()'s keywords) replacing its fields; an unknown keyword is
        a TypeError naming it."""
        if options is None:
            return cls(**keywords)
        return dataclasses.replace(options, **keywords) if keywords else options

    @property
    def selection(self) -> Selection:
        return Selection(self.include, self.exclude)


def _bind_foreign(manifest: Manifest, state: dict) -> Manifest:
    """A Hugging Face folder holds one module's tensors, read under the key "model"; a DCP folder
    with no state keys of its own (a flat model state dict, Megatron torch_dist) names the keys
    its reader chose in layout["implied_keys"]. Each loads into the state's only module (or
    optimizer) whatever its key."""
    implied = ["model"] if manifest.layout.get("format") == "hf" else manifest.layout.get("implied_keys") or []
    moves = {}
    for key, kind in (("model", torch.nn.Module), ("optimizer", torch.optim.Optimizer)):
        found = [k for k, v in state.items() if isinstance(v, kind)]
        if key in implied and key not in state and len(found) == 1:
            moves[key] = found[0]
    return bind_keys(manifest, moves) if moves else manifest


def load(ckpt: Checkpointer, path: str, state: dict, options: LoadOptions) -> LoadResult:
    """Every rank: Checkpointer.load, with `ckpt`'s threads, staging pool and communicators. Three
    phases, each a local step settled on every rank (Comm.run_step): plan, read, install."""
    t_start = time.perf_counter()
    ckpt._await_snapshots()   # a lazy snapshot still copying would copy the loaded values
    path = str(path)
    o = options
    comm = ckpt.comm(o.process_group)
    job = _LoadJob(path, storage_for(path), state, PhaseTimer())
    job.raw_manifest = _shared_manifest(job, comm)
    # A shm:// checkpoint is each machine's own: a rank on another machine may not hold the bytes
    # this rank would be assigned to read for it.
    dedup = o.dedup_reads and comm.world_size > 1 and not _per_machine(path)

    def plan() -> tuple:
        with job.timer.phase("plan"):
            _plan_load(job, comm, o)
        if not (o.strict and job.differences):
            _check_objects(job, comm, o.allow_pickle, o.strict)
        wants = [] if not dedup else (job.items.wants() if isinstance(job.items, ReadPlan) else
                                      [(item_key(it), it.nbytes) for it in job.items])
        # a process loading alone reads every file through the page cache (shared_files): no tally
        files = _files_read(job) if comm.world_size > 1 else None
        replica = _read_set(job, files, o.verify, ckpt.landing_bytes) if not dedup else None
        return sorted(job.unexpected), sorted(set(job.differences))[:20], wants, _where(job), files, replica

    gathered = comm.run_step(f"load from {path}, step plan", plan)
    _same_path([g[3] for g in gathered], "load")
    differences = _agree_on_differences(job, gathered, o.strict)
    reading = _Reading(job, comm, ckpt, o.verify, [g[2] for g in gathered] if dedup else None,
                       set() if dedup else shared_files(comm.rank, [g[4] for g in gathered], len(job.manifest.files)),
                       replica_part(comm.rank, [(g[4][0] if g[4] else None, g[5]) for g in gathered]))
    # Every rank learns whether every rank read sound bytes before anything is installed (and
    # a reader that failed never leaves its peers waiting for forwarded bytes).
    comm.run_step(f"load from {path}, step read", reading.land, on_failure=lambda _: reading.discard())
    timings = comm.run_step(f"load from {path}, step install", lambda: reading.install() or job.timer.as_dict())
    _warm_staging(ckpt, job.manifest, comm, state)
    report = summarize("load", timings, total_seconds=time.perf_counter() - t_start)
    report["path"] = job.storage.describe()
    if job.manifest is not None and job.manifest.quantized:
        # Lossy: the loaded values of these tensors differ from the saved ones by up to max_error.
        loaded = job.items.names() if isinstance(job.items, ReadPlan) else {it.name for it in job.items}
        report["quantized"] = {n: q for n, q in job.manifest.quantized.items() if n in loaded}
    return LoadResult(differences, report)


def _warm_staging(ckpt: Checkpointer, manifest: Manifest | None, comm: Comm, state: dict) -> None:
    """After a load into a training state, a restarted job's first save stages about what this rank
    wrote into the loaded checkpoint: have the staging pool warm a buffer of that size in the
    background (niced, on the persist thread), so that the lazy copy the next optimizer step waits for
    does not fault fresh memory in (bench/resume.py, mlp/ddp: the first save after a load cost training
    0.15-0.59 s against 1.46 s without the warm; where training keeps every core busy, the steps
    after the load pay about that difference instead). Only a state holding an optimizer is a training
    state: a load for inference never saves, and must not be given memory of its checkpoint's size.
    Only where the estimate holds: an omnickpt checkpoint of the same world size, stored raw and whole
    (compressed and incremental files are smaller than their staging), host staging (the pinned
    staging of a state on GPUs is not warmed), and staging kept between saves (release_staging=False)."""
    optimizers = optimizers_in(state)
    if (not optimizers or manifest is None or ckpt.release_staging
            or manifest.world_size != comm.world_size or manifest.compression or manifest.block_bytes is not None
            or manifest.derived or "format" in manifest.layout
            or any(p.is_cuda for o in optimizers for g in o.param_groups for p in g["params"])):
        return
    mine = [f.bytes for f in manifest.files if f.rank == comm.rank]
    if mine:
        # slack: the next save's objects (a step count, a data loader's position) may take a page more
        ckpt._behind_persist(ckpt._pool.warm, mine[0], WARM_SLACK)


class _Reading:
    """The read phase of one load on one rank: which items this rank reads (all of them, or with
    dedup_reads the ones it was assigned: `wants` holds every rank's wishes), their bytes landed
    and verified, then installed."""

    def __init__(self, job: _LoadJob, comm: Comm, ckpt: Checkpointer, verify: bool, wants: list | None,
                 shared: set[int], part: tuple[int, int] | None = None):
        self.job, self.comm, self.ckpt, self.verify, self.wants = job, comm, ckpt, verify, wants
        self.shared, self.part = shared, part
        self.forward, self.mine, self.landing = None, list(range(len(job.items))), None

    def land(self) -> None:
        job, rank = self.job, self.comm.rank
        if self.wants is not None:
            with job.timer.phase("plan"):
                self.forward = assign_readers(self.wants)
                readers = {key: reader for key, reader, _ in self.forward}
                # this rank's wants are its items' keys, in order
                self.mine = [i for i, (key, _) in enumerate(self.wants[rank]) if readers.get(key, rank) == rank]
        items = job.items
        if len(self.mine) < len(items):
            items = items.take(self.mine) if isinstance(items, ReadPlan) else [items[i] for i in self.mine]
        self.landing = land_tensors(job.storage, job.manifest, items, job.boxes,
                                    job.match.dests, self.ckpt._io, verify=self.verify, timer=job.timer,
                                    budget=self.ckpt.landing_bytes, pool=self.ckpt._pool, shared_files=self.shared,
                                    start_at=self.comm.rank / self.comm.world_size if self.shared else 0.0,
                                    verify_part=self.part)

    def discard(self) -> None:
        if self.landing is not None:
            self.landing.discard()

    def install(self) -> None:
        _install(self.job, self.comm, self.landing, self.forward, self.mine,
                 self.wants[self.comm.rank] if self.wants is not None else None)


@gc_paused()
def _plan_load(job: _LoadJob, comm: Comm, o: LoadOptions) -> None:
    """Every rank, no collective: read the manifest, prepare and match the targets, plan the
    reads and check that the files hold the bytes planned."""
    select = o.selection
    manifest = _bind_foreign(read_manifest(job.storage, job.raw_manifest, o.names), job.state)
    # An incremental checkpoint's unchanged blocks lie in files of checkpoints next to it.
    job.storage = with_siblings(job.storage, job.path, manifest.files)
    for transform in o.transforms:   # rewrite the manifest into the target's naming and fusing (pure)
        manifest = transform.apply(manifest)
    job.manifest = manifest
    job.targets = [(k, t) for k, t in collect_load(job.state, o.adapters or ADAPTERS) if select.entry(k)]
    for _, t in job.targets:
        if t.prepare is not None:
            job.differences += t.prepare(manifest) or []
    job.match = match_targets(manifest, job.targets, select, cast=o.cast)
    job.differences += job.match.differences
    job.unexpected = job.match.unexpected
    if o.strict and job.differences:
        return   # the load fails at the exchange, listing them: plan nothing
    job.items = plan_reads(manifest, job.match.wanted)
    # Sizes first: a truncated file fails the load before anything is read.
    check_file_sizes(job.storage, manifest, job.items,
                     [(k, manifest.object_for_rank(k, comm.rank)) for k in job.match.object_keys]
                     + [(k, e) for k in job.match.all_rank_keys for e in manifest.objects[k]])

def _check_objects(job: _LoadJob, comm: Comm, allow_pickle: bool, strict: bool) -> None:
    """Every rank, no collective. Objects are small: read and checked before the exchange, so
    that one that is corrupt, needs pickle or does not fit its target fails the load on every
    rank before any tensor is read."""
    job.objects = read_objects(job.storage, job.manifest, job.match.object_keys, comm.rank,
                               allow_pickle=allow_pickle, timer=job.timer, all_ranks=job.match.all_rank_keys)
    found = [d for _, t in job.targets if t.check is not None for d in t.check(job.objects)]
    job.differences += found
    if strict and found:
        job.items = []

@gc_paused()
def _install(job: _LoadJob, comm: Comm, landing, forward, mine: list[int], wants: list | None) -> None:
    """Every rank: copy the verified bytes into the targets, forward replicas (point-to-point
    with the ranks that wanted the same bytes), convert cast tensors, let each target finish
    (load_state_dict, plain values written back)."""
    filled = landing.install(compacts=forward is not None)
    if forward is not None:
        at = {i: k for k, i in enumerate(mine)}
        forward_replicas(job.items, [key for key, _ in wants], lambda i: filled[at[i]], forward, job.boxes,
                         job.match.dests, comm.rank, comm.group, job.timer)
    with torch.no_grad():
        for target, landed in job.match.casts:
            target.detach().copy_(landed)
    with job.timer.phase("install"):
        for _, t in job.targets:
            t.finish(job.objects)


def _shared_manifest(job: _LoadJob, comm: Comm) -> bytes | None:
    """Every rank (one broadcast with several ranks): the manifest's bytes, read from storage by
    the coordinator alone, so that a restart of N ranks reads it once, not N times (8192 ranks each
    reading a 200 MB manifest from one store is 1.6 TB). None where the coordinator could not read
    ours (a foreign format, nothing committed, a storage error): every rank then reads for itself
    in the plan phase and meets the error there, where it is settled. A shm:// checkpoint is not
    shared: each machine's memory holds its own (the memory tier's restore view of a multi-node job
    lists the boxes of the nodes on that machine), so every rank reads the manifest of its machine,
    at memory speed."""
    raw = None
    if comm.is_coordinator and not _per_machine(job.path):
        try:
            raw = job.storage.read_bytes(MANIFEST_NAME)
            job.timer.count("metadata", len(raw))
        except Exception:
            raw = None
    if comm.world_size == 1:
        return raw
    where, raw = comm.broadcast_object((_where(job), raw), step=f"load from {job.path}, step metadata")
    # A rank given another path reads its own (the plan phase then refuses the differing paths).
    return raw if where == _where(job) else None


def _files_read(job: _LoadJob) -> tuple[str, dict[int, int]]:
    """(this machine, {data file: bytes this rank's items read from it}): see shared_files."""
    if isinstance(job.items, ReadPlan):
        return socket.gethostname(), job.items.bytes_per_file()
    read: dict[int, int] = {}
    for it in job.items:
        if it.saved.file >= 0:
            read[it.saved.file] = read.get(it.saved.file, 0) + it.nbytes
    return socket.gethostname(), read


def shared_files(rank: int, files_read: list[tuple[str, dict[int, int]] | None], nfiles: int) -> set[int]:
    """The files `rank` reads of which another rank on its machine reads at least half as many
    bytes (files_read: each rank's `_files_read`). Those go through the page cache, whose one
    device read serves every reader on the machine (DDP replicas: each rank reads the whole
    model); the others are read from the device straight into the landing buffers
    (engine.load.land_tensors). A few small tensors saved once and wanted by every rank (FSDP2's
    replicated ones) do not make a rank's own file shared: the peer re-reads those bytes only.

    A rank alone on its machine (a one-process load, a conversion) reads every file through the
    cache: one process's buffered reads with the kernel's readahead beat its O_DIRECT requests
    (bench/compare.py, MLP/FSDP2 2->1: 0.45-0.62 s against 0.64-0.74 s), while ranks that read
    their own files side by side gain from O_DIRECT (same layout: 0.36-0.45 s against 0.65-0.71 s).
    A process alone in its group sends None (no tally: 0.06 s for 80k items) and gets every one of
    the checkpoint's `nfiles` files."""
    if files_read[rank] is None:
        return set(range(nfiles))
    host, mine = files_read[rank]
    if not any(h == host for r, (h, _) in enumerate(files_read) if r != rank):
        return set(mine)
    out = set()
    for f, n in mine.items():
        if any(h == host and fs.get(f, 0) * 2 >= n for r, (h, fs) in enumerate(files_read) if r != rank):
            out.add(f)
    return out


def _read_set(job: _LoadJob, files: tuple[str, dict[int, int]] | None, verify: bool, landing_bytes: int
              ) -> str | None:
    """A digest of what this rank's load reads and how it lands it: its read plan (ReadPlan.digest),
    its destinations' shapes, strides, dtypes and device types, `verify` and the landing size. Ranks of one machine
    with equal digests are replicas (DDP: each reads the whole model) and split the first pass of a
    two-pass load between them (replica_part). None where that pass never happens: a load of at most
    REREAD_MIN bytes, or a process alone."""
    if files is None or sum(files[1].values()) <= engine_load.REREAD_MIN:
        return None
    items = job.items
    plan = (items if isinstance(items, ReadPlan) else ReadPlan(list(items))).digest()
    dests = [(tuple(d.shape), d.stride(), str(d.dtype), d.device.type) for d in job.match.dests]
    return hashlib.blake2b(repr((plan, dests, verify, landing_bytes)).encode(), digest_size=16).hexdigest()


def replica_part(rank: int, replicas: list[tuple[str | None, str | None]]) -> tuple[int, int] | None:
    """(i, n) when `rank` is the i-th of n ranks of its machine whose loads read the same bytes the
    same way (`replicas`: each rank's (machine, _read_set digest)), else None."""
    host, digest = replicas[rank]
    if digest is None:
        return None
    peers = [r for r, (h, d) in enumerate(replicas) if h == host and d == digest]
    return (peers.index(rank), len(peers)) if len(peers) > 1 else None


def _per_machine(path: str) -> bool:
    return path.startswith("shm://")


def _where(job: _LoadJob) -> str:
    """The checkpoint a load reads, comparable across ranks: shm:// is per machine, so the same URL
    is the same checkpoint whatever $OMNICKPT_SHM_DIR is."""
    return job.path if job.path.startswith("shm://") else job.storage.describe()


@dataclasses.dataclass
class _LoadJob:
    """One load on one rank, as its phases fill it in."""
    path: str
    storage: Storage
    state: dict
    timer: PhaseTimer
    manifest: Manifest | None = None
    targets: list = dataclasses.field(default_factory=list)
    match: LoadMatch = dataclasses.field(default_factory=LoadMatch)
    items: list = dataclasses.field(default_factory=list)
    objects: dict = dataclasses.field(default_factory=dict)
    differences: list[str] = dataclasses.field(default_factory=list)
    unexpected: set[str] = dataclasses.field(default_factory=set)
    raw_manifest: bytes | None = None    # read by the coordinator, shared with every rank

    @property
    def boxes(self) -> list[Box]:
        return [b for _, b in self.match.wanted]


def _agree_on_differences(job: _LoadJob, gathered: list, strict: bool) -> list[str]:
    """Every rank, from the plan exchange: the differences of the whole job. A checkpoint tensor is
    unexpected only if no rank wants it (pipeline stages each hold different modules). With
    strict=True any difference on any rank fails the load on every rank, listing them."""
    unwanted = set.intersection(*(set(g[0]) for g in gathered))
    differences = sorted(set(job.differences) | {f"{n}: in the checkpoint but not in the target state"
                                                  for n in unwanted})
    if strict and differences:
        raise MismatchError(
            f"checkpoint {job.path} does not match the state to load ({len(differences)} difference(s); pass "
            "strict=False to load what matches):\n  " + "\n  ".join(differences), differences)
    if strict and any(g[1] for g in gathered):
        theirs = [f"rank {r}: {d}" for r, g in enumerate(gathered) for d in g[1]]
        raise MismatchError(f"checkpoint {job.path} does not match the state to load on other ranks; pass "
                            "strict=False to load what matches:\n  " + "\n  ".join(theirs), theirs)
    return differences
