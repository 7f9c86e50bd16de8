"""What every adapter produces: tensor shards (boxes of global tensors) and plain objects."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from omnickpt.errors import UnsupportedError
from omnickpt.format.manifest import dtype_from_name
from omnickpt.format.objects import MAX_DEPTH, ShardRef
from omnickpt.layout import Box
from omnickpt.spec import ShardSpec

SEP = "/"


@dataclass
class TensorShard:
    """This rank's `local` data is box `box` of the global tensor `name` (shape, dtype)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    local: torch.Tensor

    def __post_init__(self):
        # Checked here, whatever adapter built the record (as Megatron's ShardedTensor does): a
        # wrong box would save or load the wrong elements without any other sign.
        box, shape = self.box, self.shape
        if len(box.offsets) != len(shape) or not box.within(shape):
            raise UnsupportedError(f"tensor {self.name!r}: box offsets={list(box.offsets)} "
                                   f"lengths={list(box.lengths)} does not lie in its shape {list(shape)}")
        if self.local.shape != box.lengths:
            raise UnsupportedError(f"tensor {self.name!r}: local data of shape {tuple(self.local.shape)} does not "
                                   f"match its box lengths {list(self.box.lengths)}")

    @classmethod
    def fitted(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype, box: Box, local: torch.Tensor
               ) -> "TensorShard":
        """A shard whose box is known to lie in `shape` (made from it by a function that checked
        it once per layout: a DTensor's box, a whole tensor's): only the local data's shape is
        checked. A load or a first save makes one per tensor, and the dataclass's own __init__
        with the box check costs three times as much (24,000 tensors: 35 ms)."""
        if local.shape != box.lengths:
            return cls(name, shape, dtype, box, local)   # raises, naming the tensor
        s = _new(cls)
        s.name, s.shape, s.dtype, s.box, s.local = name, shape, dtype, box, local
        return s


_new = object.__new__


@dataclass
class SaveItems:
    """What one state entry saves. `framework` is recorded in the manifest's layout as what the entry
    was saved from: a module's parallel framework (plain, ddp, fsdp, fsdp2, dtensor, megatron) or an
    optimizer's class ('torch.optim.adam.Adam'), which loading checks against its target."""
    shards: list[TensorShard] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)   # object key -> value to encode
    framework: str | None = None
    # How the entry was laid out, for people (`inspect`), never for loading: the device mesh and a
    # count of the DTensor placements, e.g. {"mesh": {"shape": [2, 2], "dims": ["dp", "tp"]},
    # "placements": {"(Shard(dim=0), Shard(dim=1))": 12}}.
    layout: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadTarget:
    """Where loaded data goes for one top-level state entry.

    `shards` are destinations filled in place; `objects` names the object keys wanted;
    `finish(objects)` installs everything (load_state_dict, writing plain values back), given the
    decoded objects, after all shards are filled. `prefix` is the tensor-name prefix this entry
    owns, so that checkpoint tensors under it that no shard wants can be reported.

    Differences between checkpoint and target that the shards alone cannot show are found by two
    optional hooks, both run before any tensor is read and before any `finish`. Each returns the
    differences it found, one line each naming the tensor or state key and what to do; the caller
    raises MismatchError with them under strict loading and returns them otherwise. Whatever a
    difference concerns has been taken out of the target: nothing of it will be filled or installed.
    - `prepare(manifest)`: from the manifest alone (a state entry saved as another kind of thing,
      an optimizer of another kind); may also build destinations (optimizer state that does not
      exist yet) and change `shards` and `objects`.
    - `check(objects)`: from the decoded objects (tensors inside plain values of another shape).
    """
    prefix: str
    shards: list[TensorShard] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    # Object keys wanted with every saving rank's value ({saved rank: value} in `finish`), for
    # state that is redistributed when the number of ranks changes.
    objects_from_all_ranks: list[str] = field(default_factory=list)
    finish: Callable[[dict[str, Any]], None] = lambda objects: None
    framework: str | None = None
    prepare: Callable[[Any], list[str] | None] | None = None
    check: Callable[[dict[str, Any]], list[str]] | None = None


