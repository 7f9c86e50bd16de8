"""Where each parameter of a ZeRO checkpoint lies in the ranks' flat partitions: pure functions over
the decoded files (no I/O), the same rules DeepSpeed's `zero_to_fp32` and `ds_to_universal` follow.

- ZeRO-1/2: per parameter group, the parameters of `param_shapes[g]` are concatenated in that order
  (each followed by `param_alignment_paddings[g][i]` elements) into one flat buffer padded at its end,
  and rank r holds elements [r*P, (r+1)*P) of it (`single_partition_of_fp32_groups[g]`, P the
  partition size; the last rank's tensor stops where the padding starts). The Adam moments of the
  group are flat tensors of P elements beside it. Each rank's `param_slice_mappings` (where present)
  must agree with what these rules compute.
- ZeRO-3: every parameter is cut on its own into `ceil(numel / W)`-element slices, rank r holding
  slice r (the last one padded); a rank's `fp32_flat_groups` are its slices of the parameters of
  `param_shapes` (all groups, in order) concatenated, split into sub-groups.
A `Piece` is then `numel` elements of a parameter's row-major flattening, from `start`, lying at
element `offset` of one rank's flat tensor: layout.flat_range_to_boxes makes boxes of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from omnickpt.errors import CorruptCheckpointError, UnsupportedError
from omnickpt.formats.dcp.unpickle import _shape, _StoredTensor
from omnickpt.formats.deepspeed.unpickle import FragmentAddress

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    file: str                 # the archive holding `flat`
    flat: _StoredTensor       # a rank's flat tensor (or a whole tensor: offset 0, start 0, numel all)
    offset: int
    start: int
    numel: int


@dataclass
class Planned:
    """One tensor of the manifest-to-be: its global shape, dtype and the pieces that hold it."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class RankFiles:
    """One data-parallel rank's optimizer file, decoded: `osd` is its `optimizer_state_dict`."""
    path: str
    osd: dict


def whole(path: str, t: _StoredTensor) -> Planned:
    return Planned(t.shape, t.dtype, [Piece(path, t, 0, 0, math.prod(t.shape))])


def param_shapes(value: Any, where: str) -> list[dict[str, tuple[int, ...]]]:
    """`param_shapes` of a model file: one {name: shape} per parameter group, in flat order."""
    groups = value.get("param_shapes")
    if isinstance(groups, dict):      # some DeepSpeed versions save one dict
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(f"{where}: its param_shapes is not a list of {{name: shape}}; the file is damaged")
    out = []
    for g in groups:
        shapes = {}
        for name, shape in g.items():
            s = _shape(tuple(shape)) if isinstance(shape, (tuple, list)) else None
            if not isinstance(name, str) or not name or s is None:
                raise CorruptCheckpointError(f"{where}: param_shapes entry {name!r}: {shape!r} is not a shape")
            shapes[name] = s
        out.append(shapes)
    return out


def _tensor(value: Any, what: str, where: str) -> _StoredTensor:
    if not isinstance(value, _StoredTensor):
        raise CorruptCheckpointError(f"{where}: {what} is not a tensor; the file is damaged or was not written by "
                                     "DeepSpeed's save_checkpoint")
    return value


def _flat(value: Any, what: str, where: str) -> _StoredTensor:
    t = _tensor(value, what, where)
    if len(t.shape) != 1:
        raise CorruptCheckpointError(f"{where}: {what} has shape {list(t.shape)}, not a flat partition")
    return t


