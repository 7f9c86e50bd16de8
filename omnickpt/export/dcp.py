"""Writing a PyTorch DCP folder from any checkpoint omnickpt reads (`export_dcp`).

The folder is written here in DCP's format rather than by dcp.save, which needs the whole state in memory at
once: the source is read through a CheckpointReader, each tensor chunk (the source's boxes, big ones cut into
rows) read, torch.save'd into `__0_0.distcp` as FileSystemWriter would, and dropped; `.metadata` is pickled
last from DCP's own classes. Memory stays near one chunk. Its keys are those `dcp.save` gives the nested state
dict the checkpoint's names describe (omnickpt.formats.dcp reads them back the same way).
"""
from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time
import uuid
from typing import Any, Callable

import torch

from omnickpt.adapters.dataloader import merged_loader_state
from omnickpt.adapters.generic import parse_per_rank_name
from omnickpt.adapters.module import canonical_name
from omnickpt.data import is_dp_state
from omnickpt.errors import UnsupportedError
from omnickpt.export.destination import FULL_DISK_HINT, Destination, byte_progress
from omnickpt.format import Manifest, ShardRef, dtype_from_name
from omnickpt.formats.dcp import DATA_SUFFIX, METADATA_NAME
from omnickpt.layout import Box
from omnickpt.planner import plan_reads
from omnickpt.reader import CheckpointReader
from omnickpt.storage.base import os_failure

_DCP_VERSION = "1.0.0"          # what export writes: the Metadata.version of torch 2.4 and later
# A box larger than this is written as several DCP chunks of whole rows, so that memory stays near this size
# (or one row) whatever the tensor's size.
EXPORT_CHUNK_BYTES = 64 << 20


# ---------------------------------------------------------------------- export
@dataclasses.dataclass
class _TensorSlot:
    """A place in the exported state dict that holds manifest tensor `name`."""
    name: str


