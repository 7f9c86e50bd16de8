"""Declared transforms: load a checkpoint into a model that names, fuses, splits or pads its
parameters differently from the model that saved it.

    omnickpt.load(path, {"model": plain}, transforms=[
        Rename.regex(r"decoder\\.layers\\.", "layers."),
        SplitQKV("layers.*.self_attention.linear_qkv.weight", into=("layers.*.q.weight", "layers.*.k.weight",
                 "layers.*.v.weight"), num_heads=8, num_groups=2, head_dim=64),
        SplitFused("layers.*.mlp.linear_fc1.weight", into=("layers.*.gate.weight", "layers.*.up.weight")),
        ResizeVocab("embedding.word_embeddings.weight", rows=50257),
    ])

A transform is a pure function Manifest -> Manifest (`apply`). It re-expresses the saved tensors
in the target's names, shapes and fusing by pointing at the SAME stored bytes: no data is
rewritten and nothing is read while transforming. It works because every saved box is a
row-major block: a range of its leading rows is a contiguous byte range (a plain SavedBox at a
byte offset), a selection along another dimension is a WindowBox the reader turns into strided
runs, concatenation is boxes at shifted offsets, and pad rows are zero-fill boxes backed by no
bytes (omnickpt/derived.py builds them). Derived boxes keep the chunk checksums of the stored box
their bytes lie in, so the reader verifies every byte it reads, whatever the transform. The record
that a tensor is stored lossy (Manifest.quantized) follows its bytes the same way: to its new
names, to every part of a split, and to a fused tensor with the largest error of its parts. See
docs/transforms.md.

Names. A name containing "/" is a full manifest name ("model/tok.weight") and matches exactly
that tensor. A name without "/" is a parameter name ("tok.weight") and matches wherever it
appears as whole "/"-separated parts of a manifest name: under any state key ("model/tok.weight")
and inside optimizer state names ("optimizer/state/tok.weight/exp_avg"), so the optimizer's
moments follow their parameter. "*" matches one dotted component ("layers.*.w" matches
"layers.7.w", not "layers.7.mlp.w"); the components it matched are substituted, in order, into
the "*"s of the output names. Every declared name must match at least one tensor: a typo is an
error, not a silent no-op. 0-dim tensors matched by a splitting transform (an optimizer's `step`)
are copied to every part; fusing ones keep the first part's.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

from omnickpt.derived import carry_quantized, concat, indexed, narrow, resize_rows, stack, take_rows
from omnickpt.errors import MismatchError
from omnickpt.format.manifest import Manifest, TensorEntry

__all__ = [
    "Alias", "Drop", "Fuse", "FuseQKV", "RelayoutQKV", "Rename", "ResizeVocab", "SplitFused", "SplitQKV",
    "StackExperts", "Transform", "UnstackExperts", "qkv_rows",
]


# ---------------------------------------------------------------------- name patterns
class _Pattern:
    """A declared name: exact (contains "/") or a parameter name matched as whole "/"-parts."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError(f"a transform name must be a non-empty string, not {text!r}")
        self.text = text
        self.exact = "/" in text
        body = r"([^/.]*)".join(re.escape(p) for p in text.split("*"))
        self.stars = text.count("*")
        self.regex = re.compile("^()" + body + "()$" if self.exact else r"^((?:[^/]*/)*?)" + body + r"((?:/.*)?)$")

    def match(self, name: str) -> tuple | None:
        """(prefix, starred parts, suffix) or None."""
        m = self.regex.match(name)
        if m is None:
            return None
        groups = m.groups()
        return groups[0], tuple(groups[1:-1]), groups[-1]

    def fill(self, key: tuple) -> str:
        """This pattern as a name, at the place `key` (a match of another pattern) describes."""
        prefix, stars, suffix = key
        pieces = self.text.split("*")
        if len(pieces) - 1 > len(stars):
            raise ValueError(f"name {self.text!r} has more '*' than the name it is derived from")
        out = pieces[0]
        for s, p in zip(stars, pieces[1:]):
            out += s + p
        return prefix + out + suffix


