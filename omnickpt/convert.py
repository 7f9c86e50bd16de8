"""Convert a checkpoint between formats: to a Hugging Face folder, to PyTorch DCP, to DeepSpeed, or into omnickpt.

    from omnickpt.convert import convert
    convert("ckpt/global_step_100", "hf/step100", to="hf", key="model", dtype="bfloat16")
    convert("hf/llama", "ckpt/llama", to="omnickpt")          # any format omnickpt reads, into ours

`to="hf"`, `to="dcp"` and `to="deepspeed"` hand over to the exporters of omnickpt/export/. `to="omnickpt"` is
here: it streams the source through a CheckpointReader into a new omnickpt checkpoint, part by
part, so that memory holds one part (at most `max_shard_size` bytes, default PART_BYTES), not
the whole checkpoint. The public save path cannot do that: `save()` snapshots the whole state
before it writes anything. So this writer uses the format layer directly (chunk checksums,
manifest written last and atomically), and its output is a checkpoint like any other: `omnickpt
verify` checks it, `load()` reshards it.

What a conversion must not do silently (issue 17):
- write inside its source (or the source inside it): the source's next save or retention deletes
  files its manifest does not name, and a folder inside a source is read as part of it;
- drop the record that a tensor is lossy: a tensor the source stored quantized (save(quantize_optimizer=))
  keeps its `codec` / `max_error` record in the new manifest, its values stored raw (a quantized
  tensor whose chunks are all raw is valid format), so load reports, inspect and diff still say so;
  a target format with no such record (hf, dcp) gets it in the summary ("lossy");
- lose values to a dtype cast: a cast that turns finite values into inf or non-zero values into 0
  is refused unless allow_lossy_cast=True, and then counted per tensor in the summary and in the
  new manifest's layout["converted_from"]["lossy_casts"] (format/cast.py).
"""
from __future__ import annotations

import ast
import math
import os
import posixpath
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omnickpt.engine.save import tensor_bytes_view
from omnickpt.format import DATA_DIR
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.export import export_dcp, export_deepspeed, export_hf
from omnickpt.export.destination import refuse_occupied
from omnickpt.export.hf import TOP_LEVEL
from omnickpt.export.mapping import MappingFn
from omnickpt.format import CHUNK_BYTES, MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, SavedBox, Sums, TensorEntry
from omnickpt.format import checksum, dtype_from_name, dtype_name
from omnickpt.format.cast import CastLosses, keeps_dtype
from omnickpt.format.quant import QUANT_DTYPES
from omnickpt.formats import read_manifest
from omnickpt.layout import Box
from omnickpt.monitor import PhaseTimer, summarize
from omnickpt.planner.save_plan import ALIGN
from omnickpt.reader import CheckpointReader, as_dtype, slab_boxes
from omnickpt.storage import Segment, Storage, storage_for

TARGETS = ("hf", "dcp", "deepspeed", "omnickpt")
# Default largest data file of a conversion into omnickpt, and so the memory it holds at once.
PART_BYTES = 1 << 30
# The Hugging Face default (transformers' save_pretrained): 5 GB shards.
HF_SHARD_BYTES = 5 * 10**9
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or from text as Hugging Face spells it: "5GB" (10**9), "500MB", "2GiB"
    (2**30), "1048576". ValueError otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"not a size: {size!r} (use bytes, or e.g. 500MB, 5GB, 2GiB)")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n < 1:
        raise ValueError(f"a size must be positive, got {size!r}")
    return n


# ---------------------------------------------------------------------- transforms on the command line
def parse_transform(text: str):
    """A transform from its Python spelling, e.g. `SplitFused("mlp.fc1.weight", into=["mlp.gate.weight",
    "mlp.up.weight"])` or `Rename.regex("^model/decoder\\.", "model/")`: a call of a class of
    omnickpt.transforms (or Rename.regex) whose arguments are literals. Parsed, never evaluated:
    no other name, attribute or expression is accepted. ValueError saying what is wrong."""
    from omnickpt import transforms
    allowed = [n for n in transforms.__all__ if n not in ("Transform", "qkv_rows")]
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"transform {text!r} is not a call like Rename({{'a': 'b'}}): {e.msg}") from None
    if not isinstance(node, ast.Call):
        raise ValueError(f"transform {text!r} must be a call of one of {', '.join(allowed)}")
    func = node.func
    if isinstance(func, ast.Name) and func.id in allowed:
        make = getattr(transforms, func.id)
    elif (isinstance(func, ast.Attribute) and func.attr == "regex" and isinstance(func.value, ast.Name)
          and func.value.id == "Rename"):
        make = transforms.Rename.regex
    else:
        raise ValueError(f"transform {text!r}: unknown transform {ast.unparse(func)!r}; use one of "
                         f"{', '.join(allowed)} or Rename.regex")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        raise ValueError(f"transform {text!r}: arguments must be literals (strings, numbers, lists, dicts)") from None
    if len(kwargs) != len(node.keywords):
        raise ValueError(f"transform {text!r}: **kwargs are not accepted")
    try:
        return make(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"transform {text!r}: {e}") from None