def export_dcp(src: str, dst: str, *, progress: bool = True, allow_pickle: bool = False) -> dict:
    """Write the checkpoint at `src` (anything omnickpt reads: an omnickpt checkpoint of any world size
    and layout, a Hugging Face folder, a DCP folder) as a DCP checkpoint at the local folder `dst`,
    which `torch.distributed.checkpoint.load` reads at any world size.

    Keys are those of `get_model_state_dict` / `get_optimizer_state_dict`, under the checkpoint's state
    keys: `model/fc1.weight` -> "model.fc1.weight"; an optimizer's `optim/state/fc1.weight/exp_avg` ->
    "optim.state.fc1.weight.exp_avg" and its param groups -> "optim.param_groups.<i>.<field>" (with
    "params" naming the parameters); other objects are written as DCP writes a nested value, each
    leaf torch.save'd. Load it with `sd = {"model": get_model_state_dict(m), "optim":
    get_optimizer_state_dict(m, o)}; dcp.load(sd, checkpoint_id=dst); set_state_dict(m, o,
    model_state_dict=sd["model"], optim_state_dict=sd["optim"])`. Per-rank objects (RNG states) are
    written as the lowest saving rank's value; a dataloader saved by omnickpt's DataLoaderAdapter as
    the loader's own state_dict(), its data-parallel ranks' states merged when their keys differ
    (torchtitan's loaders key theirs "dp_rank_<r>"), so that the loader's load_state_dict takes it. A tensor saved at the top level
    (a name with no "/", or a plain value {"w": t}) is the top-level key of that name, as `dcp.save({"w": t})`
    writes it; so is a model a DCP source held at its top level (read as "model", the reader's
    layout["implied_keys"]): the state dict dcp.load accepted for the source accepts the export.

    Every entry is keyed exactly as `dcp.save` would key the same nested state dict (its flatten rules:
    the path joined with "."), so two entries whose paths join to the same key (`{"a.b": x}` beside
    `{"a": {"b": y}}`), or a value where another entry needs a container, cannot both be written: they are
    refused (UnsupportedError naming both) before anything is written, as dcp.save refuses them.

    Streams: one file `__0_0.distcp`, written box by box in the source's own layout (a box above
    EXPORT_CHUNK_BYTES as several chunks of whole rows), each read (and verified against the source's
    checksums where it has them) just before it is written, so memory stays near the largest such
    chunk whatever the checkpoint's size; `.metadata` is written last, with DCP's own classes. `dst`
    must not hold a checkpoint yet. Returns {"path", "tensors", "chunks", "values", "bytes", "seconds"}.
    A failed export removes what it wrote (and `dst` itself when the export made it); a write that fails
    (a full disk, a read-only file system) raises StorageError naming the file and what to do.
    """
    t0 = time.perf_counter()
    dest = Destination(src, dst)
    with CheckpointReader(str(src), workers=1, allow_pickle=allow_pickle) as reader:
        where = reader.location
        manifest = reader.manifest
        state, owners = _export_state(manifest, _objects(reader), where)
        leaves: list[tuple[tuple, Any]] = []
        _traverse(state, leaves.append)
        _refuse_key_collisions(leaves, owners, where)
        values = [(_flat(path), v) for path, v in leaves if not isinstance(v, (_TensorSlot, torch.Tensor))]
        # plain tensors inside objects are tensors to DCP too (one chunk each): dcp.load fills its target's in place
        plain = [(_flat(path), v) for path, v in leaves if isinstance(v, torch.Tensor)]
        for flat, value in values:
            if _holds_slot(value):
                raise UnsupportedError(f"{where}: {flat!r} holds a sharded tensor inside a tuple or set, which DCP "
                                       "stores as one pickled value; it cannot be exported")
        pieces = _pieces(manifest, leaves)
        # Plan every read before writing anything: a tensor the checkpoint does not fully hold fails now.
        plan_reads(manifest, [(name, box) for _, name, _, box in pieces])
        dest.refuse_occupied()
        total = sum(box.numel * dtype.itemsize for _, _, dtype, box in pieces)
        with dest:
            data_name = f"__0_0{DATA_SUFFIX}"
            records = _write_data(reader, dest, data_name, values, plain, pieces, byte_progress(total, progress))
            _write_metadata(dest, _export_metadata(leaves, records, data_name, dest.path))
    return {"path": dest.path, "tensors": len({name for _, name, _, _ in pieces}), "chunks": len(pieces),
            "values": len(values) + len(plain), "bytes": total, "seconds": time.perf_counter() - t0}


def _objects(reader: CheckpointReader) -> dict[str, Any]:
    """The values to write: each object as the lowest saving rank's value, except a dataloader's
    per-rank records (omnickpt's DataLoaderAdapter), written as the loader's own state_dict() that
    DCP would hold: the ranks' states merged (adapters.dataloader.merged_loader_state)."""
    objects = reader.objects()
    loaders = [k for k, v in objects.items() if is_dp_state(v)]
    if loaders:
        for key, by_rank in reader.objects(loaders, all_ranks=True).items():
            shards = {v["dp_rank"]: v["shard"] for _, v in sorted(by_rank.items()) if is_dp_state(v)}
            objects[key] = merged_loader_state(shards)
    return objects


def _flat(path: tuple) -> str:
    """DCP's key of a path in the state dict: its parts joined with "."."""
    return ".".join(map(str, path))


def _pieces(manifest: Manifest, leaves: list[tuple[tuple, Any]]) -> list[tuple[str, str, torch.dtype, Box]]:
    """(flat key, manifest tensor, dtype, box) of every tensor chunk to write: the source's boxes, big ones cut
    into row pieces."""
    pieces: list[tuple[str, str, torch.dtype, Box]] = []
    for path, slot in leaves:
        if isinstance(slot, _TensorSlot):
            entry = manifest.tensors[slot.name]
            dtype = dtype_from_name(entry.dtype)
            boxes = [Box(b.offsets, b.lengths) for b in entry.boxes if math.prod(b.lengths)] or [Box.full(entry.shape)]
            pieces += [(_flat(path), slot.name, dtype, p) for b in boxes for p in _row_pieces(b, dtype.itemsize)]
    return pieces