def _int(value: Any, what: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise CorruptCheckpointError(f"{where}: {what} is {value!r}, not a count")
    return value


def _adam_state(state: Any, index: int) -> dict[str, Any]:
    s = state.get(index) if isinstance(state, dict) else None
    return s if isinstance(s, dict) else {}


def _moments(adam: dict[str, Any], g: int, size: int, path: str) -> dict[str, _StoredTensor]:
    """A rank's Adam moments of group `g`: flat tensors of (at least) its partition's `size` elements."""
    out = {}
    for k in ADAM_KEYS:
        if k in adam:
            t = _flat(adam[k], f"state {g} {k}", path)
            if t.shape[0] < size:
                raise CorruptCheckpointError(f"{path}: {k} of group {g} has {t.shape[0]} elements, its partition "
                                             f"{size}")
            out[k] = t
    return out


def _add(out: dict[str, Planned], name: str, shape: tuple, dtype: torch.dtype, piece: Piece | None) -> None:
    planned = out.setdefault(name, Planned(shape, dtype))
    if piece is not None and piece.numel:
        planned.pieces.append(piece)


def _check_covered(out: dict[str, Planned], where: str) -> None:
    for name, p in out.items():
        held = sum(x.numel for x in p.pieces)
        if held != math.prod(p.shape):
            raise CorruptCheckpointError(f"{where}: the ranks' partitions hold {held} of the {math.prod(p.shape)} "
                                         f"elements of {name!r}; the checkpoint is incomplete or damaged")


@dataclass
class ZeroLayout:
    """What a ZeRO tag holds, by name: `params` (fp32 master weights), `state[fqn][key]` (the Adam moments
    and step), and each parameter's group index into `groups` (the inner optimizer's param_groups)."""
    params: dict[str, Planned]
    state: dict[str, dict[str, Planned]]
    group_of: dict[str, int]
    groups: list[dict]


def zero12(shapes: list[dict[str, tuple]], ranks: list[RankFiles], where: str) -> ZeroLayout:
    """ZeRO-1/2: the pieces of every parameter, its Adam moments and step, from each rank's partitions."""
    first = ranks[0].osd
    fp32_groups = [r.osd.get("single_partition_of_fp32_groups") for r in ranks]
    counts = first.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts] * len(shapes)
    if len(counts) != len(shapes) or any(not isinstance(g, list) or len(g) != len(shapes) for g in fp32_groups):
        raise CorruptCheckpointError(f"{where}: the optimizer files hold {len(fp32_groups[0] or [])} parameter "
                                     f"groups but param_shapes {len(shapes)}; the checkpoint is damaged")
    paddings = first.get("param_alignment_paddings")
    base = [r.osd.get("base_optimizer_state") or {} for r in ranks]
    params: dict[str, Planned] = {}
    state: dict[str, dict[str, Planned]] = {}
    group_of: dict[str, int] = {}
    for g, group in enumerate(shapes):
        world = _int(counts[g], f"partition_count[{g}]", where)
        if world != len(ranks):
            raise UnsupportedError(
                f"{where}: parameter group {g} is partitioned over {world} ranks but the tag holds {len(ranks)} "
                "optimizer files (expert parallelism, whose groups have their own data-parallel size); omnickpt "
                "reads DeepSpeed checkpoints whose groups all span the data-parallel ranks")
        flats = [_flat(fp32_groups[r][g], f"single_partition_of_fp32_groups[{g}]", ranks[r].path)
                 for r in range(world)]
        size = flats[0].shape[0]
        moments = [_moments(_adam_state(base[r].get("state"), g), g, size, ranks[r].path) for r in range(world)]
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            group_of[name] = g
            _add(params, name, shape, flats[0].dtype, None)
            for r, flat in enumerate(flats):
                lo, hi = max(offset, r * size), min(offset + n, r * size + flat.shape[0])
                if hi <= lo:
                    continue
                _check_mapping(ranks[r], g, name, hi - lo, lo - r * size, where)
                piece = (lo - r * size, lo - offset, hi - lo)
                _add(params, name, shape, flat.dtype, Piece(ranks[r].path, flat, *piece))
                for k, t in moments[r].items():
                    _add(state.setdefault(name, {}), k, shape, t.dtype, Piece(ranks[r].path, t, *piece))
            offset += n + (_int(pads[i], f"param_alignment_paddings[{g}][{i}]", where)
                           if isinstance(pads, list) and i < len(pads) else 0)
        if offset > size * len(flats):
            raise CorruptCheckpointError(f"{where}: parameter group {g} needs {offset} elements but its "
                                         f"{len(flats)} partitions hold {size} each; the checkpoint is damaged")
        step = _adam_state(base[0].get("state"), g).get("step")
        if isinstance(step, _StoredTensor):
            for name in group:
                state.setdefault(name, {})["step"] = whole(ranks[0].path, step)
    _check_covered(params, where)
    for s in state.values():
        _check_covered(s, where)
    groups = base[0].get("param_groups") if isinstance(base[0].get("param_groups"), list) else []
    return ZeroLayout(params, state, group_of, groups)


