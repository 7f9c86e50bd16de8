"""What differs between two checkpoints, of any formats omnickpt reads: `diff(a, b)`, importable as
`omnickpt.diff`; the command `omnickpt diff A B` prints its report (omnickpt/cli/diff.py).

Tensors are compared by name: missing on one side, shape or dtype differences, and the largest
absolute and relative difference of their values (relative to B, as numpy.allclose and
torch.allclose measure: |a - b| <= atol + rtol * |b|; NaN equals NaN in the same place). Where A
differs from an exact 0 of B the relative difference is inf, as numpy.testing.assert_allclose and
torch.testing.assert_close report it (no rtol covers it, only atol); the row then also counts those
elements and gives the largest relative difference of the others. Values are streamed: each
tensor is read in slabs of leading rows of at most `slab_bytes` (as stored), and compared in blocks
of BLOCK_ELEMENTS (widened to float64 only where the stored bytes differ), so memory stays bounded
whatever the tensors' sizes. Objects (plain values) are decoded safely and compared by
value, naming the first place they differ.

A tensor a side holds lossy (stored quantized by save(quantize_optimizer=), or a converted copy of
one: its manifest's `codec` / `max_error` record) is marked on that side, equal or not: equal values
then say only that the two copies agree, not that either is what was saved before quantization.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from omnickpt.contents import short_repr
from omnickpt.errors import UnsafeCheckpointError
from omnickpt.planner.match import Selection
from omnickpt.reader import CheckpointReader, slab_boxes

# Bytes of one slab as stored: what a comparison reads (and holds) per side at once.
SLAB_BYTES = 64 << 20
# Elements compared at once, widened to float64: temporaries of 2 MiB each, reused from block to block.
BLOCK_ELEMENTS = 1 << 18
# Statuses that make two checkpoints different (exit status 1).
DIFFERENT = frozenset({"differs", "shape", "dtype", "only in A", "only in B"})


@dataclass
class DiffReport:
    """What `diff` found: a row per tensor and per object (see `diff`); `differs` is the verdict and
    `as_dict()` the `diff --json` document."""
    a: str
    b: str
    atol: float
    rtol: float
    tensors: list[dict] = field(default_factory=list)   # one per tensor name of A or B, A's order first
    objects: list[dict] = field(default_factory=list)   # one per object key of A or B
    include: list[str] = field(default_factory=list)    # the name filter the comparison ran with (see `diff`)
    exclude: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return any(t["status"] in DIFFERENT for t in self.tensors + self.objects)

    def lossy(self, side: str) -> list[dict]:
        """The tensor rows whose copy on `side` ("a" or "b") is lossy (quantized)."""
        return [t for t in self.tensors if t.get(f"lossy_{side}")]

    def counts(self, rows: list[dict]) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in rows:
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def as_dict(self) -> dict:
        """The `diff --json` document (non-finite numbers as the strings "inf" / "nan")."""
        return {"a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "same": not self.differs,
                "include": self.include, "exclude": self.exclude,
                "tensor_counts": self.counts(self.tensors), "object_counts": self.counts(self.objects),
                "lossy": {"a": len(self.lossy("a")), "b": len(self.lossy("b"))},
                "tensors": [{k: _finite(v) for k, v in t.items()} for t in self.tensors], "objects": self.objects}


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def diff(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, slab_bytes: int = SLAB_BYTES,
         progress: bool = False, workers: int = 4, include: Sequence[str] = (),
         exclude: Sequence[str] = ()) -> DiffReport:
    """Compare the checkpoints at `a` and `b` (see the module docstring). Each tensor row holds
    "name", "status" ("equal": identical values; "close": within atol/rtol; "differs"; "shape";
    "dtype"; "only in A"; "only in B"), shapes and dtypes of both sides, where values were
    compared "max_abs", "max_rel" (inf where A differs from a 0 of B), "zero_b" (how many elements
    differ from a 0 of B), "max_rel_nonzero_b" (the largest relative difference where B is not 0:
    the rtol those elements need) and "mismatched" (elements beyond the tolerance), and for a side
    that holds the tensor lossy "lossy_a" / "lossy_b": {"scheme", "max_error"} (its manifest's
    record) plus, where values were compared, "within_lossy_error": whether max_abs is within the
    sum of the recorded errors (the copies may come from one original). Each object
    row holds "key", "status" and, when it differs, "detail".

    `include` / `exclude` are glob patterns over names with load's meaning (include=/exclude= of
    omnickpt.load, planner.match.Selection): a pattern matches a name equal to it, under it ("model"
    matches "model/fc.weight") or by fnmatch ("model/layers.0.*"); a tensor takes part when it is
    included (or there is no include) and not excluded, an object when its state entry is. What is left
    out is neither read nor listed: `diff(ckpt, its_hf_export, include=["model"])` compares the model
    alone. TypeError for patterns that are not a list of non-empty strings. Raises what opening either
    checkpoint raises (NotCommittedError, CorruptCheckpointError on a damaged byte read)."""
    from tqdm.auto import tqdm
    select = Selection(include, exclude)
    with CheckpointReader(a, workers=workers) as ra, CheckpointReader(b, workers=workers) as rb:
        report = DiffReport(ra.location, rb.location, float(atol), float(rtol), include=list(include),
                            exclude=list(exclude))
        names = [n for n in ra.names() + [n for n in rb.names() if n not in ra] if select.name(n)]
        shared = [n for n in names if n in ra and n in rb and ra.info(n).shape == rb.info(n).shape]
        bar = tqdm(total=sum(ra.info(n).nbytes for n in shared), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="diff", disable=not progress, leave=False)
        try:
            for name in names:
                row = _tensor_row(ra, rb, name, report.atol, report.rtol, slab_bytes, bar)
                report.tensors.append(_mark_lossy(row, _quantized(ra).get(name), _quantized(rb).get(name)))
        finally:
            bar.close()
        keys = [k for k in ra.object_keys() + [k for k in rb.object_keys() if k not in ra.manifest.objects]
                if select.entry(k)]
        for key in keys:
            report.objects.append(_object_row(ra, rb, key))
    return report


def _tensor_row(ra: CheckpointReader, rb: CheckpointReader, name: str, atol: float, rtol: float, slab_bytes: int,
                bar) -> dict:
    ia = ra.info(name) if name in ra else None
    ib = rb.info(name) if name in rb else None
    row: dict[str, Any] = {"name": name,
                           "shape_a": list(ia.shape) if ia else None, "shape_b": list(ib.shape) if ib else None,
                           "dtype_a": str(ia.dtype).removeprefix("torch.") if ia else None,
                           "dtype_b": str(ib.dtype).removeprefix("torch.") if ib else None}
    if ia is None or ib is None:
        row["status"] = "only in B" if ia is None else "only in A"
        return row
    if ia.shape != ib.shape:
        row["status"] = "shape"
        return row
    total = _Difference()
    widest = max(ia.dtype.itemsize, ib.dtype.itemsize)
    for box in slab_boxes(ia.shape, max(1, slab_bytes // widest)):
        total = total.add(_compare_slab(ra.get(name, box), rb.get(name, box), atol, rtol))
        bar.update(box.numel * ia.dtype.itemsize)
    row.update(max_abs=total.max_abs, max_rel=total.max_rel, zero_b=total.zero_b,
               max_rel_nonzero_b=total.max_rel_nonzero_b, mismatched=total.mismatched)
    if ia.dtype != ib.dtype:
        row["status"] = "dtype"
    else:
        row["status"] = "equal" if total.identical else ("differs" if total.mismatched else "close")
    return row


def _quantized(reader: CheckpointReader) -> dict[str, dict]:
    return getattr(reader.manifest, "quantized", None) or {}


def _mark_lossy(row: dict, qa: dict | None, qb: dict | None) -> dict:
    """`row` with the lossy records of the sides that hold the tensor quantized."""
    for side, q in (("a", qa), ("b", qb)):
        if q:
            row[f"lossy_{side}"] = {"scheme": q["scheme"], "max_error": float(q["max_error"])}
    if (qa or qb) and "max_abs" in row:
        bound = sum(float(q["max_error"]) for q in (qa, qb) if q)
        row["within_lossy_error"] = bool(row["max_abs"] <= bound)
    return row


def _wide(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_complex:
        return t.to(torch.complex128)
    return t.to(torch.float64)


@dataclass(frozen=True)
class _Difference:
    """How two tensors (or slabs of them) differ; `add` combines two slabs' figures."""
    identical: bool = True
    max_abs: float = 0.0          # max |a - b|
    max_rel: float = 0.0          # max |a - b| / |b|: inf where b == 0 != a (or B holds NaN / inf)
    zero_b: int = 0               # elements where a differs from b == 0
    max_rel_nonzero_b: float = 0.0   # max |a - b| / |b| over the elements where b != 0
    mismatched: int = 0           # elements beyond atol + rtol * |b|

    def add(self, other: "_Difference") -> "_Difference":
        return _Difference(self.identical and other.identical, max(self.max_abs, other.max_abs),
                           max(self.max_rel, other.max_rel), self.zero_b + other.zero_b,
                           max(self.max_rel_nonzero_b, other.max_rel_nonzero_b), self.mismatched + other.mismatched)