# ---------------------------------------------------------------------- a mapping on the command line
def load_mapping(text: str) -> MappingFn:
    """The function `text` names, "package.module:function" or "module:object.method" (e.g.
    "my_export:adapter.to_hf"), imported: this RUNS the module's code, as `python -c "import module"`
    would; the current directory is on the import path while it is imported (a module beside the
    command). UnsupportedError naming what is missing or not callable."""
    import importlib
    module_name, sep, attrs = text.strip().partition(":")
    if not sep or not module_name or not attrs:
        raise UnsupportedError(f"mapping {text!r} must be written module:function, e.g. my_export:to_hf or "
                               "my_export:adapter.to_hf")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise UnsupportedError(f"mapping {text!r}: cannot import {module_name!r} ({e}); pass a module on the import "
                               "path or in the current directory") from e
    finally:
        if added:
            sys.path.remove(os.getcwd())
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise UnsupportedError(f"mapping {text!r}: {getattr(obj, '__name__', module_name)!r} has no attribute "
                                   f"{attr!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UnsupportedError(f"mapping {text!r} is a {type(obj).__name__}, not a function {{name: tensor}} -> "
                               "{Hugging Face name: tensor}")
    return obj


# ---------------------------------------------------------------------- entry point
def convert(src: str, dst: str, *, to: str, key: str | None = None, dtype: torch.dtype | str | None = None,
            max_shard_size: int | str | None = None, transforms: Sequence[Any] = (), progress: bool = True,
            workers: int = 4, allow_lossy_cast: bool = False, mapping: MappingFn | str | None = None,
            optimizer_key: str | None = None, tag: str | None = None, overwrite: bool = False) -> dict:
    """Write the checkpoint at `src` (any format omnickpt reads) as a new checkpoint at `dst` in
    format `to`: "hf" (a Hugging Face safetensors folder), "dcp" (PyTorch DCP), "deepspeed" (a DeepSpeed
    universal checkpoint, export_deepspeed: docs/deepspeed_export.md) or "omnickpt".

    `dst` must not exist or be an empty directory: a conversion never overwrites anything; nor may it
    lie inside `src` or a folder `src` references, or hold `src` (CheckpointError naming both).
    to="deepspeed" is the exception: `dst` may be a DeepSpeed checkpoint folder with other tags and files, and
    is refused only when it holds `latest`, `latest_universal` or the tag, unless `overwrite`. Its `key` is
    the model's entry, `optimizer_key` the optimizer's (both inferred when not given), `tag` the tag folder
    (default "global_step<N>"); these three options are taken by to="deepspeed" only.
    `key` keeps only one state key's tensors (and its objects: with to="omnickpt"), e.g. "model"; with to="hf"
    it is the entry exported as the model (never an optimizer's), "" or "." for the tensors saved at the top
    level of the state (a flat model: omnickpt.save(path, {"layer.weight": t, ...}));
    `dtype` casts floating-point tensors, except an optimizer's step counts and other 0-dim state,
    which keep their saved dtype (format/cast.py keeps_dtype); `max_shard_size` (bytes or "5GB",
    "500MB") caps each data file (to="hf": default 5 GB; to="omnickpt": default 1 GiB, and the memory
    held at once is about twice that, three times with a dtype cast); `transforms`
    (omnickpt.transforms) rewrite names and fusing first. `progress` shows a progress bar on stderr. A cast that would
    turn finite values into inf or non-zero values into 0 is refused (UnsupportedError naming the
    tensor and the counts) unless `allow_lossy_cast`; then the summary's "lossy_casts" counts them.
    `mapping` (to="hf" only) makes the folder's tensors through a model's own state-dict adapter, layer by layer
    (export_hf's mapping=, docs/hf_mapping.md): a function, or its "module:function" spelling, which is
    imported (load_mapping: that runs the module's code).

    Returns a summary dict (at least "to" and "path"; to="hf" adds "key" and "entry", the state entry it
    exported in words, e.g. "the top-level tensors of the state"; "lossy": the tensors the source holds lossy,
    quantized, with their scheme and largest error; "lossy_casts": {tensor: {"overflow", "flush"}}).
    Raises UnsupportedError for an option the target does not take, CheckpointError when `dst` is not
    empty or overlaps `src`, and what reading the source
    raises (NotCommittedError, CorruptCheckpointError, ...).
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target format {to!r}; use one of {', '.join(TARGETS)}")
    refuse_nested(str(src), str(dst))
    given = [n for n, v in (("optimizer_key", optimizer_key), ("tag", tag), ("overwrite", overwrite)) if v]
    if given and to != "deepspeed":
        raise UnsupportedError(f"convert to {to} takes no {', '.join(given)}: those name what a DeepSpeed checkpoint "
                               "holds; convert to deepspeed")
    if to != "deepspeed":   # export_deepspeed checks for the DeepSpeed checkpoint files it would replace
        _refuse_non_empty(storage_for(str(dst)))
    cast = _float_dtype(dtype)
    size = parse_size(max_shard_size) if max_shard_size is not None else None
    if mapping is not None and to != "hf":
        raise UnsupportedError(f"convert to {to} takes no mapping: a mapping makes Hugging Face names and layouts; "
                               "convert to hf")
    if isinstance(mapping, str):
        mapping = load_mapping(mapping)
    if to == "omnickpt":   # to_omnickpt keeps the lossy records in the checkpoint it writes
        result = to_omnickpt(str(src), str(dst), key=key, dtype=cast, part_bytes=size or PART_BYTES,
                             transforms=transforms, progress=progress, workers=workers,
                             allow_lossy_cast=allow_lossy_cast)
        return _summary(result, to, dst, {})
    # checked here for the exporters; to_omnickpt checks these with the manifest its reader holds
    source = read_manifest(storage_for(str(src)))
    _refuse_in_bases(str(src), str(dst), source)
    if to == "hf":
        # "." is the command line's spelling of the top-level tensors (key ""), which a shell makes awkward
        key = TOP_LEVEL if key == "." else key
        result, lossy = _convert_hf(str(src), str(dst), source, key=key, dtype=cast, size=size,
                                    transforms=transforms, progress=progress, workers=workers,
                                    allow_lossy_cast=allow_lossy_cast, mapping=mapping)
    elif to == "deepspeed":
        result, lossy = _convert_deepspeed(str(src), str(dst), source, key=key, dtype=cast, size=size,
                                           transforms=transforms, progress=progress, optimizer_key=optimizer_key,
                                           tag=tag, overwrite=overwrite)
    else:
        result, lossy = _convert_dcp(str(src), str(dst), source, key=key, dtype=cast, size=size,
                                     transforms=transforms, progress=progress)
    return _summary(result, to, dst, lossy)


def _float_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a torch dtype (None: no cast); ValueError unless it is a floating-point one."""
    cast = as_dtype(dtype)
    if cast is not None and not cast.is_floating_point:
        raise ValueError(f"dtype {cast} is not a floating-point type; only floating-point tensors are cast")
    return cast


