"""Everything that is not a module or an optimizer: Stateful objects (anything with
state_dict()/load_state_dict(): LR schedulers, dataloaders, RNGState), DTensors, plain values.
Last in the adapter registry: it claims every value.

DTensors inside them are stored as boxes and reshard; everything else is an object saved per
rank (identical values are stored once) and loaded back by the same rank, or by rank 0's value
when the loading world is larger.

Large plain tensors inside them (at least `min_tensor_bytes`, 1 MiB by default) are not encoded
into the object, which would copy and serialise them on the stall path (a 403 MB tensor stalled a
save for 2 s): each is a tensor of its own, saved whole by its rank under a per-rank name,
"<key path>/@rank<r>" (`per_rank_name`; e.g. "extra/buf/@rank1", under the path so that
include=/exclude= patterns and prefixes covering the path cover it), and the object holds a
ShardRef to it. Nothing says such a tensor is the same on every rank, so every rank's is saved (unlike the
object path, identical values are not stored once). The rank is the process's rank in the default
process group, which names a process uniquely also when a save runs on a subgroup (the memory
tier's node groups). Loading follows the objects: a rank reads the tensors of the value it loads
(its own rank's, else the lowest saving rank's), in place into the target's tensor at that place
when it has one, else into a new CPU tensor that is written back; the other ranks' tensors are
claimed with empty boxes so that a strict load does not report them as unexpected.

A plain value is loaded into the target's own containers: dicts are updated in place, and where
the target holds a tensor at a place the saved value has too (the value itself, a dict key, a
position of a list or tuple of the same length), the saved tensor is copied into it, so that every
reference to it sees the loaded values; everything else is written back. A saved tensor of another
shape or dtype, or a saved non-tensor, at such a place never replaces the target's tensor: `check`
(for inline tensors) or the matching of tensors (for per-rank ones) reports it as a difference and
the target keeps its tensor.
"""
from __future__ import annotations

from typing import Any

import torch

from omnickpt.adapters.base import (SEP, Adapter, LoadTarget, SaveItems, collect_tensors, dtensor_shards,
                                    empty_claim, full_shard, is_dtensor, restore_refs, split_tensors)
from omnickpt.errors import CorruptCheckpointError, MismatchError
from omnickpt.format.manifest import dtype_from_name
from omnickpt.format.objects import ShardRef, tensor_problem

MIN_TENSOR_BYTES = 1 << 20
RANK_MARK = f"{SEP}@rank"


class GenericAdapter(Adapter):
    """Stateful objects, DTensors and plain values; claims everything, so it comes last.

    `min_tensor_bytes`: plain tensors inside a value at least this large are saved as per-rank
    tensors, smaller ones inline in the value's object (0: every tensor; a huge number: none).
    `replicated=True` (DCP's rule, what omnickpt.dcp saves with): every plain tensor is taken to be
    the same on every rank and saved once, as a tensor named by its key path ("model/fc.weight"),
    like a replica; `min_tensor_bytes` does not apply then.
    Loading needs no setting: it follows what the checkpoint holds."""
    name = "generic"

    def __init__(self, min_tensor_bytes: int = MIN_TENSOR_BYTES, *, replicated: bool = False):
        if isinstance(min_tensor_bytes, bool) or not isinstance(min_tensor_bytes, int) or min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes must be a non-negative integer number of bytes, got "
                             f"{min_tensor_bytes!r}")
        self.min_tensor_bytes = min_tensor_bytes
        self.replicated = bool(replicated)

    def claims(self, value: Any, state: dict) -> bool:
        return True

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_value(key, value, self.min_tensor_bytes, replicated=self.replicated)

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_value(key, value, state)

    def __repr__(self) -> str:
        extra = ", replicated=True" if self.replicated else ""
        return f"GenericAdapter(min_tensor_bytes={self.min_tensor_bytes}{extra})"


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def process_rank() -> int:
    """This process's rank in the default process group, 0 without one: the rank of per-rank names.
    Adapters see no checkpoint process group; the default group's rank is unique in the job."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def per_rank_name(path: str, rank: int) -> str:
    """The tensor name of rank `rank`'s large plain tensor at key path `path`."""
    return f"{path}{RANK_MARK}{rank}"