def _compare_slab(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> _Difference:
    """`_compare` of two slabs as read (their stored dtypes), a block of BLOCK_ELEMENTS at a time: the widened
    (float64) temporaries of a block stay small enough for the allocator to reuse and the caches to hold (whole
    64 MB slabs widened made a diff of two 640 MB checkpoints take 12 s), and a block whose stored bits are
    the same on both sides (the usual case, a checkpoint against a copy of it) is never widened at all."""
    x, y = x.reshape(-1), y.reshape(-1)
    bits = _bits_view(x) if x.dtype == y.dtype else None
    other = _bits_view(y) if bits is not None else None
    total = _Difference()
    for i in range(0, x.numel(), BLOCK_ELEMENTS):
        j = min(i + BLOCK_ELEMENTS, x.numel())
        if bits is not None and torch.equal(bits[i:j], other[i:j]):
            continue   # the same bytes: identical values (NaNs included), nothing to measure
        total = total.add(_compare(x[i:j], y[i:j], atol, rtol))
    return total


def _bits_view(t: torch.Tensor) -> torch.Tensor | None:
    """The flat tensor `t`'s bytes as integers of its item size (compared exactly, unlike floats: NaN == NaN),
    None for an item size with no integer type (complex128: compared as values)."""
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.dtype.itemsize)
    if kind is None:
        return None
    return t if t.dtype == kind else t.view(kind)


