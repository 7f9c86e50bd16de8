"""Reading objects (non-tensor values: param_groups, scheduler, RNG, user dicts): each verified
against its checksum before it is decoded, safely (format.decode_object)."""
from __future__ import annotations

from typing import Sequence

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import Manifest, checksum, decode_object
from omnickpt.monitor import PhaseTimer
from omnickpt.storage import Storage


def read_objects(storage: Storage, manifest: Manifest, keys: Sequence[str], rank: int, *, allow_pickle: bool,
                 timer: PhaseTimer, all_ranks: Sequence[str] = ()) -> dict:
    """Decode objects: for each key in `keys` the value saved by this rank (or the lowest rank's);
    for each key in `all_ranks` a dict {saving rank: value} with every rank's value (for state that
    is redistributed across ranks on load, like dataloader positions)."""
    out: dict = {}
    with timer.phase("objects"):
        for key in keys:
            if key in manifest.objects:
                out[key] = _read_object(storage, manifest, key, manifest.object_for_rank(key, rank), allow_pickle, timer)
        for key in all_ranks:
            if key in manifest.objects:
                by_rank = {}
                for e in manifest.objects[key]:
                    value = _read_object(storage, manifest, key, e, allow_pickle, timer)
                    by_rank.update({r: value for r in e.ranks})
                out[key] = dict(sorted(by_rank.items()))
    return out


def _read_object(storage, manifest, key, e, allow_pickle, timer):
    if e.inline is not None:   # decoded from a foreign format when its manifest was read
        return decode_object(e.inline, allow_pickle=allow_pickle, where=key)
    buf = bytearray(e.nbytes)
    path = manifest.files[e.file].path
    try:
        storage.read_into(path, e.offset, [memoryview(buf)])
    except CorruptCheckpointError as err:
        raise CorruptCheckpointError(f"{err} (reading object {key!r})") from None
    if checksum(buf) != e.checksum:
        raise CorruptCheckpointError(
            f"checksum mismatch in {storage.describe(path)} for object {key!r}: the data file is corrupt")
    timer.count("read", e.nbytes)
    return decode_object(bytes(buf), allow_pickle=allow_pickle, where=key)