def parse_per_rank_name(name: str) -> tuple[str, int] | None:
    """(key path, rank) of a per-rank tensor name, None for any other name."""
    path, mark, rank = name.rpartition(RANK_MARK)
    if not mark or not path or not rank.isascii() or not rank.isdigit() or rank != str(int(rank)):
        return None
    return path, int(rank)


def save_value(key: str, value: Any, min_tensor_bytes: int = MIN_TENSOR_BYTES, *, replicated: bool = False
               ) -> SaveItems:
    items = SaveItems()
    if is_dtensor(value):
        # A DTensor or ShardSpec entry is its own box: no object (10^5 ShardSpec entries are common).
        items.shards.extend(dtensor_shards(key, value))
        return items
    if replicated and isinstance(value, torch.Tensor) and tensor_problem(value) is None:
        # A plain tensor at the top level (dcp.save({"w": t})): a box of its own, like a DTensor entry.
        items.shards.append(full_shard(key, value.detach()))
        return items
    raw = value.state_dict() if is_stateful(value) else value

    def large(path: str, t: torch.Tensor) -> str | None:
        # A tensor the format cannot store stays in the value, whose encoding refuses it by path.
        if tensor_problem(t) is not None:
            return None
        if replicated:
            return path     # one tensor for all ranks, named by its place: the planner saves it once
        if t.nbytes < min_tensor_bytes:
            return None
        return per_rank_name(path, process_rank())   # asked only here: it costs microseconds per entry

    items.objects[key] = split_tensors(raw, key, items.shards, large)
    return items


def load_value(key: str, value: Any, state: dict) -> LoadTarget:
    stateful = is_stateful(value)
    current = value.state_dict() if stateful else value
    dtensors: dict[str, Any] = {}
    plain: dict[str, torch.Tensor] = {}
    collect_tensors(current, key, dtensors, plain)
    target = LoadTarget(prefix=f"{key}{SEP}")
    for name, dt in dtensors.items():
        target.shards.extend(dtensor_shards(name, dt))
    if is_dtensor(value):
        return target     # filled in place; nothing else to install
    target.objects.append(key)
    checked: list[list[str]] = []   # what check() found, once it ran
    read: dict[str, torch.Tensor] = {}   # per-rank tensor name -> the tensor it is read into (set by prepare)

    def prepare(manifest) -> list[str] | None:
        if key in manifest.objects:
            _per_rank_destinations(key, manifest, plain, target, read)
            _placed_destinations(key, manifest, plain, dtensors, target, read, allocate=True)
            return None
        # A plain value is stored as one object. With none, a dict of tensors loads the tensors
        # named by their places (`model/fc.weight`: a Hugging Face folder, a module's or an
        # optimizer's tensors read into a flat dict, DCP's state dicts).
        if _placed_destinations(key, manifest, plain, dtensors, target, read, allocate=False) or dtensors:
            target.objects.remove(key)
            return None
        # When there are tensors under `key/` that no place of the target names, the entry was
        # saved from a module or an optimizer: say so, instead of listing its tensors as
        # unexpected and the value as missing.
        prefix = f"{key}{SEP}"
        saved = [name for name in manifest.tensors if name.startswith(prefix)]
        if not saved:
            return None
        target.objects.remove(key)
        framework = (manifest.layout.get("frameworks") or {}).get(key)
        if framework is None:
            saved_as = "a module or an optimizer"
        elif "." in framework:
            saved_as = f"an optimizer ({framework})"
        else:
            saved_as = f"a module ({framework})"
        return [f"{key}: state entry {key!r} was saved as {saved_as}, {len(saved)} tensor(s) such as {saved[0]!r}, "
                f"but the target is {_describe(value)}; load into the module or optimizer itself "
                f"({{{key!r}: model}}), or save a plain value (e.g. {{{key!r}: model.state_dict()}}) to load into it"]

    def check(objects: dict) -> list[str]:
        diffs: list[str] = []
        if key in objects:
            if not stateful:     # a Stateful's load_state_dict() judges its own state
                _tensor_differences(value, objects[key], key, diffs)
            _unread_refs(objects[key], read.keys() | dtensors.keys(), key, diffs)
        checked.append(diffs)
        return diffs

    def resolve(name: str) -> Any:
        # A ShardRef with no tensor here stays a ShardRef: _fill leaves that place as it is.
        if name in dtensors:
            return dtensors[name]
        return read[name] if name in read else ShardRef(name)

    def finish(objects):
        if key not in objects:
            return
        if not checked:
            # The caller did not run check(): never let a saved tensor of another shape or dtype
            # replace the target's silently.
            diffs = check(objects)
            if diffs:
                raise MismatchError(f"state entry {key!r} does not match the checkpoint:\n  " + "\n  ".join(diffs),
                                    diffs)
        loaded = restore_refs(objects[key], resolve)
        if stateful:
            value.load_state_dict(loaded)
        else:
            state[key] = _fill(value, loaded)

    target.prepare = prepare
    target.check = check
    target.finish = finish
    return target


