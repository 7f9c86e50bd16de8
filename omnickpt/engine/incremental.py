"""Incremental saves (Check-N-Run): write only the blocks whose content changed since a base
checkpoint, and reference the base's bytes for the others.

A box is cut along its first dimension into blocks of whole rows, about `block_bytes` each (a row
being one index of dimension 0: an embedding row, a slice of a weight). Each block gets a content
hash (xxh3-64), stored in the manifest. The next incremental save hashes its own blocks, looks up
the block at the same rows of the same tensor in the base (same dtype and shape, same extent on
the other dimensions, same block grid) and, where the hashes agree, does not write the block: the
new manifest's box for those rows points at the base's file (a sibling checkpoint folder,
"../<base>/data/...") and byte range. Changed blocks are written to this rank's file. A box thus
becomes several boxes (runs of rows), each stored or referenced whole; loading is unchanged.

Why rows: a reference must be one contiguous byte range of the base, and a run of rows of a
row-major box is one. Why the CRCs of a referenced run are computed here, from this save's own
bytes, not copied from the base: a block wrongly taken as unchanged (a base damaged since, or a
hash collision at 2^-64) then fails its checksum at load and verify instead of loading wrong.

References are flattened: a block the base itself referenced points at the file it lies in, so
a load never follows a chain, and retention and garbage collection (omnickpt/steps.py) keep every
file a checkpoint next to it references. The engine never reads the base's data, only its manifest
and the size of each file it is about to reference: a file gone or shorter than the manifest says
(deleted, expired, cut short) is not referenced; its blocks are written by this save instead, with
a warning naming the file. Writing them is what a user wants of a save taken during training:
the new checkpoint complete and loadable, rather than a failed save over an old checkpoint's loss.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from omnickpt.errors import CheckpointError
from omnickpt.format import Manifest, TensorEntry, dtype_from_name
from omnickpt.storage import Storage

_log = logging.getLogger("omnickpt")

BLOCK_BYTES = 64 << 10    # one changed embedding row rewrites at most this many bytes


def _hasher():
    try:
        import xxhash
    except ImportError as e:   # a core dependency; only a broken install lacks it
        raise ImportError("incremental saves need the xxhash package: pip install xxhash") from e
    return xxhash.xxh3_64_intdigest


def rows_per_block(lengths: Sequence[int], itemsize: int, block_bytes: int) -> int:
    """Rows of dimension 0 in one block of a box with these lengths (a 0-d box: its one element)."""
    if not lengths:
        return 1
    row = math.prod(lengths[1:]) * itemsize
    return max(1, block_bytes // max(row, 1))


def block_count(lengths: Sequence[int], itemsize: int, block_bytes: int) -> int:
    if not lengths:
        return 1
    if math.prod(lengths) == 0:
        return 0
    return -(-lengths[0] // rows_per_block(lengths, itemsize, block_bytes))


def block_hashes(data: memoryview, lengths: Sequence[int], itemsize: int, block_bytes: int) -> np.ndarray:
    """The content hash of each block of a box's bytes (row-major), uint64."""
    n = len(data)
    if not n:
        return np.zeros(0, dtype=np.uint64)
    step = n if not lengths else rows_per_block(lengths, itemsize, block_bytes) * math.prod(lengths[1:]) * itemsize
    h = _hasher()
    return np.fromiter((h(data[i:i + step]) for i in range(0, n, step)), dtype=np.uint64, count=-(-n // step))


@dataclass(frozen=True)
class WriteMeta:
    """What a rank knows of one of its writes: the box of which tensor."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    itemsize: int


class Base:
    """The base checkpoint of an incremental save, as this rank compares against it. `name`: the
    base's folder next to the new checkpoint, None when it is the same folder (a save over it).
    `storage`: the new checkpoint's storage that also reads the folders next to it
    (storage.linked.LinkedStorage), to check the files it references (None: not checked); `own`:
    the new checkpoint's folder name."""

    def __init__(self, manifest: Manifest, name: str | None, storage: Storage | None = None, own: str | None = None):
        self.manifest, self.name, self.storage, self.own = manifest, name, storage, own
        self.block_bytes = manifest.block_bytes
        self.usable = bool(manifest.block_bytes) and manifest.compression is None
        self._boxes: dict[str, dict | None] = {}
        self._checked: set[int] = set()
        self._lost = np.zeros(len(manifest.files), dtype=bool)    # files not to reference (drop_unreadable)

    def file_path(self, i: int) -> str:
        """Base file i as the new checkpoint names it (flattened: a base's own reference stays; one
        to the new checkpoint's own folder is a file of its own)."""
        path = self.manifest.files[i].path
        if self.own and path.startswith(f"../{self.own}/"):
            return path[len(self.own) + 4:]
        return path if self.name is None or path.startswith("../") else f"../{self.name}/{path}"

    def drop_unreadable(self, files: Iterable[int]) -> bool:
        """Check the base files `files` (indices) that a plan references: one gone, shorter than the
        base's manifest says, or not one a reference may name is dropped (never referenced; its
        blocks count as changed), with a warning naming it. True if any was dropped."""
        if self.storage is None:
            return False
        dropped = False
        for i in sorted(set(files) - self._checked):
            self._checked.add(i)
            rel, want = self.file_path(i), self.manifest.files[i].bytes
            try:
                size = self.storage.size(rel)
                problem = None if size >= want else f"has {size} bytes, the base's manifest says {want}"
            except (OSError, CheckpointError) as e:
                problem = f"cannot be read ({type(e).__name__}: {e})"
            if problem is not None:
                self._lost[i], dropped = True, True
                _log.warning("omnickpt: incremental save: base file %s %s; its unchanged blocks are written by this "
                             "save instead of referenced", self.storage.describe(rel), problem)
        return dropped

    def _index(self, meta: WriteMeta) -> dict | None:
        """Per extent on the other dimensions: the base boxes of this tensor sorted by first row,
        as arrays (start, end, file, offset, first hash)."""
        if meta.name in self._boxes:
            return self._boxes[meta.name]
        t = self.manifest.tensors.get(meta.name)
        hashes = self.manifest.hashes.get(meta.name)
        out = None
        if t is not None and hashes is not None and tuple(t.shape) == meta.shape and t.dtype == meta.dtype \
                and meta.shape:
            out = self._by_extent(t, hashes)
        self._boxes[meta.name] = out
        return out

    def _by_extent(self, t: TensorEntry, hashes) -> dict | None:
        """_index of a tensor of the same shape and dtype; None where the base's blocks cannot be
        compared (its boxes compressed, or its hashes not those of this block grid)."""
        c = t.columns
        if c is None or c.codec is not None:
            return None
        item = dtype_from_name(t.dtype).itemsize
        lens, offs = c.lengths.tolist(), c.offsets.tolist()
        counts = [block_count(ln, item, self.block_bytes) for ln in lens]
        if sum(counts) != len(hashes):
            return None
        first = np.concatenate(([0], np.cumsum(counts)))[:-1]
        groups: dict = {}
        for i, (o, ln) in enumerate(zip(offs, lens)):
            groups.setdefault((tuple(o[1:]), tuple(ln[1:])), []).append(i)
        out = {"hashes": np.asarray(hashes, dtype=np.uint64)}
        for key, rows in groups.items():
            rows.sort(key=lambda i: offs[i][0])
            r = np.array(rows, dtype=np.int64)
            start = np.array([offs[i][0] for i in rows], dtype=np.int64)
            out[key] = (start, start + np.array([lens[i][0] for i in rows], dtype=np.int64),
                        c.file[r].astype(np.int64), c.offset[r].astype(np.int64), first[r])
        return out

    def unchanged(self, meta: WriteMeta, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block of the write: (unchanged, base file, base byte offset of the block)."""
        nb = len(hashes)
        none = np.zeros(nb, dtype=bool), np.zeros(nb, dtype=np.int64), np.zeros(nb, dtype=np.int64)
        index = self._index(meta) if self.usable and meta.lengths else None
        found = index.get((tuple(meta.offsets[1:]), tuple(meta.lengths[1:]))) if index else None
        if found is None or not nb:
            return none
        start, end, file, offset, first = found
        rpb = rows_per_block(meta.lengths, meta.itemsize, self.block_bytes)
        r0, r1 = meta.offsets[0], meta.offsets[0] + meta.lengths[0]
        rows = r0 + np.arange(nb, dtype=np.int64) * rpb
        block_end = np.minimum(rows + rpb, r1)
        k = np.clip(np.searchsorted(start, rows, side="right") - 1, 0, len(start) - 1)
        # The same block in the base: inside one base box, on its block grid, and as long.
        ok = (start[k] <= rows) & (block_end <= end[k]) & ((rows - start[k]) % rpb == 0)
        ok &= np.minimum(rows + rpb, end[k]) == block_end
        at = np.where(ok, first[k] + (rows - start[k]) // rpb, 0)
        base_hashes = index["hashes"]
        ok &= (at < len(base_hashes)) & (base_hashes[np.minimum(at, len(base_hashes) - 1)] == hashes)
        ok &= ~self._lost[file[k]]
        row_bytes = math.prod(meta.lengths[1:]) * meta.itemsize
        return ok, file[k], offset[k] + (rows - start[k]) * row_bytes


def plan_pieces(meta: WriteMeta, hashes: np.ndarray, base: Base | None, block_bytes: int
                ) -> list[tuple[int, int, int | None, int]]:
    """Pure: the runs of a write as (first row, rows, base file or None (written), base byte
    offset). Consecutive unchanged blocks of one base box make one referenced run."""
    rows_total = meta.lengths[0] if meta.lengths else 1
    if base is None or not len(hashes) or not meta.lengths:
        return [(0, rows_total, None, 0)]
    same, file, offset = base.unchanged(meta, hashes)
    if not same.any():
        return [(0, rows_total, None, 0)]
    rpb = rows_per_block(meta.lengths, meta.itemsize, block_bytes)
    row_bytes = math.prod(meta.lengths[1:]) * meta.itemsize
    nb = len(hashes)
    # A run ends where a block changes from written to referenced or back, or where the next
    # referenced block is not the next bytes of the same base file.
    cut = np.ones(nb, dtype=bool)
    cut[1:] = (same[1:] != same[:-1]) | (same[1:] & ((file[1:] != file[:-1])
                                                     | (offset[1:] != offset[:-1] + rpb * row_bytes)))
    starts = np.nonzero(cut)[0].tolist()
    ends = starts[1:] + [nb]
    return [(b * rpb, min(e * rpb, rows_total) - b * rpb, int(file[b]) if same[b] else None,
             int(offset[b]) if same[b] else 0) for b, e in zip(starts, ends)]
