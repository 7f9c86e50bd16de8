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

This module holds one rank's view of that memory (MemoryTier: its folders, scanning, retention, the
merged restore view, peer replicas); the policy (when to save, persist, flush, restore) is
manager.py's (TieredCheckpointManager). Beside it: layout.py (NodeLayout), transfer.py (files between
ranks), restore.py (what to restore from), durable.py (the copy to durable storage, committed through
omnickpt/commit.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import warnings
from typing import Any, Sequence

from omnickpt.errors import CheckpointError, CorruptCheckpointError
from omnickpt.format import MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, checksum
from omnickpt.memory.durable import merge_node_manifests
from omnickpt.memory.layout import NodeLayout
from omnickpt.memory.transfer import transfer_files
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
        to_move = self._sort_node_folders()
        if to_move:
            old = _read_identity(self.job, f"{PREVIOUS}/{to_move[0]}/{TIER_FILE}")
            if _holds_steps(self.job, PREVIOUS) and old:
                warnings.warn(f"omnickpt: memory set aside earlier at {self.job.describe(PREVIOUS)} (world size "
                              f"{old.get('world_size')}) is replaced by the newer one of world size "
                              f"{_read_identity(self.job, f'{to_move[0]}/{TIER_FILE}').get('world_size')}",
                              RuntimeWarning, stacklevel=5)
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

    def _sort_node_folders(self) -> list[str]:
        """prepare()'s first pass: remove the node folders of another job (with a warning) or holding
        no step; returns those of this durable root at another layout, to set aside."""
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
                # stacklevel 6: the caller of TieredCheckpointManager()
                warnings.warn(f"omnickpt: the shared memory at {self.job.describe(name)} belongs to another job "
                              f"layout or durable root ({found or 'no readable ' + TIER_FILE}); it is removed and not "
                              f"restored from", RuntimeWarning, stacklevel=6)
                self.job.delete_tree(name)
            else:
                to_move.append(name)
        return to_move

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

    # ---------------------------------------------------------------- at a clean close
    def give_back_node(self, safe: bool, root_newest: int | None, on_close: str, root: str,
                       memory_step: int | None) -> None:
        """Node leader, at a clean close of the manager of durable root `root`: this node's memory
        goes back per `on_close`, but a step root lacks (newer than root's newest) is kept, with a
        warning saying where; so is the newest step (`memory_step`) when its copy to root did not
        complete on every rank (not `safe`)."""
        unsaved = [s for s in self.committed_steps() if root_newest is None or s > root_newest]
        if safe and not unsaved and on_close == "remove":
            self.remove()
            return
        if unsaved:
            warnings.warn(f"omnickpt: {root} does not hold memory step {unsaved[-1]}; it is kept in "
                          f"{self.storage.describe(step_dir(unsaved[-1]))} (load_latest() restores it on this "
                          f"machine; CheckpointManager.flush() copies it to root)", RuntimeWarning, stacklevel=5)
        elif not safe and on_close == "remove":
            warnings.warn(f"omnickpt: the copy of memory step {memory_step} to {root} did not complete "
                          f"on every rank; the step is kept in {self.node_url}", RuntimeWarning, stacklevel=5)
        self.retain(1)

    def give_back_previous(self, root_newest: int | None, root: str) -> None:
        """Machine leader, at a clean close: memory of another layout goes unless it holds a step
        root lacks (the only copy: kept for a restart at that layout)."""
        info = self.previous_view()
        if info is None:
            self.drop_previous()
            return
        steps = sorted({s for ss in info["nodes"].values() for s in ss})
        if steps and (root_newest is None or steps[-1] > root_newest):
            warnings.warn(f"omnickpt: {self.job.describe('previous')} keeps step {steps[-1]}, saved at world "
                          f"size {info['world_size']} and not in {root}", RuntimeWarning, stacklevel=5)
            return
        self.drop_previous()

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