def _per_rank_destinations(key: str, manifest, plain: dict[str, torch.Tensor], target: LoadTarget,
                           read: dict[str, torch.Tensor]) -> None:
    """Destinations of the per-rank tensors of entry `key`: the ones of the value this rank loads
    (its own, else the lowest saving rank's, as Manifest.object_for_rank picks the object) are read
    into the target's tensor at their place, or into a new tensor; the other ranks' are claimed."""
    by_path: dict[str, dict[int, str]] = {}
    for name in manifest.tensors:
        if not name.startswith(target.prefix):
            continue
        parsed = parse_per_rank_name(name)
        if parsed is not None and (parsed[0] == key or parsed[0].startswith(f"{key}{SEP}")):
            by_path.setdefault(parsed[0], {})[parsed[1]] = name
    if not by_path:
        return
    saved = {r for e in manifest.objects[key] for r in e.ranks}
    me = process_rank()
    source = me if me in saved or not saved else min(saved)
    for path, names in by_path.items():
        for rank, name in sorted(names.items()):
            entry = manifest.tensors[name]
            if rank != source:
                target.shards.append(empty_claim(name, entry))
                continue
            dest = plain.get(path)
            if dest is None:
                dest = _allocate(name, entry)
            # Another shape or dtype in the target is a difference the matching reports (or casts).
            target.shards.append(full_shard(name, dest.detach()))
            read[name] = dest


def _placed_destinations(key: str, manifest, plain: dict[str, torch.Tensor], dtensors: dict[str, Any],
                         target: LoadTarget, read: dict[str, torch.Tensor], allocate: bool) -> bool:
    """Destinations of the checkpoint's tensors named by their place in entry `key` (not per-rank,
    not a DTensor of the target): each read whole into the target's plain tensor at that place, or,
    with `allocate` (the saved value refers to it), into a new tensor installed in its place.
    Returns whether any was found."""
    found = False
    if allocate:     # every tensor under the entry's key: the saved value may refer to any of them
        prefix = f"{key}{SEP}"
        names = [n for n in manifest.tensors if n == key or n.startswith(prefix)]
    else:            # the target's places only: one lookup each, not a scan per entry (10^4 entries)
        names = [n for n in plain if n in manifest.tensors]
    for name in names:
        if name in dtensors or name in read or parse_per_rank_name(name) is not None:
            continue
        entry = manifest.tensors[name]
        dest = plain.get(name)
        if dest is None:
            if not allocate:
                continue
            dest = _allocate(name, entry)
        # Another shape or dtype in the target is a difference the matching reports (or casts).
        target.shards.append(full_shard(name, dest.detach()))
        read[name] = dest
        found = True
    return found


def _allocate(name: str, entry) -> torch.Tensor:
    dtype = dtype_from_name(entry.dtype)
    try:
        return torch.empty(entry.shape, dtype=dtype)
    except RuntimeError as e:   # the allocator refused: no real checkpoint stores more than memory holds
        raise CorruptCheckpointError(f"tensor {name!r} declares shape {list(entry.shape)}, which cannot be "
                                     f"allocated ({e}); the manifest is damaged") from None