def _compare(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> _Difference:
    """How `x` (A) differs from `y` (B), relative to B as numpy.allclose measures; NaN in the same
    place counts as equal, NaN against a number as an infinite difference."""
    if x.numel() == 0:
        return _Difference()
    if x.dtype.is_complex or y.dtype.is_complex:
        return _compare_general(x, y, atol, rtol)
    # widened copies (a float64 input is not copied by .to): the inputs may be a caller's tensors, never changed
    delta = x.to(torch.float64, copy=True)
    delta.sub_(y)                            # y is widened on the fly, exactly (float64 holds every value)
    scale = y.to(torch.float64, copy=True)
    # a - b and b finite: both finite (checked in float64, faster than in a 16-bit dtype)
    if not (bool(torch.isfinite(delta).all()) and bool(torch.isfinite(scale).all())):
        return _compare_general(x, y, atol, rtol)
    return _compare_finite(x, y, delta.abs_(), scale.abs_(), atol, rtol)


def _compare_general(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> _Difference:
    """`_compare` of any two tensors of one shape: NaN, infinities and complex values included."""
    xw, yw = _wide(x), _wide(y)
    both_nan = torch.isnan(xw) & torch.isnan(yw)
    equal = (xw == yw) | both_nan            # also equal infinities, which x - y would make NaN
    delta = (xw - yw).abs()
    # posinf too: nan_to_num's default turns inf into the largest float64, a max_abs of 1.8e308
    delta = torch.where(equal, torch.zeros_like(delta), torch.nan_to_num(delta, nan=math.inf, posinf=math.inf))
    scale = yw.abs()
    # x / 0 -> inf (no rtol covers a difference from an exact 0); against a NaN or an infinity in B
    # the ratio is NaN: call it infinite too
    rel = torch.where(delta == 0, torch.zeros_like(delta),
                      torch.nan_to_num(delta / scale, nan=math.inf, posinf=math.inf))
    at_zero = (scale == 0) & (delta > 0)
    beyond = ~equal & ~(delta <= atol + rtol * scale)    # a NaN bound (B holds NaN or inf) is never "within"
    if x.dtype == y.dtype and not (x.dtype.is_floating_point or x.dtype.is_complex):
        identical = torch.equal(x, y)   # exact for 64-bit integers that float64 would round
    else:
        identical = bool(equal.all()) and x.dtype == y.dtype
    return _Difference(identical, float(delta.max()), float(rel.max()), int(at_zero.sum()),
                       float(torch.where(scale == 0, torch.zeros_like(rel), rel).max()), int(beyond.sum()))


def _compare_finite(x: torch.Tensor, y: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, atol: float,
                    rtol: float) -> _Difference:
    """`_compare` of real tensors holding no NaN or infinity (the usual case), in a third of its operations,
    from `delta` = |a - b| and `scale` = |b| in float64 (both consumed): there equal means |a - b| == 0, and
    only b == 0 makes a relative difference infinite."""
    max_abs = float(delta.max())
    if max_abs == 0:
        identical = x.dtype == y.dtype and (torch.equal(x, y) if not x.dtype.is_floating_point else True)
        return _Difference(identical)
    beyond = int((delta > scale * rtol + atol).sum())
    at_zero = int(((scale == 0) & (delta > 0)).sum())
    rel = delta.div_(scale).nan_to_num_(nan=0.0, posinf=math.inf)   # 0 / 0 (equal zeros) -> 0; a / 0 -> inf
    max_rel = float(rel.max())
    max_rel_nonzero_b = float(rel.masked_fill_(scale == 0, 0.0).max()) if at_zero else max_rel
    identical = x.dtype == y.dtype and not x.dtype.is_floating_point and torch.equal(x, y)
    return _Difference(identical, max_abs, max_rel, at_zero, max_rel_nonzero_b, beyond)


# ---------------------------------------------------------------------- objects
def _object_row(ra: CheckpointReader, rb: CheckpointReader, key: str) -> dict:
    in_a, in_b = key in ra.manifest.objects, key in rb.manifest.objects
    if not (in_a and in_b):
        return {"key": key, "status": "only in A" if in_a else "only in B"}
    try:
        va, vb = _values(ra, key), _values(rb, key)
        how = ""
    except UnsafeCheckpointError:
        # A pickled value is never unpickled by a diff: compare what is stored instead.
        va = {tuple(e.ranks): ra.object_bytes(key, e) for e in ra.manifest.objects[key]}
        vb = {tuple(e.ranks): rb.object_bytes(key, e) for e in rb.manifest.objects[key]}
        how = " (pickled: compared as stored bytes)"
    detail = _difference(va, vb, "")
    row = {"key": key, "status": "equal" if detail is None else "differs"}
    if detail is not None:
        row["detail"] = detail + how
    return row


def _values(reader: CheckpointReader, key: str) -> Any:
    """The value of `key`, or {saving rank: value} when ranks saved different values."""
    if len(reader.manifest.objects[key]) == 1:
        return reader.objects([key])[key]
    return reader.objects([key], all_ranks=True)[key]


def _short(v: Any) -> str:
    return short_repr(v, 60)


def _difference(a: Any, b: Any, path: str) -> str | None:
    """None when `a` and `b` are the same value, else where and how they first differ."""
    where = path or "value"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, where)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _array_difference(a, b, where)
    if type(a) is not type(b):
        return f"{where}: {_short(a)} ({type(a).__name__}) vs {_short(b)} ({type(b).__name__})"
    if isinstance(a, dict):
        return _dict_difference(a, b, path)
    if isinstance(a, (list, tuple)):
        return _sequence_difference(a, b, path)
    return _plain_difference(a, b, where)


def _tensor_difference(a: Any, b: Any, where: str) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{where}: {_short(a)} vs {_short(b)}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{where}: tensor {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    return None if _compare(a, b, 0.0, 0.0).identical else f"{where}: tensor values differ"


def _array_difference(a: Any, b: Any, where: str) -> str | None:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype != b.dtype or a.shape != b.shape:
        return f"{where}: {_short(a)} vs {_short(b)}"
    same = np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    return None if same else f"{where}: array values differ"


def _dict_difference(a: dict, b: dict, path: str) -> str | None:
    for k in a:
        if k not in b:
            return f"{path}[{k!r}]: only in A"
    for k in b:
        if k not in a:
            return f"{path}[{k!r}]: only in B"
    return next((found for k in a if (found := _difference(a[k], b[k], f"{path}[{k!r}]"))), None)


def _sequence_difference(a: list | tuple, b: list | tuple, path: str) -> str | None:
    if len(a) != len(b):
        return f"{path or 'value'}: length {len(a)} vs {len(b)}"
    return next((found for i, (x, y) in enumerate(zip(a, b)) if (found := _difference(x, y, f"{path}[{i}]"))), None)


def _plain_difference(a: Any, b: Any, where: str) -> str | None:
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        same = bool(a == b)
    except Exception:   # a value whose == is not a plain truth value
        same = False
    return None if same else f"{where}: {_short(a)} vs {_short(b)}"


__all__ = ["DIFFERENT", "DiffReport", "SLAB_BYTES", "diff"]