def _write_data(reader: CheckpointReader, dest: Destination, data_name: str, values: list, plain: list,
                pieces: list, bar) -> list[tuple[str, Any, int, int]]:
    """Write `__0_0.distcp`: each value and tensor chunk torch.save'd back to back, a chunk read (verified) just
    before it is written. Returns (flat key, None for a value or (global shape, dtype, box) for a tensor chunk,
    offset, length) per item. A failed write is the StorageError naming the file (torch.save would report it
    as a RuntimeError that no longer says the disk is full)."""
    records: list[tuple[str, Any, int, int]] = []
    path = dest.file(data_name)
    sink: _Sink | None = None
    try:
        with open(path, "xb") as raw_file:
            dest.wrote(path)
            f = sink = _Sink(raw_file)
            for flat, value in values:
                at = f.tell()
                torch.save(value, f)
                records.append((flat, None, at, f.tell() - at))
            for flat, t in plain:
                at = f.tell()
                torch.save(t.detach().cpu().contiguous(), f)
                records.append((flat, (tuple(t.shape), t.dtype, Box.full(t.shape)), at, f.tell() - at))
            for flat, name, dtype, box in pieces:
                t = torch.empty(box.lengths, dtype=dtype)
                if box.numel:
                    reader.read_into([(name, box)], [t])
                at = f.tell()
                torch.save(t, f)
                records.append((flat, (reader.manifest.tensors[name].shape, dtype, box), at, f.tell() - at))
                if bar is not None:
                    bar.update(box.numel * dtype.itemsize)
                del t
            f.flush()
            os.fsync(raw_file.fileno())
    except BaseException as e:
        # torch.save reports a failed write as a RuntimeError ("unexpected pos"): the sink kept the OSError
        cause = e if isinstance(e, OSError) else sink.error if sink is not None else None
        if cause is not None:
            raise os_failure("writing the DCP export", path, cause, device=dest.path, hint=FULL_DISK_HINT) from cause
        raise
    finally:
        if bar is not None:
            bar.close()
    return records


def _write_metadata(dest: Destination, metadata) -> None:
    """`.metadata`, last and atomically (a temporary file renamed): a folder without it is no checkpoint."""
    path = dest.file(f"{METADATA_NAME}.tmp")
    try:
        with open(path, "xb") as f:
            dest.wrote(path)
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path, dest.file(METADATA_NAME))
        dest.written[-1] = dest.file(METADATA_NAME)
    except OSError as e:
        raise os_failure("writing the DCP export", path, e, device=dest.path, hint=FULL_DISK_HINT) from e