def _patterns(names: str | Sequence[str]) -> list[_Pattern]:
    return [_Pattern(n) for n in ([names] if isinstance(names, str) else names)]


# ---------------------------------------------------------------------- transforms
class Transform:
    """Base class: a pure rewrite of the manifest's tensors. Subclasses implement `_rewrite`,
    which edits a fresh copy of the name -> TensorEntry dict (replacing entries, never mutating
    them), so the manifest passed to `apply` is left untouched."""

    def apply(self, manifest: Manifest) -> Manifest:
        tensors = dict(manifest.tensors)
        self._rewrite(tensors)
        return dataclasses.replace(manifest, tensors=tensors, derived=True,
                                   quantized=carry_quantized(manifest, tensors))

    def _rewrite(self, tensors: dict[str, TensorEntry]) -> None:
        raise NotImplementedError

    # helpers for subclasses ------------------------------------------------------------------
    def _error(self, msg: str, tensors: Mapping[str, TensorEntry] | None = None) -> MismatchError:
        hint = ""
        if tensors is not None:
            sample = sorted(tensors)[:8]
            hint = f" (the checkpoint's tensors include {sample}{' ...' if len(tensors) > 8 else ''})"
        return MismatchError(f"transform {self!r}: {msg}{hint}", [f"{self!r}: {msg}"])

    def _matches(self, pattern: _Pattern, tensors: Mapping[str, TensorEntry]) -> list[tuple[str, tuple]]:
        """Every (name, key) the pattern matches; an error when there is none."""
        found = [(n, k) for n in tensors if (k := pattern.match(n)) is not None]
        if not found:
            raise self._error(f"no tensor matches {pattern.text!r}", tensors)
        return found

    def _take(self, tensors: dict[str, TensorEntry], name: str) -> TensorEntry:
        entry = tensors.pop(name, None)
        if entry is None:
            raise self._error(f"tensor {name!r} is not in the checkpoint", tensors)
        return entry

    def _put(self, tensors: dict[str, TensorEntry], name: str, entry: TensorEntry) -> None:
        if name in tensors:
            raise self._error(f"its output {name!r} is already a tensor of the checkpoint; drop or rename "
                              "that one first")
        tensors[name] = entry

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._describe().items())
        return f"{type(self).__name__}({fields})"

    def _describe(self) -> dict:
        return {}


class Rename(Transform):
    """Give saved tensors the target's names.

    `mapping` is a dict {saved name: target name} (names follow the module's matching rules, "*"
    included: {"decoder.layers.*.self_attention.linear_qkv.weight": "layers.*.attn.qkv.weight"}),
    or a callable taking a full manifest name and returning the new name (or None / the same name
    to keep it). `Rename.regex(pattern, repl)` applies `re.sub` to every full name.
    All renames of one Rename happen at once; two tensors ending on one name is an error.
    """

    def __init__(self, mapping: Mapping[str, str] | Callable[[str], str | None], *, label: str | None = None):
        self.label = label   # how repr() and error messages name a callable
        if callable(mapping) and not isinstance(mapping, Mapping):
            self.fn, self.mapping = mapping, None
        else:
            self.fn, self.mapping = None, [(_Pattern(k), _Pattern(v)) for k, v in dict(mapping).items()]

    @classmethod
    def regex(cls, pattern: str, repl: str) -> "Rename":
        compiled = re.compile(pattern)
        return cls(lambda name: compiled.sub(repl, name), label=f"regex {pattern!r} -> {repl!r}")

    def _describe(self) -> dict:
        if self.mapping is not None:
            return {"mapping": {s.text: t.text for s, t in self.mapping}}
        return {"fn": self.label or getattr(self.fn, "__name__", repr(self.fn))}

    def _rewrite(self, tensors):
        renames = self._mapped(tensors) if self.mapping is not None else self._called(tensors)
        moved = {renames[n]: tensors.pop(n) for n in list(renames)}
        if len(moved) != len(renames):
            self._refuse_collision(renames)
        for new, entry in moved.items():
            self._put(tensors, new, entry)

    def _mapped(self, tensors) -> dict[str, str]:
        """{old: new} by the mapping; an error for a name several patterns match, or a pattern none does."""
        renames: dict[str, str] = {}
        used = set()
        for name in tensors:
            hits = [(s, t, k) for s, t in self.mapping if (k := s.match(name)) is not None]
            if len(hits) > 1:
                raise self._error(f"{name!r} matches several names {[s.text for s, _, _ in hits]}")
            if hits:
                s, t, k = hits[0]
                used.add(s.text)
                renames[name] = t.fill(k)
        unused = [s.text for s, _ in self.mapping if s.text not in used]
        if unused:
            raise self._error(f"no tensor matches {unused}", tensors)
        return renames

    def _called(self, tensors) -> dict[str, str]:
        """{old: new} by the callable; an error when it renames nothing."""
        renames: dict[str, str] = {}
        for name in tensors:
            new = self.fn(name)
            if new is not None and new != name:
                renames[name] = new
        if not renames:
            raise self._error("it renames no tensor", tensors)
        return renames

    def _refuse_collision(self, renames: dict[str, str]) -> None:
        """Raise for the first two tensors `renames` sends to one name."""
        seen: dict[str, str] = {}
        for old, new in renames.items():
            if new in seen:
                raise self._error(f"both {seen[new]!r} and {old!r} would be renamed to {new!r}")
            seen[new] = old


