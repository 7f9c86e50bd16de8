"""The memory tier behind CheckpointManager(memory="shm://JOB"): where each node keeps its
in-memory checkpoints and its peer's replicas, how they are found complete after a crash, sent to
and restored from a peer, and copied to durable storage under one global manifest.

Layout in host shared memory (one directory per node; on one machine each simulated node has its own):

    shm://JOB/node<k>/tier.json                        what this memory belongs to (durable root, world, ranks per node)
    shm://JOB/node<k>/global_step_<N>/                 node k's checkpoint of step N: an ordinary omnickpt
                                                       checkpoint of node k's ranks (saved with the node's process
                                                       group), manifest written last
    shm://JOB/node<k>/replicas/node<j>/global_step_<N>/  a copy of node j's checkpoint (j = k - 1 on the ring)
    shm://JOB/node<k>/restore/global_step_<N>/         while restoring with several nodes only: node k's data
                                                       files (hard links) and every node's objects, one manifest

A node's checkpoint holds every tensor byte its own ranks need (replicas are deduplicated within
the node only), so a restart reads tensors from local memory only; the few object values that a
rank may need from other ranks (a dataloader position redistributed on load) are exchanged between
node leaders at restore. A node that lost its memory gets its files back from the peer that holds
its replica. The durable copy is one global checkpoint (any layout can load it): every rank copies
its node file, node leaders send their node manifests in their records, and the coordinator merges
them (merge_node_manifests) and writes the manifest last.

This module holds the mechanics; the policy (when to save, persist, flush, restore) is manager.py's.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import time
import warnings
from concurrent.futures import Executor
from typing import Any, Sequence

import torch

from omnickpt.engine.save import CONTROL_DIR, collect_garbage
from omnickpt.errors import CheckpointError, CheckpointTimeoutError, CorruptCheckpointError, PlanError
from omnickpt.format import MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, TensorEntry
from omnickpt.storage import Segment, Storage
from omnickpt.storage.shm import ShmStorage, parse_shm_url

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TIER_FILE = "tier.json"
REPLICAS = "replicas"
RESTORE = "restore"   # a world view of one step, only while it is being restored from
_TIER_FORMAT = "omnickpt-memory-tier"
_POLL_MAX = 0.05


def step_dir(step: int) -> str:
    return f"global_step_{int(step)}"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where a rank sits: ranks [k * ranks_per_node, (k + 1) * ranks_per_node) of the manager's
    process group form node k. Peer replicas go around the ring of nodes: rank r's snapshot is kept
    by rank (r + ranks_per_node) % world_size, the same local rank on the next node."""
    world_size: int
    ranks_per_node: int
    rank: int

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} does not divide the world size {self.world_size}; "
                             "pass the number of ranks on each machine (all machines must have the same number)")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node

    def holder_of(self, rank: int) -> int:
        """The rank that keeps `rank`'s replica."""
        return (rank + self.ranks_per_node) % self.world_size

    def source_for(self, rank: int) -> int:
        """The rank whose replica `rank` keeps."""
        return (rank - self.ranks_per_node) % self.world_size