class _Sink:
    """The data file as torch.save sees it, keeping the OSError of a failed write: torch's zip writer turns
    that error into a RuntimeError ("unexpected pos 704 vs 598") that no longer says the disk is full."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def tell(self) -> int:
        return self.f.tell()


def _row_pieces(box, itemsize: int):
    """`box` cut along its first dimension into pieces of at most EXPORT_CHUNK_BYTES (one row at least)."""
    if not box.lengths or box.numel * itemsize <= EXPORT_CHUNK_BYTES:
        return [box]
    row = math.prod(box.lengths[1:]) * itemsize
    step = max(1, EXPORT_CHUNK_BYTES // max(row, 1))
    return [Box((box.offsets[0] + r,) + box.offsets[1:], (min(step, box.lengths[0] - r),) + box.lengths[1:])
            for r in range(0, box.lengths[0], step)]


def _export_state(manifest: Manifest, objects: dict[str, Any], where: str) -> tuple[dict, dict[tuple, str]]:
    """The nested state dict to write: what get_model_state_dict / get_optimizer_state_dict give, under
    the checkpoint's state keys, with `_TensorSlot`s where its tensors go; and, for messages, what filled
    each path ({path: "tensor 'model/w'" or "object 'sched'"}). Two entries that need the same place (a
    value where another needs a dict, or one path twice) are refused, naming both."""
    state: dict[str, Any] = {}
    owners: dict[tuple, str] = {}
    claimed: set[str] = set()
    # A key the DCP reader chose for a checkpoint that had none (dcp.save(model.state_dict()) reads as "model"):
    # written back at the top level, where dcp.load's state dict (the one that was saved) has those entries.
    implied = set(manifest.layout.get("implied_keys") or ()) if _keeps_dcp_keys(manifest) else set()

    def slots(value: Any) -> Any:
        """`value` with every ShardRef (a DTensor stored as boxes) replaced by the tensor's slot."""
        if isinstance(value, ShardRef):
            if value.name in manifest.tensors:
                claimed.add(value.name)
                return _TensorSlot(value.name)
            return None
        if isinstance(value, dict):
            return {k: slots(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(slots(v) for v in value) if type(value) in (list, tuple) else value
        return value

    def place(path: tuple, value: Any, who: str) -> None:
        node = state
        for i, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise _collision(where, _owner(owners, path[:i + 1]), who, path[:i + 1],
                                 "the first is a value where the second needs a container")
        if path[-1] in node:
            raise _collision(where, _owner(owners, path), who, path, "both fill it")
        node[path[-1]] = value
        owners[path] = who

    for key, value in objects.items():
        top, _, rest = key.partition("/")
        value = slots(value)
        who = f"object {key!r}"
        if rest:     # a per-object key (Megatron's ShardedObjects: "<state key>/<unique key>")
            place((top, rest), value, who)
            continue
        if key in implied and isinstance(value, dict):   # a module's extra states, at the top level as saved
            for k, v in value.items():
                place((k,), v, who)
        elif _is_optimizer_object(value):
            # names as the plain model has them (a checkpoint saved before names were canonical), as
            # get_optimizer_state_dict gives them
            place((key,), {"state": {canonical_name(fqn): dict(v) for fqn, v in (value.get("state") or {}).items()},
                           "param_groups": [_canonical_params(g) for g in value["param_groups"]]}, who)
        elif isinstance(value, dict) and isinstance(state.get(key), dict):
            for k, v in value.items():
                place((key, k), v, who)
        else:
            place((key,), value, who)
    for name in manifest.tensors:
        if name in claimed:
            continue
        if parse_per_rank_name(name) is not None:
            continue   # another rank's copy of a plain value's tensor: values are written as the lowest rank's
        who = f"tensor {name!r}"
        top, _, rest = name.partition("/")
        if not rest:     # saved at the top level: DCP's key is the name itself (dcp.save({"w": t}) -> "w")
            place((name,), _TensorSlot(name), who)
            continue
        if top in implied:
            place((rest,), _TensorSlot(name), who)
            continue
        node = state.get(top)
        if isinstance(node, dict) and "state" in node and "param_groups" in node and rest.startswith("state/"):
            fqn, _, k = rest[len("state/"):].rpartition("/")
            place((top, "state", canonical_name(fqn), k), _TensorSlot(name), who)
        else:
            place((top, canonical_name(rest)), _TensorSlot(name), who)
    return state, owners


def _canonical_params(group: Any) -> Any:
    """A param group with its parameter names as the plain model has them."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return group
    return {**group, "params": [canonical_name(p) if isinstance(p, str) else p for p in group["params"]]}


def _keeps_dcp_keys(manifest: Manifest) -> bool:
    """Whether the checkpoint is a plain DCP one, whose implied keys are the reader's own invention (a Megatron
    torch_dist checkpoint's "model" and "optimizer" name its sharded state: they stay)."""
    return manifest.layout.get("format") == "dcp" and "megatron" not in manifest.layout


def _owner(owners: dict[tuple, str], path: tuple) -> str:
    """What filled `path` or the nearest place above it (a value placed whole owns what lies inside it)."""
    return next((owners[path[:n]] for n in range(len(path), 0, -1) if path[:n] in owners), "an entry")


_RENAME_ONE = ("Nothing was written: rename one of them (a tensor: `omnickpt convert SRC NEW --to omnickpt --transform "
               "'Rename(...)'`, then export NEW; a value: in the state you save) and export again")


def _collision(where: str, first: str, second: str, path: tuple, how: str) -> UnsupportedError:
    return UnsupportedError(f"{where}: {first} and {second} both need the state dict entry {list(path)} ({how}); a "
                            f"DCP state dict holds one value per path, so one of them would be lost. {_RENAME_ONE}")


def _refuse_key_collisions(leaves: list[tuple[tuple, Any]], owners: dict[tuple, str], where: str) -> None:
    """Refuse two leaves whose paths join to the same DCP key (DCP joins a path with ".", so
    ("a.b",) and ("a", "b") are both "a.b"): the metadata can hold only one of them, and torch's own
    dcp.save raises "duplicated flatten key" for such a state dict."""
    seen: dict[str, tuple] = {}
    for path, value in leaves:
        flat = ".".join(map(str, path))
        if flat in seen:
            first = _leaf_owner(owners, *seen[flat])
            raise UnsupportedError(
                f"{where}: {first} at {list(seen[flat][0])} and {_leaf_owner(owners, path, value)} at {list(path)} "
                f"would both be written as the DCP key {flat!r} (DCP joins a path in the state dict with '.'); "
                f"torch's dcp.save refuses such a state dict and dcp.load could fill only one of them. {_RENAME_ONE}")
        seen[flat] = (path, value)


def _leaf_owner(owners: dict[tuple, str], path: tuple, value: Any) -> str:
    return f"tensor {value.name!r}" if isinstance(value, _TensorSlot) else _owner(owners, path)


def _is_optimizer_object(value: Any) -> bool:
    """The object omnickpt's optimizer adapter saves: {"param_groups": [{..., "params": [names]}], "state": {...}}."""
    return (isinstance(value, dict) and set(value) == {"param_groups", "state"}
            and isinstance(value["param_groups"], list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"]))


def _holds_slot(value: Any) -> bool:
    if isinstance(value, _TensorSlot):
        return True
    if isinstance(value, dict):
        return any(_holds_slot(v) for v in value.values())
    return isinstance(value, (list, tuple, set, frozenset)) and any(_holds_slot(v) for v in value)


def _traverse(state: dict, visit: Callable[[tuple[tuple, Any]], None]) -> None:
    """DCP's traverse_state_dict (torch 2.4+), with `_TensorSlot`s as tensors: dicts are always walked
    (keys as text), lists only when they hold a tensor or a container that does; every other value is
    a leaf. The paths are what DCP's flatten_state_dict records, so dcp.load maps them back."""
    def terminal(value: Any) -> bool:
        if isinstance(value, dict):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, (_TensorSlot, torch.Tensor)) or isinstance(v, (dict, list)) and not terminal(v)
                       for v in value)

    def walk(path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif terminal(value):
            visit((path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    for key, value in state.items():
        walk((str(key),), value)


def _export_metadata(leaves: list[tuple[tuple, Any]], records: list, data_name: str, out_dir: str):
    """DCP's Metadata for what was written, built with DCP's own classes (dcp.load unpickles it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    entries: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for flat, tensor, at, length in records:
        info = StorageInfo(relative_path=data_name, offset=at, length=length)
        if tensor is None:
            entries[flat] = BytesStorageMetadata()
            storage_data[MetadataIndex(flat)] = info
            continue
        shape, dtype, box = tensor
        md = entries.setdefault(flat, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), []))
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths)))
        storage_data[MetadataIndex(flat, box.offsets, len(md.chunks) - 1)] = info
    meta = StorageMeta(checkpoint_id=out_dir, save_id=str(uuid.uuid4()))
    return Metadata(state_dict_metadata=entries, planner_data={".".join(map(str, p)): p for p, _ in leaves},
                    storage_data=storage_data, storage_meta=meta, version=_DCP_VERSION)


__all__ = ["EXPORT_CHUNK_BYTES", "export_dcp"]