class Drop(Transform):
    """Leave saved tensors out (ones the target does not have, so that strict loading passes)."""

    def __init__(self, *names: str):
        self.names = _patterns(list(names))

    def _describe(self):
        return {"names": [p.text for p in self.names]}

    def _rewrite(self, tensors):
        for p in self.names:
            for name, _ in self._matches(p, tensors):
                del tensors[name]


class Alias(Transform):
    """Tied parameters: target tensor `name` reads the same stored bytes as saved tensor `source`
    (an untied LM head loaded from a checkpoint that stored only the embedding). `source` stays.
    Give full names ("model/head.weight") when the optimizer does not hold the alias separately."""

    def __init__(self, name: str, source: str):
        self.name, self.source = _Pattern(name), _Pattern(source)

    def _describe(self):
        return {"name": self.name.text, "source": self.source.text}

    def _rewrite(self, tensors):
        for src, key in self._matches(self.source, tensors):
            self._put(tensors, self.name.fill(key), tensors[src])


def _split_sizes(total: int, sizes: Sequence[int] | None, parts: int) -> list[int]:
    if sizes is None:
        if total % parts:
            raise ValueError(f"size {total} does not split into {parts} equal parts; pass sizes=")
        return [total // parts] * parts
    return [int(s) for s in sizes]


class SplitFused(Transform):
    """One saved tensor holds several target tensors concatenated along `dim` (a SwiGLU fc1
    [gate; up], any fused projection): the target gets one tensor per part.

        SplitFused("mlp.fc1.weight", into=["mlp.gate.weight", "mlp.up.weight"], sizes=[F, F])

    `sizes` defaults to equal parts. Along dim 0 each part is a contiguous byte range of the
    stored boxes; along another dim the reader reads strided runs.
    """

    def __init__(self, name: str, into: Sequence[str], sizes: Sequence[int] | None = None, dim: int = 0):
        self.name, self.into, self.sizes, self.dim = _Pattern(name), _patterns(into), sizes, dim

    def _describe(self):
        return {"name": self.name.text, "into": [p.text for p in self.into], "sizes": self.sizes, "dim": self.dim}

    def _rewrite(self, tensors):
        for name, key in self._matches(self.name, tensors):
            entry = self._take(tensors, name)
            if not entry.shape:
                for p in self.into:
                    self._put(tensors, p.fill(key), entry)
                continue
            if not 0 <= self.dim < len(entry.shape):
                raise self._error(f"{name!r} has shape {list(entry.shape)}: no dim {self.dim}")
            try:
                sizes = _split_sizes(entry.shape[self.dim], self.sizes, len(self.into))
            except ValueError as e:
                raise self._error(f"{name!r} of shape {list(entry.shape)}: {e}") from None
            if len(sizes) != len(self.into) or sum(sizes) != entry.shape[self.dim]:
                raise self._error(f"{name!r} has {entry.shape[self.dim]} along dim {self.dim}, the declared "
                                  f"sizes {sizes} of {len(self.into)} parts do not add up to it")
            at = 0
            for p, n in zip(self.into, sizes):
                self._put(tensors, p.fill(key), narrow(entry, self.dim, at, at + n))
                at += n


class Fuse(Transform):
    """The inverse of SplitFused: saved tensors `parts` become one target tensor `into`,
    concatenated along `dim` in the order given.

        Fuse(["mlp.gate.weight", "mlp.up.weight"], into="mlp.fc1.weight")
    """

    def __init__(self, parts: Sequence[str], into: str, dim: int = 0):
        self.parts, self.into, self.dim = _patterns(parts), _Pattern(into), dim

    def _describe(self):
        return {"parts": [p.text for p in self.parts], "into": self.into.text, "dim": self.dim}

    def _rewrite(self, tensors):
        for name, key in self._matches(self.parts[0], tensors):
            entries = [self._take(tensors, p.fill(key)) for p in self.parts]
            if not entries[0].shape:
                fused = entries[0]
            elif not 0 <= self.dim < len(entries[0].shape):
                raise self._error(f"{name!r} has shape {list(entries[0].shape)}: no dim {self.dim}")
            else:
                fused = concat(entries, self.dim, repr(self))
            self._put(tensors, self.into.fill(key), fused)


# ---------------------------------------------------------------------- attention QKV
QKV_LAYOUTS = ("grouped", "concat")


def qkv_rows(num_heads: int, head_dim: int, num_groups: int | None = None,
             layout: str = "grouped") -> list[tuple[int, int, int]]:
    """The row order of a fused QKV tensor: (part 0/1/2 for q/k/v, first row in that part, rows).

    layout="grouped" (Megatron-core's linear_qkv): for each query group g, the rows of the
    num_heads/num_groups query heads of g, then k_g, then v_g, each head `head_dim` rows. With
    num_groups == num_heads (plain multi-head attention) that is per-head [q_h; k_h; v_h].
    layout="concat": [Q; K; V] (all query heads, then all key heads, then all value heads).
    num_groups (key/value heads, GQA/MQA) defaults to num_heads.
    """
    groups = num_heads if num_groups is None else num_groups
    if num_heads <= 0 or head_dim <= 0 or groups <= 0 or num_heads % groups:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_groups={groups} "
                         f"(and head_dim={head_dim} positive)")
    if layout == "concat":
        return [(0, 0, num_heads * head_dim), (1, 0, groups * head_dim), (2, 0, groups * head_dim)]
    if layout != "grouped":
        raise ValueError(f"unknown QKV layout {layout!r}; expected one of {QKV_LAYOUTS}")
    q_rows = num_heads // groups * head_dim
    out = []
    for g in range(groups):
        out += [(0, g * q_rows, q_rows), (1, g * head_dim, head_dim), (2, g * head_dim, head_dim)]
    return out


