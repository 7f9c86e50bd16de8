"""The memory tier's durable copy: every rank copies its node file from shared memory to the durable
step folder (persist_rank, copy_file), and the coordinator merges the node manifests into one global
manifest (merge_node_manifests, pure) and writes it last (commit_durable). The round of records and
status goes through omnickpt/commit.py."""
from __future__ import annotations

import base64
import dataclasses
import json
import mmap
import os
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Sequence

from omnickpt.monitor import summarize
from omnickpt.monitor.report import REPORT_NAME
from omnickpt.errors import CheckpointError, CorruptCheckpointError, PlanError
from omnickpt.format import MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, TensorEntry
from omnickpt.storage import Segment, Storage
from omnickpt.steps import step_dir

if TYPE_CHECKING:
    from omnickpt.memory.tier import MemoryTier


def persist_rank(tier: MemoryTier, step: int, durable: Storage, rank: int, executor: Executor | None) -> dict:
    """Copy this rank's file of node checkpoint `step` to `durable`; returns the record that reports
    it in the commit round (omnickpt.commit.run_round posts it); node leaders add their node
    manifest."""
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


def commit_durable(durable: Storage, attempt: str, records: list[dict], ranks_per_node: int, tool_version: str,
                   total_seconds: float | None = None) -> Manifest:
    """Coordinator, with every rank's record (the finish of omnickpt.commit.run_round, which then
    sets the status): merge the node manifests into one global manifest, write it last, then the
    report (report.json: monitor.summarize's document, kind "persist"). The caller removes files
    of earlier attempts there once the status is set (collect_garbage)."""
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
    durable.commit(REPORT_NAME, json.dumps(persist_report(durable, attempt, records, total_seconds)).encode())
    return merged


def persist_report(durable: Storage, attempt: str, records: list[dict], total_seconds: float | None) -> dict:
    """The report of a durable copy: per rank, the seconds of its copy and its bytes (read from
    memory and written to root: the same count)."""
    per_rank = [{"seconds": {"persist": r["seconds"]}, "bytes": {"written": r["bytes"]}}
                for r in records]
    return dict(summarize("persist", per_rank, total_seconds=total_seconds), path=durable.describe(),
                save_id=attempt)


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
        index = _merge_files(k, m, renames, files)
        _merge_tensors(k, m, index, tensors, seen)
        for key, entries in m.objects.items():
            for e in entries:
                objects.setdefault(key, []).append(
                    ObjectEntry([k * ranks_per_node + r for r in e.ranks], index[e.file], e.offset, e.nbytes,
                                e.checksum))
    for t in tensors.values():
        t.boxes.sort(key=lambda b: b.offsets)
    world = world_size if world_size is not None else len(nodes) * ranks_per_node
    layout = dict(nodes[0][0].layout, world_size=world, ranks_per_node=ranks_per_node) if nodes else {}
    extra = {"chunk_bytes": nodes[0][0].chunk_bytes, "compression": nodes[0][0].compression} if nodes else {}
    return Manifest(save_id=save_id, world_size=world, files=files, tensors=tensors, objects=objects,
                    layout=layout, tool_version=tool_version, created=time.time(), **extra)


def _merge_files(node: int, m: Manifest, renames: dict[int, tuple[str, int]], files: list[FileEntry]) -> dict[int, int]:
    """Append node `node`'s files to `files` under their global names; returns {node file index:
    global file index}."""
    index = {}
    for i, f in enumerate(m.files):
        if f.rank not in renames:
            raise CheckpointError(f"node {node}: no rank reported copying its file {f.path} (node rank {f.rank})")
        name, grank = renames[f.rank]
        index[i] = len(files)
        files.append(FileEntry(name, grank, f.bytes))
    return index


def _merge_tensors(node: int, m: Manifest, index: dict[int, int], tensors: dict[str, TensorEntry],
                   seen: dict[str, set]) -> None:
    """Add node `node`'s boxes to `tensors`, each box once (the first node's: a replica across nodes)."""
    for name, t in m.tensors.items():
        entry = tensors.setdefault(name, TensorEntry(t.shape, t.dtype, []))
        if (entry.shape, entry.dtype) != (t.shape, t.dtype):
            raise PlanError(f"tensor {name}: node {node} saved shape {list(t.shape)} {t.dtype}, an earlier node "
                            f"{list(entry.shape)} {entry.dtype}; the nodes' states disagree")
        boxes = seen.setdefault(name, set())
        for b in t.boxes:
            if (b.offsets, b.lengths) in boxes:
                continue
            boxes.add((b.offsets, b.lengths))
            entry.boxes.append(dataclasses.replace(b, file=index[b.file]))
