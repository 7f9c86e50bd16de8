"""Writing a DeepSpeed universal checkpoint from any checkpoint omnickpt reads (`export_deepspeed`), so that a
run can move back to DeepSpeed: `engine.load_checkpoint(dst)` with `{"checkpoint": {"load_universal": true}}`
restores the fp32 master weights and the Adam moments at any data-parallel size and ZeRO stage 1, 2 or 3.

What DeepSpeed's universal loader reads (deepspeed/runtime/engine.py `load_checkpoint`, the ZeRO optimizers'
`_load_universal_checkpoint`, deepspeed/checkpoint/universal_checkpoint.py), and so what is written:

    <dst>/<tag>/zero/<param>/fp32.pt        {"param": full fp32 tensor, "cat_dim": 0}; exp_avg.pt, exp_avg_sq.pt alike
    <dst>/<tag>/zero/<param>/step.pt        the parameter's Adam step (ZeRO 1/2 read it per parameter)
    <dst>/<tag>/zero/optimizer_state.pt     the param groups' hyperparameters, ds_version; and, for ZeRO-3,
                                            "optimizer_state_dict" {"state": {0: {"step"}}, "param_groups"}
    <dst>/<tag>/mp_rank_00_model_states.pt  counters (global_steps, skipped_steps, dp/mp world size), param_shapes,
                                            and "module": the model's tensors that are no parameter of the optimizer
                                            (buffers, frozen weights), which DeepSpeed's universal load leaves alone
    <dst>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same record, under the name ZeRO-3 globs for
    <dst>/latest_universal, <dst>/latest    the tag, written last

The tag folder is written under a temporary name inside `dst`, every file fsynced, then renamed into place;
the pointer files follow, each written to a temporary name, fsynced and renamed, and the folder fsynced: a
conversion that fails at any point leaves no `latest` naming a partial tag (and the temporary folder removed).
Tensors are read one at a time through the CheckpointReader and dropped once written.
"""
from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from omnickpt.adapters.generic import parse_per_rank_name
from omnickpt.adapters.module import canonical_name
from omnickpt.errors import CheckpointError, MismatchError, UnsafeCheckpointError, UnsupportedError
from omnickpt.export.destination import FULL_DISK_HINT, Destination, byte_progress
from omnickpt.reader import CheckpointReader
from omnickpt.storage.base import os_failure

# The pointer files DeepSpeed reads for the newest tag: `latest_universal` with load_universal, `latest` without
# (written too, so that a load that forgot load_universal fails on the missing ZeRO files instead of warning
# "Unable to find latest file" and training on from the engine's fresh initialisation).
LATEST_FILES = ("latest_universal", "latest")
# ZeRO-1/2's loader asserts a version of at least 0.3.17 in optimizer_state.pt: the DeepSpeed release whose
# universal layout this writes (checked against 0.19.8).
DS_VERSION = "0.19.8"
# The Adam moments DeepSpeed's ZeRO-3 universal loader requires of every parameter (ZeRO 1/2 load any).
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class _Param:
    """One parameter of the optimizer: its name in DeepSpeed (the plain module's fqn), the source's tensor names."""
    fqn: str
    weight: str                    # "model/<fqn>"
    state: dict[str, str]          # {"exp_avg": "optimizer/state/<fqn>/exp_avg", ...}; "step" when a tensor
    step: Any                      # the step when the optimizer object holds it as a value, else None


