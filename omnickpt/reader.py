"""Model-free reading of a checkpoint, one tensor (or one box of one tensor) at a time.

    with omnickpt.open("ckpt/global_step_100") as ckpt:
        ckpt.names()                                   # every tensor's name
        ckpt.info("model/tok.weight")                  # shape, dtype, boxes, bytes
        w = ckpt.get("model/tok.weight")               # the whole tensor, on the CPU
        top = ckpt.get("model/tok.weight", box=(slice(0, 128),))   # reads only those rows' bytes
        ckpt.objects()                                 # {key: value} of the plain values

The counterpart of safetensors' `safe_open` for any checkpoint omnickpt reads (its own, and the
foreign formats `read_manifest` recognises). There is no model and no process group: a read is a
load of one box into a fresh tensor, through the same code as `load()` (`plan_reads`, then
`read_tensors`), so it reads only the checksum chunks the box touches, from whatever boxes the
saving ranks wrote, and verifies every chunk it reads before returning anything.

`read_report(path)` reads the other file a save leaves next to its manifest: its timing report.
"""
from __future__ import annotations

import difflib
import math
import operator
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from omnickpt.formats import read_manifest
from omnickpt.engine.load import check_file_sizes, read_objects, read_tensors
from omnickpt.errors import CheckpointError, CorruptCheckpointError, MismatchError, StorageError
from omnickpt.format import Manifest, ObjectEntry, checksum, decode_object, dtype_from_name
from omnickpt.layout import Box
from omnickpt.monitor import PhaseTimer
from omnickpt.monitor.report import REPORT_NAME, parse_report
from omnickpt.planner import plan_reads
from omnickpt.storage import storage_for
from omnickpt.storage.linked import with_siblings

# Spellings accepted wherever a dtype is given as text (command line, convert(dtype="bf16")).
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                  "fp64": "float64", "double": "float64"}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a torch dtype: a torch.dtype, a format name ("bfloat16") or a short spelling
    ("bf16", "fp16", "half", "fp32"). None stays None. ValueError for anything else."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."), str(dtype).lower().removeprefix("torch."))
    try:
        return dtype_from_name(name)
    except CorruptCheckpointError:
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32 (or another dtype name of the "
                         "omnickpt format)") from None


@dataclass(frozen=True)
class TensorInfo:
    """What the manifest says about one tensor; `nbytes` is its logical size, `stored_bytes` the
    bytes its boxes occupy in data files (equal unless a transform selected part of a box or the
    checkpoint is compressed)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: int
    nbytes: int
    stored_bytes: int


def slab_boxes(shape: Sequence[int], max_elements: int) -> Iterator[Box]:
    """Boxes that tile a tensor of `shape` in row-major order, each of at most `max_elements`
    elements where possible: runs of whole leading rows, and pieces of one row when a single row
    is larger (recursively). A 0-d tensor is one box; a tensor with no elements has none."""
    shape = tuple(int(s) for s in shape)
    max_elements = max(1, int(max_elements))
    if not shape:
        yield Box((), ())
        return
    if math.prod(shape) == 0:
        return
    inner = math.prod(shape[1:])
    if inner <= max_elements or len(shape) == 1:
        rows = max(1, max_elements // inner)
        for r in range(0, shape[0], rows):
            yield Box((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + shape[1:])
        return
    for r in range(shape[0]):
        for sub in slab_boxes(shape[1:], max_elements):
            yield Box((r,) + sub.offsets, (1,) + sub.lengths)


def _index_int(v: Any, name: str) -> int | None:
    """`v` as an integer index (an int, a numpy or 0-d torch integer: anything with __index__), None
    when it is not one. A bool is refused: numpy reads True as a new axis and torch as a mask, while
    an int subclass would read it as row 1; none of those is a box."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
        raise TypeError(f"tensor {name!r}: {v!r} is a boolean, which selects no box: index with integers and "
                        "slices")
    if isinstance(v, (slice, type(Ellipsis), tuple, list, str, bytes, float)):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _as_box(spec: Any, shape: tuple[int, ...], name: str) -> tuple[Box, tuple[int, ...]]:
    """(the Box `spec` selects, the dimensions an integer index drops). `spec` is a Box,
    (offsets, lengths), or what you would put in tensor[...]: integers (numpy ones too), slices
    with step 1, at most one `...`; `()` and `...` are the whole tensor, and missing trailing
    dimensions are whole. TypeError for a boolean, ValueError for anything else that selects no box."""
    if spec is None:
        return Box.full(shape), ()
    if isinstance(spec, Box):
        box = spec
    elif _is_index(spec, name):
        return _index_box(spec, shape, name)
    else:
        box = _pair_box(spec, name)
    if box.ndim != len(shape) or not box.within(shape):
        raise ValueError(f"box offsets={list(box.offsets)} lengths={list(box.lengths)} does not fit in tensor "
                         f"{name!r} of shape {list(shape)}")
    return box, ()