def _check_mapping(rank: RankFiles, g: int, name: str, numel: int, start: int, where: str) -> None:
    """A rank's own record of where a parameter lies in its partition must agree with the rules."""
    mappings = rank.osd.get("param_slice_mappings")
    if not isinstance(mappings, list) or g >= len(mappings) or not isinstance(mappings[g], dict):
        return
    got = mappings[g].get(name)
    if isinstance(got, FragmentAddress) and (got.get("numel"), got.get("start")) != (numel, start):
        raise CorruptCheckpointError(
            f"{rank.path}: param_slice_mappings puts {name!r} at elements [{got.get('start')}, "
            f"{got.get('start', 0) + got.get('numel', 0)}) of the partition, but param_shapes and the paddings put "
            f"it at [{start}, {start + numel}); the checkpoint is damaged or from a DeepSpeed layout omnickpt does "
            "not know: convert it with DeepSpeed's ds_to_universal and load that folder")


class _Virtual:
    """A rank's sub-group flats as one concatenation: a range of it in pieces of the real tensors."""

    def __init__(self, path: str, flats: list[_StoredTensor]):
        self.path, self.flats = path, flats
        self.starts = [0]
        for f in flats:
            self.starts.append(self.starts[-1] + f.shape[0])

    def pieces(self, lo: int, n: int, start: int, flats: list[_StoredTensor] | None = None) -> list[Piece]:
        out, i = [], 0
        flats = flats or self.flats
        while n > 0:
            while self.starts[i + 1] <= lo:
                i += 1
            take = min(n, self.starts[i + 1] - lo)
            out.append(Piece(self.path, flats[i], lo - self.starts[i], start, take))
            lo, n, start = lo + take, n - take, start + take
        return out

    def group(self, lo: int) -> int:
        return max(i for i in range(len(self.flats)) if self.starts[i] <= lo)


def zero3(shapes: list[dict[str, tuple]], ranks: list[RankFiles], where: str) -> ZeroLayout:
    """ZeRO-3: every parameter's slices, and its Adam moments', from each rank's sub-group flats."""
    world = len(ranks)
    count = ranks[0].osd.get("partition_count")
    if count != world:
        raise CorruptCheckpointError(f"{where}: partition_count is {count!r} but the tag holds {world} optimizer "
                                     "files; the checkpoint is incomplete (a rank's file is missing) or damaged")
    merged = {name: shape for group in shapes for name, shape in group.items()}
    virtual, inner = [], []
    for r in ranks:
        flats = r.osd.get("fp32_flat_groups")
        if not isinstance(flats, list) or not flats:
            raise CorruptCheckpointError(f"{r.path}: no fp32_flat_groups; not a ZeRO-3 optimizer file")
        virtual.append(_Virtual(r.path, [_flat(f, "fp32_flat_groups", r.path) for f in flats]))
        inner.append(r.osd.get("optimizer_state_dict") or {})
    total = sum(math.ceil(math.prod(s) / world) for s in merged.values())
    for v in virtual:
        if v.starts[-1] != total:
            raise CorruptCheckpointError(f"{v.path}: its fp32_flat_groups hold {v.starts[-1]} elements but the "
                                         f"parameters' slices take {total}; the checkpoint is damaged")
    moments: list[dict[str, list[_StoredTensor]]] = []
    for r, v in enumerate(virtual):
        per: dict[str, list[_StoredTensor]] = {}
        for k in ADAM_KEYS:
            ts = [_adam_state(inner[r].get("state"), i).get(k) for i in range(len(v.flats))]
            if all(isinstance(t, _StoredTensor) for t in ts):
                per[k] = [_flat(t, f"state {i} {k}", ranks[r].path) for i, t in enumerate(ts)]
                if [t.shape[0] for t in per[k]] != [f.shape[0] for f in v.flats]:
                    raise CorruptCheckpointError(f"{ranks[r].path}: {k} does not match the fp32 sub-groups' sizes")
        moments.append(per)
    groups = inner[0].get("param_groups") if isinstance(inner[0].get("param_groups"), list) else []
    sub_to_group = {s: gi for gi, g in enumerate(groups) if isinstance(g, dict)
                    for s in (g.get("params") or []) if type(s) is int}
    params: dict[str, Planned] = {}
    state: dict[str, dict[str, Planned]] = {}
    group_of: dict[str, int] = {}
    offset = 0
    for name, shape in merged.items():
        n = math.prod(shape)
        part = math.ceil(n / world)
        _add(params, name, shape, virtual[0].flats[0].dtype, None)
        sub = virtual[0].group(offset) if part else 0
        group_of[name] = sub_to_group.get(sub, 0)
        for r, v in enumerate(virtual):
            held = max(0, min(part, n - r * part))
            for piece in v.pieces(offset, held, r * part):
                _add(params, name, shape, piece.flat.dtype, piece)
            for k, ts in moments[r].items():
                for piece in v.pieces(offset, held, r * part, ts):
                    _add(state.setdefault(name, {}), k, shape, piece.flat.dtype, piece)
        step = _adam_state(inner[0].get("state"), sub).get("step")
        if isinstance(step, _StoredTensor):
            state.setdefault(name, {})["step"] = whole(ranks[0].path, step)
        offset += part
    _check_covered(params, where)
    for s in state.values():
        _check_covered(s, where)
    return ZeroLayout(params, state, group_of, groups)