class Adapter:
    """One kind of state entry (a module of some framework, an optimizer, a dataloader, any other
    value) turned into tensor shards and objects, both ways. The save and the load side of a kind
    live side by side in one class, one file per framework (STYLE.md), and `adapters.ADAPTERS`
    lists them in the order they are asked: the first whose `claims` is true handles the entry.

    Every method is given the whole `state` dict besides the entry, because some kinds depend on
    their neighbours (an optimizer names its state by the parameter names of the modules beside
    it; a torch optimizer over a Megatron model is saved the Megatron way). Adapters are pure
    translators: no I/O, no collectives.

    `frameworks` maps each `framework=` value of save()/load() this adapter answers to onto the
    frameworks it accepts as `detect()`ed from an entry ({"dtensor": {"dtensor", "fsdp2"}}: an
    FSDP2 module passes framework="dtensor"). Subclasses need only set what differs.
    """
    name: str = "adapter"
    frameworks: Mapping[str, frozenset[str]] = {}

    def claims(self, value: Any, state: dict) -> bool:
        """Whether this adapter handles `value` (an entry of `state`). Cheap and side-effect free:
        it is asked for every entry of every save and load."""
        raise NotImplementedError

    def detect(self, value: Any) -> str | None:
        """The parallel framework of a claimed value, checked against `framework=`; None: not
        checked (optimizers, plain values)."""
        return None

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        """What entry `key` saves: shards (no copies: views of the live tensors) and objects."""
        raise NotImplementedError

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        """Where entry `key` loads to: destinations filled in place and the hooks that install the rest."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def is_dtensor(t: Any) -> bool:
    """A value that carries its own global layout: a DTensor or an explicit ShardSpec."""
    if isinstance(t, ShardSpec):
        return True
    # Importing torch.distributed.tensor costs about a second; if nothing imported it, no DTensor exists.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


# What _dtensor_box returns for a layout with a Partial placement (not one box of a global tensor).
_PARTIAL = "partial"


@functools.lru_cache(maxsize=1 << 16)
def _dtensor_box(shape: tuple, mesh, placements: tuple, coordinate: tuple | None) -> Box | str | None:
    """This rank's box of a DTensor of `shape` laid out by (mesh, placements), whose coordinate in
    the mesh is `coordinate`; _PARTIAL for a Partial placement. The box is checked to lie in
    `shape` (else the caller's TensorShard reports it, naming the tensor): what TensorShard.fitted
    takes as known.

    A pure function of its arguments, so it is memoised: computing it costs ~0.3 ms per tensor,
    which made every save of a model with hundreds of sharded tensors stall for tens of
    milliseconds, and even the Partial test costs a microsecond per tensor that 10^4 tensors feel.
    It is what DTensor's own __create_chunk_list__ (DCP's protocol) computes; None when that
    helper is not importable.
    """
    from torch.distributed.tensor import Partial
    if any(isinstance(p, Partial) for p in placements):
        return _PARTIAL
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    box = Box(tuple(int(x) for x in offsets), tuple(int(x) for x in lengths))
    return box if len(box.offsets) == len(shape) and box.within(shape) else None


def dtensor_shards(name: str, t) -> list[TensorShard]:
    """The box this rank holds of a DTensor (or ShardSpec)."""
    if isinstance(t, ShardSpec):
        box = Box(t.offsets, tuple(t.local.shape))
        local = t.local
        return [TensorShard(t.name or name, t.global_shape, local.dtype, box,
                            local.detach() if local.requires_grad else local)]
    shape = tuple(t.shape)
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()   # a list, or None off the mesh
    box = _dtensor_box(shape, mesh, tuple(t.placements), None if coordinate is None else tuple(coordinate))
    if box is _PARTIAL:
        raise UnsupportedError(f"tensor {name!r} is a DTensor with a Partial placement; reduce it before saving")
    # The local shard itself, without to_local() (an autograd function: a dispatch per tensor on
    # the stall path) or detach() of the DTensor (another): a save reads it and a load writes it in
    # place, neither wants a graph. A local tensor that requires grad itself is detached (cheap).
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = t.to_local().detach()
    elif local.requires_grad:
        local = local.detach()
    if box is None:
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1:
            raise UnsupportedError(f"tensor {name!r}: DTensor local shard is not one regular box ({len(chunks)} chunks)")
        box = Box(tuple(int(x) for x in chunks[0].offsets), tuple(int(x) for x in chunks[0].sizes))
        return [TensorShard(name, shape, t.dtype, box, local)]   # every field checked
    # An empty box (uneven shards leave some ranks nothing) is kept: it tells the loader the
    # tensor is wanted here, and it plans no reads or writes. The local shape is checked.
    return [TensorShard.fitted(name, shape, t.dtype, box, local)]


def empty_claim(name: str, entry) -> TensorShard:
    """An empty box of checkpoint tensor `name` (its manifest `entry`): tells the loader the tensor is
    accounted for on this rank although this rank reads none of it (another pipeline stage's, another
    rank's per-rank value), so that a strict load does not call it unexpected."""
    dtype = dtype_from_name(entry.dtype)
    zeros = (0,) * len(entry.shape)
    return TensorShard(name, tuple(entry.shape), dtype, Box(zeros, zeros), torch.empty(zeros, dtype=dtype))


def full_shard(name: str, t: torch.Tensor) -> TensorShard:
    """A plain tensor that this rank holds entirely (a replica when other ranks hold it too)."""
    shape = tuple(t.shape)
    return TensorShard.fitted(name, shape, t.dtype, _full_box(shape), t)


@functools.lru_cache(maxsize=1 << 12)
def _full_box(shape: tuple[int, ...]) -> Box:
    # one Box per shape (10^4 tensors of an MoE model share a few); a pure function of it
    return Box.full(shape)


def tensor_shards(name: str, t: torch.Tensor) -> list[TensorShard]:
    return dtensor_shards(name, t) if is_dtensor(t) else [full_shard(name, t)]


def split_tensors(value: Any, prefix: str, shards: list[TensorShard], plain: Callable[[str, torch.Tensor], str | None]
                  | None = None, depth: int = 0) -> Any:
    """Replace each DTensor inside nested dicts/lists by a ShardRef, collecting its shards; also each
    plain tensor for which `plain(path, tensor)` gives a name (saved whole under that name).

    Other plain tensors stay in the value (saved per rank with the object). A value nested deeper
    than the object encoding allows is refused here, before this walk could exhaust the stack.
    """
    if is_dtensor(value):
        shards.extend(dtensor_shards(prefix, value))
        return ShardRef(getattr(value, "name", None) or prefix)
    if plain is not None and isinstance(value, torch.Tensor):
        name = plain(prefix, value)
        if name is None:
            return value
        shards.append(full_shard(name, value.detach()))
        return ShardRef(name)
    if isinstance(value, (dict, list, tuple)):
        _check_depth(prefix, depth)
    if isinstance(value, dict):
        return {k: split_tensors(v, f"{prefix}{SEP}{k}", shards, plain, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [split_tensors(v, f"{prefix}{SEP}{i}", shards, plain, depth + 1) for i, v in enumerate(value)]
        return type(value)(out) if isinstance(value, tuple) and type(value) is tuple else out
    return value


def _check_depth(name: str, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise UnsupportedError(
            f"{name[:200]!r}: the value is nested more than {MAX_DEPTH} levels deep (dicts, lists, tuples inside "
            "each other); omnickpt refuses deeper values: flatten it, or save it under several keys")


def restore_refs(value: Any, resolve: Callable[[str], Any]) -> Any:
    """Inverse of split_tensors: ShardRefs become the target's (now filled) tensors."""
    if isinstance(value, ShardRef):
        return resolve(value.name)
    if isinstance(value, dict):
        return {k: restore_refs(v, resolve) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_refs(v, resolve) for v in value]
    if isinstance(value, tuple):
        return tuple(restore_refs(v, resolve) for v in value)
    return value


def collect_tensors(value: Any, prefix: str, dtensors: dict[str, Any], plain: dict[str, torch.Tensor] | None = None,
                    depth: int = 0) -> None:
    """name -> DTensor for every DTensor nested in `value`, and path -> tensor for every plain
    tensor into `plain` when given (the load-side mirror of split_tensors)."""
    if is_dtensor(value):
        dtensors[getattr(value, "name", None) or prefix] = value
    elif isinstance(value, torch.Tensor):
        if plain is not None:
            plain[prefix] = value
    elif isinstance(value, dict):
        _check_depth(prefix, depth)
        for k, v in value.items():
            collect_tensors(v, f"{prefix}{SEP}{k}", dtensors, plain, depth + 1)
    elif isinstance(value, (list, tuple)):
        _check_depth(prefix, depth)
        for i, v in enumerate(value):
            collect_tensors(v, f"{prefix}{SEP}{i}", dtensors, plain, depth + 1)