def _index_box(spec: Any, shape: tuple[int, ...], name: str) -> tuple[Box, tuple[int, ...]]:
    """`_as_box` of a tensor[...] index: integers, slices with step 1, at most one `...`."""
    index = _full_index(spec, shape, name)
    offsets, lengths, drop = [], [], []
    for d, (s, n) in enumerate(zip(index, shape)):
        if not isinstance(s, slice):
            i = _index_int(s, name)
            i = i + n if i < 0 else i
            if not 0 <= i < n:
                raise ValueError(f"index {s} is out of range for dimension {d} of tensor {name!r} (size {n})")
            offsets.append(i)
            lengths.append(1)
            drop.append(d)
            continue
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"tensor {name!r}: only slices with step 1 select a box, got {s}")
        offsets.append(start)
        lengths.append(max(0, stop - start))
    return Box(tuple(offsets), tuple(lengths)), tuple(drop)


def _full_index(spec: Any, shape: tuple[int, ...], name: str) -> tuple:
    """`spec` as a tuple with one entry per dimension: `...` expanded, missing trailing dimensions whole."""
    index = spec if isinstance(spec, tuple) else (spec,)
    if sum(s is Ellipsis for s in index) > 1:
        raise ValueError(f"tensor {name!r}: an index can have only one '...', got {spec!r}")
    if Ellipsis in index:
        at = next(i for i, s in enumerate(index) if s is Ellipsis)
        index = index[:at] + (slice(None),) * max(0, len(shape) - len(index) + 1) + index[at + 1:]
    if len(index) > len(shape):
        raise ValueError(f"tensor {name!r} has {len(shape)} dimension(s); the index {spec!r} has {len(index)}")
    return index + (slice(None),) * (len(shape) - len(index))


def _pair_box(spec: Any, name: str) -> Box:
    """The Box of an (offsets, lengths) pair, not yet checked against the tensor's shape."""
    try:
        offsets, lengths = spec
        return Box(tuple(_box_int(o, name) for o in offsets), tuple(_box_int(n, name) for n in lengths))
    except (TypeError, ValueError):
        raise ValueError(f"tensor {name!r}: a box is a Box, (offsets, lengths) or a tuple of slices, "
                         f"got {spec!r:.80}") from None


def _is_index(spec: Any, name: str) -> bool:
    """Whether `spec` is a tensor[...] index rather than (offsets, lengths): a slice, an integer,
    `...`, or a tuple of those (the empty tuple included). (offsets, lengths) is a pair of sequences."""
    items = spec if isinstance(spec, tuple) else (spec,)
    return all(isinstance(s, slice) or s is Ellipsis or _index_int(s, name) is not None for s in items)


def _box_int(v: Any, name: str) -> int:
    """An offset or length of an (offsets, lengths) box: an integer, not a bool nor a float."""
    i = _index_int(v, name)
    if i is None:
        raise TypeError(f"{v!r} is not an integer")
    return i


