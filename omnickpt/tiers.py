"""The memory tier behind TieredCheckpointManager(root, memory="shm://JOB"): where each node keeps its
in-memory checkpoints and its peer's replicas, how they are found complete after a crash, sent to
and restored from a peer, and copied to durable storage under one global manifest.

Layout in host shared memory (one directory per node; on one machine each simulated node has its own):

    shm://JOB/node<k>/tier.json                        what this memory belongs to (durable root, world, ranks per node)
    shm://JOB/node<k>/global_step_<N>/                 node k's checkpoint of step N: an ordinary omnickpt
                                                       checkpoint of node k's ranks (saved with the node's process
                                                       group), manifest written last
    shm://JOB/node<k>/replicas/node<j>/global_step_<N>/  a copy of node j's checkpoint (j = k - 1 on the ring)
    shm://JOB/.omnickpt/owner.json                     the owner lease of the job's memory on this machine
    shm://JOB/restore/global_step_<N>/                 while restoring with several nodes (or from another layout)
                                                       only: the data files of the nodes on this machine (hard
                                                       links) and every rank's objects, one manifest
    shm://JOB/previous/node<j>/...                     memory left at another world size or node layout by a job
                                                       of the same durable root, kept for load_latest() to reshard

A node's checkpoint holds every tensor byte its own ranks need (replicas are deduplicated within
the node only), so a restart reads tensors from local memory only; the few object values that a
rank may need from other ranks (a dataloader position redistributed on load) are exchanged between
node leaders at restore. A node that lost its memory gets its files back from the peer that holds
its replica. Memory saved at another layout is resharded from when every machine holds every old
node's checkpoint (one machine: always), through the same merged view. The durable copy is one
global checkpoint (any layout can load it): every rank copies its node file, node leaders send their
node manifests in their records, and the coordinator merges them (merge_node_manifests) and writes
the manifest last.

This module holds the mechanics; the policy (when to save, persist, flush, restore) is tiered.py's
(TieredCheckpointManager); the durable copy's records and status go through commit.py.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import logging
import mmap
import os
import re
import time
import warnings
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import torch

from omnickpt.commit import post_record, set_status
from omnickpt.engine.save import collect_garbage
from omnickpt.errors import CheckpointError, CorruptCheckpointError, PlanError
from omnickpt.format import MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, TensorEntry, checksum
from omnickpt.storage import Segment, Storage
from omnickpt.storage.shm import ShmStorage, parse_shm_url
from omnickpt.steps import committed_steps, parse_step, remove_step, retire, step_dir, step_folders

NODE_DIR = re.compile(r"^node(\d+)$")
TIER_FILE = "tier.json"
REPLICAS = "replicas"
RESTORE = "restore"     # a world view of one step, only while it is being restored from
PREVIOUS = "previous"   # memory of another layout of the same durable root, until restored or replaced
log = logging.getLogger("omnickpt")
_TIER_FORMAT = "omnickpt-memory-tier"


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
    """One rank's view of the memory tier: its node's directory in shared memory (`storage`), and
    the job's directory on this machine (`job`: the lease, the restore view, `previous/`)."""

    def __init__(self, url: str, layout: NodeLayout, durable: str):
        parse_shm_url(url)   # validates the job name before anything touches the file system
        self.url = url.rstrip("/")
        self.layout = layout
        self.durable = durable
        self.node_url = f"{self.url}/node{layout.node}"
        self.storage = ShmStorage(self.node_url)
        self.job = ShmStorage(self.url)

    # ---------------------------------------------------------------- paths
    def step_url(self, step: int) -> str:
        return f"{self.node_url}/{step_dir(step)}"

    def view_url(self, step: int) -> str:
        """The merged view of `step` that a restore with several nodes (or from another layout)
        loads: the same URL on every machine, each machine's own files behind it."""
        return f"{self.url}/{RESTORE}/{step_dir(step)}"

    def replica_rel(self, step: int | None = None) -> str:
        """This node's replica folder (of the previous node on the ring), or one step in it."""
        src = (self.layout.node - 1) % self.layout.nodes
        base = f"{REPLICAS}/node{src}"
        return base if step is None else f"{base}/{step_dir(step)}"

    def _sub(self, rel: str) -> ShmStorage:
        return ShmStorage(f"{self.node_url}/{rel}")

    # ---------------------------------------------------------------- identity
    def identity(self, node: int | None = None) -> dict:
        return {"format": _TIER_FORMAT, "version": 1, "durable": self.durable, "world_size": self.layout.world_size,
                "ranks_per_node": self.layout.ranks_per_node, "node": self.layout.node if node is None else node}

    def prepare(self, nodes_here: Sequence[int]) -> None:
        """Machine leader, at start, holding the job's lease on this machine. Node folders here that
        are not this job layout's: left by another durable root (or unreadable), they are another
        job's and are removed with a warning (their steps could be mistaken for newer ones); left by
        this durable root at another world size or node layout, they are set aside under previous/
        for load_latest() to reshard from. Then every node of `nodes_here` gets its tier.json."""
        to_move = []
        for name in self.job.children(""):
            m = NODE_DIR.match(name)
            if not m:
                continue
            found = _read_identity(self.job, f"{name}/{TIER_FILE}")
            if found == self.identity(int(m.group(1))):
                continue
            if not _holds_steps(self.job, name):
                self.job.delete_tree(name)   # nothing to restore from: no need to say anything
            elif not found or found.get("format") != _TIER_FORMAT or found.get("durable") != self.durable:
                warnings.warn(f"omnickpt: the shared memory at {self.job.describe(name)} belongs to another job "
                              f"layout or durable root ({found or 'no readable ' + TIER_FILE}); it is removed and not "
                              f"restored from", RuntimeWarning, stacklevel=4)
                self.job.delete_tree(name)
            else:
                to_move.append(name)
        if to_move:
            old = _read_identity(self.job, f"{PREVIOUS}/{to_move[0]}/{TIER_FILE}")
            if _holds_steps(self.job, PREVIOUS) and old:
                warnings.warn(f"omnickpt: memory set aside earlier at {self.job.describe(PREVIOUS)} (world size "
                              f"{old.get('world_size')}) is replaced by the newer one of world size "
                              f"{_read_identity(self.job, f'{to_move[0]}/{TIER_FILE}').get('world_size')}",
                              RuntimeWarning, stacklevel=4)
            self.job.delete_tree(PREVIOUS)
            os.makedirs(os.path.join(self.job.root, PREVIOUS), exist_ok=True)
            for name in to_move:
                os.rename(os.path.join(self.job.root, name), os.path.join(self.job.root, PREVIOUS, name))
            log.info("omnickpt: shared memory of another layout of %s set aside at %s for load_latest() to reshard",
                     self.durable, self.job.describe(PREVIOUS))
        else:
            self._reclaim_previous()
        for node in nodes_here:
            rel = f"node{node}/{TIER_FILE}"
            if _read_identity(self.job, rel) != self.identity(node):
                self.job.commit(rel, json.dumps(self.identity(node)).encode())

    def _reclaim_previous(self) -> None:
        """previous/ saved at this very layout (a job went back to it before any save): its node
        folders become the current ones again."""
        names = [n for n in self.job.children(PREVIOUS) if NODE_DIR.match(n)]
        if not names or any(_read_identity(self.job, f"{PREVIOUS}/{n}/{TIER_FILE}") != self.identity(int(n[4:]))
                            or self.job.exists(n) for n in names):
            return
        for n in names:
            os.rename(os.path.join(self.job.root, PREVIOUS, n), os.path.join(self.job.root, n))
        self.job.delete_tree(PREVIOUS)

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

    def previous_view(self) -> dict | None:
        """Machine leader: what previous/ holds on this machine, or None: {"world_size",
        "ranks_per_node", "nodes": {old node j: sorted steps complete for it here, in its own folder
        or as a replica in another's}}."""
        layout, nodes = None, {}
        for name in self.job.children(PREVIOUS):
            m = NODE_DIR.match(name)
            ident = _read_identity(self.job, f"{PREVIOUS}/{name}/{TIER_FILE}") if m else None
            if not ident:
                continue
            key = (ident.get("world_size"), ident.get("ranks_per_node"))
            if layout is None:
                layout = key
            if key != layout:
                continue
            rel = f"{PREVIOUS}/{name}"
            nodes.setdefault(int(m.group(1)), set()).update(_complete_steps(self.job, rel))
            for src in self.job.children(f"{rel}/{REPLICAS}"):
                if NODE_DIR.match(src):
                    nodes.setdefault(int(src[4:]), set()).update(_complete_steps(self.job, f"{rel}/{REPLICAS}/{src}"))
        if layout is None:
            return None
        return {"world_size": layout[0], "ranks_per_node": layout[1], "nodes": {j: sorted(s) for j, s in nodes.items()}}

    # ---------------------------------------------------------------- retention
    def retain(self, keep: int, pinned: set[int] = frozenset(), upto: int | None = None) -> None:
        """Node leader: of the complete steps up to `upto` (default: the newest complete one), keep
        the newest `keep` (and `pinned` ones, still being copied to durable storage); remove older
        steps, complete or not. Steps newer than `upto` are left alone: in flight, or an abandoned
        run's that this run has not passed yet (never retired in favour of this run's own)."""
        for rel in ("", self.replica_rel()):
            last = upto
            if last is None:
                complete = _complete_steps(self.storage, rel)
                last = complete[-1] if complete else None
            if last is not None:
                retire(self.storage, keep, last, pinned, rel, complete=is_complete)

    def purge_newer(self, step: int | None) -> list[int]:
        """Node leader, after a restore (or before the first save of a run that restored nothing):
        steps newer than `step` (or all, for None) come from an abandoned timeline; one node may
        hold them complete while another does not, so they must never be restored from, nor mixed
        with the new run's saves of the same numbers. Returns the complete ones removed."""
        gone = []
        for rel in ("", self.replica_rel()):
            complete = set(_complete_steps(self.storage, rel))
            for s, name in step_folders(self.storage, rel):
                if step is None or s > step:
                    if rel == "" and s in complete:
                        gone.append(s)
                    remove_step(self.storage, f"{rel}/{name}" if rel else name)
        return sorted(gone)

    def drop_step(self, step: int) -> None:
        """Node leader: remove `step` (own checkpoint and replica), e.g. found corrupt at restore."""
        remove_step(self.storage, step_dir(step))
        remove_step(self.storage, self.replica_rel(step))

    # ---------------------------------------------------------------- restoring through a merged view
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
                path = f"{rel}/{manifest.files[e.file].path}"
                self.storage.read_into(path, e.offset, [memoryview(buf)])
                # Checked here, where the file is this node's: in the merged view it would be
                # reported in a copy that names no node.
                if checksum(buf) != e.checksum:
                    raise CorruptCheckpointError(f"checksum mismatch in {self.storage.describe(path)} for object "
                                                 f"{key!r}: the data file is corrupt")
                out.append((key, [base + r for r in e.ranks], bytes(buf), e.checksum))
        return out

    def world_view(self, step: int, nodes_here: Sequence[int],
                   objects: Sequence[tuple[str, list[int], bytes, int]]) -> str:
        """Machine leader: a checkpoint of `step` in this machine's memory that the whole group can
        load, each rank reading only from its own machine: the tensors of the nodes on this machine
        (their data files hard-linked, no copy) and every node's objects (so that state needing
        every rank's value on load, such as a dataloader position, restores as from the global
        checkpoint). Returns its URL, the same on every machine."""
        rpn = self.layout.ranks_per_node
        sources = [(k, f"node{k}/{step_dir(step)}") for k in nodes_here]
        return self._merged_view(step, sources, rpn, self.layout.world_size, objects)

    def previous_world_view(self, step: int) -> str:
        """Machine leader: the merged view of previous/'s step `step` (every old node's checkpoint,
        its own or its replica), which any layout can load: load_latest() reshards from it."""
        info = self.previous_view()
        if info is None:
            raise CheckpointError(f"{self.job.describe(PREVIOUS)} holds no memory of another layout")
        rpn, world = info["ranks_per_node"], info["world_size"]
        sources = []
        for j in range(world // rpn):
            rel = f"{PREVIOUS}/node{j}/{step_dir(step)}"
            if not is_complete(self.job, rel):
                rel = next((f"{PREVIOUS}/{n}/{REPLICAS}/node{j}/{step_dir(step)}" for n in self.job.children(PREVIOUS)
                            if is_complete(self.job, f"{PREVIOUS}/{n}/{REPLICAS}/node{j}/{step_dir(step)}")), None)
            if rel is None:
                raise CheckpointError(f"step {step} of node {j} (saved at world size {world}) is not complete in "
                                      f"{self.job.describe(PREVIOUS)}")
            sources.append((j, rel))
        return self._merged_view(step, sources, rpn, world, None)

    def _merged_view(self, step: int, sources: Sequence[tuple[int, str]], rpn: int, world: int,
                     objects: Sequence[tuple[str, list[int], bytes, int]] | None) -> str:
        """One checkpoint from node checkpoints (node index, folder under the job): data files
        hard-linked, manifests merged; `objects` replace the merged objects when given."""
        view = f"{RESTORE}/{step_dir(step)}"
        self.job.delete_tree(RESTORE)
        nodes = []
        for node, rel in sources:
            manifest = Manifest.decode(self.job.read_bytes(f"{rel}/{MANIFEST_NAME}"),
                                       where=self.job.describe(f"{rel}/{MANIFEST_NAME}"))
            renames = {}
            for f in manifest.files:   # names carry the node save's id: no two nodes' collide
                dst = os.path.join(self.job.root, *view.split("/"), *f.path.split("/"))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.link(os.path.join(self.job.root, *rel.split("/"), *f.path.split("/")), dst)
                renames[f.rank] = (f.path, node * rpn + f.rank)
            nodes.append((manifest, renames))
        merged = merge_node_manifests(nodes, ranks_per_node=rpn, save_id=nodes[0][0].save_id,
                                      tool_version=nodes[0][0].tool_version, node_index=[n for n, _ in sources],
                                      world_size=world)
        if objects is not None:
            blob, entries = bytearray(), {}
            for key, ranks, data, crc in objects:
                entry = ObjectEntry(list(ranks), len(merged.files), len(blob), len(data), crc)
                entries.setdefault(key, []).append(entry)
                blob += data
            name = f"data/objects-{merged.save_id}.bin"
            self.job.write_file(f"{view}/{name}", len(blob), [Segment(0, memoryview(blob))], None, durable=False)
            merged.files.append(FileEntry(name, sources[0][0] * rpn, len(blob)))
            merged.objects = entries
        self.job.commit(f"{view}/{MANIFEST_NAME}", merged.encode())
        return f"{self.url}/{view}"

    def attribute(self, message: str, step: int) -> str:
        """`message` with the merged view's files of `step` named where they live (their node's
        folder): the view is gone by the time anyone reads the message, and names no node."""
        for node in self.job.children(""):
            if NODE_DIR.match(node):
                for name in self.job.children(f"{node}/{step_dir(step)}/data"):
                    message = message.replace(f"{RESTORE}/{step_dir(step)}/data/{name}",
                                              f"{node}/{step_dir(step)}/data/{name}")
        return message

    def drop_world_view(self) -> None:
        self.job.delete_tree(RESTORE)

    def drop_previous(self, step: int | None = None) -> None:
        """Machine leader: remove previous/ (or its step `step` only, e.g. found corrupt)."""
        if step is None:
            self.job.delete_tree(PREVIOUS)
            return
        for name in self.job.children(PREVIOUS):
            for rel in [f"{PREVIOUS}/{name}"] + [f"{PREVIOUS}/{name}/{REPLICAS}/{r}"
                                                 for r in self.job.children(f"{PREVIOUS}/{name}/{REPLICAS}")]:
                remove_step(self.job, f"{rel}/{step_dir(step)}")

    def remove(self) -> None:
        """Node leader: give this node's shared memory back (own steps and replicas)."""
        self.storage.delete_tree("")

    def remove_job_dir(self) -> None:
        """Machine leader, once the lease is released: the job folder, if nothing is left in it."""
        for d in (os.path.join(self.job.root, ".omnickpt"), self.job.root):
            try:
                os.rmdir(d)
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
            remove_step(self.storage, step_dir(step))
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
    return committed_steps(storage, rel, complete=is_complete)


def _read_identity(storage: Storage, rel: str) -> dict | None:
    """A tier.json: None if there is none, {} if it is unreadable."""
    try:
        doc = json.loads(storage.read_bytes(rel))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError, OSError, CheckpointError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _holds_steps(storage: Storage, rel: str) -> bool:
    """Whether folder `rel` (a node's, or previous/) holds any step folder, its own or a replica."""
    for name in storage.children(rel):
        if parse_step(name) is not None:
            return True
        if name == REPLICAS or NODE_DIR.match(name):
            if _holds_steps(storage, f"{rel}/{name}"):
                return True
    return False


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
        _send_files(group, dst, files, sizes, extra, keep, reqs)
    got = None
    if src is not None:
        got = _receive_files(group, src, json.loads(bytes(raw_in.numpy())), into, keep, reqs)
    for r in reqs:
        r.wait()
    return None if got is None else bytes(got.numpy())


def _send_files(group: Any, dst: int, files: Sequence[tuple[str, str]], sizes: list[int], extra: bytes | None,
                keep: list[torch.Tensor], reqs: list) -> None:
    """transfer_files' third round, sending side: post a send of each non-empty file and of `extra`."""
    import torch.distributed as dist
    for (_, path), size in zip(files, sizes):
        if size:
            keep.append(_map(path, size))
            reqs.append(dist.isend(keep[-1], dst=dst, group=group))
    if extra:
        keep.append(torch.frombuffer(bytearray(extra), dtype=torch.uint8))
        reqs.append(dist.isend(keep[-1], dst=dst, group=group))


def _receive_files(group: Any, src: int, meta: dict, into: str, keep: list[torch.Tensor],
                   reqs: list) -> torch.Tensor | None:
    """transfer_files' third round, receiving side: create each file `meta` names under `into` and post
    a receive into its mapping; returns the buffer the byte string arrives in (None if none is sent)."""
    import torch.distributed as dist
    from omnickpt.format.manifest import safe_relative_path
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
    if meta["extra"] is None:
        return None
    buf = torch.empty(meta["extra"], dtype=torch.uint8)
    if meta["extra"]:
        reqs.append(dist.irecv(buf, src=src, group=group))
    return buf


# ---------------------------------------------------------------------- restore decision
@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step load_latest() may restore from memory: from the node checkpoints of this layout
    ("memory"; `broken` nodes first get theirs back from their peer), or resharded from the memory
    of another layout ("previous")."""
    step: int
    source: str
    broken: tuple[int, ...] = ()


def restore_candidates(views: Sequence[tuple[Sequence[int], Sequence[int]]], durable_step: int | None, peers: bool,
                       previous: Sequence[dict | None] = ()) -> tuple[list[Candidate], list[str]]:
    """The steps that can be restored from memory, newest first, and notes on memory that cannot be.

    views[k] = (steps complete in node k's memory, steps of node k-1 complete in node k's replica
    folder). A step every node has (itself or through the next node's replica) is a candidate.
    previous[m] = machine m's previous_view() (memory of another layout): a step is a candidate
    when every machine holds every old node's checkpoint of it (each machine builds the whole
    checkpoint from its own memory). Steps older than `durable_step` are stale: never candidates."""
    fresh = (lambda s: durable_step is None or s >= durable_step)
    out = _memory_candidates(views, peers, fresh)
    notes = []
    if previous and any(p is not None for p in previous):
        out += _previous_candidates(previous, fresh, notes)
    out.sort(key=lambda c: (c.step, c.source == "memory"), reverse=True)
    return out, notes


def _memory_candidates(views: Sequence[tuple[Sequence[int], Sequence[int]]], peers: bool,
                       fresh: Callable[[int], bool]) -> list[Candidate]:
    """Fresh steps every node of this layout has, itself or through the next node's replica."""
    n = len(views)
    own = [set(v[0]) for v in views]
    kept = [set(v[1]) for v in views]
    avail = [own[k] | (kept[(k + 1) % n] if peers and n > 1 else set()) for k in range(n)]
    return [Candidate(s, "memory", tuple(k for k in range(n) if s not in own[k]))
            for s in (set.intersection(*avail) if avail else set()) if fresh(s)]


def _previous_candidates(previous: Sequence[dict | None], fresh: Callable[[int], bool],
                         notes: list[str]) -> list[Candidate]:
    """Fresh steps of another layout's memory that every machine holds whole; the fresh steps some
    machine lacks go into `notes` (they cannot be resharded from memory)."""
    layouts = {(p["world_size"], p["ranks_per_node"]) for p in previous if p is not None}
    # A machine that saw no old memory, or machines that disagree on the old layout, hold nothing usable.
    per_machine = [set() if p is None or len(layouts) > 1 else _whole_steps(p) for p in previous]
    common = set.intersection(*per_machine)
    lost = _lost_steps(previous, fresh, common)
    if lost:
        notes.append(_lost_note(lost, layouts))
    return [Candidate(s, "previous") for s in common if fresh(s)]


def _lost_steps(previous: Sequence[dict | None], fresh: Callable[[int], bool], common: set) -> list[int]:
    """Fresh steps some machine's old memory holds that are not restorable from every machine, sorted."""
    return sorted({s for p in previous if p is not None for ss in p["nodes"].values() for s in ss
                   if fresh(s) and s not in common})


def _lost_note(lost: list[int], layouts: set[tuple[int, int]]) -> str:
    """Why the `lost` steps of another layout's memory cannot be restored; '?' when machines disagree on it."""
    w, r = next(iter(layouts)) if len(layouts) == 1 else ("?", "?")
    return (f"step(s) {lost} in shared memory were saved at world size {w} ({r} rank(s) per node) and "
            f"cannot be resharded from memory: not every machine of this job holds every old node's "
            f"checkpoint of them (a node's memory holds only its own ranks' part)")


def _whole_steps(view: dict) -> set:
    """Steps of which one machine's previous_view() holds every old node's checkpoint."""
    nodes = range(view["world_size"] // view["ranks_per_node"])
    return set.intersection(*(set(view["nodes"].get(j, ())) for j in nodes))


def choose_restore(views: Sequence[tuple[Sequence[int], Sequence[int]]], durable_step: int | None,
                   peers: bool) -> tuple[int | None, list[int]]:
    """Which step every node can restore from memory, and which nodes need their peer's replica:
    the newest candidate of restore_candidates(), unless durable storage holds a newer step (the
    memory is stale): then (None, [])."""
    found, _ = restore_candidates(views, durable_step, peers)
    if not found:
        return None, []
    return found[0].step, list(found[0].broken)


# ---------------------------------------------------------------------- durable copy
def persist_rank(tier: MemoryTier, step: int, durable: Storage, attempt: str, rank: int,
                 executor: Executor | None) -> dict:
    """Copy this rank's file of node checkpoint `step` to `durable` and report it in a record
    (omnickpt.commit.post_record); node leaders add their node manifest."""
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
              # base64: a manifest is bytes (not necessarily UTF-8 text) and the record is JSON
              "manifest_b64": base64.b64encode(raw).decode("ascii") if lay.local == 0 else None,
              "seconds": time.perf_counter() - t0}
    post_record(durable, attempt, rank, record)
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


def commit_durable(durable: Storage, attempt: str, records: list[dict], ranks_per_node: int,
                   tool_version: str) -> Manifest:
    """Coordinator, with every rank's record (omnickpt.commit.await_records): merge the node
    manifests into one global manifest, write it last, then a small report and the status; remove
    files of earlier attempts there."""
    nodes: dict[int, tuple[Manifest | None, dict[int, tuple[str, int]]]] = {}
    for rec in records:
        m, renames = nodes.get(rec["node"], (None, {}))
        raw = _node_manifest(rec)
        if raw is not None:
            m = Manifest.decode(raw, where=f"rank {rec['rank']}'s node manifest")
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
    set_status(durable, attempt)
    collect_garbage(durable, merged)
    return merged


def _node_manifest(record: dict) -> bytes | None:
    """The node manifest a node leader's record carries (as text in records of earlier versions)."""
    if record.get("manifest_b64") is not None:
        return base64.b64decode(record["manifest_b64"])
    return record["manifest"].encode() if record.get("manifest") is not None else None


def merge_node_manifests(nodes: Sequence[tuple[Manifest, dict[int, tuple[str, int]]]], *, ranks_per_node: int,
                         save_id: str, tool_version: str, node_index: Sequence[int] | None = None,
                         world_size: int | None = None) -> Manifest:
    """One global manifest from per-node manifests (pure).

    nodes[i] = (a node's manifest, {node-local rank: (file name in the global checkpoint, global rank)});
    the node is node_index[i] (default: i). Node-local ranks become node * ranks_per_node + local.
    A box saved by several nodes (a replica across nodes) is listed once, from the first node; an
    object keeps every rank's value. world_size defaults to len(nodes) * ranks_per_node."""
    files: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, list[ObjectEntry]] = {}
    seen: dict[str, set] = {}
    for i, (m, renames) in enumerate(nodes):
        k = node_index[i] if node_index is not None else i
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
    world = world_size if world_size is not None else len(nodes) * ranks_per_node
    layout = dict(nodes[0][0].layout, world_size=world, ranks_per_node=ranks_per_node) if nodes else {}
    extra = {"chunk_bytes": nodes[0][0].chunk_bytes, "compression": nodes[0][0].compression} if nodes else {}
    return Manifest(save_id=save_id, world_size=world, files=files, tensors=tensors, objects=objects,
                    layout=layout, tool_version=tool_version, created=time.time(), **extra)