def _convert_hf(src: str, dst: str, source: Manifest, *, key: str | None, dtype: torch.dtype | None,
                size: int | None, transforms: Sequence[Any], progress: bool, workers: int,
                allow_lossy_cast: bool, mapping: MappingFn | None = None) -> tuple[dict, dict[str, dict]]:
    """convert(to="hf"): (export_hf's summary, with "lossy_casts" when a cast lost values; the lossy records
    of the entry it exported, under the names it wrote them: with a mapping, under the source's names, as
    what the mapping made of them cannot be said)."""
    for transform in transforms:   # the lossy records under the names the export writes
        source = transform.apply(source)
    lossy = dict(source.quantized)
    losses = CastLosses(allow_lossy_cast)   # the export casts each tensor through it as it writes it
    result = export_hf(src, dst, key=key, dtype=dtype, max_shard_size=size or HF_SHARD_BYTES,
                       transforms=tuple(transforms), workers=workers, progress=progress, losses=losses,
                       mapping=mapping)
    # the records of the entry exported ("entry" says which in words); key "" is the top-level tensors
    lossy = {n: r for n, r in lossy.items() if (n.split("/", 1)[0] if "/" in n else "") == result["key"]}
    if losses.counts:
        result = dict(result, lossy_casts=losses.counts)
    return result, lossy