class CheckpointReader:
    """Read-only access to the checkpoint at `path`, with no model: see the module docstring.

    `omnickpt.open` is this class, as safetensors' `safe_open` is its reader class: open a checkpoint
    with `omnickpt.open(path)` and name its type `CheckpointReader` (annotations, isinstance).
    NotCommittedError when there is no checkpoint of any format omnickpt reads at `path`.

    `transforms` (omnickpt.transforms) rewrite the names and fusing first, as they do for a load.
    `workers` threads read in parallel. `verify=False` skips the checksums (never needed for
    speed on local disks; only for reading a damaged checkpoint's intact parts on purpose).
    `allow_pickle` is the default of `objects()`. Close it (or use `with`) to stop its threads.
    """

    def __init__(self, path: str, *, transforms: Sequence[Any] = (), workers: int = 4, verify: bool = True,
                 allow_pickle: bool = False):
        self.path = str(path)
        self._storage = storage_for(self.path)
        manifest = read_manifest(self._storage)
        self._storage = with_siblings(self._storage, self.path, manifest.files)   # incremental: see storage/linked.py
        for transform in transforms:
            manifest = transform.apply(manifest)
        self._manifest = manifest
        self._workers = max(1, int(workers))
        self._verify = verify
        self._allow_pickle = allow_pickle
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()   # exporters call read_into from several threads at once
        self._timer = PhaseTimer()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _executor(self) -> ThreadPoolExecutor | None:
        if self._workers == 1:
            return None
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="omnickpt-reader")
            return self._pool

    # ------------------------------------------------------------------ what is there
    @property
    def manifest(self) -> Manifest:
        """The manifest (after transforms): every tensor's boxes and every object's records."""
        return self._manifest

    @property
    def location(self) -> str:
        """The checkpoint's path as the storage describes it (absolute for a local path)."""
        return self._storage.describe()

    @property
    def format(self) -> str:
        """"omnickpt", or the foreign format read ("hf", "dcp")."""
        return str(self._manifest.layout.get("format", "omnickpt"))

    @property
    def layout(self) -> dict:
        """How the checkpoint was saved: {"format", "world_size", "frameworks", ...}, plus every
        other key the saving job recorded (role, mesh, a foreign format's metadata)."""
        m = self._manifest
        out = {"format": self.format, "world_size": m.world_size, "frameworks": {}}
        out.update(m.layout)
        out["format"] = self.format
        return out

    @property
    def bytes_read(self) -> int:
        """Bytes read from data files by this reader so far (tensor reads, including the whole
        checksum chunks a partial read widens to; objects included)."""
        return self._timer.bytes.get("read", 0)

    def names(self) -> list[str]:
        """Every tensor name, in manifest order."""
        return list(self._manifest.tensors)

    def object_keys(self) -> list[str]:
        return list(self._manifest.objects)

    def __contains__(self, name: str) -> bool:
        return name in self._manifest.tensors

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype, number of stored boxes and sizes of tensor `name` (no data is read).
        MismatchError naming close names when there is no such tensor."""
        t = self._entry(name)
        dtype = dtype_from_name(t.dtype)
        cols = t.columns
        # A compressed checkpoint's boxes occupy their stored chunks, not their raw bytes.
        stored = int(cols.stored.sum()) if cols is not None and cols.stored is not None else t.nbytes
        return TensorInfo(name, tuple(t.shape), dtype, len(t.boxes), math.prod(t.shape) * dtype.itemsize, stored)

    def _entry(self, name: str):
        entry = self._manifest.tensors.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(self._manifest.tensors), n=5, cutoff=0.5)
            hint = (f"; close names: {', '.join(close)}" if close
                    else f"; it holds {len(self._manifest.tensors)} tensors (omnickpt inspect {self.location} "
                         "lists them)")
            raise MismatchError(f"no tensor {name!r} in checkpoint {self.location}{hint}", [f"{name}: not found"])
        return entry

    # ------------------------------------------------------------------ tensors
    def get(self, name: str, box: Any = None, dtype: torch.dtype | str | None = None) -> torch.Tensor:
        """Tensor `name`, or its part `box`, as a new CPU tensor, optionally cast to `dtype`.

        `box` is a layout.Box, (offsets, lengths), or what you would put in tensor[...]: a slice,
        an integer (numpy integers too), `...` or a tuple of them (step 1; an integer drops its
        dimension; `()` is the whole tensor). Only the stored bytes the box needs are read (widened
        to whole checksum chunks), and every chunk read is verified: CorruptCheckpointError if one
        does not match. MismatchError for an unknown name, TypeError for a boolean index,
        ValueError for a box that does not fit the tensor.
        """
        entry = self._entry(name)
        want, drop = _as_box(box, tuple(entry.shape), name)
        items = self._plan([(name, want)])   # the files hold the bytes: only then allocate what the manifest says
        out = torch.empty(want.lengths, dtype=dtype_from_name(entry.dtype))
        read_tensors(self._storage, self._manifest, items, [want], [out], self._executor(), verify=self._verify,
                     timer=self._timer)
        for d in reversed(drop):
            out = out.squeeze(d)
        cast = as_dtype(dtype)
        return out if cast is None or cast == out.dtype else out.to(cast)

    def read_into(self, wanted: Sequence[tuple[str, Box]], dests: Sequence[torch.Tensor]) -> None:
        """Fill each CPU tensor `dests[i]` (of the stored dtype, shaped as the box) with box
        `wanted[i] = (name, box)`: one planned, parallel, verified read for all of them. Nothing
        is written into `dests` unless every chunk read is intact."""
        if len(wanted) != len(dests):
            raise ValueError(f"{len(wanted)} boxes wanted but {len(dests)} destination tensors given")
        for (name, box), dest in zip(wanted, dests):
            want = dtype_from_name(self._entry(name).dtype)
            if dest.dtype != want or tuple(dest.shape) != box.lengths or dest.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: the destination must be a CPU {want} tensor of shape "
                                 f"{list(box.lengths)}, got {dest.device.type} {dest.dtype} {list(dest.shape)}")
        items = self._plan(wanted)
        read_tensors(self._storage, self._manifest, items, [b for _, b in wanted], list(dests), self._executor(),
                     verify=self._verify, timer=self._timer)

    def _plan(self, wanted: Sequence[tuple[str, Box]], objects: Sequence[tuple[str, ObjectEntry]] = ()) -> list:
        """The reads of `wanted`, after checking that the data files hold every byte they and
        `objects` need (a truncated file, or a manifest declaring more than is there: one clear
        error before anything is allocated from a declared size)."""
        items = plan_reads(self._manifest, list(wanted)) if wanted else []
        check_file_sizes(self._storage, self._manifest, items, list(objects))
        return items

    def slabs(self, name: str, max_bytes: int = 64 << 20,
              dtype: torch.dtype | str | None = None) -> Iterator[tuple[Box, torch.Tensor]]:
        """(box, values) pieces of tensor `name` that tile it in row-major order, each at most
        about `max_bytes` (runs of leading rows): the way to stream a tensor larger than memory."""
        entry = self._entry(name)
        itemsize = dtype_from_name(entry.dtype).itemsize
        for box in slab_boxes(entry.shape, max_bytes // itemsize):
            yield box, self.get(name, box, dtype)

    # ------------------------------------------------------------------ objects
    def objects(self, keys: Sequence[str] | None = None, *, rank: int = 0, all_ranks: bool = False,
                allow_pickle: bool | None = None) -> dict:
        """{key: value} of the stored plain values (all keys, or `keys`): the value rank `rank`
        saved, or else the lowest saving rank's, as a load on that rank would get it. With
        `all_ranks=True` each value is {saving rank: value}. Decoding runs no code from the
        checkpoint: a value saved with pickle raises UnsafeCheckpointError unless
        `allow_pickle=True` (default: the reader's). Every value's checksum is verified."""
        pickle = self._allow_pickle if allow_pickle is None else allow_pickle
        wanted = list(self._manifest.objects) if keys is None else list(keys)
        missing = [k for k in wanted if k not in self._manifest.objects]
        if missing:
            raise MismatchError(f"no object {missing[0]!r} in checkpoint {self.location}; it holds "
                                f"{', '.join(self._manifest.objects) or 'none'}", [f"{k}: not found" for k in missing])
        self._plan([], [(k, e) for k in wanted for e in (self._manifest.objects[k] if all_ranks else
                                                       [self._manifest.object_for_rank(k, rank)])])
        return read_objects(self._storage, self._manifest, [] if all_ranks else wanted, rank, allow_pickle=pickle,
                            timer=self._timer, all_ranks=wanted if all_ranks else ())

    def object_bytes(self, key: str, entry: ObjectEntry) -> bytes:
        """The encoded bytes of one stored value of object `key` (see docs/format.md, object
        encoding), checksum-verified, not decoded: for copying values without unpickling them."""
        if entry.inline is not None:   # a foreign format's value, encoded when its manifest was read
            return entry.inline
        path = self._manifest.files[entry.file].path
        self._plan([], [(key, entry)])
        buf = bytearray(entry.nbytes)
        try:
            self._storage.read_into(path, entry.offset, [memoryview(buf)])
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{err} (reading object {key!r})") from None
        if self._verify and checksum(buf) != entry.checksum:
            raise CorruptCheckpointError(f"checksum mismatch in {self._storage.describe(path)} for object {key!r}: "
                                         "the data file is corrupt; restore it or use an earlier checkpoint")
        self._timer.count("read", entry.nbytes)
        return bytes(buf)

    def decode(self, key: str, data: bytes, *, allow_pickle: bool | None = None) -> Any:
        """Decode `object_bytes` of `key` (safely unless pickle is allowed)."""
        return decode_object(data, allow_pickle=self._allow_pickle if allow_pickle is None else allow_pickle,
                             where=key)

    def __repr__(self) -> str:
        return (f"CheckpointReader({self.location!r}, format={self.format!r}, tensors={len(self._manifest.tensors)}, "
                f"objects={len(self._manifest.objects)})")


def open_checkpoint(path: str, *, transforms: Sequence[Any] = (), workers: int = 4, verify: bool = True,
                    allow_pickle: bool = False) -> CheckpointReader:
    """Deprecated: `omnickpt.open(path)` is the same reader (this warns, then returns it)."""
    warnings.warn("omnickpt.reader.open_checkpoint is deprecated: use omnickpt.open(path), the same reader",
                  DeprecationWarning, stacklevel=2)
    return CheckpointReader(path, transforms=transforms, workers=workers, verify=verify, allow_pickle=allow_pickle)


def read_report(path: str) -> dict:
    """The timing report at `path`: a JSON file (a report saved with `json.dump(result.report, f)`),
    or the report.json of the checkpoint directory `path`; omnickpt.monitor.report summarises, traces
    and draws it. NotCommittedError when `path` is no checkpoint, CheckpointError when it has no
    report, CorruptCheckpointError when the report is not a JSON object."""
    if os.path.isfile(path):
        where = path
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise StorageError(f"{path}: cannot read the report ({e.strerror or e})") from None
    else:
        storage = storage_for(path)
        where = storage.describe(REPORT_NAME)
        try:
            raw = storage.read_bytes(REPORT_NAME)
        except FileNotFoundError:
            manifest = read_manifest(storage)   # NotCommittedError when there is no checkpoint at all
            raise CheckpointError(
                f"{storage.describe()} has no {REPORT_NAME}"
                + (f": it is a {manifest.layout['format']} checkpoint read by omnickpt, which records no timings"
                   if manifest.layout.get("format") else
                   ": the save that wrote it kept no report (removed, or written by an older omnickpt)")) from None
    return parse_report(raw, where, path)


__all__ = ["CheckpointReader", "TensorInfo", "as_dtype", "read_report", "slab_boxes"]