def frozen(model_files: list[tuple[str, dict]], stage: int, world: int, where: str) -> dict[str, Planned]:
    """Parameters that do not train (requires_grad=False): whole in the model file (ZeRO-1/2), or each
    rank's ZeRO-3 slice in its own model file."""
    out: dict[str, Planned] = {}
    path0, first = model_files[0]
    shapes = first.get("frozen_param_shapes") or {}
    if not isinstance(shapes, dict):
        return out
    for name, shape in shapes.items():
        shape = _shape(tuple(shape)) if isinstance(shape, (tuple, list)) else None
        if not isinstance(name, str) or shape is None:
            raise CorruptCheckpointError(f"{path0}: frozen_param_shapes entry {name!r} is not a shape")
        if stage < 3:
            frag = (first.get("frozen_param_fragments") or {}).get(name)
            t = _tensor(frag, f"frozen parameter {name!r}", path0)
            if t.shape != shape:
                raise CorruptCheckpointError(f"{path0}: frozen parameter {name!r} has shape {list(t.shape)}, "
                                             f"frozen_param_shapes says {list(shape)}")
            out[name] = whole(path0, t)
            continue
        n = math.prod(shape)
        part = math.ceil(n / world)
        for r, (path, value) in enumerate(model_files):
            frag = _flat((value.get("frozen_param_fragments") or {}).get(name), f"frozen parameter {name!r}", path)
            held = max(0, min(part, n - r * part))
            if frag.shape[0] < held:
                raise CorruptCheckpointError(f"{path}: frozen parameter {name!r}: {frag.shape[0]} elements, {held} "
                                             "expected")
            _add(out, name, shape, frag.dtype, Piece(path, frag, 0, r * part, held))
    _check_covered(out, where)
    return out


def param_group_objects(layout: ZeroLayout, names: Callable[[str], str]) -> list[dict]:
    """The inner optimizer's param_groups with `params` naming each group's parameters (by `names`)."""
    out = []
    for gi, g in enumerate(layout.groups):
        if not isinstance(g, dict):
            continue
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = [names(n) for n, i in layout.group_of.items() if i == gi]
        out.append(group)
    return out


__all__ = ["ADAM_KEYS", "Piece", "Planned", "RankFiles", "ZeroLayout", "frozen", "param_group_objects",
           "param_shapes", "whole", "zero12", "zero3"]