class _QKVBase(Transform):
    def __init__(self, num_heads, head_dim, num_groups, layout):
        self.num_heads, self.head_dim, self.num_groups, self.layout = num_heads, head_dim, num_groups, layout
        self.rows = qkv_rows(num_heads, head_dim, num_groups, layout)
        groups = num_heads if num_groups is None else num_groups
        self.part_rows = (num_heads * head_dim, groups * head_dim, groups * head_dim)

    def _check_fused(self, name: str, entry: TensorEntry) -> None:
        if entry.shape and entry.shape[0] != sum(self.part_rows):
            raise self._error(f"{name!r} has {entry.shape[0]} rows, but {self.num_heads} heads in "
                              f"{self.num_groups or self.num_heads} groups of head_dim {self.head_dim} make "
                              f"{sum(self.part_rows)}")

    def _split(self, name: str, entry: TensorEntry) -> list[TensorEntry]:
        """q, k, v of a fused entry in this transform's layout."""
        self._check_fused(name, entry)
        if not entry.shape:
            return [entry] * 3
        at, ranges = 0, ([], [], [])
        for part, first, n in self.rows:
            ranges[part].append((first, at, n))
            at += n
        return [take_rows(entry, [(a, a + n) for _, a, n in sorted(rs)], repr(self)) for rs in ranges]

    def _fuse(self, parts: Sequence[tuple[str, TensorEntry]]) -> TensorEntry:
        """A fused entry in this transform's layout from q, k, v."""
        entries = [e for _, e in parts]
        if not entries[0].shape:
            return entries[0]
        for (name, e), rows in zip(parts, self.part_rows):
            if not e.shape or e.shape[0] != rows:
                raise self._error(f"{name!r} has shape {list(e.shape)}; expected {rows} rows")
        return concat([narrow(entries[part], 0, first, first + n) for part, first, n in self.rows], 0, repr(self))

    def _describe(self):
        return {"num_heads": self.num_heads, "head_dim": self.head_dim, "num_groups": self.num_groups,
                "layout": self.layout}


