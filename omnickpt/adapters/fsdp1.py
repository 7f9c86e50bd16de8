"""FSDP1 (FullyShardedDataParallel) adapter: each rank's flat-parameter shard -> boxes of the
original parameters, with no communication (no all-gather, no unshard).

FSDP1 concatenates the original parameters of a wrapped unit into one 1-D FlatParameter (with
alignment padding between them when use_orig_params=True, and padding at the end so that it
splits evenly) and gives each rank one contiguous chunk. The part of an original parameter inside
a rank's chunk is a contiguous range of its row-major flattening, which layout.flat_range_to_boxes
turns into at most 2*ndim-1 regular boxes of the original tensor. The checkpoint then names only
original parameters ("model/fc1.weight"), exactly like a plain module's, so it loads into any
layout at any world size and back. Padding is never saved; on load it is left as it is.

Flattened optimizer state (exp_avg... of a FlatParameter, or of an original parameter's 1-D
sharded view when use_orig_params=True) is cut the same way (FlatPiece.shards).

Which part of which original parameter a rank holds is FlatParameter metadata (_fqns, _shapes,
_shard_param_infos, _shared_param_infos, _params, _local_shard) reached through the FSDP
instance's _handle: torch offers no public API for it (FlatParamHandle.shard_metadata() drops the
offsets into the local shard, and the SHARDED/LOCAL state-dict types all-gather or exchange
metadata). Nothing of FSDP is patched; we only read these attributes, and check them against
the local shard's size so that a torch version that changes them fails loudly, not silently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from torch import nn

from omnickpt.adapters.base import SEP, Adapter, LoadTarget, SaveItems, TensorShard, tensor_shards
from omnickpt.adapters.module import canonical_name, detect_framework, match_saved_names, unwrap
from omnickpt.errors import UnsupportedError
from omnickpt.layout import Box, flat_range_to_boxes

# FSDP1 names hold "_fsdp_wrapped_module" (and often the other wrapper segments): dropped, as for
# every module and optimizer (module.canonical_name). `clean_fqn` is its older name here.
clean_fqn = canonical_name


def _join(prefix: str, name: str) -> str:
    return canonical_name(f"{prefix}.{name}" if prefix else name)


@dataclass(frozen=True)
class FlatPiece:
    """The part of original parameter `fqn` (of `shape`) that a rank's flat tensor holds: its
    elements [start, start+numel) in row-major order, stored at [offset, offset+numel) of the
    1-D local tensor (a FlatParameter shard, its optimizer state, or a use_orig_params view)."""
    fqn: str
    shape: tuple[int, ...]
    offset: int
    start: int
    numel: int      # 0: this rank holds none of it

    def shards(self, name: str, flat: torch.Tensor, *, for_load: bool = False) -> list[TensorShard]:
        """The boxes of global tensor `name` that `flat` holds, each a view into `flat` (no copy),
        so saving reads and loading writes the flat tensor itself.

        A piece with nothing on this rank still yields an empty box: it tells the loader that
        this rank's state has the tensor (else the checkpoint's tensor looks unexpected here).
        A 0-d parameter cannot have an empty box; for loading it gets a scratch destination.
        """
        if self.numel == 0:
            if not self.shape:
                return [TensorShard(name, (), flat.dtype, Box((), ()), flat.new_empty(()))] if for_load else []
            zeros = (0,) * len(self.shape)
            return [TensorShard(name, self.shape, flat.dtype, Box(zeros, zeros), flat.new_empty(zeros))]
        out, pos = [], self.offset
        for box in flat_range_to_boxes(self.shape, self.start, self.numel):
            out.append(TensorShard(name, self.shape, flat.dtype, box, flat[pos:pos + box.numel].view(box.lengths)))
            pos += box.numel
        return out


@dataclass
class FlatParamShard:
    """One FlatParameter as this rank holds it."""
    flat_param: nn.Parameter
    local: torch.Tensor               # this rank's 1-D shard, padding included: what the optimizer steps
    pieces: list[FlatPiece]           # one per original parameter, in flat order (no padding)
    aliases: list[FlatPiece]          # other names of shared (tied) parameters, same data as their primary
    orig_params: list[nn.Parameter] | None   # use_orig_params=True: the original parameters, parallel to pieces
    unsharded: bool                   # the handle holds a live full copy (e.g. after a SHARD_GRAD_OP forward)
    where: str                        # the FSDP instance's module path, for messages


def flat_param_shards(root: nn.Module) -> list[FlatParamShard]:
    """Every FlatParameter under `root` (the unwrapped module whose names are the checkpoint's)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    paths = {id(m): name for name, m in root.named_modules()}
    out = []
    for fsdp in FSDP.fsdp_modules(root):
        handle = fsdp._handle   # private: the FlatParamHandle; no public accessor exists
        if handle is None:      # an FSDP instance that manages no parameters
            continue
        # _fqns are relative to the wrapped module, which is the FSDP instance's path plus
        # "_fsdp_wrapped_module" (dropped by canonical_name).
        out.append(_flat_param_shard(handle, paths[id(fsdp)]))
    return out


def _flat_param_shard(handle, prefix: str) -> FlatParamShard:
    """The FlatParamShard of one FSDP unit's handle; `prefix` is the unit's module path."""
    fp = handle.flat_param
    where = prefix or "<root>"
    if any(ext is not None for ext in getattr(fp, "_param_extensions", ())):
        raise UnsupportedError(
            f"FSDP1 unit {where!r} flattens DTensor (tensor-parallel) parameters; FSDP1 x TP is not "
            "supported: use FSDP2 (fully_shard) with tensor parallelism")
    local, unsharded = _local_shard(handle, where)
    pieces, by_fqn = _flat_pieces(fp, prefix, where, local)
    aliases = []
    for spi in fp._shared_param_infos:
        prim = by_fqn[f"{spi.prim_module_name}.{spi.prim_param_name}" if spi.prim_module_name
                      else spi.prim_param_name]
        alias = spi.module_name + "." + spi.param_name if spi.module_name else spi.param_name
        aliases.append(replace(prim, fqn=_join(prefix, alias)))
    orig = list(fp._params) if getattr(fp, "_params", None) is not None else None
    return FlatParamShard(fp, local, pieces, aliases, orig, unsharded, where)


def _local_shard(handle, where: str) -> tuple[torch.Tensor, bool]:
    """(this rank's 1-D shard of the handle's FlatParameter, whether a live full copy exists)."""
    fp = handle.flat_param
    local_shard = getattr(fp, "_local_shard", None)   # set at FSDP's lazy init (first forward)
    # Outside forward/backward a sharded handle's data *is* its local shard; inside, the shard
    # is still _local_shard, which the optimizer steps, so saving from it is right either way.
    local = (local_shard if local_shard is not None else fp).detach()
    # A full copy that FSDP will use again without gathering (kept after a SHARD_GRAD_OP
    # forward until the backward) would go stale if we loaded into the shard.
    unsharded = (local_shard is not None and fp.data_ptr() != local_shard.data_ptr()) or (
        handle.uses_sharded_strategy and hasattr(fp, "_full_param_padded") and not handle.needs_unshard())
    sharded_numel = fp._sharded_size.numel() if hasattr(fp, "_sharded_size") else local.numel()
    if local.dim() != 1 or local.numel() != sharded_numel:
        raise UnsupportedError(
            f"FSDP1 unit {where!r}: its local shard has shape {tuple(local.shape)}, expected "
            f"({sharded_numel},); this torch version's FlatParameter differs from what omnickpt reads")
    return local, unsharded


def _flat_pieces(fp, prefix: str, where: str, local: torch.Tensor) -> tuple[list[FlatPiece], dict[str, FlatPiece]]:
    """(one FlatPiece per original parameter in flat order, the same by relative fqn), each
    checked to lie inside both the local shard and its parameter."""
    pieces, by_fqn = [], {}
    for fqn, shape, info in zip(fp._fqns, fp._shapes, fp._shard_param_infos, strict=True):
        shape = tuple(int(s) for s in shape)
        if info.in_shard:
            piece = FlatPiece(_join(prefix, fqn), shape, int(info.offset_in_shard),
                              int(info.intra_param_start_idx), int(info.numel_in_shard))
            if piece.offset + piece.numel > local.numel() or piece.start + piece.numel > math.prod(shape):
                raise UnsupportedError(
                    f"FSDP1 unit {where!r}: parameter {piece.fqn!r} claims elements [{piece.start}, "
                    f"{piece.start + piece.numel}) at offset {piece.offset} of a {local.numel()}-element "
                    "shard; this torch version's FlatParameter metadata differs from what omnickpt reads")
        else:
            piece = FlatPiece(_join(prefix, fqn), shape, 0, 0, 0)
        pieces.append(piece)
        by_fqn[fqn] = piece
    return pieces, by_fqn


def _managed_ids(flats: list[FlatParamShard]) -> set[int]:
    ids = set()
    for f in flats:
        ids.add(id(f.flat_param))
        ids.update(id(p) for p in f.orig_params or ())
        ids.update(id(p) for p in getattr(f.flat_param, "_shared_params", None) or ())
    return ids


def _unflattened_state(root: nn.Module, managed: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(clean name, tensor) for what FSDP1 leaves whole: persistent buffers and parameters it does
    not manage (ignored modules/states). Walks like nn.Module.state_dict (shared modules under every
    name) without calling it: on an FSDP1 module, state_dict() would all-gather."""
    for mname, m in root.named_modules(remove_duplicate=False):
        for name, p in m.named_parameters(prefix=mname, recurse=False, remove_duplicate=False):
            if id(p) not in managed:
                yield canonical_name(name), p
        skip = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in m.named_buffers(prefix=mname, recurse=False, remove_duplicate=False):
            if name.rpartition(".")[2] not in skip:
                yield canonical_name(name), b


def _extra_state_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for mname, m in root.named_modules(remove_duplicate=False):
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            yield _join(mname, "_extra_state"), m


def save_fsdp1(key: str, root: nn.Module) -> SaveItems:
    """Save an FSDP1 module from each rank's local flat shards (no communication)."""
    flats = flat_param_shards(root)
    items = SaveItems(framework="fsdp")
    for f in flats:
        for piece in f.pieces + f.aliases:
            items.shards.extend(piece.shards(f"{key}{SEP}{piece.fqn}", f.local))
    with torch.no_grad():
        for name, t in _unflattened_state(root, _managed_ids(flats)):
            items.shards.extend(tensor_shards(f"{key}{SEP}{name}", t.detach()))
    extra = {name: m.get_extra_state() for name, m in _extra_state_modules(root)}
    if extra:
        items.objects[key] = extra
    return items


def load_fsdp1(key: str, root: nn.Module) -> LoadTarget:
    """Load into an FSDP1 module in place: destinations are views into each rank's local flat
    shard (so use_orig_params views see the new values too), padding untouched."""
    flats = flat_param_shards(root)
    for f in flats:
        if f.unsharded:
            raise UnsupportedError(
                f"{key}: FSDP1 unit {f.where!r} holds a full (unsharded) copy of its parameters that it will "
                "use without gathering again, e.g. after a SHARD_GRAD_OP forward with no backward yet; loading "
                "only its shard would leave that copy stale. Load before the forward or after the backward")
    target = LoadTarget(prefix=f"{key}{SEP}", framework="fsdp")
    for f in flats:
        for piece in f.pieces + f.aliases:
            target.shards.extend(piece.shards(f"{key}{SEP}{piece.fqn}", f.local, for_load=True))
    for name, t in _unflattened_state(root, _managed_ids(flats)):
        target.shards.extend(tensor_shards(f"{key}{SEP}{name}", t.detach()))
    extra_modules = dict(_extra_state_modules(root))
    if extra_modules:
        target.objects.append(key)

    def finish(objects: dict[str, Any]) -> None:
        # set_extra_state directly: load_state_dict on an FSDP1 module would all-gather
        for name, value in (objects.get(key) or {}).items():
            if name in extra_modules:
                extra_modules[name].set_extra_state(value)

    def prepare(manifest) -> None:
        # a checkpoint of the same model saved with wrapper segments in its names (a compiled block)
        match_saved_names(target.shards, manifest, target.prefix)

    target.prepare = prepare
    target.finish = finish
    return target


class Fsdp1Adapter(Adapter):
    """FullyShardedDataParallel modules; before the module adapter, whose state_dict() path would all-gather."""
    name = "fsdp1"
    frameworks = {"fsdp": frozenset({"fsdp"})}

    def claims(self, value: Any, state: dict) -> bool:
        return isinstance(value, nn.Module) and detect_framework(value) == "fsdp"

    def detect(self, value: Any) -> str | None:
        return "fsdp"

    def save_items(self, key: str, value: Any, state: dict) -> SaveItems:
        return save_fsdp1(key, unwrap(value))

    def load_target(self, key: str, value: Any, state: dict) -> LoadTarget:
        return load_fsdp1(key, unwrap(value))


@dataclass
class FlatOptimParam:
    """An optimizer parameter of an FSDP1 module: a FlatParameter (use_orig_params=False) or an
    original parameter's 1-D sharded view (use_orig_params=True). Its flat optimizer state
    (exp_avg...) has `numel` elements laid out like it, holding `pieces` of original parameters."""
    pieces: list[FlatPiece]
    numel: int


def optimizer_params(root: nn.Module) -> dict[int, FlatOptimParam]:
    """id(parameter as the optimizer holds it) -> its flat layout, for every FSDP1 parameter."""
    out: dict[int, FlatOptimParam] = {}
    for f in flat_param_shards(root):
        out[id(f.flat_param)] = FlatOptimParam(list(f.pieces), f.local.numel())
        for p, piece in zip(f.orig_params or (), f.pieces):
            # with use_orig_params the parameter is the view local[offset:offset+numel]
            out.setdefault(id(p), FlatOptimParam([replace(piece, offset=0)], piece.numel))
    return out