def _convert_dcp(src: str, dst: str, source: Manifest, *, key: str | None, dtype: torch.dtype | None,
                 size: int | None, transforms: Sequence[Any], progress: bool) -> tuple[dict, dict[str, dict]]:
    """convert(to="dcp"): (export_dcp's summary, the source's lossy records). UnsupportedError for an option
    given, as DCP takes none of them."""
    given = [n for n, v in (("key", key), ("dtype", dtype), ("max_shard_size", size),
                            ("transforms", tuple(transforms))) if v]
    if given:
        raise UnsupportedError(f"convert to dcp takes no {', '.join(given)}: PyTorch DCP stores the checkpoint's "
                               "tensors as they are (convert to omnickpt first to select, cast or transform)")
    return export_dcp(src, dst, progress=progress), dict(source.quantized)


def _convert_deepspeed(src: str, dst: str, source: Manifest, *, key: str | None, dtype: torch.dtype | None,
                       size: int | None, transforms: Sequence[Any], progress: bool, optimizer_key: str | None,
                       tag: str | None, overwrite: bool) -> tuple[dict, dict[str, dict]]:
    """convert(to="deepspeed"): (export_deepspeed's summary, the source's lossy records). UnsupportedError for
    dtype, max_shard_size and transforms: DeepSpeed's universal tensors are fp32, one file each, under the
    engine's parameter names."""
    given = [n for n, v in (("dtype", dtype), ("max_shard_size", size), ("transforms", tuple(transforms))) if v]
    if given:
        raise UnsupportedError(f"convert to deepspeed takes no {', '.join(given)}: a DeepSpeed universal checkpoint "
                               "holds fp32 tensors, one file per tensor, under the model's parameter names "
                               "(convert to omnickpt first to rename or transform)")
    result = export_deepspeed(src, dst, tag=tag, model_key=key, optimizer_key=optimizer_key, overwrite=overwrite,
                              progress=progress)
    return result, dict(source.quantized)


def _summary(result: dict | None, to: str, dst: str, lossy: dict[str, dict]) -> dict:
    """convert's summary: the target's own, with at least "to" and "path", and "lossy" when the source held any."""
    result = dict(result or {})
    result.setdefault("to", to)
    result.setdefault("path", str(dst))
    if lossy:
        # hf and dcp have nowhere to record it: the summary is the one place that still says so
        result.setdefault("lossy", lossy)
    return result


def location(path: str) -> tuple[str, ...]:
    """A comparable form of a checkpoint's place: ("file", *components of its real path) for a local
    path or file:// URL (symlinks and relative parts resolved: what the path names, not how it is
    spelt), (scheme, *components) for other URLs (s3://bucket/prefix: ("s3", "bucket", *prefix);
    fsspec+SCHEME:// as SCHEME://)."""
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    if "://" not in path:
        real = os.path.realpath(os.path.expanduser(path))
        return ("file",) + tuple(p for p in real.replace(os.sep, "/").split("/") if p)
    scheme, _, rest = path.partition("://")
    scheme = scheme.lower().removeprefix("fsspec+")
    if scheme in ("file", "local"):
        return location(rest)
    return (scheme,) + tuple(p for p in posixpath.normpath("/" + rest).split("/") if p)