class SplitQKV(_QKVBase):
    """A saved fused QKV tensor becomes separate q, k, v target tensors.

        SplitQKV("attn.qkv.weight", into=("attn.q.weight", "attn.k.weight", "attn.v.weight"),
                 num_heads=8, head_dim=64, num_groups=2, layout="grouped")

    `layout` is the saved tensor's row order (see `qkv_rows`): "grouped" for Megatron-core's
    per-query-group interleaving ([q heads of g; k_g; v_g] for each group g; per head [q; k; v]
    when num_groups == num_heads), "concat" for [Q; K; V]. Works for weights and biases alike.
    """

    def __init__(self, name: str, into: Sequence[str], *, num_heads: int, head_dim: int,
                 num_groups: int | None = None, layout: str = "grouped"):
        super().__init__(num_heads, head_dim, num_groups, layout)
        self.name, self.into = _Pattern(name), _patterns(into)
        if len(self.into) != 3:
            raise ValueError(f"SplitQKV: into= needs three names (q, k, v), got {into!r}")

    def _describe(self):
        return {"name": self.name.text, "into": [p.text for p in self.into], **super()._describe()}

    def _rewrite(self, tensors):
        for name, key in self._matches(self.name, tensors):
            for p, part in zip(self.into, self._split(name, self._take(tensors, name))):
                self._put(tensors, p.fill(key), part)


class FuseQKV(_QKVBase):
    """The inverse of SplitQKV: saved q, k, v tensors become one fused target tensor in `layout`.

        FuseQKV(("attn.q.weight", "attn.k.weight", "attn.v.weight"), into="attn.qkv.weight",
                num_heads=8, head_dim=64, num_groups=2, layout="grouped")
    """

    def __init__(self, parts: Sequence[str], into: str, *, num_heads: int, head_dim: int,
                 num_groups: int | None = None, layout: str = "grouped"):
        super().__init__(num_heads, head_dim, num_groups, layout)
        self.parts, self.into = _patterns(parts), _Pattern(into)
        if len(self.parts) != 3:
            raise ValueError(f"FuseQKV: parts= needs three names (q, k, v), got {parts!r}")

    def _describe(self):
        return {"parts": [p.text for p in self.parts], "into": self.into.text, **super()._describe()}

    def _rewrite(self, tensors):
        for name, key in self._matches(self.parts[0], tensors):
            names = [p.fill(key) for p in self.parts]
            parts = [(n, self._take(tensors, n)) for n in names]
            self._put(tensors, self.into.fill(key), self._fuse(parts))


class RelayoutQKV(Transform):
    """A fused QKV tensor saved in one row layout, loaded into a target fused in another
    ("grouped" <-> "concat"), same name unless `into` is given."""

    def __init__(self, name: str, *, num_heads: int, head_dim: int, num_groups: int | None = None,
                 saved: str = "grouped", target: str = "concat", into: str | None = None):
        self.name, self.into = _Pattern(name), _Pattern(into or name)
        self.saved = _QKVBase(num_heads, head_dim, num_groups, saved)
        self.target = _QKVBase(num_heads, head_dim, num_groups, target)

    def _describe(self):
        return {"name": self.name.text, "into": self.into.text, **self.saved._describe(),
                "layout": f"{self.saved.layout} -> {self.target.layout}"}

    def _rewrite(self, tensors):
        for name, key in self._matches(self.name, tensors):
            entry = self._take(tensors, name)
            q, k, v = self.saved._split(name, entry)
            self._put(tensors, self.into.fill(key), self.target._fuse([(name, q), (name, k), (name, v)]))