def export_deepspeed(src: str, dst: str, *, tag: str | None = None, model_key: str | None = None,
                     optimizer_key: str | None = None, overwrite: bool = False, progress: bool = True,
                     allow_pickle: bool = False) -> dict:
    """Write the checkpoint at `src` (anything omnickpt reads holding a model and its torch Adam/AdamW state) as
    a DeepSpeed universal checkpoint in the local folder `dst`, tag `tag` (default "global_step<N>", N the
    optimizer's step). Load it with a DeepSpeed engine built on the same model, at any data-parallel size,
    ZeRO stage 1, 2 or 3, fp32 or bf16, configured with `{"checkpoint": {"load_universal": true}}`:
    `engine.load_checkpoint(dst)` (with an lr scheduler, pass load_lr_scheduler_states=False: none is written).
    The engine's fp32 master weights are the source's weights, its exp_avg / exp_avg_sq the source's moments
    and its param groups' hyperparameters (lr, betas, eps, weight_decay...) the source's.

    `model_key` / `optimizer_key` name the state entries holding the model and the optimizer (default: inferred
    from the manifest's layout["frameworks"] and the entries' contents, "model" and "optimizer" when those hold
    them). Parameters are the optimizer's param groups' "params", in order; the model's other tensors
    (buffers, frozen weights) go to the "module" of mp_rank_00_model_states.pt, which DeepSpeed's universal load
    does not restore: load them from there yourself when the model has any.

    Refused before anything is written: a source with no optimizer state (UnsupportedError: a universal
    checkpoint is the optimizer's state; export to hf for weights only) or with one that is not Adam/AdamW's
    (no exp_avg / exp_avg_sq at all), a parameter without exp_avg /
    exp_avg_sq or with a step differing from the others' (DeepSpeed keeps one step per group), a
    parameter name unusable as a folder name (UnsafeCheckpointError), and a `dst` already holding a DeepSpeed
    checkpoint (`latest`, `latest_universal` or the tag: CheckpointError) unless `overwrite`; other files in
    `dst` stay. With `overwrite` the old tag folder is replaced only once the new one is complete. A failed
    export leaves `dst` as it found it; a failed write raises StorageError naming the file.

    Returns {"path", "tag", "params", "buffers", "tensors", "bytes", "seconds"}.
    """
    t0 = time.perf_counter()
    dest = Destination(src, dst)
    with CheckpointReader(str(src), workers=1, allow_pickle=allow_pickle) as reader:
        where = reader.location
        objects = reader.objects()
        opt_key = optimizer_key or _optimizer_key(reader, objects, where)
        if not isinstance(objects.get(opt_key), dict) or not _is_optimizer(objects[opt_key]):
            raise UnsupportedError(f"{where}: state entry {opt_key!r} holds no optimizer (no object with "
                                   f"param_groups and state); pass optimizer_key= naming the optimizer's entry")
        mod_key = _model_key(reader, opt_key, objects[opt_key], model_key, where)
        groups, params = _params(reader, objects[opt_key], mod_key, opt_key, where)
        step = _common_step(reader, params, where)
        tag = tag if tag is not None else f"global_step{_as_int(step)}"
        _check_folder_name(tag, "tag", where)
        if tag in LATEST_FILES:
            raise UnsupportedError(f"tag {tag!r} is the name of DeepSpeed's pointer file beside the tags; pick another")
        in_groups = {p.weight for p in params}
        extras = [n for n in reader.names() if n.startswith(f"{mod_key}/") and n not in in_groups
                  and parse_per_rank_name(n) is None]
        clashes = {tag, *LATEST_FILES}
        if not overwrite:
            dest.refuse_occupied(clashes=lambda n: n in clashes,
                                 why="an export never replaces a DeepSpeed checkpoint unless told to (overwrite=True, "
                                     "--overwrite)")
        total = sum(reader.info(n).nbytes for p in params for n in (p.weight, *(p.state[m] for m in _MOMENTS)))
        extra_bytes = sum(reader.info(n).nbytes for n in extras)
        bar = byte_progress(total, progress)
        with dest:
            staging = dest.file(f".{tag}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                _make_dir(staging)
                written = _write_zero(reader, staging, params, step, bar)
                _save(os.path.join(staging, "zero", "optimizer_state.pt"), _optimizer_state(groups, step))
                record = _model_states(reader, mod_key, extras, params, groups, step, where)
                for name in _MODEL_FILES:
                    _save(os.path.join(staging, name), record)
                _fsync_dir(staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            finally:
                if bar is not None:
                    bar.close()
            _commit(dest, staging, tag)
    return {"path": dest.path, "tag": tag, "params": len(params), "buffers": len(extras), "tensors": written,
            "bytes": total + extra_bytes, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------- what the source holds
def _is_optimizer(value: Any) -> bool:
    """The object omnickpt's optimizer adapter saves: {"param_groups": [{..., "params": [names]}], "state": ...}."""
    groups = value.get("param_groups") if isinstance(value, dict) else None
    return (isinstance(groups, list) and "state" in value
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups))


def _optimizer_key(reader: CheckpointReader, objects: dict[str, Any], where: str) -> str:
    """The entry holding the optimizer: "optimizer" when it is one, else the only entry that is."""
    found = [k for k, v in objects.items() if "/" not in k and _is_optimizer(v)]
    if "optimizer" in found:
        return "optimizer"
    if len(found) == 1:
        return found[0]
    if not found:
        raise UnsupportedError(
            f"{where} holds no optimizer state (its entries: {sorted({n.split('/', 1)[0] for n in reader.names()})}"
            f"; frameworks: {reader.layout.get('frameworks') or 'none recorded'}). A DeepSpeed universal checkpoint "
            "is the optimizer's state (fp32 master weights and Adam moments per parameter), and DeepSpeed's "
            "universal load reads them all: save the optimizer beside the model (omnickpt.save(path, {'model': "
            "model, 'optimizer': opt})), or export the weights alone with `omnickpt convert SRC DST --to hf`")
    raise MismatchError(f"{where}: which entry is the optimizer is ambiguous ({', '.join(sorted(found))}); pass "
                        "optimizer_key= (--optimizer-key)", [f"{k!r}: candidate" for k in sorted(found)])


def _model_key(reader: CheckpointReader, opt_key: str, optimizer: dict, given: str | None, where: str) -> str:
    """The entry holding the model. When the state held several modules, omnickpt's optimizer adapter names
    each parameter "<module key>/<fqn>": that key. Otherwise `given`, else "model" when it holds tensors, else the
    only entry recorded as a module (a framework without a dotted class path: plain, ddp, fsdp2...)."""
    names = [n for g in optimizer["param_groups"] for n in g["params"] if isinstance(n, str)]
    keys = sorted({n.split("/", 1)[0] for n in names if "/" in n})
    if keys:
        if len(keys) > 1 or len(keys) != len({n.split("/", 1)[0] if "/" in n else "" for n in names}):
            raise UnsupportedError(f"{where}: the optimizer {opt_key!r} steps the parameters of several state "
                                   f"entries ({', '.join(keys)}); a DeepSpeed engine trains one module: save that "
                                   "module and its optimizer alone")
        if given is not None and given != keys[0]:
            raise MismatchError(f"{where}: the optimizer {opt_key!r} steps the parameters of {keys[0]!r}, not of "
                                f"model_key {given!r} (--key)", [f"{given!r}: not the optimizer's module"])
        return keys[0]
    if given is not None:
        return given
    held = {n.split("/", 1)[0] for n in reader.names() if "/" in n} - {opt_key}
    if "model" in held:
        return "model"
    frameworks = reader.layout.get("frameworks") or {}
    modules = sorted(k for k in held if k in frameworks and "." not in str(frameworks[k]))
    if len(modules) == 1:
        return modules[0]
    if len(held) == 1 and not modules:
        return next(iter(held))
    raise MismatchError(f"{where}: which entry is the model is ambiguous (entries with tensors: "
                        f"{sorted(held) or 'none'}); pass model_key= (--key on the command line)",
                        [f"{k!r}: candidate" for k in (modules or sorted(held))])


def _params(reader: CheckpointReader, optimizer: dict, mod_key: str, opt_key: str,
            where: str) -> tuple[list[dict], list[_Param]]:
    """(the param groups with "params" as indices, every parameter in group order), each checked: a weight in
    the model entry, Adam's moments of its shape in the optimizer entry."""
    names = set(reader.names())
    if not any(n.startswith(f"{opt_key}/state/") and n.rpartition("/")[2] in _MOMENTS for n in names):
        kind = (reader.layout.get("frameworks") or {}).get(opt_key) or "its optimizer"
        raise UnsupportedError(f"{where}: {opt_key!r} ({kind}) holds no Adam moments (exp_avg, exp_avg_sq); a "
                               "DeepSpeed universal checkpoint holds an Adam/AdamW state, which the ZeRO-3 universal "
                               "load requires: only a torch Adam or AdamW checkpoint can be exported to DeepSpeed")
    state = optimizer.get("state") or {}
    state = {canonical_name(str(k)): v for k, v in state.items()} if isinstance(state, dict) else {}
    groups, params, seen = [], [], set()
    for g in optimizer["param_groups"]:
        indices = []
        for raw in g["params"]:
            if not isinstance(raw, str):
                raise UnsupportedError(f"{where}: param group of {opt_key!r} lists parameter {raw!r}, not a name; "
                                       "only a checkpoint saved with parameter names (omnickpt's optimizer "
                                       "adapter) says which weight each moment belongs to")
            # "<module key>/<fqn>" when the state held several modules (_model_key checked the key)
            qualified = canonical_name(raw)
            fqn = qualified.split("/", 1)[1] if "/" in qualified else qualified
            if fqn in seen:
                raise UnsupportedError(f"{where}: parameter {fqn!r} is in two param groups of {opt_key!r}")
            seen.add(fqn)
            _check_folder_name(fqn, "parameter name", where)
            weight = f"{mod_key}/{fqn}"
            if weight not in names:
                raise MismatchError(f"{where}: the optimizer {opt_key!r} lists parameter {fqn!r} but the model entry "
                                    f"{mod_key!r} holds no tensor {weight!r}; pass model_key= naming the entry "
                                    "holding its weights", [f"{weight}: missing"])
            prefix = f"{opt_key}/state/{qualified}/"
            held = {n[len(prefix):]: n for n in names if n.startswith(prefix) and "/" not in n[len(prefix):]}
            missing = [m for m in _MOMENTS if m not in held]
            if missing:
                raise UnsupportedError(
                    f"{where}: parameter {fqn!r} has no {' or '.join(missing)} in {opt_key!r} (the tensors "
                    f"{prefix}{{{','.join(_MOMENTS)}}}): DeepSpeed's universal load needs Adam's moments for every "
                    "parameter. A parameter that never got a gradient has none: save after a step that reaches "
                    "every parameter, or leave it out of the optimizer")
            shape = reader.info(weight).shape
            for n in (weight, *(held[m] for m in _MOMENTS)):
                if not reader.info(n).dtype.is_floating_point:
                    raise UnsupportedError(f"{where}: {n} is {reader.info(n).dtype}, not a floating-point tensor; "
                                           "DeepSpeed trains floating-point parameters only")
            for m in _MOMENTS:
                if reader.info(held[m]).shape != shape:
                    raise MismatchError(f"{where}: {held[m]} has shape {list(reader.info(held[m]).shape)}, its "
                                        f"parameter {weight} {list(shape)}", [f"{held[m]}: shape"])
            value_step = state[qualified].get("step") if isinstance(state.get(qualified), dict) else None
            if "step" not in held and value_step is None:
                raise UnsupportedError(f"{where}: parameter {fqn!r} has no Adam step in {opt_key!r}; DeepSpeed's "
                                       "universal load needs one")
            indices.append(len(params))
            params.append(_Param(fqn, weight, {k: held[k] for k in ("step", *_MOMENTS) if k in held},
                                 None if "step" in held else value_step))
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": indices})
    if not params:
        raise UnsupportedError(f"{where}: the optimizer {opt_key!r} has no parameters; nothing to export")
    return groups, params


def _common_step(reader: CheckpointReader, params: list[_Param], where: str) -> torch.Tensor:
    """The Adam step all parameters share (as a float32 0-d tensor, as torch's Adam holds it). DeepSpeed keeps
    one step per param group (ZeRO-3: one for all), so parameters stepped a different number of times (one
    frozen for a while) cannot be represented: refused, naming two of them."""
    first, first_value = None, None
    for p in params:
        value = reader.get(p.state["step"]) if "step" in p.state else torch.as_tensor(p.step)
        value = value.detach().to(torch.float32).reshape(())
        if first is None:
            first, first_value = p, value
        elif not torch.equal(value, first_value):
            raise UnsupportedError(f"{where}: parameters {first.fqn!r} (step {float(first_value):g}) and {p.fqn!r} "
                                   f"(step {float(value):g}) were stepped a different number of times; DeepSpeed "
                                   "keeps one Adam step for all parameters, so the moments' bias correction would "
                                   "change: not exported")
    return first_value


def _as_int(step: torch.Tensor) -> int:
    value = float(step)
    return int(value) if math.isfinite(value) else 0


def _check_folder_name(name: str, what: str, where: str) -> None:
    """DeepSpeed names a parameter's folder by the parameter's name and the tag's by the tag: neither may leave
    `dst` or be hidden inside another name."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeCheckpointError(f"{where}: {what} {name!r} cannot be a folder name in a DeepSpeed checkpoint "
                                    "(it is empty, '.', '..' or holds a path separator); rename it")


# ---------------------------------------------------------------------- the files
def _write_zero(reader: CheckpointReader, staging: str, params: list[_Param], step: torch.Tensor, bar) -> int:
    """zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt, one tensor in memory at a time. Returns the tensors written."""
    count = 0
    for p in params:
        folder = os.path.join(staging, "zero", p.fqn)
        _make_dir(folder)
        for key, name in (("fp32", p.weight), *((m, p.state[m]) for m in _MOMENTS)):
            value = reader.get(name)
            # DeepSpeed's universal tensors are fp32 (its master weights and moments): a bf16 source widens exactly
            _save(os.path.join(folder, f"{key}.pt"), {"param": value.to(torch.float32), "cat_dim": 0})
            count += 1
            if bar is not None:
                bar.update(value.numel() * value.element_size())
            del value
        _save(os.path.join(folder, "step.pt"), step.clone())
        _fsync_dir(folder)
    _fsync_dir(os.path.join(staging, "zero"))
    return count


def _optimizer_state(groups: list[dict], step: torch.Tensor) -> dict:
    """zero/optimizer_state.pt: what both ZeRO-1/2 (`param_groups`, `ds_version`) and ZeRO-3
    (`optimizer_state_dict`) read. The loss scaler and clip_grad are left out: the loaders keep the engine's."""
    return {"param_groups": groups, "ds_version": DS_VERSION,
            "optimizer_state_dict": {"state": {0: {"step": step.clone()}}, "param_groups": groups}}


def _model_states(reader: CheckpointReader, mod_key: str, extras: list[str], params: list[_Param],
                  groups: list[dict], step: torch.Tensor, where: str) -> dict:
    """The engine's record: what load_checkpoint reads from it (counters, world sizes) and the module's tensors
    that are no optimizer parameter (read here: they are what DeepSpeed's universal load does not restore)."""
    prefix = f"{mod_key}/"
    module = OrderedDict((canonical_name(n[len(prefix):]), reader.get(n)) for n in extras)
    shapes = [OrderedDict((params[i].fqn, torch.Size(reader.info(params[i].weight).shape)) for i in g["params"])
              for g in groups]
    return {"module": module, "buffer_names": list(module), "optimizer": None, "param_shapes": shapes,
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
            "skipped_steps": 0, "global_steps": _as_int(step),
            "dp_world_size": int(reader.layout.get("world_size") or 1), "mp_world_size": 1,
            "ds_version": DS_VERSION,
            # returned to the caller of load_checkpoint as client state: where the checkpoint came from
            "converted_from": {"format": reader.format, "path": where}}


def _save(path: str, value: Any) -> None:
    """torch.save `value` to `path` and fsync it (the folder it is in is fsynced once it is complete)."""
    try:
        with open(path, "xb") as f:
            torch.save(value, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise os_failure("writing the DeepSpeed export", path, e, device=os.path.dirname(path),
                         hint=FULL_DISK_HINT) from e
    except RuntimeError as e:   # torch's zip writer turns a failed write into a RuntimeError without the errno
        raise CheckpointError(f"writing the DeepSpeed export file {path} failed ({e}); check the space and "
                              "permissions there (what this export had written was removed)") from e


def _make_dir(path: str) -> None:
    try:
        os.makedirs(path)
    except OSError as e:
        raise os_failure("creating the DeepSpeed export folder", path, e, device=os.path.dirname(path)) from e


def _fsync_dir(path: str) -> None:
    """Make the names in folder `path` durable (a renamed or new file is not, until its folder is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise os_failure("syncing the DeepSpeed export folder", path, e, device=path) from e


def _commit(dest: Destination, staging: str, tag: str) -> None:
    """Install the complete staging folder as `<dst>/<tag>`, then publish the pointer files. A failure before the
    pointers are all written removes what this export put there (a new tag folder, pointer files that were not
    there before), so that no pointer names a tag the export did not finish; an old tag folder (overwrite) is
    moved aside first and removed only once the new one is in place."""
    final = dest.file(tag)
    existed = {name for name in LATEST_FILES if os.path.lexists(dest.file(name))}
    old = None
    try:
        if os.path.lexists(final):
            old = dest.file(f".{tag}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError:
            if old is not None:
                os.rename(old, final)
                old = None
            raise
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise os_failure("installing the DeepSpeed export", final, e, device=dest.path) from e
    try:
        _fsync_dir(dest.path)
        for name in LATEST_FILES:
            _publish(dest, name, tag)
    except BaseException:
        for name in set(LATEST_FILES) - existed:
            try:
                os.unlink(dest.file(name))
            except OSError:
                pass
        if old is None:   # a tag of its own: nothing names it now
            shutil.rmtree(final, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _publish(dest: Destination, name: str, tag: str) -> None:
    """`<dst>/<name>` holding `tag`: written to a temporary name, fsynced, renamed, the folder fsynced, so that
    it never names a tag whose files are not all durable, and is never seen half written."""
    path = dest.file(name)
    tmp = dest.file(f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "x") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise os_failure("publishing the DeepSpeed export", path, e, device=dest.path, hint=FULL_DISK_HINT) from e
    _fsync_dir(dest.path)


__all__ = ["DS_VERSION", "LATEST_FILES", "export_deepspeed"]
