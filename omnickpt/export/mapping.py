"""Exporting through a model's own state-dict adapter: export_hf(mapping=) (docs/hf_mapping.md).

A `mapping` is a function {name: tensor} -> {Hugging Face name: tensor}, such as torchtitan's
`StateDictAdapter.to_hf`: it may rename, permute rows (Llama's q/k for RoPE), split or fuse tensors,
which transforms (omnickpt.transforms) cannot, as they rewrite names and boxes only. It never sees
the whole model: the exporter calls it on one group of tensors at a time, by default the tensors of
one layer (`layer_group`), so that memory holds a group, not the model.

Files are laid out (header, offsets) before any data is written, so the exporter must know every
output's name, shape and dtype first: `plan_groups` calls the mapping on meta tensors of each group
(no data read); a group whose mapping needs values (it fails on meta tensors) is read and mapped
once more for that. The real pass (export/hf.py) checks that what it gets matches the plan.

Planning here is pure (plan_groups calls what it is given); GroupSource reads a group through the
checkpoint reader and write_groups runs read, map, check and the exporter's write on worker threads
(run_bounded: the exporters' loop over threads with memory in flight bounded, which export_hf's
unmapped path uses too).
"""
from __future__ import annotations

import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence, TypeVar

import torch

from omnickpt.errors import MismatchError, UnsupportedError
from omnickpt.format import TensorEntry, dtype_from_name
from omnickpt.layout import Box
from omnickpt.reader import CheckpointReader

T = TypeVar("T")
# {name: tensor} -> {Hugging Face name: tensor}
MappingFn = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]
# name -> the key of the group it is mapped with
GroupFn = Callable[[str], Hashable]

# The first path segment that is an integer ("layers.3.", "blocks/12/"): its end closes the group key.
_LAYER_SEGMENT = re.compile(r"(?:^|[./])\d+(?:[./]|$)")


def layer_group(name: str) -> str:
    """export_hf's default grouping: a name up to and including its first integer path segment
    ("layers.3.attention.wq.weight" -> "layers.3."; "layers.3.moe.experts.7.w1" -> "layers.3.", so an
    adapter that fuses a layer's experts sees them all), or "" for a name with no integer segment: the
    embeddings, the final norm and the output head form one group, so an adapter that ties or fuses
    them sees them together."""
    m = _LAYER_SEGMENT.search(name)
    return name[:m.end()] if m else ""


def group_names(names: Sequence[str], group: GroupFn) -> list[tuple[Hashable, list[str]]]:
    """[(group key, its names)], in the order each group's first name comes in `names`."""
    groups: dict[Hashable, list[str]] = {}
    for name in names:
        try:
            key = group(name)
        except Exception as e:
            e.add_note(f"omnickpt: raised by the export's group= function on tensor {name!r}")
            raise
        groups.setdefault(key, []).append(name)
    return list(groups.items())


def describe_group(key: Hashable, names: Sequence[str]) -> str:
    """A group in words for messages: its key and its first tensors."""
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"group {key!r} ({shown})"