# ---------------------------------------------------------------------- vocabulary padding
class ResizeVocab(Transform):
    """The target has `rows` rows where the checkpoint has another number (a vocabulary padded to
    a multiple of 128 x TP by Megatron, or not padded): surplus saved rows are dropped, missing
    rows load as zeros. Applies along dim 0 (embedding [V, H], output layer [V, H], bias [V]).

        ResizeVocab("embedding.word_embeddings.weight", rows=50304)
    """

    def __init__(self, name: str, rows: int):
        if int(rows) < 0:
            raise ValueError(f"ResizeVocab({name!r}): rows must be >= 0, got {rows}")
        self.name, self.rows = _Pattern(name), int(rows)

    def _describe(self):
        return {"name": self.name.text, "rows": self.rows}

    def _rewrite(self, tensors):
        for name, _ in self._matches(self.name, tensors):
            if tensors[name].shape:
                tensors[name] = resize_rows(tensors[name], self.rows)


# ---------------------------------------------------------------------- experts
def _expert_pattern(text: str, e: int | str) -> _Pattern:
    if "{e}" not in text:
        raise ValueError(f"expert name {text!r} needs an '{{e}}' where the expert index goes")
    return _Pattern(text.replace("{e}", str(e)))


class UnstackExperts(Transform):
    """A saved stacked expert tensor [E, ...] becomes E target tensors: `into` with "{e}" replaced
    by the expert index holds index e of dim 0.

        UnstackExperts("mlp.experts.w1", into="mlp.experts.{e}.w1")
    """

    def __init__(self, name: str, into: str):
        self.name, self.into = _Pattern(name), into
        _expert_pattern(into, 0)

    def _describe(self):
        return {"name": self.name.text, "into": self.into}

    def _rewrite(self, tensors):
        matches = self._matches(self.name, tensors)
        # A 0-dim match (an optimizer's step for the stacked parameter) goes to every expert; how
        # many there are comes from a stacked tensor matched with the same "*" parts.
        experts = {key[1]: tensors[name].shape[0] for name, key in matches if tensors[name].shape}
        for name, key in matches:
            entry = self._take(tensors, name)
            if entry.shape:
                parts = [indexed(entry, e) for e in range(entry.shape[0])]
            elif key[1] in experts:
                parts = [entry] * experts[key[1]]
            else:
                raise self._error(f"{name!r} is 0-dim and no stacked tensor beside it says how many experts "
                                  "to copy it to")
            for e, part in enumerate(parts):
                self._put(tensors, _expert_pattern(self.into, e).fill(key), part)


class StackExperts(Transform):
    """The inverse of UnstackExperts: saved per-expert tensors `parts` ("{e}" = expert index,
    0, 1, ... as many as exist, or exactly `num_experts`) become one stacked target tensor [E, ...].

        StackExperts("mlp.experts.{e}.w1", into="mlp.experts.w1")
    """

    def __init__(self, parts: str, into: str, num_experts: int | None = None):
        self.parts, self.into, self.num_experts = parts, _Pattern(into), num_experts
        _expert_pattern(parts, 0)

    def _describe(self):
        return {"parts": self.parts, "into": self.into.text, "num_experts": self.num_experts}

    def _rewrite(self, tensors):
        for name, key in self._matches(_expert_pattern(self.parts, 0), tensors):
            names = []
            while self.num_experts is None or len(names) < self.num_experts:
                n = _expert_pattern(self.parts, len(names)).fill(key)
                if n not in tensors:
                    if self.num_experts is None:
                        break
                    raise self._error(f"expert tensor {n!r} is not in the checkpoint "
                                      f"(num_experts={self.num_experts})", tensors)
                names.append(n)
            entries = [self._take(tensors, n) for n in names]
            if not entries[0].shape:
                self._put(tensors, self.into.fill(key), entries[0])
                continue
            self._put(tensors, self.into.fill(key), stack(entries, repr(self)))