def _inside(inner: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    return inner[:len(outer)] == outer


def refuse_nested(src: str, dst: str) -> None:
    """CheckpointError unless `dst` and `src` are apart: neither the same place nor one inside the
    other. A destination inside a checkpoint is deleted by that checkpoint's next save into its folder
    (it removes the data files its new manifest does not name) or by retention; a source inside the
    destination would be written over."""
    a, b = location(src), location(dst)
    if a == b:
        raise CheckpointError(f"the destination {dst} is the source {src} itself; pass a new, empty folder")
    if _inside(b, a):
        raise CheckpointError(f"the destination {dst} lies inside the source checkpoint {src}: the "
                              "source's next save or its retention would delete it; pass a folder outside the source")
    if _inside(a, b):
        raise CheckpointError(f"the source checkpoint {src} lies inside the destination {dst}; pass a "
                              "destination that does not hold the source")


def _refuse_in_bases(src: str, dst: str, manifest: Manifest) -> None:
    """CheckpointError when `dst` lies inside a folder an incremental `src` references (its files
    `../<folder>/...`): retention of that folder keeps only the files checkpoints reference."""
    from omnickpt.storage.linked import sibling_path
    for folder in sorted({f.path.split("/")[1] for f in manifest.files if f.path.startswith("../")}):
        base = sibling_path(src, folder)
        if _inside(location(dst), location(base)):
            raise CheckpointError(f"the destination {dst} lies inside {base}, a checkpoint folder the "
                                  f"source {src} references; its retention would delete it: pass a folder outside")


def _refuse_non_empty(storage: Storage) -> None:
    """CheckpointError naming what the destination holds, when it holds anything (any storage, not only a
    local folder: the check every exporter makes, omnickpt.export.destination.refuse_occupied)."""
    if storage.exists(""):
        refuse_occupied(storage.describe(), storage.list(""), why="a conversion never writes over existing files")


# ---------------------------------------------------------------------- into omnickpt, streamed
@dataclass(frozen=True)
class _Piece:
    """One stored range of the new checkpoint: a box of a tensor, or one object value."""
    name: str                       # tensor name or object key
    nbytes: int
    box: Box | None = None          # tensors
    entry: ObjectEntry | None = None   # objects (the source's record)


@dataclass
class _Part:
    """One data file: pieces at aligned offsets."""
    pieces: list[tuple[_Piece, int]] = field(default_factory=list)
    size: int = 0


def plan_parts(pieces: Sequence[_Piece], part_bytes: int) -> list[_Part]:
    """Lay pieces out back to back (aligned) in data files of at most `part_bytes` each; a piece
    larger than that gets a file of its own. Pieces keep their order."""
    parts = [_Part()]
    for p in pieces:
        cur = parts[-1]
        start = -(-cur.size // ALIGN) * ALIGN
        if cur.pieces and start + p.nbytes > part_bytes:
            cur = _Part()
            parts.append(cur)
            start = 0
        cur.pieces.append((p, start))
        cur.size = start + p.nbytes
    return [p for p in parts if p.pieces]


def _selected(names: Sequence[str], key: str | None) -> list[str]:
    return [n for n in names if key is None or n == key or n.startswith(f"{key}/")]


def to_omnickpt(src: str, dst: str, *, key: str | None = None, dtype: torch.dtype | None = None,
                part_bytes: int = PART_BYTES, transforms: Sequence[Any] = (), progress: bool = True,
                workers: int = 4, allow_lossy_cast: bool = False) -> dict:
    """Write the checkpoint at `src` (any format omnickpt reads) as an omnickpt checkpoint at `dst`
    (see `convert`): every tensor (of `key`) read box by box, verified as a load verifies, cast
    to `dtype` when floating point (not an optimizer's step counts and scalar state; refusing a cast
    that overflows or flushes values unless `allow_lossy_cast`), written with chunk checksums into
    data files of at most `part_bytes`; every object value copied as its encoded bytes (nothing is
    decoded, so pickled values pass through unopened); the manifest written last, atomically. A
    tensor the source holds quantized keeps that record (see the module docstring). On any failure
    the data files written so far are removed and nothing is committed."""
    t_start = time.perf_counter()
    refuse_nested(src, dst)
    storage = storage_for(dst)
    _refuse_non_empty(storage)
    timer = PhaseTimer()
    written: list[str] = []
    losses = CastLosses(allow_lossy_cast)
    with CheckpointReader(src, transforms=transforms, workers=workers) as reader, \
            ThreadPoolExecutor(max(1, workers), thread_name_prefix="omnickpt-convert") as pool:
        source = reader.manifest
        _refuse_in_bases(src, dst, source)   # transforms rewrite tensors, never files
        names, object_keys = _selected_entries(reader, key)
        out_dtype = {n: _target_dtype(n, source.tensors[n], dtype) for n in names}
        lossy = _lossy_records(source, names)
        _refuse_unrecorded_lossy(lossy, out_dtype)
        # per lossy tensor cast to another dtype: the largest |x' - cast(x')|, added to its recorded error
        cast_error = {n: 0.0 for n in lossy if out_dtype[n] != dtype_from_name(source.tensors[n].dtype)}
        pieces = _pieces(source, names, object_keys, out_dtype, part_bytes)
        parts = plan_parts(pieces, part_bytes)
        save_id = uuid.uuid4().hex[:16]
        files: list[FileEntry] = []
        tensors = {n: TensorEntry(tuple(source.tensors[n].shape), dtype_name(out_dtype[n]), []) for n in names}
        objects: dict[str, list[ObjectEntry]] = {}
        bar = _progress_bar(sum(p.nbytes for p in pieces), progress)
        try:
            for i, part in enumerate(parts):
                rel = f"{DATA_DIR}/{save_id}-p{i:05d}.bin"
                sums = _write_part(reader, storage, rel, part, out_dtype, pool, timer, bar, written, losses,
                                   cast_error)
                files.append(FileEntry(rel, 0, part.size))
                _record_part(part, i, sums, tensors, objects, out_dtype, lossy)
            _add_cast_error(lossy, cast_error)
            layout = _converted_layout(source, reader, dtype, losses)
            manifest = _new_manifest(save_id, source.world_size, files, tensors, objects, layout, lossy)
            with timer.phase("commit"):
                storage.commit(MANIFEST_NAME, manifest.encode())
        except BaseException:
            _remove_files(storage, written)
            raise
        finally:
            bar.close()
    seconds = time.perf_counter() - t_start
    _write_report(storage, timer, seconds, save_id, reader.location)
    return {"to": "omnickpt", "path": storage.describe(), "source": reader.location, "source_format": reader.format,
            "save_id": save_id, "tensors": len(tensors), "objects": sum(len(v) for v in objects.values()),
            "files": len(files), "bytes": sum(f.bytes for f in files), "seconds": seconds} | _losses(lossy, losses)


def _selected_entries(reader: CheckpointReader, key: str | None) -> tuple[list[str], list[str]]:
    """(tensor names, object keys) of `reader`'s checkpoint that to_omnickpt copies: all, or those of `key`.
    CheckpointError naming the keys there are when `key` selects nothing."""
    names = _selected(reader.names(), key)
    object_keys = _selected(reader.object_keys(), key)
    if key is not None and not names and not object_keys:
        raise CheckpointError(f"{reader.location} holds no tensor or object under key {key!r}; its keys are "
                              f"{sorted({n.split('/', 1)[0] for n in reader.names() + reader.object_keys()})}")
    return names, object_keys


def _refuse_unrecorded_lossy(lossy: dict[str, dict], out_dtype: dict[str, torch.dtype]) -> None:
    """UnsupportedError for a lossy tensor written as a dtype whose quantized record the format cannot hold:
    writing it without the record would pass a lossy copy off as exact."""
    for n in lossy:
        if dtype_name(out_dtype[n]) not in QUANT_DTYPES:
            raise UnsupportedError(f"{n} is a lossy (quantized) copy and the omnickpt format records that only "
                                   f"for tensors of {', '.join(QUANT_DTYPES)}, not {dtype_name(out_dtype[n])}; "
                                   "cast to one of those, or leave this tensor out with key=")


def _pieces(source: Manifest, names: Sequence[str], object_keys: Sequence[str], out_dtype: dict[str, torch.dtype],
            part_bytes: int) -> list[_Piece]:
    """What to_omnickpt stores, in order: each tensor in slabs that fit a part, then each object value."""
    pieces: list[_Piece] = []
    for n in names:
        entry = source.tensors[n]
        sizes = (dtype_from_name(entry.dtype).itemsize, out_dtype[n].itemsize)
        # both the source slab and the cast result of one piece stay within a part
        for box in slab_boxes(entry.shape, max(1, part_bytes // max(sizes))):
            pieces.append(_Piece(n, box.numel * sizes[1], box=box))
    for k in object_keys:
        for e in source.objects[k]:
            pieces.append(_Piece(k, len(e.inline) if e.inline is not None else e.nbytes, entry=e))
    return pieces


def _progress_bar(total: int, progress: bool):
    """to_omnickpt's byte progress bar on stderr (disabled, but still a bar to update, without `progress`)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert to omnickpt",
                disable=not progress, leave=False)


def _record_part(part: _Part, file: int, sums: list[list[int]], tensors: dict[str, TensorEntry],
                 objects: dict[str, list[ObjectEntry]], out_dtype: dict[str, torch.dtype],
                 lossy: dict[str, dict]) -> None:
    """Add the manifest records of the pieces of data file number `file`, written with chunk CRCs `sums`."""
    for (piece, offset), crcs in zip(part.pieces, sums):
        if piece.box is not None:
            tensors[piece.name].boxes.append(_stored_box(piece, file, offset, crcs, out_dtype[piece.name],
                                                         lossy.get(piece.name), bool(lossy)))
        else:
            objects.setdefault(piece.name, []).append(
                ObjectEntry(list(piece.entry.ranks), file, offset, piece.nbytes, crcs[0]))


def _add_cast_error(lossy: dict[str, dict], cast_error: dict[str, float]) -> None:
    for n, err in cast_error.items():
        # a bound of |x - cast(x')| for the original x, no longer a measurement (finite: JSON)
        lossy[n]["max_error"] = min(lossy[n]["max_error"] + err, sys.float_info.max)


def _converted_layout(source: Manifest, reader: CheckpointReader, dtype: torch.dtype | None,
                      losses: CastLosses) -> dict:
    """The new manifest's layout: the source's (its format is ours now), with where it came from and how."""
    layout = {k: v for k, v in source.layout.items() if k != "format"}
    layout.setdefault("world_size", source.world_size)
    layout["converted_from"] = {"format": reader.format, "path": reader.location}
    if dtype is not None:
        layout["converted_from"]["dtype"] = dtype_name(dtype)
    if losses.counts:
        layout["converted_from"]["lossy_casts"] = losses.counts
    return layout


def _new_manifest(save_id: str, world_size: int, files: list[FileEntry], tensors: dict[str, TensorEntry],
                  objects: dict[str, list[ObjectEntry]], layout: dict, lossy: dict[str, dict]) -> Manifest:
    from omnickpt.version import __version__
    # A lossy tensor keeps its codec record; the chunked layout ("none": every chunk raw) is
    # what lets a manifest carry one (format.md, "Quantized tensors").
    return Manifest(save_id=save_id, world_size=world_size, files=files, tensors=tensors,
                    objects=objects, layout=layout, tool_version=__version__, created=time.time(),
                    chunk_bytes=CHUNK_BYTES, compression="none" if lossy else None, quantized=lossy)


def _remove_files(storage: Storage, written: Sequence[str]) -> None:
    """Delete what a failed conversion wrote, as far as the storage lets us."""
    for rel in written:
        try:
            storage.delete(rel)
        except Exception:   # the storage may be what failed; the original error matters more
            pass


def _write_report(storage: Storage, timer: PhaseTimer, seconds: float, save_id: str, source: str) -> None:
    """Write the conversion's report.json beside the committed checkpoint, if the storage lets us."""
    report = summarize("save", [timer.as_dict()], total_seconds=seconds)
    report.update(kind="convert", path=storage.describe(), save_id=save_id, source=source)
    try:
        storage.commit("report.json", _json(report))
    except CheckpointError:
        pass   # informational; the checkpoint is committed


def _losses(lossy: dict[str, dict], losses: CastLosses) -> dict:
    """to_omnickpt's summary entries for what is lossy: "lossy" records and "lossy_casts" counts, where any."""
    return ({"lossy": lossy} if lossy else {}) | ({"lossy_casts": losses.counts} if losses.counts else {})


def _lossy_records(source: Manifest, names: Sequence[str]) -> dict[str, dict]:
    """{name: {"scheme", "max_error"}} of the selected tensors the source holds quantized, copies (a
    cast adds to them). `source` is the manifest after transforms, which carry each record over to
    the names and fusing they make (transforms.py)."""
    return {n: {"scheme": source.quantized[n]["scheme"], "max_error": float(source.quantized[n]["max_error"])}
            for n in names if n in source.quantized}


def _stored_box(piece: _Piece, file: int, offset: int, crcs: list[int], dtype: torch.dtype, lossy: dict | None,
                chunked: bool) -> SavedBox:
    """The manifest record of a written box: plain, or in a chunked layout (a checkpoint that keeps
    lossy records) every chunk stored raw, marked with its tensor's scheme where it is lossy."""
    box = SavedBox.stored(piece.box.offsets, piece.box.lengths, file, offset, piece.nbytes, crcs)
    if not chunked:
        return box
    raw = tuple(min(CHUNK_BYTES, piece.nbytes - a) for a in range(0, piece.nbytes, CHUNK_BYTES))
    box.sums = Sums(offset, offset + piece.nbytes, CHUNK_BYTES, tuple(crcs), stored=raw,
                    codec=lossy["scheme"] if lossy else "none", itemsize=dtype.itemsize, dtype=dtype_name(dtype))
    return box


def _rows(box: Box) -> str:
    return f"{box.offsets[0]}:{box.offsets[0] + box.lengths[0]}" if box.lengths else "-"


def _largest_difference(a: torch.Tensor, b: torch.Tensor, step: int = 1 << 22) -> float:
    """max |a - b| in float64 (inf where one side overflowed), a slab at a time: a piece can be a GiB."""
    a, b = a.reshape(-1), b.reshape(-1)
    out = 0.0
    for i in range(0, a.numel(), step):
        d = (a[i:i + step].double() - b[i:i + step].double()).abs()
        # posinf too: nan_to_num's default would turn an overflow into the largest float64
        d = torch.where(torch.isnan(a[i:i + step]), torch.zeros_like(d),
                        torch.nan_to_num(d, nan=math.inf, posinf=math.inf))
        out = max(out, float(d.max()))
    return out


def _json(doc: dict) -> bytes:
    import json
    return json.dumps(doc).encode()


def _target_dtype(name: str, entry: TensorEntry, dtype: torch.dtype | None) -> torch.dtype:
    """What tensor `name` is written as: `dtype` for a floating-point tensor, except an optimizer's step
    counts and scalar state (format/cast.py keeps_dtype), else its saved dtype."""
    src = dtype_from_name(entry.dtype)
    if dtype is None or not src.is_floating_point or keeps_dtype(name, entry.shape):
        return src
    return dtype


def _write_part(reader: CheckpointReader, storage: Storage, rel: str, part: _Part, out_dtype: dict,
                pool: ThreadPoolExecutor, timer: PhaseTimer, bar, written: list[str], losses: CastLosses,
                cast_error: dict[str, float]) -> list[list[int]]:
    """Fill one data file's bytes in memory, checksum them per chunk, write the file. Returns the
    chunk CRCs of each piece, in order. Casts go through `losses`; for the tensors of `cast_error`
    the largest rounding the cast made is kept there."""
    buf = torch.zeros(part.size, dtype=torch.uint8)   # zeros: the alignment gaps are written too
    direct, direct_dests, casts = [], [], []
    for piece, offset in part.pieces:
        region = buf[offset:offset + piece.nbytes]
        if piece.entry is not None:
            region.numpy()[:] = memoryview(reader.object_bytes(piece.name, piece.entry))
            continue
        saved = reader.info(piece.name).dtype
        view = region.view(out_dtype[piece.name]).view(piece.box.lengths)
        if saved == out_dtype[piece.name]:
            direct.append((piece.name, piece.box))   # read straight into the part's memory
            direct_dests.append(view)
        else:
            casts.append((piece, view))
    if direct:
        reader.read_into(direct, direct_dests)
    for piece, view in casts:   # one at a time: the source-dtype copy is never more than one piece
        values = reader.get(piece.name, piece.box)
        view.copy_(values)
        shape = reader.info(piece.name).shape
        where = "" if tuple(piece.box.lengths) == tuple(shape) else f"rows {_rows(piece.box)} of {shape[0]}"
        losses.check(values, view, piece.name, where)
        if piece.name in cast_error:
            cast_error[piece.name] = max(cast_error[piece.name], _largest_difference(values, view))
    with timer.phase("checksum"):
        whole = tensor_bytes_view(buf)
        # A tensor box has one CRC per chunk (a partial read verifies what it reads), an object
        # one CRC of all its bytes (it is always read whole).
        chunks = [(i, whole[a:min(a + CHUNK_BYTES, off + p.nbytes) if p.box is not None else off + p.nbytes])
                  for i, (p, off) in enumerate(part.pieces)
                  for a in (range(off, off + p.nbytes, CHUNK_BYTES) if p.box is not None else (off,))]
        crcs = list(pool.map(lambda c: checksum(c[1]), chunks))
        out: list[list[int]] = [[] for _ in part.pieces]
        for (i, _), crc in zip(chunks, crcs):
            out[i].append(crc)
    written.append(rel)
    t0 = time.perf_counter()
    phases = storage.write_file(rel, part.size, [Segment(0, whole)], pool, durable=True) or {}
    for name, secs in phases.items():
        timer.add(name, secs)
    timer.add("write", time.perf_counter() - t0 - sum(phases.values()))
    timer.count("written", part.size)
    bar.update(sum(p.nbytes for p, _ in part.pieces))
    return out


__all__ = ["HF_SHARD_BYTES", "PART_BYTES", "TARGETS", "convert", "load_mapping", "location", "parse_size",
           "parse_transform", "plan_parts", "refuse_nested", "to_omnickpt"]