def call_mapping(mapping: MappingFn, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """`mapping(tensors)`, checked: a mapping of str names to tensors (UnsupportedError naming the group
    and the entry otherwise). An exception the mapping raises keeps its class, with a note naming the group."""
    try:
        result = mapping(dict(tensors))
    except Exception as e:
        e.add_note(f"omnickpt: raised by the export's mapping on {where}")
        raise
    if not isinstance(result, Mapping):
        raise UnsupportedError(f"the export's mapping returned a {type(result).__name__} for {where}; it must "
                               "return a dict {Hugging Face name: tensor}")
    out: dict[str, torch.Tensor] = {}
    for name, value in result.items():
        if not isinstance(name, str) or not name:
            raise UnsupportedError(f"the export's mapping returned the key {name!r} for {where}; names must be "
                                   "non-empty strings")
        if not isinstance(value, torch.Tensor):
            raise UnsupportedError(f"the export's mapping returned a {type(value).__name__} as {name!r} for "
                                   f"{where}; a Hugging Face folder holds tensors only: return a torch.Tensor, or "
                                   "leave the name out")
        out[name] = value
    return out


@dataclass(frozen=True)
class GroupPlan:
    """One group of an export through a mapping: the entry's tensors it maps and what comes out."""
    key: Hashable
    names: tuple[str, ...]
    # {Hugging Face name: (dtype, shape)}, in the order the mapping returned them
    outputs: dict[str, tuple[torch.dtype, tuple[int, ...]]]

    @property
    def where(self) -> str:
        return describe_group(self.key, self.names)


def plan_groups(groups: Sequence[tuple[Hashable, list[str]]], mapping: MappingFn,
                meta: Callable[[list[str]], dict[str, torch.Tensor]],
                real: Callable[[list[str]], dict[str, torch.Tensor]]) -> list[GroupPlan]:
    """What the mapping makes of each group, learnt without reading data where it can: the mapping is
    called on `meta(names)` (meta tensors of the saved shapes and dtypes); when that fails (a mapping
    that looks at values), on `real(names)`, the group read from the checkpoint. MismatchError when
    two groups give the same name, naming both."""
    plans: list[GroupPlan] = []
    made_by: dict[str, GroupPlan] = {}
    for key, names in groups:
        where = describe_group(key, names)
        try:
            result = call_mapping(mapping, meta(names), where)
        except UnsupportedError:
            raise   # what it returned is wrong whatever the values are
        except Exception:
            # e.g. a value-dependent branch, .item(), numpy(): meta tensors hold no values
            result = call_mapping(mapping, real(names), where)
        plan = GroupPlan(key, tuple(names), {n: (t.dtype, tuple(t.shape)) for n, t in result.items()})
        for name in plan.outputs:
            if name in made_by:
                other = made_by[name]
                raise MismatchError(
                    f"the export's mapping returned {name!r} for both {other.where} and {where}: a folder holds one "
                    "tensor per name. Return each name from one group only, or pass group= so that the tensors "
                    "it is made from are mapped together",
                    [f"{name}: {other.where}", f"{name}: {where}"])
            made_by[name] = plan
        plans.append(plan)
    return plans


def check_as_planned(plan: GroupPlan, result: dict[str, torch.Tensor]) -> None:
    """MismatchError unless the mapping gave the real tensors of `plan`'s group the names, shapes and dtypes it
    gave their meta tensors (the files were laid out from those)."""
    got = {n: (t.dtype, tuple(t.shape)) for n, t in result.items()}
    if got == plan.outputs and not any(t.is_meta for t in result.values()):
        return
    differences = [f"{n}: planned {plan.outputs.get(n)}, got {got.get(n)}" for n in sorted(set(got) | set(plan.outputs))
                   if got.get(n) != plan.outputs.get(n)]
    differences += [f"{n}: a meta tensor, no values" for n, t in result.items() if t.is_meta]
    raise MismatchError(f"the export's mapping gave {plan.where} other names, shapes or dtypes than it gave the same "
                        "tensors' shapes before (on meta tensors), or returned meta tensors; its output must depend "
                        "on its input's names, shapes and dtypes only", differences)


class GroupSource:
    """The tensors of an exported entry by name, for a mapping: meta tensors of their saved shapes and dtypes (to
    plan), or their values (read through the reader, or from memory: small plain values held in their objects)."""

    def __init__(self, reader: CheckpointReader, entries: dict[str, tuple[str, TensorEntry]],
                 inline: dict[str, torch.Tensor]):
        self.reader = reader
        self.entries = entries   # {name: (manifest name, its entry)}
        self.inline = inline     # {name: tensor}

    def meta(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.inline[n].detach().to("meta") if n in self.inline else self._empty(n, "meta") for n in names}

    def _empty(self, name: str, device: str = "cpu") -> torch.Tensor:
        entry = self.entries[name][1]
        return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device=device)

    def nbytes(self, names: Sequence[str]) -> int:
        return sum(t.numel() * t.element_size() for t in self.meta(names).values())

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The values of `names`, each read whole (verified against the checkpoint's checksums)."""
        out = {}
        for n in names:
            if n in self.inline:
                out[n] = self.inline[n].detach()
                continue
            out[n] = t = self._empty(n)
            if t.numel():
                # one read_into per tensor, as the unmapped export reads: one for the whole group lands
                # neighbouring tensors in one buffer and copies them out, measured slower
                self.reader.read_into([(self.entries[n][0], Box.full(t.shape))], [t])
        return out


def write_groups(source: GroupSource, mapping: MappingFn, plans: Sequence[GroupPlan],
                 write: Callable[[str, torch.Tensor], None], workers: int) -> None:
    """Read each group, map it, check it against its plan and `write(name, tensor)` what it returns, on `workers`
    threads. The groups in flight (inputs and outputs counted) hold at most twice the largest group's bytes or
    256 MiB: two large groups overlap one's reading with the other's writing; small ones run `workers` at
    once. The mapping is called from one thread at a time (it need not be thread-safe); `write` from several."""
    calling = threading.Lock()

    def one(plan: GroupPlan) -> None:
        values = source.read(plan.names)
        with calling:
            result = call_mapping(mapping, values, plan.where)
        del values
        check_as_planned(plan, result)
        for name, t in result.items():
            write(name, t)

    sizes = [source.nbytes(p.names) + sum(t.itemsize * math.prod(s) for t, s in p.outputs.values()) for p in plans]
    run_bounded(one, plans, sizes, workers, budget=max(2 * max(sizes, default=0), 256 << 20))


def run_bounded(fn: Callable[[T], None], items: Sequence[T], sizes: Sequence[int], workers: int,
                budget: int | None = None) -> None:
    """`fn(item)` for every item on `workers` threads, largest `sizes` first (the long reads start early, the small
    ones fill in around them), admitting an item once those in flight leave room for its size within `budget`
    (default: the largest size or 64 MiB; one item always runs): the exporters' memory stays a few times their
    largest piece, whatever the total. The first failure cancels the items not yet started and is raised."""
    if budget is None:
        budget = max(max(sizes, default=0), 64 << 20)
    gate = threading.Condition()
    in_flight = [0]

    def one(k: int) -> None:
        with gate:
            gate.wait_for(lambda: in_flight[0] == 0 or in_flight[0] + sizes[k] <= budget)
            in_flight[0] += sizes[k]
        try:
            fn(items[k])
        finally:
            with gate:
                in_flight[0] -= sizes[k]
                gate.notify_all()

    order = sorted(range(len(items)), key=lambda k: -sizes[k])
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="omnickpt-export") as pool:
        futures = [pool.submit(one, k) for k in order]
        try:
            for f in futures:
                f.result()
        except BaseException:
            # a refused cast or a full disk fails the export: the items after it would only be removed again
            for f in futures:
                f.cancel()
            raise


__all__ = ["GroupFn", "GroupPlan", "GroupSource", "MappingFn", "call_mapping", "check_as_planned", "describe_group",
           "group_names", "layer_group", "plan_groups", "run_bounded", "write_groups"]
