"""Matching a target state against a manifest: which saved tensor fills which destination, and
what differs. A pure function of its inputs (no I/O, no collectives), so every case of it is a
unit test; `Checkpointer.load` calls it on every rank between preparing the targets and planning
the reads."""
from __future__ import annotations

import bisect

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omnickpt.format.manifest import Manifest, dtype_from_name, dtype_name
from omnickpt.layout import Box


class Selection:
    """load(include=, exclude=): glob patterns over state keys and tensor names. A pattern matches
    a name equal to it, under it ("model" matches "model/fc.weight") or by fnmatch
    ("model/layers.0.*"). A state entry takes part when an include pattern matches its key or
    lies inside it, and no exclude pattern matches the key itself; a tensor when it is included
    (or there is no include) and not excluded. Tensors left out are neither loaded nor reported."""

    def __init__(self, include: Sequence[str] = (), exclude: Sequence[str] = ()):
        for what, pats in (("include", include), ("exclude", exclude)):
            if isinstance(pats, str) or not all(isinstance(p, str) and p for p in pats):
                raise TypeError(f"{what}= takes a list of glob patterns such as ['model'] or ['optimizer/*'], "
                                f"got {pats!r}")
        self.include, self.exclude = list(include), list(exclude)

    @staticmethod
    def _match(name: str, pat: str) -> bool:
        return name == pat or name.startswith(pat.rstrip("/") + "/") or fnmatch.fnmatchcase(name, pat)

    def entry(self, key: str) -> bool:
        if any(self._match(key, p) for p in self.exclude):
            return False
        return not self.include or any(self._match(key, p) or p.startswith(key + "/") for p in self.include)

    def name(self, name: str) -> bool:
        if any(self._match(name, p) for p in self.exclude):
            return False
        return not self.include or any(self._match(name, p) for p in self.include)


@dataclass
class LoadMatch:
    """What a rank reads (`wanted[i]` fills `dests[i]`), converts after reading (`casts`: target,
    tensor read in the saved dtype), the object keys it decodes (its own rank's value, or every
    rank's), the differences found, and the checkpoint tensors under its entries nobody asked for."""
    wanted: list[tuple[str, Box]] = field(default_factory=list)
    dests: list[torch.Tensor] = field(default_factory=list)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    object_keys: list[str] = field(default_factory=list)
    all_rank_keys: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    unexpected: set[str] = field(default_factory=set)


def match_targets(manifest: Manifest, targets: Sequence[tuple[str, Any]], select: Selection | None = None, *,
                  cast: bool = False) -> LoadMatch:
    """Match each target's shards (LoadTarget: name, global shape, dtype, box, destination) and
    object keys with the manifest. A tensor of another dtype is read as saved and converted when
    `cast` (a temporary of its box in the saved dtype), else reported."""
    select = select or Selection()
    everything = not select.include and not select.exclude   # no pattern to try per name
    m = LoadMatch()
    ordered = sorted(manifest.tensors)   # each target's names under its prefix by bisection, not a scan per target
    tensors = manifest.tensors
    names_of: dict[torch.dtype, str] = {}   # dtype_name per dtype, not per shard (10^4 shards)
    for _, t in targets:
        names = {s.name for s in t.shards}
        for s in t.shards:
            if not everything and not select.name(s.name):
                continue
            entry = tensors.get(s.name)
            if entry is None:
                m.differences.append(f"{s.name}: missing from the checkpoint")
                continue
            if entry.shape != s.shape:
                m.differences.append(f"{s.name}: shape {list(entry.shape)} in the checkpoint, {list(s.shape)} in the "
                                     "target")
                continue
            mine = names_of.get(s.dtype)
            if mine is None:
                mine = names_of[s.dtype] = dtype_name(s.dtype)
            if entry.dtype != mine and not cast:
                m.differences.append(f"{s.name}: dtype {entry.dtype} in the checkpoint, {mine} in the "
                                     "target (pass cast=True to convert)")
            elif entry.dtype != mine:
                landed = torch.empty(s.box.lengths, dtype=dtype_from_name(entry.dtype))
                m.wanted.append((s.name, s.box))
                m.dests.append(landed)
                m.casts.append((s.local, landed))
            else:
                m.wanted.append((s.name, s.box))
                m.dests.append(s.local)
        exact = t.prefix.rstrip("/")
        under = _names_under(ordered, t.prefix)
        for name in ([exact] if exact in manifest.tensors and not exact.startswith(t.prefix) else []) + under:
            if name not in names and (everything or select.name(name)):
                m.unexpected.add(name)
        for keys, into in ((t.objects, m.object_keys), (t.objects_from_all_ranks, m.all_rank_keys)):
            for key in keys:
                if key in manifest.objects:
                    into.append(key)
                else:
                    m.differences.append(f"{key}: missing from the checkpoint (no saved value)")
    return m


def _names_under(ordered: list[str], prefix: str) -> list[str]:
    """The names of sorted `ordered` that start with `prefix` (a contiguous run of a sorted list)."""
    out = []
    for i in range(bisect.bisect_left(ordered, prefix), len(ordered)):
        if not ordered[i].startswith(prefix):
            break
        out.append(ordered[i])
    return out