class MemoryTier:
    """One rank's view of the memory tier: its node's directory in shared memory."""

    def __init__(self, url: str, layout: NodeLayout, durable: str):
        parse_shm_url(url)   # validates the job name before anything touches the file system
        self.url = url.rstrip("/")
        self.layout = layout
        self.durable = durable
        self.node_url = f"{self.url}/node{layout.node}"
        self.storage = ShmStorage(self.node_url)

    # ---------------------------------------------------------------- paths
    def step_url(self, step: int) -> str:
        return f"{self.node_url}/{step_dir(step)}"

    def replica_rel(self, step: int | None = None) -> str:
        """This node's replica folder (of the previous node on the ring), or one step in it."""
        src = (self.layout.node - 1) % self.layout.nodes
        base = f"{REPLICAS}/node{src}"
        return base if step is None else f"{base}/{step_dir(step)}"

    def _sub(self, rel: str) -> ShmStorage:
        return ShmStorage(f"{self.node_url}/{rel}")

    # ---------------------------------------------------------------- identity
    def identity(self) -> dict:
        return {"format": _TIER_FORMAT, "version": 1, "durable": self.durable, "world_size": self.layout.world_size,
                "ranks_per_node": self.layout.ranks_per_node, "node": self.layout.node}

    def prepare(self) -> None:
        """Node leader, at start: memory left by a different job layout or durable root is not ours
        to restore from (its steps could be mistaken for newer ones): warn and remove it."""
        try:
            found = json.loads(self.storage.read_bytes(TIER_FILE))
        except FileNotFoundError:
            found = None
        except (ValueError, UnicodeDecodeError):
            found = {"unreadable": True}
        if found is not None and found != self.identity():
            warnings.warn(f"omnickpt: the shared memory at {self.storage.describe()} belongs to another job layout or "
                          f"durable root ({found}); it is removed and not restored from", RuntimeWarning, stacklevel=3)
            self.storage.delete_tree("")
        if found != self.identity():
            self.storage.commit(TIER_FILE, json.dumps(self.identity()).encode())

    # ---------------------------------------------------------------- scanning
    def committed_steps(self) -> list[int]:
        """Steps whose node checkpoint is complete in memory (manifest and every file it names, at
        full size), oldest first."""
        return _complete_steps(self.storage, "")

    def replica_steps(self) -> list[int]:
        return _complete_steps(self.storage, self.replica_rel())

    def view(self) -> tuple[list[int], list[int]]:
        """What this node can restore from by itself: (own complete steps, complete replica steps)."""
        if not self.storage.exists(TIER_FILE):
            return [], []
        return self.committed_steps(), self.replica_steps()

    # ---------------------------------------------------------------- retention
    def retain(self, keep: int, pinned: set[int] = frozenset()) -> None:
        """Node leader: keep the newest `keep` complete steps (and `pinned` ones, still being
        copied to durable storage); remove older steps, complete or not. Steps newer than the newest
        complete one may be in flight and are left alone."""
        for rel in ("", self.replica_rel()):
            complete = _complete_steps(self.storage, rel)
            if not complete:
                continue
            keep_set = set(complete[-keep:]) | set(pinned)
            for name in self.storage.children(rel):
                m = STEP_DIR.match(name)
                if not m or int(m.group(1)) in keep_set or int(m.group(1)) > complete[-1]:
                    continue
                where = f"{rel}/{name}" if rel else name
                # Manifest first: from then on the step is not a checkpoint, even if removal stops halfway.
                self.storage.delete(f"{where}/{MANIFEST_NAME}")
                self.storage.delete_tree(where)

    def purge_newer(self, step: int | None) -> None:
        """Node leader, after a restore: steps newer than the restored one (or all, for None) come
        from an abandoned timeline; one node may hold them complete while another does not, so
        they must never be restored from, nor mixed with the new run's saves of the same numbers."""
        for rel in ("", self.replica_rel()):
            for name in self.storage.children(rel):
                m = STEP_DIR.match(name)
                if m and (step is None or int(m.group(1)) > step):
                    where = f"{rel}/{name}" if rel else name
                    self.storage.delete(f"{where}/{MANIFEST_NAME}")
                    self.storage.delete_tree(where)

    # ---------------------------------------------------------------- restoring with several nodes
    def node_objects(self, step: int) -> list[tuple[str, list[int], bytes, int]]:
        """Node leader: every object value of node checkpoint `step` as (key, global ranks, bytes,
        checksum). Objects are small (param_groups, RNG, dataloader positions)."""
        rel = step_dir(step)
        manifest = Manifest.decode(self.storage.read_bytes(f"{rel}/{MANIFEST_NAME}"),
                                   where=self.storage.describe(f"{rel}/{MANIFEST_NAME}"))
        base = self.layout.node * self.layout.ranks_per_node
        out = []
        for key, entries in manifest.objects.items():
            for e in entries:
                buf = bytearray(e.nbytes)
                self.storage.read_into(f"{rel}/{manifest.files[e.file].path}", e.offset, [memoryview(buf)])
                out.append((key, [base + r for r in e.ranks], bytes(buf), e.checksum))
        return out

    def world_view(self, step: int, objects: Sequence[tuple[str, list[int], bytes, int]]) -> str:
        """Node leader: a checkpoint in this node's memory that the whole group can load, each rank
        reading only from its own node: this node's tensors (its data files hard-linked, no copy)
        and every node's objects (so that state needing every rank's value on load, such as a
        dataloader position, restores as from the global checkpoint). Returns its URL."""
        rel = step_dir(step)
        manifest = Manifest.decode(self.storage.read_bytes(f"{rel}/{MANIFEST_NAME}"),
                                   where=self.storage.describe(f"{rel}/{MANIFEST_NAME}"))
        view = f"{RESTORE}/{rel}"
        self.storage.delete_tree(RESTORE)
        base = self.layout.node * self.layout.ranks_per_node
        files = []
        for f in manifest.files:   # same order: the tensors' file indices stay valid
            dst = os.path.join(self.storage.root, *view.split("/"), *f.path.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(os.path.join(self.storage.root, rel, *f.path.split("/")), dst)
            files.append(FileEntry(f.path, base + f.rank, f.bytes))
        blob, entries = bytearray(), {}
        for key, ranks, data, crc in objects:
            entries.setdefault(key, []).append(ObjectEntry(list(ranks), len(files), len(blob), len(data), crc))
            blob += data
        name = f"data/objects-{manifest.save_id}.bin"
        self.storage.write_file(f"{view}/{name}", len(blob), [Segment(0, memoryview(blob))], None, durable=False)
        files.append(FileEntry(name, base, len(blob)))
        world = self.layout.world_size
        merged = Manifest(save_id=manifest.save_id, world_size=world, files=files, tensors=manifest.tensors,
                          objects=entries, layout=dict(manifest.layout, world_size=world),
                          tool_version=manifest.tool_version, created=manifest.created)
        self.storage.commit(f"{view}/{MANIFEST_NAME}", merged.encode())
        return f"{self.node_url}/{view}"

    def drop_world_view(self) -> None:
        self.storage.delete_tree(RESTORE)

    def remove(self) -> None:
        """Node leader: give this node's shared memory back (own steps and replicas)."""
        self.storage.delete_tree("")
        try:
            os.rmdir(os.path.dirname(self.storage.root))   # the job folder, once no node uses it
        except OSError:
            pass

    # ---------------------------------------------------------------- peer replicas
    def send_replica(self, step: int, group: Any, global_rank: Sequence[int]) -> bytes | None:
        """Every rank, after step `step` is committed in memory on every node: send this rank's
        node file (and, from node leaders, the node manifest) to its holder on the next node, and
        keep what the previous node sends. Returns the manifest that came (node leaders); the
        caller then runs a barrier and commit_replica()."""
        lay = self.layout
        raw = self.storage.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
        manifest = Manifest.decode(raw, where=self.storage.describe(f"{step_dir(step)}/{MANIFEST_NAME}"))
        out = [(f.path, os.path.join(self.storage.root, step_dir(step), *f.path.split("/")))
               for f in manifest.files if f.rank == lay.local]
        extra = raw if lay.local == 0 else None
        into = self._sub(self.replica_rel(step))
        if lay.local == 0:
            # An older replica of the same step (the step saved twice) stops being one now; its
            # files have other names and cannot be overwritten by what arrives.
            into.delete(MANIFEST_NAME)
        return transfer_files(group, dst=global_rank[lay.holder_of(lay.rank)], files=out, extra=extra,
                              src=global_rank[lay.source_for(lay.rank)], into=into.root)

    def commit_replica(self, step: int, manifest: bytes | None) -> None:
        """Node leader, after every rank of the node received its part: the replica's manifest, last."""
        if self.layout.local == 0 and manifest:
            self._sub(self.replica_rel(step)).commit(MANIFEST_NAME, manifest)

    def repair(self, step: int, broken_nodes: Sequence[int], group: Any, global_rank: Sequence[int], barrier) -> None:
        """Every rank, at restore: nodes in `broken_nodes` lost step `step`; the next node on the ring
        sends back the replica it keeps, straight into the broken node's memory."""
        lay = self.layout
        mine_broken = lay.node in broken_nodes
        holder_for = (lay.node - 1) % lay.nodes   # the node whose replica this node keeps
        if mine_broken and lay.local == 0:
            self.storage.delete(f"{step_dir(step)}/{MANIFEST_NAME}")
            self.storage.delete_tree(step_dir(step))
        barrier()
        send = {}
        if holder_for in broken_nodes:   # this node keeps the replica of a broken node: send it back
            rel = self.replica_rel(step)
            raw = self.storage.read_bytes(f"{rel}/{MANIFEST_NAME}")
            manifest = Manifest.decode(raw, where=self.storage.describe(f"{rel}/{MANIFEST_NAME}"))
            send = {"dst": global_rank[lay.source_for(lay.rank)], "extra": raw if lay.local == 0 else None,
                    "files": [(f.path, os.path.join(self.storage.root, *rel.split("/"), *f.path.split("/")))
                              for f in manifest.files if f.rank == lay.local]}
        recv = {}
        if mine_broken:
            recv = {"src": global_rank[lay.holder_of(lay.rank)], "into": os.path.join(self.storage.root, step_dir(step))}
        got = transfer_files(group, **send, **recv) if send or recv else None
        barrier()
        if mine_broken and lay.local == 0:
            if not got:
                raise CheckpointError(f"restoring step {step} of node {lay.node} from its peer: no manifest came back")
            self.storage.commit(f"{step_dir(step)}/{MANIFEST_NAME}", got)
        barrier()


def _complete_steps(storage: Storage, rel: str) -> list[int]:
    out = []
    for name in storage.children(rel):
        m = STEP_DIR.match(name)
        if m and is_complete(storage, f"{rel}/{name}" if rel else name):
            out.append(int(m.group(1)))
    return sorted(out)


def is_complete(storage: Storage, rel: str) -> bool:
    """A committed manifest that decodes, and every file it names present at its full size."""
    try:
        manifest = Manifest.decode(storage.read_bytes(f"{rel}/{MANIFEST_NAME}"), where=storage.describe(rel))
        return all(storage.size(f"{rel}/{f.path}") == f.bytes for f in manifest.files)
    except (FileNotFoundError, CheckpointError, OSError):
        return False


# ---------------------------------------------------------------------- moving files between ranks
def _map(path: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the file's pages (shared mapping: no copy in or out of shared memory)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def transfer_files(group: Any, *, dst: int | None = None, files: Sequence[tuple[str, str]] = (),
                   extra: bytes | None = None, src: int | None = None, into: str | None = None) -> bytes | None:
    """Send files (name, local path) and an optional byte string to global rank `dst`, and/or
    receive the same from global rank `src` into the directory `into` (files under their names);
    returns the byte string received. Non-blocking sends and receives in three rounds (sizes,
    names, bytes), so ranks that both send and receive never wait on each other's order. The file
    bytes go from and to mapped shared memory, with no copy on either side. Received names are
    checked: a peer cannot make us write outside `into`."""
    import torch.distributed as dist
    from omnickpt.format.manifest import safe_relative_path
    keep: list[torch.Tensor] = []   # tensors must outlive their requests

    def _round(send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        reqs = []
        if send is not None:
            keep.append(send)
            reqs.append(dist.isend(send, dst=dst, group=group))
        if recv is not None:
            reqs.append(dist.irecv(recv, src=src, group=group))
        for r in reqs:
            r.wait()

    meta_out = None
    if dst is not None:
        sizes = [os.path.getsize(p) for _, p in files]
        meta_out = json.dumps({"files": [[n, s] for (n, _), s in zip(files, sizes)],
                               "extra": None if extra is None else len(extra)}).encode()
    n_in = torch.empty(1, dtype=torch.int64) if src is not None else None
    _round(torch.tensor([len(meta_out)], dtype=torch.int64) if meta_out is not None else None, n_in)
    raw_in = torch.empty(int(n_in), dtype=torch.uint8) if n_in is not None else None
    _round(torch.frombuffer(bytearray(meta_out), dtype=torch.uint8) if meta_out is not None else None, raw_in)
    reqs = []
    if dst is not None:
        for (_, path), size in zip(files, sizes):
            if size:
                keep.append(_map(path, size))
                reqs.append(dist.isend(keep[-1], dst=dst, group=group))
        if extra:
            keep.append(torch.frombuffer(bytearray(extra), dtype=torch.uint8))
            reqs.append(dist.isend(keep[-1], dst=dst, group=group))
    got = None
    if src is not None:
        meta = json.loads(bytes(raw_in.numpy()))
        for name, size in meta["files"]:
            path = os.path.join(into, *safe_relative_path(name, f"replica from rank {src}").split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                if size:
                    # Reserve the pages now: a full tmpfs then fails here with ENOSPC, not with
                    # SIGBUS while the bytes are written through the mapping.
                    os.posix_fallocate(f.fileno(), 0, size)
            if size:
                keep.append(_map(path, size))
                reqs.append(dist.irecv(keep[-1], src=src, group=group))
        if meta["extra"] is not None:
            buf = torch.empty(meta["extra"], dtype=torch.uint8)
            if meta["extra"]:
                reqs.append(dist.irecv(buf, src=src, group=group))
            got = buf
    for r in reqs:
        r.wait()
    return None if got is None else bytes(got.numpy())


# ---------------------------------------------------------------------- restore decision
def choose_restore(views: Sequence[tuple[Sequence[int], Sequence[int]]], durable_step: int | None,
                   peers: bool) -> tuple[int | None, list[int]]:
    """Which step every node can restore from memory, and which nodes need their peer's replica.

    views[k] = (steps complete in node k's memory, steps of node k-1 complete in node k's replica
    folder). The newest step every node has (itself or through the next node's replica) wins,
    unless durable storage holds a newer one (the memory is stale): then (None, [])."""
    n = len(views)
    own = [set(v[0]) for v in views]
    kept = [set(v[1]) for v in views]
    avail = [own[k] | (kept[(k + 1) % n] if peers and n > 1 else set()) for k in range(n)]
    common = set.intersection(*avail) if avail else set()
    if not common:
        return None, []
    step = max(common)
    if durable_step is not None and step < durable_step:
        return None, []
    return step, [k for k in range(n) if step not in own[k]]


# ---------------------------------------------------------------------- durable copy
def persist_rank(tier: MemoryTier, step: int, durable: Storage, attempt: str, rank: int,
                 executor: Executor | None) -> dict:
    """Copy this rank's file of node checkpoint `step` to `durable` and report it in a record
    (`.omnickpt/<attempt>/r<rank>.json`); node leaders add their node manifest."""
    t0 = time.perf_counter()
    lay = tier.layout
    rel = step_dir(step)
    raw = tier.storage.read_bytes(f"{rel}/{MANIFEST_NAME}")
    manifest = Manifest.decode(raw, where=tier.storage.describe(f"{rel}/{MANIFEST_NAME}"))
    files, nbytes = {}, 0
    for f in manifest.files:
        if f.rank != lay.local:
            continue
        # Node save ids are unique per save, so names never collide with another node's or an
        # older checkpoint's files in the same step folder.
        name = f"data/{manifest.save_id}-r{rank:05d}.bin"
        src = os.path.join(tier.storage.root, rel, *f.path.split("/"))
        copy_file(src, f.bytes, durable, name, executor)
        files[str(f.rank)] = name
        nbytes += f.bytes
    record = {"rank": rank, "node": lay.node, "local": lay.local, "files": files, "bytes": nbytes,
              "manifest": raw.decode() if lay.local == 0 else None, "seconds": time.perf_counter() - t0}
    durable.commit(f"{CONTROL_DIR}/{attempt}/r{rank:05d}.json", json.dumps(record).encode())
    return record


def copy_file(src: str, nbytes: int, durable: Storage, name: str, executor: Executor | None) -> None:
    """One file from shared memory to durable storage, straight from its mapped pages."""
    try:
        fd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{src} is missing from shared memory; the memory checkpoint is incomplete") from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise CorruptCheckpointError(f"{src} has {size} bytes in shared memory, its manifest says {nbytes}")
        if not nbytes:
            durable.write_file(name, 0, [], executor, durable=True)
            return
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                durable.write_file(name, nbytes, [Segment(0, view)], executor, durable=True)
            finally:
                view.release()
    finally:
        os.close(fd)


def report_failure(durable: Storage, attempt: str, rank: int, message: str) -> None:
    """A rank's record saying its copy failed (best effort: the storage may be what failed)."""
    try:
        durable.commit(f"{CONTROL_DIR}/{attempt}/r{rank:05d}.json", json.dumps({"rank": rank, "error": message}).encode())
    except Exception:
        pass


def await_records(durable: Storage, attempt: str, world_size: int, timeout: float) -> list[dict]:
    """Coordinator: every rank's record of `attempt`, or CheckpointTimeoutError naming the missing ranks."""
    prefix = f"{CONTROL_DIR}/{attempt}"
    deadline, delay = time.monotonic() + timeout, 0.001
    pattern = re.compile(r"r(\d{5})\.json")
    while True:
        have = {int(m.group(1)) for p in durable.list(prefix) if (m := pattern.fullmatch(p.rsplit("/", 1)[-1]))}
        if len(have) >= world_size:
            return [json.loads(durable.read_bytes(f"{prefix}/r{r:05d}.json")) for r in range(world_size)]
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - have)
            msg = (f"ranks {missing} did not copy their memory checkpoint to {durable.describe()} within {timeout:.0f} s; "
                   "nothing was committed there")
            put_status(durable, attempt, {"state": "failed", "error": msg})
            raise CheckpointTimeoutError(msg)
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX)


def await_status(durable: Storage, attempt: str, timeout: float) -> None:
    """Non-coordinator: wait until the coordinator committed (or failed) `attempt`."""
    rel = f"{CONTROL_DIR}/{attempt}/status.json"
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        try:
            status = json.loads(durable.read_bytes(rel))
            break
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(f"the coordinator (rank 0) did not commit {durable.describe()} within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX)
    if status.get("state") != "committed":
        raise CheckpointError(f"persisting to {durable.describe()} failed: {status.get('error')}")


def put_status(durable: Storage, attempt: str, doc: dict) -> None:
    try:
        durable.commit(f"{CONTROL_DIR}/{attempt}/status.json", json.dumps(doc).encode())
    except Exception:   # best effort: the error being reported matters more
        pass


def commit_durable(durable: Storage, attempt: str, records: list[dict], ranks_per_node: int,
                   tool_version: str) -> Manifest:
    """Coordinator: merge the node manifests of `records` into one global manifest, write it last,
    then the status and a small report; remove files of earlier attempts there."""
    errors = [r["error"] for r in records if r.get("error")]
    if errors:
        msg = "; ".join(errors) + " (nothing was committed there)"
        put_status(durable, attempt, {"state": "failed", "error": msg})
        raise CheckpointError(msg)
    nodes: dict[int, tuple[Manifest | None, dict[int, tuple[str, int]]]] = {}
    for rec in records:
        m, renames = nodes.get(rec["node"], (None, {}))
        if rec.get("manifest") is not None:
            m = Manifest.decode(rec["manifest"].encode(), where=f"rank {rec['rank']}'s node manifest")
        for local, name in rec["files"].items():
            renames[int(local)] = (name, rec["rank"])
        nodes[rec["node"]] = (m, renames)
    missing = [k for k, (m, _) in sorted(nodes.items()) if m is None]
    if missing:
        raise CheckpointError(f"no node manifest came from node(s) {missing}; nothing was committed")
    merged = merge_node_manifests([nodes[k] for k in sorted(nodes)], ranks_per_node=ranks_per_node,
                                  save_id=attempt, tool_version=tool_version)
    durable.commit(MANIFEST_NAME, merged.encode())
    report = {"kind": "persist", "save_id": attempt, "path": durable.describe(),
              "total_bytes": sum(r["bytes"] for r in records),
              "seconds_per_rank": [r["seconds"] for r in records]}
    durable.commit("report.json", json.dumps(report).encode())
    put_status(durable, attempt, {"state": "committed"})
    collect_garbage(durable, merged)
    return merged


def merge_node_manifests(nodes: Sequence[tuple[Manifest, dict[int, tuple[str, int]]]], *, ranks_per_node: int,
                         save_id: str, tool_version: str) -> Manifest:
    """One global manifest from per-node manifests (pure).

    nodes[k] = (node k's manifest, {node-local rank: (file name in the global checkpoint, global rank)}).
    Node-local ranks become k * ranks_per_node + local. A box saved by several nodes (a replica
    across nodes) is listed once, from the first node; an object keeps every rank's value."""
    files: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, list[ObjectEntry]] = {}
    seen: dict[str, set] = {}
    for k, (m, renames) in enumerate(nodes):
        base = k * ranks_per_node
        index = {}
        for i, f in enumerate(m.files):
            if f.rank not in renames:
                raise CheckpointError(f"node {k}: no rank reported copying its file {f.path} (node rank {f.rank})")
            name, grank = renames[f.rank]
            index[i] = len(files)
            files.append(FileEntry(name, grank, f.bytes))
        for name, t in m.tensors.items():
            entry = tensors.setdefault(name, TensorEntry(t.shape, t.dtype, []))
            if (entry.shape, entry.dtype) != (t.shape, t.dtype):
                raise PlanError(f"tensor {name}: node {k} saved shape {list(t.shape)} {t.dtype}, an earlier node "
                                f"{list(entry.shape)} {entry.dtype}; the nodes' states disagree")
            boxes = seen.setdefault(name, set())
            for b in t.boxes:
                if (b.offsets, b.lengths) in boxes:
                    continue
                boxes.add((b.offsets, b.lengths))
                entry.boxes.append(dataclasses.replace(b, file=index[b.file]))
        for key, entries in m.objects.items():
            for e in entries:
                objects.setdefault(key, []).append(
                    ObjectEntry([base + r for r in e.ranks], index[e.file], e.offset, e.nbytes, e.checksum))
    for t in tensors.values():
        t.boxes.sort(key=lambda b: b.offsets)
    world = len(nodes) * ranks_per_node
    layout = dict(nodes[0][0].layout, world_size=world, ranks_per_node=ranks_per_node) if nodes else {}
    return Manifest(save_id=save_id, world_size=world, files=files, tensors=tensors, objects=objects,
                    layout=layout, tool_version=tool_version, created=time.time())
