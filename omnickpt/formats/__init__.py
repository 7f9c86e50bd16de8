"""Reading any checkpoint's manifest: our own `manifest.json`, else one of the readers of foreign
formats. Each turns a folder it recognises into our `Manifest`
(its tensors as boxes pointing at byte ranges of its own files, its small values decoded safely
and carried inline), so that planning, resharding, parallel ranged reads and transforms are the
same code for every format. A reader never executes code from the checkpoint.

Foreign manifests name tensors as ours do, `<state key>/<name inside it>`, with the key the
foreign format implies (`model` for a Hugging Face folder; the top-level keys of the state dict
DCP saved); `bind_keys` renames them to the keys of the state being loaded when those differ.

This package holds readers only (`hf.py`; `dcp/` and `deepspeed/`, one module per idea), tried in the static order of
`READERS`; writing those formats is omnickpt.export's, a layer above that reads through the checkpoint reader.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from omnickpt.errors import CheckpointError, NotCommittedError
from omnickpt.format import CONTROL_DIR, DATA_DIR, MANIFEST_NAME, Manifest
from omnickpt.lease import OWNER_RECORD
from omnickpt.steps import STEP_DIR, committed_steps, step_dir
from omnickpt.storage import Storage


@dataclass(frozen=True)
class ForeignReader:
    """One reader of a foreign format. `read` returns None when the folder is not in its format, and raises
    CorruptCheckpointError / UnsafeCheckpointError when it is but cannot be trusted. `read` is None when the
    reader cannot run here: `missing` then names the module it needs (shown when no reader recognises a folder)."""
    name: str                                          # layout["format"] of what it reads
    read: Callable[[Storage], Manifest | None] | None
    missing: str = ""
    # The folder under the foreign library's own keys (names="as_saved"), where they differ from what
    # omnickpt's adapters name (DCP's); None: the same view as `read`.
    as_saved: Callable[[Storage], Manifest | None] | None = None


def _unavailable(name: str, err: ImportError) -> ForeignReader:
    return ForeignReader(name, None, err.name or str(err))


# The readers, tried in this order after our own manifest.json (exporters live above, in omnickpt.export).
try:
    from omnickpt.formats import hf as _hf
    _HF = ForeignReader("hf", _hf.read_manifest)
except ImportError as e:   # an optional dependency missing: named in the "not a checkpoint" error
    _HF = _unavailable("hf", e)
try:
    from omnickpt.formats import dcp as _dcp
    _DCP = ForeignReader("dcp", _dcp.read_manifest, as_saved=lambda storage: _dcp.read_manifest(storage, "as_saved"))
except ImportError as e:
    _DCP = _unavailable("dcp", e)
try:
    from omnickpt.formats import deepspeed as _deepspeed
    _DEEPSPEED = ForeignReader("deepspeed", _deepspeed.read_manifest)
except ImportError as e:
    _DEEPSPEED = _unavailable("deepspeed", e)
READERS: tuple[ForeignReader, ...] = (_HF, _DCP, _DEEPSPEED)


NAMES = ("adapters", "as_saved")


def read_foreign(storage: Storage, names: str = "adapters") -> Manifest | None:
    """The manifest of the foreign checkpoint at `storage`, or None when no reader recognises it.
    `manifest.layout["format"]` names the format. `names="as_saved"`: under the foreign library's own
    keys (a DCP folder as `dcp.load` sees it) rather than as omnickpt's adapters name them."""
    if names not in NAMES:
        raise ValueError(f"names={names!r}: expected one of {', '.join(NAMES)}")
    for reader in READERS:
        if reader.read is None:
            continue
        read = reader.as_saved if names == "as_saved" and reader.as_saved is not None else reader.read
        manifest = read(storage)
        if manifest is not None:
            return manifest
    return None


def bind_keys(manifest: Manifest, state_keys: dict[str, str]) -> Manifest:
    """Rename the top-level keys of a foreign manifest's tensors and objects: `state_keys` maps a
    key the format implies to the state's own key (e.g. {"model": "net"})."""
    moves = {k: v for k, v in state_keys.items() if k != v}
    if not moves:
        return manifest

    def rename(name: str) -> str:
        key, sep, rest = name.partition("/")
        return f"{moves.get(key, key)}{sep}{rest}"

    return dataclasses.replace(manifest, tensors={rename(n): t for n, t in manifest.tensors.items()},
                               objects={rename(k): v for k, v in manifest.objects.items()})


def read_manifest(storage: Storage, raw: bytes | None = None, names: str = "adapters") -> Manifest:
    """The committed manifest at `storage`, or NotCommittedError saying why there is none. `raw`:
    its bytes, already read (a load reads them on one rank and shares them over the group).
    `names`: the view of a foreign folder (read_foreign); our own checkpoints have one."""
    try:
        if raw is None:
            raw = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        foreign = read_foreign(storage, names)   # a Hugging Face or DCP folder reads as our manifest
        if foreign is not None:
            return foreign
        if not storage.exists(""):
            raise NotCommittedError(f"no such checkpoint: {storage.describe()} does not exist") from None
        if storage.list(DATA_DIR) or [p for p in storage.list(CONTROL_DIR) if p != OWNER_RECORD]:
            raise NotCommittedError(
                f"{storage.describe()} is not a committed checkpoint: it has data files but no {MANIFEST_NAME} "
                "(an interrupted or failed save); load an earlier checkpoint") from None
        raise NotCommittedError(f"{storage.describe()} is not a committed checkpoint: no {MANIFEST_NAME} there"
                                + (_step_hint(storage) or _found(storage))) from None
    return Manifest.decode(raw, where=storage.describe(MANIFEST_NAME))


def _found(storage: Storage) -> str:
    """What a folder that is no checkpoint of any format we read holds, for the error message."""
    try:
        names = storage.children("")
    except CheckpointError:
        return ""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"; found {shown or 'nothing'}, none of which is a checkpoint this omnickpt reads: an omnickpt "
            f"{MANIFEST_NAME}, a Hugging Face model.safetensors (or model-*-of-*.safetensors with "
            "model.safetensors.index.json), a PyTorch DCP .metadata, or a DeepSpeed checkpoint (`latest` and "
            "*_model_states.pt)" + _missing_readers())


def _missing_readers() -> str:
    """Which readers could not run here, and the module each needs."""
    gone = [f"the {r.name} reader needs {r.missing}, which could not be imported" for r in READERS if r.read is None]
    return f" ({'; '.join(gone)}: install it to read that format)" if gone else ""


def _step_hint(storage: Storage) -> str:
    """Point someone who passed a CheckpointManager root at its step checkpoints."""
    try:
        steps = committed_steps(storage)
    except CheckpointError:
        return ""
    if not steps:
        return ""
    root = storage.describe().rstrip("/")
    shown = ", ".join(step_dir(s) for s in steps[-5:])
    return (f"; it is a checkpoint root holding {len(steps)} committed step checkpoint(s) ({shown}): pass one of "
            f"them, e.g. {root}/{step_dir(steps[-1])}, or use CheckpointManager({root!r}).load_latest(state)")


__all__ = ["NAMES", "READERS", "STEP_DIR", "ForeignReader", "bind_keys", "committed_steps", "read_foreign", "read_manifest"]