def _unread_refs(saved: Any, read: set[str], path: str, out: list[str]) -> None:
    """A per-rank ShardRef in the value this rank loads whose tensor it did not plan to read: the
    value came from another rank than the tensors (a checkpoint saved on a process subgroup and
    loaded on another), or the checkpoint lacks the tensor. Bounded by the decoded value's depth."""
    if isinstance(saved, ShardRef):
        if parse_per_rank_name(saved.name) is not None and saved.name not in read:
            out.append(f"{path}: the saved value refers to tensor {saved.name!r}, which this rank does not load (the "
                       "checkpoint lacks it, or it was saved on another process group); load with the process group "
                       "it was saved with")
    elif isinstance(saved, dict):
        for k, v in saved.items():
            _unread_refs(v, read, f"{path}{SEP}{k}", out)
    elif isinstance(saved, (list, tuple)):
        for i, v in enumerate(saved):
            _unread_refs(v, read, f"{path}{SEP}{i}", out)


def _is_plain_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not is_dtensor(value)


def _tensor_differences(target: Any, saved: Any, path: str, out: list[str]) -> None:
    """Every place where `target` holds a plain tensor that `saved` (a decoded value) would not fill
    exactly (another shape or dtype, or no tensor at all). Containers are followed where both sides
    have the same kind; elsewhere the saved value is written back whole. Bounded by the decoded
    value's depth (MAX_DEPTH)."""
    if _is_plain_tensor(target):
        if isinstance(saved, ShardRef):
            return
        if not isinstance(saved, torch.Tensor):
            out.append(f"{path}: {_describe(saved)} in the checkpoint, {_describe(target)} in the target")
        elif tuple(saved.shape) != tuple(target.shape) or saved.dtype != target.dtype:
            out.append(f"{path}: {_describe(saved)} in the checkpoint, {_describe(target)} in the target")
        return
    if isinstance(target, dict) and isinstance(saved, dict):
        for k, v in saved.items():
            if k in target:
                _tensor_differences(target[k], v, f"{path}{SEP}{k}", out)
    elif _same_sequence(target, saved):
        for i, (t, v) in enumerate(zip(target, saved)):
            _tensor_differences(t, v, f"{path}{SEP}{i}", out)


def _same_sequence(target: Any, saved: Any) -> bool:
    """Both lists, or both tuples, of one length: loaded element by element."""
    return (isinstance(target, list) and isinstance(saved, list) or type(target) is tuple and type(saved) is tuple) \
        and len(target) == len(saved)


def _fill(target: Any, loaded: Any) -> Any:
    """`loaded` installed into `target`: the value to write back in its place. Tensors of the
    target are filled in place; dicts and lists are updated in place; tuples are rebuilt around the
    filled tensors; anything else is the loaded value. A tensor the loaded value would not fill
    exactly (a difference `check` reported) keeps its contents."""
    if loaded is target or isinstance(loaded, ShardRef):
        return target
    if _is_plain_tensor(target):
        if isinstance(loaded, torch.Tensor) and loaded.shape == target.shape and loaded.dtype == target.dtype:
            with torch.no_grad():
                target.copy_(loaded)
        return target
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if k in target:
                target[k] = _fill(target[k], v)
            elif not isinstance(v, ShardRef):
                target[k] = v
        return target
    if _same_sequence(target, loaded):
        filled = [_fill(t, v) for t, v in zip(target, loaded)]
        if isinstance(target, list):
            target[:] = filled
            return target
        return tuple(filled)
    return loaded


def _describe(value: Any) -> str:
    """A short description of a value for a difference line."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        if not value:
            return "an empty dict"
        tensors = sum(isinstance(v, torch.Tensor) for v in value.values())
        return f"a dict of {len(value)} entries" + (f" ({tensors} tensor(s))" if tensors else "")
    if value is None:
        return "None"
    if is_stateful(value):
        return f"a {type(value).__name__} (state_dict()/load_state_dict())"
    return f"a {type(value).__name__}"
