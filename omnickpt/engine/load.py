"""Parallel reads of only the byte ranges needed (widened to whole checksum chunks), verified before
anything is copied into the destination tensors."""
from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import torch

from omnickpt.engine.objects import read_objects  # noqa: F401  (reader.py, loading.py import it from here)
from omnickpt.engine.staging import StagingPool, checksums, copy_bytes, gc_paused, plain_bytes
from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import Manifest
from omnickpt.format.codec import decode_into
from omnickpt.format.manifest import Sums, WindowBox
from omnickpt.layout import Box, contiguous_start, present, relative, row_major_strides, spans
from omnickpt.monitor import PhaseTimer
from omnickpt.planner import ReadItem, ReadPlan
from omnickpt.planner.load_plan import ZERO_FILL, ForwardPlan
from omnickpt.storage import Storage
from omnickpt.storage.base import require_length, run_all

# Ranges closer than this land in one buffer and are read in one request (the gap is read too):
# fewer syscalls / HTTP requests for a little extra data.
COALESCE_GAP = 256 << 10
# Largest read request: big enough to amortise a round trip, small enough to spread a large
# file over several reader threads.
MAX_REQUEST = 64 << 20
# Bytes landed (read and verified) before any of them is installed. A rank whose load fits is
# all-or-nothing: a corrupt byte anywhere leaves every destination untouched. A larger load is
# landed and installed in batches of this size, each verified before it is installed.
LANDING_BYTES = 4 << 30
# Below this many bytes, checksumming on the calling thread beats handing chunks to the pool.
_PARALLEL_BYTES = 8 << 20
# Read request of a file read from the device (Storage.read_direct): small enough that one
# request's checksums run while the next requests are read and that a rank's one large extent
# spreads over the reader threads, large enough to keep the device's queue full (2 ranks x 4
# threads of 16 MiB O_DIRECT requests read at dd's speed here; bench/cold_load_probe.py).
DIRECT_REQUEST = 16 << 20
# O_DIRECT moves whole pages between the device and memory aligned like the file offset: extents
# of at least _CONGRUENT_MIN bytes land at an address congruent to their first file byte modulo
# a page (the rest keep 64-byte alignment: the padding would cost more than it saves).
_PAGE = 4096
_CONGRUENT_MIN = 1 << 20
# A load read through the page cache whose landing memory would be fresh (a restarted process:
# nothing in the staging pool as large) and of more than REREAD_MIN bytes on this rank verifies
# in a first pass through one reused buffer of REREAD_BATCH bytes, then reads again and installs
# (see _reread). bench/cold_load_probe.py --fresh, DDP: 505 MB per rank 1.09 -> 0.76 s, 806 MB
# 2.07 -> 0.96 s. Smaller loads land once: a few batches' worth of fresh memory costs little.
REREAD_BATCH = 128 << 20
REREAD_MIN = 256 << 20
# A second pass reads a whole stored box of at least this many bytes that is one run of a plain
# destination straight into it, and verifies it there (smaller ones: through the batch buffer).
IN_PLACE_MIN = 1 << 20


def stored_grids(manifest: Manifest, items: Sequence[ReadItem]) -> Sequence[ReadItem]:
    """`items` whose boxes carry their whole chunk grid. The load planner builds a box's Sums from
    the CRC columns alone; a compressed box's grid also needs its stored lengths and codec, taken
    here from the manifest's row of that box (same tensor, file and first byte)."""
    if not manifest.compression:
        return items
    if isinstance(items, ReadPlan):   # rows of columns are uncompressed boxes
        return ReadPlan(list(stored_grids(manifest, items.objects)), items.columns)
    out, rows = list(items), {}
    for i, it in enumerate(items):
        sums = it.saved.sums
        if sums is None or sums.stored is not None or it.saved.file == ZERO_FILL:
            continue
        found = rows.get(it.name)
        if found is None:
            entry = manifest.tensors.get(it.name)
            cols = entry.columns if entry is not None else None
            if cols is None or cols.stored is None:
                raise CorruptCheckpointError(f"tensor {it.name!r}: the compressed checkpoint's manifest holds no stored "
                                             "chunk lengths for it; the manifest is damaged")
            found = rows[it.name] = (cols, {(f, o): r for r, (f, o) in
                                            enumerate(zip(cols.file.tolist(), cols.offset.tolist()))})
        cols, at = found
        r = at.get((it.saved.file, sums.start))
        if r is None:
            raise CorruptCheckpointError(f"tensor {it.name!r}: no stored box at byte {sums.start} of file "
                                         f"{it.saved.file}; the manifest is damaged")
        out[i] = dataclasses.replace(it, saved=dataclasses.replace(it.saved, sums=cols.sums(r)))
    return out


def _dest_view(item: ReadItem, dest_box: Box, dest: torch.Tensor) -> torch.Tensor:
    """The region of the destination tensor that `item` fills, as a view of its detached data: the
    bytes are written in place, outside autograd (destinations may be parameters, or views that
    adapters made under no_grad)."""
    dest = dest.detach()
    rel_dest = relative(item.region, dest_box)
    return dest[tuple(slice(o, o + l) for o, l in zip(rel_dest.offsets, rel_dest.lengths))] if dest.dim() else dest


@dataclass(slots=True)   # one per read item: 10^5 and more in a resharded load
class _Need:
    """The file bytes one read item needs, and the range that must land to verify them."""
    index: int            # into the items
    lo: int               # first byte of the item's region in the file
    hi: int               # one past its last byte
    land_lo: int          # [land_lo, land_hi): lo..hi widened to whole checksum chunks
    land_hi: int
    first: int            # row-major index of the region's first element in its stored block
    strides: tuple[int, ...]   # element strides of the stored block


def _need(i: int, item: ReadItem, itemsize: int, verify: bool, strides_of: dict) -> _Need:
    # Called once per item (10^5 and more in a resharded load): plain arithmetic, no Box objects.
    sb, region = item.saved, item.region
    if isinstance(sb, WindowBox):
        stored, shift = sb.base_lengths, sb.base_start
    else:
        stored, shift = sb.lengths, None
    strides = strides_of.get(stored)
    if strides is None:
        strides = strides_of[stored] = row_major_strides(stored)
    first = last = 0
    for d, (r, o, n, st) in enumerate(zip(region.offsets, sb.offsets, region.lengths, strides)):
        rel = r - o + (shift[d] if shift is not None else 0)
        first += rel * st
        last += (rel + n - 1) * st
    lo, hi = sb.offset + first * itemsize, sb.offset + (last + 1) * itemsize
    land_lo, land_hi = lo, hi
    sums = sb.sums
    # A compressed chunk decompresses whole, verified or not.
    if sums is not None and (verify or sums.stored is not None):
        size = sums.size
        land_lo = sums.start + (lo - sums.start) // size * size
        land_hi = min(sums.end, sums.start - (-(hi - sums.start) // size) * size)
    return _Need(i, lo, hi, land_lo, land_hi, first, strides)


@dataclass
class _Extent:
    """File bytes [start, end) of one file, read into `buf` (one landing buffer). For a compressed
    box (`sums` set) [start, end) are raw bytes of that one box (Sums: its chunks lie elsewhere in
    the file); its stored chunks are read, verified and decompressed into `buf`."""
    file: int
    start: int
    end: int
    needs: list[_Need]
    buf: torch.Tensor | None = None
    sums: Sums | None = None


def _extents(needs: list[tuple[int, _Need, Sums | None]]) -> list[_Extent]:
    """Group (file, need, compressed box's grid or None) into landing buffers: ranges of one file
    that overlap or lie within COALESCE_GAP of each other share one buffer (two items of one
    stored box, a fused QKV box read as three windows, neighbouring boxes of one rank). The raw
    coordinates of compressed boxes are their own, so such a buffer holds one box only."""
    out: list[_Extent] = []

    def key(x):
        return (x[0], -1 if x[2] is None else x[2].start, x[1].land_lo)

    for fi, n, sums in sorted(needs, key=key):
        cur = out[-1] if out else None
        if (cur is not None and cur.file == fi and (cur.sums is sums or cur.sums == sums)
                and n.land_lo <= cur.end + COALESCE_GAP):
            cur.end = max(cur.end, n.land_hi)
            cur.needs.append(n)
        else:
            out.append(_Extent(fi, n.land_lo, n.land_hi, [n], sums=sums))
    return out


def _describe(items: Sequence[ReadItem], needs: Sequence[_Need]) -> str:
    names = sorted({f"tensor {items[n.index].name!r} box offsets={list(items[n.index].saved.offsets)} "
                    f"lengths={list(items[n.index].saved.lengths)}" for n in needs})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _fetch(storage: Storage, manifest: Manifest, ext: _Extent, lo: int, hi: int, check, direct: bool,
           describe) -> None:
    """Read file bytes [lo, hi) of `ext` into its buffer, then run `check` (the checksum chunks
    that lie wholly inside them, or None) on this reader thread while the others still read: a
    cold load's verification overlaps its reads instead of following them. `describe(ext, lo, hi)`
    names what those bytes hold, for an error."""
    mv = memoryview(ext.buf.numpy())[lo - ext.start:hi - ext.start]
    path = manifest.files[ext.file].path
    try:
        if direct:
            storage.read_direct(path, lo, mv)
        else:
            storage.read_into(path, lo, [mv])
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e} (reading {describe(ext, lo, hi)})") from None
    if check is not None:
        check()


def _fetch_compressed(storage: Storage, manifest: Manifest, ext: _Extent, items: Sequence[ReadItem], verify: bool,
                      executor: Executor | None) -> int:
    """Read the stored chunks behind ext's raw bytes in one request, check each one's CRC (of the
    stored bytes, so damage is named before any decompression), decompress them into ext.buf.
    Returns the file bytes read."""
    sums = ext.sums
    first = (ext.start - sums.start) // sums.size
    count = -(-(ext.end - sums.start) // sums.size) - first
    lo, hi = sums.file_chunk(first)[0], sums.file_chunk(first + count - 1)[1]
    stored = bytearray(hi - lo)
    path = manifest.files[ext.file].path
    try:
        storage.read_into(path, lo, [memoryview(stored)])
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e} (reading {_describe(items, ext.needs)})") from None
    out = memoryview(ext.buf.numpy())
    pieces = []
    for c in range(first, first + count):
        a, b = sums.file_chunk(c)
        ra, rb = sums.chunk(c)
        pieces.append((c, memoryview(stored)[a - lo:b - lo], out[ra - ext.start:rb - ext.start], a, b))
    if verify:
        _verify_stored(storage, path, ext, pieces, items, executor)

    def unpack(piece) -> None:
        c, data, dst, a, b = piece
        if len(data) == len(dst):   # stored raw: compression did not pay for this chunk
            dst[:] = data
        else:
            decode_into(data, sums.codec, sums.itemsize, sums.dtype, dst,
                            f"{storage.describe(path)} bytes [{a}, {b}) (compressed chunk {c} of "
                            f"{_describe(items, ext.needs)})")

    if executor is None or len(pieces) <= 1:
        for p in pieces:
            unpack(p)
    else:
        run_all(executor, unpack, [(p,) for p in pieces])
    return hi - lo


def _verify_stored(storage: Storage, path: str, ext: _Extent, pieces: list[tuple], items: Sequence[ReadItem],
                   executor: Executor | None) -> None:
    """Check the CRC of each stored chunk (c, bytes, _, a, b) of `ext` before it is decoded."""
    sums = ext.sums
    got = checksums([p[1] for p in pieces], executor)
    for (c, _, _, a, b), crc in zip(pieces, got):
        if crc != sums.crcs[c]:
            ra, rb = sums.chunk(c)
            within = [n for n in ext.needs if n.land_lo < rb and ra < n.land_hi]
            raise CorruptCheckpointError(
                f"checksum mismatch in {storage.describe(path)} at bytes [{a}, {b}) (compressed chunk {c}) for "
                f"{_describe(items, within)} (stored {sums.crcs[c]:#010x}, read {crc:#010x}): the data file is "
                "corrupt; nothing was loaded from it. Restore the file or load an earlier checkpoint")


def _read_direct(storage: Storage, manifest: Manifest, direct: list[tuple[int, _Need, torch.Tensor]],
                 items: Sequence[ReadItem], executor: Executor | None) -> None:
    """Read unverifiable regions straight into their destinations: ranges of one file closer than
    COALESCE_GAP share one request (the gap lands in scratch), at most MAX_REQUEST bytes each; on
    an object store a request is a round trip, and one per tensor would dominate the load."""
    requests: list[tuple[int, int, list[memoryview], list[_Need]]] = []
    end = -1
    for fi, n, view in sorted(direct, key=lambda d: (d[0], d[1].lo)):
        out = memoryview(view.reshape(-1).view(torch.uint8).numpy()) if view.numel() else memoryview(b"")
        cur = requests[-1] if requests else None
        if cur is not None and cur[0] == fi and 0 <= n.lo - end <= COALESCE_GAP and n.hi - cur[1] <= MAX_REQUEST:
            if n.lo > end:
                cur[2].append(memoryview(bytearray(n.lo - end)))
        else:
            cur = (fi, n.lo, [], [])
            requests.append(cur)
        cur[2].append(out)
        cur[3].append(n)
        end = n.hi

    def fetch(fi: int, lo: int, bufs: list[memoryview], needs: list[_Need]) -> None:
        try:
            storage.read_into(manifest.files[fi].path, lo, bufs)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e} (reading {_describe(items, needs)})") from None

    if executor is None or len(requests) <= 1:
        for r in requests:
            fetch(*r)
    else:
        run_all(executor, fetch, requests)


def _chunks_to_check(ext: _Extent, items: Sequence[ReadItem]) -> tuple[list[int], list[int], list[int], list[_Need]]:
    """(first bytes, end bytes, expected CRCs, a need that uses each) of every checksum chunk in
    `ext` that some item reads from, each once, in the order the needs first use them. Computed
    for all needs at once: a load of 10^5 small boxes checks 10^5 chunks."""
    needs = [n for n in ext.needs if items[n.index].saved.sums is not None]
    if not needs:
        return [], [], [], []
    sums = [items[n.index].saved.sums for n in needs]
    count = len(needs)
    start = np.fromiter((x.start for x in sums), dtype=np.int64, count=count)
    size = np.fromiter((x.size for x in sums), dtype=np.int64, count=count)
    end = np.fromiter((x.end for x in sums), dtype=np.int64, count=count)
    lo = np.fromiter((n.lo for n in needs), dtype=np.int64, count=count)
    hi = np.fromiter((n.hi for n in needs), dtype=np.int64, count=count)
    a, b, who, chunk = _used_chunks(start, size, end, lo, hi)
    who_l, chunk_l = who.tolist(), chunk.tolist()
    return (a.tolist(), b.tolist(), [sums[w].crcs[c] for w, c in zip(who_l, chunk_l)], [needs[w] for w in who_l])


def _used_chunks(start: np.ndarray, size: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """(first bytes, end bytes, the range using it, its index in that range's grid) of every chunk
    that byte ranges [lo[i], hi[i]) touch in their grids (chunks of size[i] from start[i], the last
    ending at end[i]), each once, in the order the ranges first use them: chunks shared by
    neighbouring ranges (boxes cut from one stored box) are checked once."""
    c0 = (lo - start) // size
    per = np.maximum(-(-(hi - start) // size) - c0, 0)
    who = np.repeat(np.arange(len(lo)), per)
    chunk = spans(c0, per)
    a = start[who] + chunk * size[who]
    b = np.minimum(a + size[who], end[who])
    order = np.lexsort((np.arange(len(a)), b, a))
    first = np.ones(len(a), dtype=bool)
    first[1:] = (a[order][1:] != a[order][:-1]) | (b[order][1:] != b[order][:-1])
    keep = np.sort(order[first])
    return a[keep], b[keep], who[keep], chunk[keep]


def _holding_requests(requests: list[tuple], rs: list[int], a: np.ndarray, b: np.ndarray):
    """(the position in `rs` of the request each chunk [a, b) starts in, whether it lies wholly
    inside it), for requests[rs] (extent, start, stop) of one extent in file order."""
    starts = np.array([requests[r][1] for r in rs], dtype=np.int64)
    stops = np.array([requests[r][2] for r in rs], dtype=np.int64)
    at = np.maximum(np.searchsorted(starts, a, side="right") - 1, 0)
    return at, (starts[at] <= a) & (b <= stops[at])


def _check_chunks(storage: Storage, manifest: Manifest, checks: Sequence[tuple], items: Sequence[ReadItem],
                  executor: Executor | None) -> None:
    """Check each landed chunk (extent, first byte, end byte, expected CRC, a need that uses it);
    one list of tasks, so many mid-sized boxes (a resharded load) spread over the threads too."""
    data: dict[int, memoryview] = {}
    views = []
    for ext, a, b, _, _ in checks:
        mv = data.get(id(ext))
        if mv is None:
            mv = data[id(ext)] = memoryview(ext.buf.numpy())
        views.append(mv[a - ext.start:b - ext.start])
    got = checksums(views, executor)
    if got == [c[3] for c in checks]:
        return
    for (ext, a, b, want, n), crc in zip(checks, got):
        if crc != want:
            it = items[n.index]
            raise CorruptCheckpointError(
                f"checksum mismatch in {storage.describe(manifest.files[ext.file].path)} at bytes [{a}, {b}) for "
                f"tensor {it.name!r} box offsets={list(it.saved.offsets)} lengths={list(it.saved.lengths)} "
                f"(stored {want:#010x}, read {crc:#010x}): the data file is corrupt; nothing was loaded from it. "
                "Restore the file or load an earlier checkpoint")


def _assign_checks(requests: list[tuple], items: Sequence[ReadItem], verify: bool) -> tuple[list[list], list]:
    """The checksum chunks of the plain extents' `requests` (extent, lo, hi): per request the
    chunks that lie wholly inside it (checked by its reader as soon as it lands), and the few
    that straddle two requests (checked once all have landed)."""
    per_request: list[list] = [[] for _ in requests]
    straddling: list = []
    if not verify:
        return per_request, straddling
    by_ext: dict[int, list[int]] = {}
    for r, (ext, _, _) in enumerate(requests):
        by_ext.setdefault(id(ext), []).append(r)
    for rs in by_ext.values():
        ext = requests[rs[0]][0]
        firsts, ends, crcs, needs = _chunks_to_check(ext, items)
        if not firsts:
            continue
        k, inside = _holding_requests(requests, rs, np.array(firsts, dtype=np.int64), np.array(ends, dtype=np.int64))
        for j, (r, whole) in enumerate(zip(k.tolist(), inside.tolist())):
            (per_request[rs[r]] if whole else straddling).append((ext, firsts[j], ends[j], crcs[j], needs[j]))
    return per_request, straddling


def _source(ext: _Extent, n: _Need, item: ReadItem, dtype: torch.dtype, typed: dict) -> torch.Tensor:
    """The item's region, as a strided view of the landed bytes (`typed` caches the extent's
    buffer viewed as `dtype`)."""
    itemsize = dtype.itemsize
    at = n.lo - ext.start
    if at % itemsize:
        flat = ext.buf[at:n.hi - ext.start].clone().view(dtype)   # a view as a wider dtype needs an aligned start
        return flat.as_strided(item.region.lengths, n.strides)
    flat = typed.get(dtype)
    if flat is None:
        usable = ext.buf.numel() // itemsize * itemsize
        flat = typed[dtype] = ext.buf[:usable].view(dtype)
    return flat.as_strided(item.region.lengths, n.strides, flat.storage_offset() + at // itemsize)


# Strided regions of at most this many elements (a box of a finely sharded tensor that is one
# run in the file but many in its destination) are installed many at once, by index (_Dests.scatter):
# one view and one copy_ per region cost ~8 us, 0.65 s for 80,000 boxes. Larger regions copy one
# by one (the per-region cost no longer shows), as do fewer than _SCATTER_FROM of one shape.
_SCATTER_NUMEL = 4096
_SCATTER_FROM = 16
# Elements per index copy: bounds the index arrays (2 x 8 bytes per element).
_SCATTER_BATCH = 1 << 20


class _Dests:
    """The destination tensors, as the install needs them: where an item's region lies in host
    memory when it is one contiguous run of a plain tensor (the usual case: whole boxes, row
    slabs; installed by one memmove instead of a slice, a view and a copy_ in torch), else the
    region as one strided view (a single as_strided call)."""

    def __init__(self, dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor]):
        self._boxes, self._dests = dest_boxes, dests
        self._plain: dict[int, tuple[int, int, int] | None] = {}
        self._detached: dict[int, tuple] = {}   # dest -> (detached tensor, strides, storage offset, box origin)

    def address(self, item: ReadItem, nbytes: int) -> int | None:
        """The first byte of `item`'s region in its destination, if the region is `nbytes` of
        contiguous memory there; else None (the caller copies through `view`)."""
        d = item.dest
        info = self._plain.get(d, False)
        if info is False:
            t = self._dests[d]
            info = None
            if plain_bytes(t):
                info = (t.data_ptr(), t.element_size(), t.numel())
            self._plain[d] = info
        if info is None:
            return None
        ptr, itemsize, numel = info
        region, box = item.region, self._boxes[d]
        if region.numel * itemsize != nbytes:
            return None   # the stored bytes are not one run (a column slice of a stored box)
        first = contiguous_start(region, box)
        if first is None or first + region.numel > numel:
            return None
        return ptr + first * itemsize

    def view(self, item: ReadItem) -> torch.Tensor:
        """The region `item` fills, as a view of the destination's detached data: written in
        place, outside autograd (destinations may be parameters, or views adapters made under
        no_grad)."""
        d = item.dest
        place = self._detached.get(d)
        if place is None:
            t = self._dests[d].detach()
            place = self._detached[d] = (t, t.stride(), t.storage_offset(), self._boxes[d].offsets)
        t, strides, at, origin = place
        if not strides:
            return t
        for r, o, st in zip(item.region.offsets, origin, strides):
            at += (r - o) * st
        return t.as_strided(item.region.lengths, strides, at)

    def scatter(self, ext: _Extent, needs: Sequence[_Need], items: Sequence[ReadItem], d: int,
                lengths: tuple[int, ...], src_strides: tuple[int, ...], typed: dict) -> bool:
        """Install `needs` (regions of destination `d`, all of `lengths`, laid out in the landed
        bytes with element strides `src_strides`) by two index arrays and one gather/scatter;
        False, having installed nothing, where that does not apply (a GPU destination, a
        destination whose dtype differs from the landed data's, a region not aligned to it)."""
        t = self._dests[d]
        if t.device.type != "cpu" or t.is_conj() or t.is_neg() or not t.dim():
            return False
        itemsize = t.element_size()
        starts = np.fromiter((n.lo for n in needs), dtype=np.int64, count=len(needs)) - ext.start
        if (starts % itemsize).any():
            return False
        t = t.detach()
        nd = len(lengths)
        offs = np.array([items[n.index].region.offsets for n in needs], dtype=np.int64).reshape(len(needs), nd)
        rel = offs - np.array(self._boxes[d].offsets, dtype=np.int64)
        dst0 = t.storage_offset() + rel @ np.array(t.stride(), dtype=np.int64)
        _scatter(t, _typed(ext, t.dtype, typed), starts // itemsize, dst0, lengths, src_strides, t.stride())
        return True


class Landing:
    """Tensor bytes read and verified but not yet installed (see `land_tensors`). Call install(),
    or discard() when the load stops here: either gives the landing memory back."""

    def __init__(self, install, discard):
        self._install, self._discard = install, discard

    def install(self, *, compacts: bool = False) -> Sequence[torch.Tensor] | None:
        """Copy the landed bytes into their destinations. With `compacts`, returns per item a
        contiguous tensor holding what it filled (the destination region itself when contiguous),
        for forwarding; each is made when first asked for."""
        try:
            return self._install(compacts)
        finally:
            self._discard()

    def discard(self) -> None:
        self._discard()


def _buffers(pool: StagingPool | None):
    """(acquire(nbytes) -> uint8 tensor, release(tensor)): from `pool` when given (its pages
    are faulted in already, and a load leaves them warm for the next save's snapshot), else
    fresh memory."""
    if pool is None:
        return (lambda n: torch.empty(max(n, 1), dtype=torch.uint8)), (lambda buf: None)
    return (lambda n: pool.acquire(n)), pool.release


def _batch_layout(batch: list[_Extent]) -> tuple[list[int], int]:
    """Each extent's offset in the batch's one (page-aligned) buffer and the buffer's size:
    extents start at 64-byte boundaries, the large ones at the address congruent to their first
    file byte modulo a page (see _CONGRUENT_MIN)."""
    offsets, total = [], 0
    for ext in batch:
        if ext.sums is None and ext.end - ext.start >= _CONGRUENT_MIN and ext.start % 64 == 0:
            total += (ext.start - total) % _PAGE
        offsets.append(total)
        total = (total + ext.end - ext.start + 63) // 64 * 64
    return offsets, total


def _carve(batch: list[_Extent], buf: torch.Tensor, offsets: list[int], request_of) -> tuple[list[tuple], list[_Extent]]:
    """Give each extent its slice of `buf`; returns the plain extents' (extent, start, end) requests of
    at most `request_of(extent)` bytes, cut at page boundaries of the file (so that each request
    but an extent's first and last is whole pages), and the compressed extents (read chunk by chunk)."""
    for ext, off in zip(batch, offsets):
        ext.buf = buf[off:off + ext.end - ext.start]
    return _requests(batch, request_of)


def _requests(extents: list[_Extent], request_of) -> tuple[list[tuple], list[_Extent]]:
    """The plain extents' requests as _carve cuts them, and the compressed extents."""
    requests, packed = [], []
    for ext in extents:
        if ext.sums is not None:
            packed.append(ext)
            continue
        size, a = request_of(ext), ext.start
        while a < ext.end:
            b = min(ext.end, (a + size) // _PAGE * _PAGE)
            b = b if b > a else min(ext.end, a + size)
            requests.append((ext, a, b))
            a = b
    return requests, packed


def _fetch_plain(storage: Storage, manifest: Manifest, requests: list[tuple], checks: list, describe,
                 direct_files, executor: Executor | None) -> None:
    """Read (and check) every request. On a failure the requests not started are cancelled and
    the running ones awaited before the error is raised: none may still be writing into the
    landing buffer when the caller gives it back."""
    args = [(storage, manifest, ext, lo, hi, c, ext.file in direct_files, describe)
            for (ext, lo, hi), c in zip(requests, checks)]
    if executor is None or len(args) <= 1:
        for a in args:
            _fetch(*a)
        return
    run_all(executor, _fetch, args)


def _fetch_packed(storage: Storage, manifest: Manifest, packed: list[_Extent], items: Sequence[ReadItem],
                  verify: bool, executor: Executor | None) -> int:
    """Read the compressed extents; returns the stored bytes read."""
    # Small compressed boxes (a few chunks) are tasks of their own; a large one spreads its
    # chunks over the threads (never both: a task waiting for tasks of the same pool could deadlock).
    small = [e for e in packed if e.end - e.start <= 2 * e.sums.size]
    large = [e for e in packed if e.end - e.start > 2 * e.sums.size]
    if executor is None or len(small) <= 1:
        read_bytes = sum(_fetch_compressed(storage, manifest, e, items, verify, None) for e in small)
    else:
        read_bytes = sum(run_all(executor, _fetch_compressed,
                                 [(storage, manifest, e, items, verify, None) for e in small]))
    read_bytes += sum(_fetch_compressed(storage, manifest, e, items, verify, executor) for e in large)
    return read_bytes


@gc_paused()
def land_tensors(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], dest_boxes: Sequence[Box],
                 dests: Sequence[torch.Tensor], executor: Executor | None, *, verify: bool, timer: PhaseTimer,
                 budget: int = LANDING_BYTES, pool: StagingPool | None = None,
                 shared_files: Collection[int] = (), start_at: float = 0.0,
                 verify_part: tuple[int, int] | None = None) -> Landing:
    """Read every item's bytes into landing buffers and verify every checksum chunk they touch
    (whole chunks are read, so a partial read of a box is verified too). Nothing is written into
    `dests` until `Landing.install()`, so a corrupt read leaves the target untouched, when this
    rank's bytes fit in `budget`; past it, batches of `budget` bytes are installed as they verify
    (a corrupt byte is still never installed) and the last one waits for install(). Landing
    memory comes from `pool` when given (see `_buffers`).

    Where the storage reads from a device (`read_direct`: local files), files are read from the
    device straight into the landing buffers, except `shared_files` (indices into
    manifest.files): other processes on this machine read those during this load too, and the
    page cache's one device read serves them all. `start_at` (0 <= x < 1): where in its list of
    read requests this rank begins, going round to the start: ranks that read the same files
    through the cache begin at different places (rank / ranks), so that the device reads each part
    once, the parts in parallel, and each rank finds the others' parts in the cache (DDP replicas:
    all in one order, every rank waits for the same pages one stream at a time).

    `verify_part` (i, n): this rank is the i-th of n ranks on this machine that read exactly the
    same bytes of the same files into destinations of the same layouts (replicas, loading.replica_part).
    A load in two passes (_reread) then verifies only the i-th of n parts of those bytes in its first
    pass, as the other replicas verify the rest; its second pass still reads and verifies every byte
    it installs. No rank installs anything before every rank's first pass is sound (the caller's
    exchange), so the checkpoint's bytes are all verified before any install, once instead of n times,
    and the device's one read of each part feeds the cache for all of them."""
    way = _Columns.of(items, manifest, dest_boxes, dests, verify)
    if way is None:
        way = _Records(storage, manifest, list(stored_grids(manifest, items)), dest_boxes, dests, verify, executor)
    acquire, release = _buffers(pool)
    held: list[torch.Tensor] = []   # the batch buffer in use, at most one
    local = getattr(storage, "read_direct", None) is not None
    direct_files = set() if not local else {e.file for e in way.extents} - set(shared_files)
    twice = local and _reread(way, direct_files, pool)
    # A staging budget below a batch bounds the batch buffer too (its request adds a page of
    # alignment and the extents' padding: leave room for them).
    step = min(REREAD_BATCH, max(budget - 2 * _PAGE, _PAGE))
    if twice:
        batches = _batches(_split(way.extents, way.bounds, step), step)
        if verify_part is not None:   # replicas verify a part each (the same cut on every one of them)
            i, n = verify_part
            batches = batches[len(batches) * i // n:len(batches) * (i + 1) // n]
        else:
            k = int(len(batches) * start_at) % len(batches)
            batches = batches[k:] + batches[:k]   # ranks sharing the files start at different places
    else:
        batches = _batches(way.extents, budget)

    def request_of(ext: _Extent) -> int:
        return DIRECT_REQUEST if ext.file in direct_files else MAX_REQUEST

    def read(batch: list[_Extent], phase: str = "read", placed: bool = False) -> None:
        """Read and check `batch` into one landing buffer, or (`placed`) into the buffers its
        extents hold already (their destinations: a second pass's in-place reads)."""
        with timer.phase(phase):
            if placed:
                requests, packed = _requests(batch, request_of)
            else:
                offsets, total = _batch_layout(batch)
                # a pool's buffers are page-aligned; fresh memory may not be. Read twice: one size, one buffer.
                raw = acquire(max(total, step if twice else 0) + _PAGE)
                held.append(raw)
                shift = -raw.data_ptr() % _PAGE
                requests, packed = _carve(batch, raw[shift:shift + total], offsets, request_of)
            checks, straddling = way.checks(storage, manifest, requests, executor)
            if start_at and requests:
                k = int(len(requests) * start_at) % len(requests)
                requests, checks = requests[k:] + requests[:k], checks[k:] + checks[:k]
            # Each request's reader checks the chunks inside it as soon as it lands.
            _fetch_plain(storage, manifest, requests, checks, way.describe, direct_files, executor)
            read_bytes = _fetch_packed(storage, manifest, packed, way.items, verify, executor) if packed else 0
            timer.count(phase, read_bytes + sum(ext.end - ext.start for ext in batch if ext.sums is None))
        if straddling is not None:
            with timer.phase("verify"):
                straddling()

    def install(batch: list[_Extent], zero: Sequence[int]) -> None:
        with timer.phase("install"):
            # copy_ and memmove release the GIL: large batches are copied on the I/O threads, one extent each.
            large = executor is not None and sum(e.end - e.start for e in batch) >= _PARALLEL_BYTES
            if large and len(batch) > 1:
                run_all(executor, way.put, [(ext, None) for ext in batch])
            else:
                for ext in batch:   # one large extent spreads its copies over the threads itself
                    way.put(ext, executor if large else None)
            give_back()   # the landing memory goes back now, not at the end of the load
            for i in zero:
                it = way.items[i]
                view = _dest_view(it, dest_boxes[it.dest], dests[it.dest])
                view.zero_()   # pad rows a transform added: no stored bytes back them

    def give_back() -> None:
        while held:
            release(held.pop())

    try:
        if way.direct:
            with timer.phase("read"):
                _read_direct(storage, manifest, way.direct, way.items, executor)
                timer.count("read", sum(n.hi - n.lo for _, n, _ in way.direct))
        if twice:
            for batch in batches:   # the first pass: every byte (replicas: this rank's part) verified, none kept
                read(batch)
                give_back()
        else:
            for batch in batches[:-1]:
                read(batch)
                install(batch, ())
            read(batches[-1])
    except BaseException:
        give_back()
        raise

    def finish(compacts: bool) -> Sequence[torch.Tensor] | None:
        if not twice:
            install(batches[-1], way.zeros)
        else:
            try:
                # The second pass: read, verified again, installed. Whole boxes of at least
                # IN_PLACE_MIN bytes that are one run of a plain destination are read straight into
                # it and verified there; the rest goes through the batch buffer.
                direct, rest = way.in_place()
                if direct:
                    read(direct, "reread", placed=True)
                again = _batches(_split(rest, way.bounds, step), step) if rest else [[]]
                for i, batch in enumerate(again):
                    if batch:
                        read(batch, "reread")
                    install(batch, way.zeros if i == len(again) - 1 else ())
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(
                    f"{e}. These bytes verified when this load read them first and changed before it read them "
                    "again to install them: the file changed during the load, and part of the target may hold "
                    "its bytes now. Load a checkpoint again") from None
        return _Compacts(way.items, dest_boxes, dests) if compacts else None

    return Landing(finish, give_back)


class _Records:
    """The read items as records: one _Need per ReadItem; any item (windows of fused tensors,
    compressed boxes, zero fill, boxes of foreign formats)."""

    def __init__(self, storage: Storage, manifest: Manifest, items: list[ReadItem], dest_boxes: Sequence[Box],
                 dests: Sequence[torch.Tensor], verify: bool, executor: Executor | None):
        self.items, self.verify = items, verify
        needs, self.zeros, self.direct = _sort_needs(items, dest_boxes, dests, verify)
        self.extents = _extents(needs)
        self.places = _Dests(dest_boxes, dests)

    @staticmethod
    def bounds(ext: _Extent) -> tuple[list[int], list[int]]:
        return [n.land_lo for n in ext.needs], [n.land_hi for n in ext.needs]

    def in_place(self) -> tuple[list[_Extent], list[_Extent]]:
        """See _Columns.in_place: the records' way reads everything through the batch buffer."""
        return [], self.extents

    def checks(self, storage: Storage, manifest: Manifest, requests: list[tuple], executor: Executor | None):
        """(per request the check of the chunks inside it or None, the check of the chunks that
        straddle two requests or None)."""
        per_request, straddling = _assign_checks(requests, self.items, self.verify)
        items = self.items

        def check(chunks: list, ex: Executor | None):
            return (lambda: _check_chunks(storage, manifest, chunks, items, ex)) if chunks else None

        return [check(c, None) for c in per_request], check(straddling, executor)

    def describe(self, ext: _Extent, lo: int, hi: int) -> str:
        return _describe(self.items, [n for n in ext.needs if n.land_lo < hi and lo < n.land_hi])

    def put(self, ext: _Extent, executor: Executor | None) -> None:
        _put(ext, self.items, self.places)


class _Columns:
    """The read items as columns (a plan_reads ReadPlan held wholly as planner.ReadColumns, loaded
    verified): the byte ranges, landing extents, chunk checks and installs of all items computed
    with numpy at once, no record per item. 10^5 boxes cost milliseconds of arithmetic instead of a
    _Need, a ReadItem, a SavedBox and a Sums each (~1 s for 80,000 boxes)."""

    @staticmethod
    def of(items, manifest: Manifest, dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor],
           verify: bool) -> "_Columns | None":
        """The column way for `items`, or None where the records' way applies (items given as
        records, some of them records, or a load without verification: that reads contiguous
        regions straight into their destinations)."""
        if not (verify and isinstance(items, ReadPlan) and not items.objects and items.columns is not None):
            return None
        return _Columns(items, dest_boxes, dests)

    verify = True

    def __init__(self, items: ReadPlan, dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor]):
        self.items = items   # records are made from it only to name an item in an error, or to forward
        self.zeros: list[int] = []
        self.direct: list = []
        c = self.c = items.columns
        width = c.offsets.shape[1]
        self.itemsize = np.array([d.element_size() for d in dests], dtype=np.int64)[c.dest]
        # Element strides of each stored block (row-major), then each region's first and last
        # element in it: the file bytes [lo, hi) the item needs, widened to whole chunks.
        strides = np.ones_like(c.saved_lengths)
        for d in range(width - 2, -1, -1):
            strides[:, d] = strides[:, d + 1] * c.saved_lengths[:, d + 1]
        self.strides = strides
        rel = c.offsets - c.saved_offsets
        first, last = (rel * strides).sum(axis=1), ((rel + c.lengths - 1) * strides).sum(axis=1)
        self.lo = c.offset + first * self.itemsize
        self.hi = c.offset + (last + 1) * self.itemsize
        size = c.chunk
        self.land_lo = c.offset + (self.lo - c.offset) // size * size
        self.land_hi = np.minimum(c.offset + c.nbytes, c.offset - (-(self.hi - c.offset) // size) * size)
        self.extents = self._extents()
        self.places = _ColumnDests(dest_boxes, dests, width, present(c.dest))

    def _extents(self, rows: np.ndarray | None = None) -> list[_Extent]:
        """As _extents: ranges of one file within COALESCE_GAP of each other share a landing
        buffer; each extent's `needs` are its rows (of `rows`, default all), by first landed byte."""
        c = self.c
        if rows is None:
            order = np.lexsort((self.land_lo, c.file))
        else:
            order = rows[np.lexsort((self.land_lo[rows], c.file[rows]))]
        if not len(order):
            return []
        f, a, b = c.file[order], self.land_lo[order], self.land_hi[order]
        new = np.ones(len(order), dtype=bool)
        if len(order) > 1:
            # The furthest end so far within each file: one running maximum over (file, end)
            # encoded as one integer (files ascend), where it fits in 63 bits.
            shift = int(b.max()) + 1
            if int(f.max()) < (1 << 62) // shift:
                reach = np.maximum.accumulate(f * shift + b)[:-1] - f[:-1] * shift
            else:
                reach, top = np.empty(len(order) - 1, dtype=np.int64), -1
                for i, (fi, bi) in enumerate(zip(f[:-1].tolist(), b[:-1].tolist())):
                    top = bi if i == 0 or fi != f[i - 1] else max(top, bi)
                    reach[i] = top
            new[1:] = (f[1:] != f[:-1]) | (a[1:] > reach + COALESCE_GAP)
        starts = np.flatnonzero(new)
        ends = np.maximum.reduceat(b, starts) if len(starts) else starts
        bounds = starts.tolist() + [len(order)]
        return [_Extent(fi, lo, hi, order[bounds[k]:bounds[k + 1]])
                for k, (fi, lo, hi) in enumerate(zip(f[starts].tolist(), a[starts].tolist(), ends.tolist()))]

    def bounds(self, ext: _Extent) -> tuple[list[int], list[int]]:
        return self.land_lo[ext.needs].tolist(), self.land_hi[ext.needs].tolist()

    def in_place(self) -> tuple[list[_Extent], list[_Extent]]:
        """(extents of one row each whose buffer is the destination memory the row's bytes go to:
        rows of at least IN_PLACE_MIN bytes that are one run of a plain destination and whose
        bytes are whole checksum chunks, so that reading them there and checking them there is
        their install; the extents of the other rows)."""
        rows = np.arange(len(self.c.dest))
        one_run, first = self._one_runs(rows)
        ok = one_run & (self.lo == self.land_lo) & (self.hi == self.land_hi) & (self.hi - self.lo >= IN_PLACE_MIN)
        out = []
        for r, f in zip(np.flatnonzero(ok).tolist(), first[ok].tolist()):
            size, n = int(self.itemsize[r]), int(self.hi[r] - self.lo[r])
            ext = _Extent(int(self.c.file[r]), int(self.lo[r]), int(self.hi[r]), rows[r:r + 1])
            ext.buf = self.places.flat_bytes(int(self.c.dest[r]))[f * size:f * size + n]
            out.append(ext)
        return out, self._extents(np.flatnonzero(~ok)) if out else self.extents

    def _one_runs(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row of `rows`: whether its region is one run of its plain destination (its bytes
        copied by one memmove), and the region's first element in that destination."""
        c, places = self.c, self.places
        dest, lo, hi = c.dest[rows], self.lo[rows], self.hi[rows]
        lengths, itemsize = c.lengths[rows], self.itemsize[rows]
        numel = lengths.prod(axis=1)
        whole = lengths == places.box_len[dest]
        tail = np.ones_like(whole)   # tail[:, d]: every dimension after d is whole
        if whole.shape[1] > 1:
            tail[:, :-1] = np.logical_and.accumulate(whole[:, ::-1], axis=1)[:, ::-1][:, 1:]
        first = ((c.offsets[rows] - places.box_off[dest]) * places.box_strides[dest]).sum(axis=1)
        one_run = (places.plain[dest] & (numel * itemsize == hi - lo) & ((lengths == 1) | tail).all(axis=1)
                   & (first + numel <= places.numel[dest]))
        return one_run, first

    def checks(self, storage: Storage, manifest: Manifest, requests: list[tuple], executor: Executor | None):
        """As _Records.checks, from arrays: each chunk any row reads, once, checked by the reader
        of the request that holds it whole (or after all reads, when it straddles two)."""
        c = self.c
        per_request: list = [None] * len(requests)
        straddling: list = []
        by_ext: dict[int, list[int]] = {}
        for r, (ext, _, _) in enumerate(requests):
            by_ext.setdefault(id(ext), []).append(r)
        for rs in by_ext.values():
            ext = requests[rs[0]][0]
            rows = ext.needs
            start = c.offset[rows]
            a, b, who, k = _used_chunks(start, c.chunk[rows], start + c.nbytes[rows], self.lo[rows], self.hi[rows])
            crc = c.crcs[c.crc_lo[rows][who] + k]
            who = rows[who]
            at, inside = _holding_requests(requests, rs, a, b)
            out = np.flatnonzero(~inside)
            if len(out):
                straddling.append((ext, a[out], b[out], crc[out], who[out]))
            held = np.flatnonzero(inside)
            held = held[np.argsort(at[held], kind="stable")]
            cuts = np.searchsorted(at[held], np.arange(len(rs) + 1))
            for j, r in enumerate(rs):
                sel = held[cuts[j]:cuts[j + 1]]
                if len(sel):
                    per_request[r] = self._checker(storage, manifest, [(ext, a[sel], b[sel], crc[sel], who[sel])],
                                                   None)
        return per_request, (self._checker(storage, manifest, straddling, executor) if straddling else None)

    def _checker(self, storage: Storage, manifest: Manifest, groups: list[tuple], executor: Executor | None):
        return lambda: self._check(storage, manifest, groups, executor)

    def _check(self, storage: Storage, manifest: Manifest, groups: list[tuple], executor: Executor | None) -> None:
        """Check landed chunks given per extent as (extent, first bytes, end bytes, CRCs, rows)."""
        views = []
        for ext, a, b, _, _ in groups:
            mv, s0 = memoryview(ext.buf.numpy()), ext.start
            views += [mv[x - s0:y - s0] for x, y in zip(a.tolist(), b.tolist())]
        got = np.array(checksums(views, executor), dtype=np.int64)
        want = np.concatenate([g[3] for g in groups]).astype(np.int64)
        bad = np.flatnonzero(got != want)
        if not len(bad):
            return
        j = int(bad[0])
        for ext, a, b, _, who in groups:
            if j < len(a):
                break
            j -= len(a)
        raise CorruptCheckpointError(
            f"checksum mismatch in {storage.describe(manifest.files[ext.file].path)} at bytes [{int(a[j])}, "
            f"{int(b[j])}) for {self._row(int(who[j]))} (stored {int(want[bad[0]]):#010x}, read "
            f"{int(got[bad[0]]):#010x}): the data file is corrupt; nothing was loaded from it. Restore the file or "
            "load an earlier checkpoint")

    def _row(self, r: int) -> str:
        c = self.c
        k = c.offsets.shape[1] - int(c.ndim[r])
        return (f"tensor {c.names[int(c.tensor[r])]!r} box offsets={c.saved_offsets[r, k:].tolist()} "
                f"lengths={c.saved_lengths[r, k:].tolist()}")

    def describe(self, ext: _Extent, lo: int, hi: int) -> str:
        rows = ext.needs[(self.land_lo[ext.needs] < hi) & (lo < self.land_hi[ext.needs])]
        names = sorted({self._row(r) for r in rows[:1000].tolist()})
        more = len(rows) - 3 if len(rows) > 1000 else len(names) - 3
        return ", ".join(names[:3]) + (f" and {more} more" if more > 0 else "")

    def put(self, ext: _Extent, executor: Executor | None) -> None:
        """Install one verified extent: runs contiguous in their destination by memmove (neighbours
        in both the file and the destination as one; pieces of large ones spread over `executor`'s
        threads when given), small strided regions by index, the rest one strided copy each."""
        c, places = self.c, self.places
        rows = ext.needs
        dest, lo, hi, itemsize = c.dest[rows], self.lo[rows], self.hi[rows], self.itemsize[rows]
        one_run, first = self._one_runs(rows)
        base = ext.buf.data_ptr() - ext.start
        runs = np.flatnonzero(one_run)
        if len(runs):
            src, dst = lo[runs] + base, places.ptr[dest[runs]] + first[runs] * itemsize[runs]
            n = hi[runs] - lo[runs]
            # Runs that follow each other in the landed bytes and in one destination: one memmove.
            join = np.ones(len(runs), dtype=bool)
            join[1:] = (src[1:] != src[:-1] + n[:-1]) | (dst[1:] != dst[:-1] + n[:-1])
            at = np.flatnonzero(join)
            _memmoves(dst[at].tolist(), src[at].tolist(), np.add.reduceat(n, at).tolist(), executor)
        rest = rows[~one_run]
        if not len(rest):
            ext.buf = None
            return
        typed: dict[torch.dtype, torch.Tensor] = {}
        small = rest[(c.lengths[rest].prod(axis=1) <= _SCATTER_NUMEL) & places.scatterable[c.dest[rest]]
                     & ((self.lo[rest] - ext.start) % self.itemsize[rest] == 0)]
        one_by_one = [rest[~np.isin(rest, small)]]
        if len(small):
            keys = np.concatenate([c.dest[small, None], c.lengths[small], self.strides[small]], axis=1)
            uniq, group = np.unique(keys, axis=0, return_inverse=True)
            group = group.reshape(-1)
            for g in range(len(uniq)):
                members = small[group == g]
                if len(members) < _SCATTER_FROM:
                    one_by_one.append(members)
                else:
                    self._scatter(ext, members, typed)
        for r in np.concatenate(one_by_one).tolist():
            self._copy_one(ext, r, typed)
        ext.buf = None

    def _scatter(self, ext: _Extent, rows: np.ndarray, typed: dict) -> None:
        """Install rows of one destination, region lengths and stored strides by index."""
        c = self.c
        d = int(c.dest[rows[0]])
        t = self.places.dests[d].detach()
        itemsize = t.element_size()
        width = c.offsets.shape[1]
        strides = np.zeros(width, dtype=np.int64)
        if t.dim():
            strides[width - t.dim():] = t.stride()
        dst0 = t.storage_offset() + (c.offsets[rows] - self.places.box_off[d]) @ strides
        src0 = (self.lo[rows] - ext.start) // itemsize
        _scatter(t, _typed(ext, t.dtype, typed), src0, dst0, tuple(c.lengths[rows[0]].tolist()),
                 tuple(self.strides[rows[0]].tolist()), tuple(strides.tolist()))

    def _copy_one(self, ext: _Extent, r: int, typed: dict) -> None:
        c = self.c
        d = int(c.dest[r])
        k = c.offsets.shape[1] - int(c.ndim[r])
        lengths = tuple(c.lengths[r, k:].tolist())
        place = self.places.view(d, c.offsets[r, k:].tolist(), lengths)
        at, itemsize = int(self.lo[r]) - ext.start, int(self.itemsize[r])
        strides = tuple(self.strides[r, k:].tolist())
        if at % itemsize:   # a view as a wider dtype needs an aligned start
            flat = ext.buf[at:int(self.hi[r]) - ext.start].clone().view(place.dtype)
            place.copy_(flat.as_strided(lengths, strides))
            return
        flat = _typed(ext, place.dtype, typed)
        place.copy_(flat.as_strided(lengths, strides, flat.storage_offset() + at // itemsize))


class _ColumnDests:
    """The destination tensors as arrays, for _Columns.put: box offsets, lengths and row-major
    strides padded in front to the columns' width, and for plain tensors their address; filled
    for the destinations some row reads into (`used`), one Python step each."""

    def __init__(self, dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor], width: int, used: np.ndarray):
        self.dests = dests
        n = len(dests)
        self.box_off = np.zeros((n, width), dtype=np.int64)
        self.box_len = np.ones((n, width), dtype=np.int64)
        self.plain = np.zeros(n, dtype=bool)
        self.scatterable = np.zeros(n, dtype=bool)
        self.ptr = np.zeros(n, dtype=np.int64)
        self.numel = np.zeros(n, dtype=np.int64)
        by_ndim: dict[int, list[int]] = {}
        # gathered in lists and set in bulk: a numpy element assignment per destination costs as
        # much as the tensor queries (24,000 destinations)
        scatterable, plain, ptr, numel = [], [], [], []
        for i in used.tolist():
            by_ndim.setdefault(len(dest_boxes[i].lengths), []).append(i)
            t = dests[i]
            if not t.is_cpu or t.is_conj() or t.is_neg():
                continue
            if t.dim() > 0:
                scatterable.append(i)
            if t.is_contiguous():
                plain.append(i)
                ptr.append(t.data_ptr())
                numel.append(t.numel())
        self.scatterable[scatterable] = True
        self.plain[plain] = True
        self.ptr[plain] = ptr
        self.numel[plain] = numel
        for nd, idx in by_ndim.items():
            if nd:   # rows of a destination have its dimensions: nd <= width
                self.box_off[idx, width - nd:] = np.array([dest_boxes[i].offsets for i in idx], dtype=np.int64)
                self.box_len[idx, width - nd:] = np.array([dest_boxes[i].lengths for i in idx], dtype=np.int64)
        self.box_strides = np.ones((n, width), dtype=np.int64)
        for d in range(width - 2, -1, -1):
            self.box_strides[:, d] = self.box_strides[:, d + 1] * self.box_len[:, d + 1]
        self._detached: dict[int, torch.Tensor] = {}

    def _data(self, d: int) -> torch.Tensor:
        t = self._detached.get(d)
        if t is None:
            t = self._detached[d] = self.dests[d].detach()
        return t

    def flat_bytes(self, d: int) -> torch.Tensor:
        """Plain destination d's memory as one run of bytes."""
        return self._data(d).reshape(-1).view(torch.uint8)

    def view(self, d: int, offsets: list[int], lengths: tuple[int, ...]) -> torch.Tensor:
        """The region (offsets, lengths: unpadded, global coordinates) of destination d, as a
        view of its detached data."""
        t = self._data(d)
        if not t.dim():
            return t
        width = self.box_off.shape[1]
        at = t.storage_offset()
        for r, o, st in zip(offsets, self.box_off[d, width - t.dim():].tolist(), t.stride()):
            at += (r - o) * st
        return t.as_strided(lengths, t.stride(), at)


# Pieces a large run is cut into when its copy is spread over threads.
_COPY_PIECE = 8 << 20


def _memmoves(dst: list[int], src: list[int], sizes: list[int], executor: Executor | None) -> None:
    """memmove each (dst, src, size): on this thread, or, with `executor` and at least
    _PARALLEL_BYTES, cut into pieces of _COPY_PIECE spread over its threads (memmove releases the
    GIL: a lone process installs a 400 MB file on both cores of this machine)."""
    if executor is None or sum(sizes) < _PARALLEL_BYTES:
        for d0, s0, nb in zip(dst, src, sizes):
            copy_bytes(d0, s0, nb)
        return
    pieces = [(d0 + a, s0 + a, min(_COPY_PIECE, nb - a)) for d0, s0, nb in zip(dst, src, sizes)
              for a in range(0, nb, _COPY_PIECE)]
    tasks = max(1, min(len(pieces), os.cpu_count() or 2))   # memory-bound: more tasks than cores gain nothing

    def run(k: int) -> None:
        for d0, s0, nb in pieces[k::tasks]:
            copy_bytes(d0, s0, nb)

    run_all(executor, run, [(k,) for k in range(tasks)])


def _typed(ext: _Extent, dtype: torch.dtype, typed: dict) -> torch.Tensor:
    """ext's landing buffer viewed as `dtype` (cached in `typed`)."""
    flat = typed.get(dtype)
    if flat is None:
        itemsize = dtype.itemsize
        usable = ext.buf.numel() // itemsize * itemsize
        flat = typed[dtype] = ext.buf[:usable].view(dtype)
    return flat


def _scatter(t: torch.Tensor, flat: torch.Tensor, src0: np.ndarray, dst0: np.ndarray, lengths: tuple[int, ...],
             src_strides: tuple[int, ...], dst_strides: tuple[int, ...]) -> None:
    """For every i: the region of `lengths` at element dst0[i] of t's storage (element strides
    `dst_strides`) = the one at element src0[i] of `flat` (strides `src_strides`), by two index
    arrays and one gather/scatter per batch. Where the innermost runs allow, the elements move in
    units of g (a gcd of the run length, every start and every outer stride): a 16x16 box moves as
    16 rows, not 256 elements (16x smaller index arrays)."""
    itemsize = t.element_size()
    whole = t.as_strided((t.untyped_storage().nbytes() // itemsize,), (1,), 0)
    nd = len(lengths)
    g = 0
    if nd and lengths[-1] > 1 and src_strides[-1] == 1 and dst_strides[-1] == 1:
        g = lengths[-1]
        for n, a, b in zip(lengths[:-1], src_strides[:-1], dst_strides[:-1]):
            if n > 1:
                g = math.gcd(g, a, b)
        g = math.gcd(g, int(np.gcd.reduce(src0)), int(np.gcd.reduce(dst0)))
    if g > 1:
        lengths = lengths[:-1] + (lengths[-1] // g,)
        src_strides = tuple(x // g for x in src_strides[:-1]) + (1,)
        dst_strides = tuple(x // g for x in dst_strides[:-1]) + (1,)
        src0, dst0 = src0 // g, dst0 // g
        whole = whole[:whole.numel() // g * g].view(-1, g)
        flat = flat[:flat.numel() // g * g].view(-1, g)
    grid = np.indices(lengths, dtype=np.int64).reshape(nd, -1)
    src_pat, dst_pat = np.array(src_strides, dtype=np.int64) @ grid, np.array(dst_strides, dtype=np.int64) @ grid
    per = max(1, _SCATTER_BATCH // max(1, grid.shape[1]))
    for a in range(0, len(src0), per):
        src = torch.from_numpy((src0[a:a + per, None] + src_pat).reshape(-1))
        dst = torch.from_numpy((dst0[a:a + per, None] + dst_pat).reshape(-1))
        whole[dst] = flat[src]


def _sort_needs(items: Sequence[ReadItem], dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor], verify: bool
                ) -> tuple[list[tuple], list[int], list[tuple[int, _Need, torch.Tensor]]]:
    """(what to land as (file, need, packed sums), the items to zero-fill, the regions to read
    straight into their destinations as (file, need, destination view))."""
    strides_of: dict[tuple, tuple] = {}
    needs: list[tuple] = []
    zeros: list[int] = []
    direct: list[tuple[int, _Need, torch.Tensor]] = []
    itemsize = [d.element_size() for d in dests]
    for i, it in enumerate(items):
        if it.saved.file == ZERO_FILL:
            zeros.append(i)
            continue
        need = _need(i, it, itemsize[it.dest], verify, strides_of)
        sums = it.saved.sums
        packed = sums if sums is not None and sums.stored is not None else None
        if (not verify or sums is None) and packed is None:
            # Nothing to verify (a foreign format has no checksums): landing would buy nothing but
            # a copy, so a contiguous region is read straight into its destination.
            view = _dest_view(it, dest_boxes[it.dest], dests[it.dest])
            if view.is_contiguous() and view.device.type == "cpu" and need.hi - need.lo == view.numel() * view.element_size():
                direct.append((it.saved.file, need, view))
                continue
        needs.append((it.saved.file, need, packed))
    return needs, zeros, direct


def _reread(way, direct_files: Collection[int], pool: StagingPool | None) -> bool:
    """Whether to land the load in two passes through one reused REREAD_BATCH buffer (verify
    everything, then read again from the page cache and install) instead of in one buffer as large
    as the rank's bytes: where every file is read through the page cache (none from the device
    into the buffer), the bytes are verified plain chunks, more than REREAD_MIN of them, and the
    pool holds no idle buffer that large. Such a buffer is fresh memory in a restarted process,
    and faulting it in costs more than the second read from the cache (0.3 s per 806 MB at best
    here, 1.5 s and more when the machine hands out pages it has not used since boot); it also
    raises the load's peak memory by the rank's bytes. A warm buffer (a second load, a load after
    saves of as many bytes) lands the bytes once."""
    if not way.verify or way.direct or direct_files or any(e.sums is not None for e in way.extents):
        return False
    total = sum(e.end - e.start for e in way.extents)
    return total > max(REREAD_MIN, 2 * REREAD_BATCH) and (pool is None or pool.idle_largest() < total + _PAGE)


def _split(extents: list[_Extent], bounds, budget: int) -> list[_Extent]:
    """`extents` with each plain one larger than `budget` cut between its needs (ascending by first
    landed byte) into extents of at most `budget` bytes (a need larger than that: one of its own).
    `bounds(ext)`: the landed ranges (land_lo, land_hi lists) of its needs, in order. The pieces
    may share a checksum chunk at a cut: each lands and verifies it whole."""
    out: list[_Extent] = []
    for ext in extents:
        if ext.sums is not None or ext.end - ext.start <= budget:
            out.append(ext)
            continue
        los, his = bounds(ext)
        first, start, reach = 0, los[0], his[0]
        for k in range(1, len(los)):
            if max(reach, his[k]) - start > budget:
                out.append(_Extent(ext.file, start, reach, ext.needs[first:k]))
                first, start, reach = k, los[k], his[k]
            else:
                reach = max(reach, his[k])
        out.append(_Extent(ext.file, start, reach, ext.needs[first:]))
    return out


def _batches(extents, budget: int) -> list[list[_Extent]]:
    """Extents in batches of at most `budget` bytes (an extent larger than it: a batch of its own)."""
    batches: list[list[_Extent]] = [[]]
    size = 0
    for ext in extents:
        if batches[-1] and size + ext.end - ext.start > budget:
            batches.append([])
            size = 0
        batches[-1].append(ext)
        size += ext.end - ext.start
    return batches


def _put(ext: _Extent, items: Sequence[ReadItem], places: _Dests) -> None:
    """Install one verified extent into its destinations, then drop its landing view."""
    base = ext.buf.data_ptr() - ext.start
    typed: dict[torch.dtype, torch.Tensor] = {}   # the landing buffer viewed as each dtype it holds
    strided: dict[tuple, list[_Need]] = {}   # (dest, region lengths, stored strides) -> small strided needs
    for n in ext.needs:
        it = items[n.index]
        at = places.address(it, n.hi - n.lo)
        if at is not None:
            copy_bytes(at, base + n.lo, n.hi - n.lo)
            continue
        if it.region.numel <= _SCATTER_NUMEL and n.strides:
            strided.setdefault((it.dest, it.region.lengths, n.strides), []).append(n)
            continue
        _copy_one(ext, n, it, places, typed)
    for (d, lengths, strides), needs in strided.items():
        if len(needs) < _SCATTER_FROM or not places.scatter(ext, needs, items, d, lengths, strides, typed):
            for n in needs:
                _copy_one(ext, n, items[n.index], places, typed)
    ext.buf = None


def _copy_one(ext: _Extent, n: _Need, it: ReadItem, places: _Dests, typed: dict) -> None:
    view = places.view(it)
    view.copy_(_source(ext, n, it, view.dtype, typed))


class _Compacts:
    """Per landed item, a contiguous tensor holding what it filled (see Landing.install), made
    when asked for: a rank forwards few of the items it read."""

    def __init__(self, items: Sequence[ReadItem], dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor]):
        self._items, self._boxes, self._dests = items, dest_boxes, dests

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> torch.Tensor:
        it = self._items[i]
        view = _dest_view(it, self._boxes[it.dest], self._dests[it.dest])
        return view if view.is_contiguous() else view.contiguous()


def read_tensors(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], dest_boxes: Sequence[Box],
                 dests: Sequence[torch.Tensor], executor: Executor | None, *, verify: bool,
                 timer: PhaseTimer) -> None:
    """land_tensors, then install at once (for callers with no other rank to agree with)."""
    land_tensors(storage, manifest, items, dest_boxes, dests, executor, verify=verify, timer=timer).install()


def forward_replicas(items: Sequence[ReadItem], keys: Sequence, compact_of, plan: "ForwardPlan",
                     dest_boxes: Sequence[Box], dests: Sequence[torch.Tensor], rank: int, group,
                     timer: PhaseTimer) -> None:
    """Zero-redundancy load, second half: readers send what they read to the other ranks that
    want the same bytes; those receive straight into their destination where it is contiguous.
    `keys` are the items' item_keys, `compact_of(i)` what this rank read for item i.

    All ranks walk the shared keys in the same order, so the point-to-point pairs always match.
    """
    import torch.distributed as dist
    by_key = {key: i for i, key in enumerate(keys)}
    with timer.phase("forward"):
        ops, pending = [], []
        for key, reader, others in plan:
            i = by_key.get(key)
            if i is None:
                continue
            if reader == rank:
                compact = compact_of(i)
                for o in others:
                    ops.append(dist.P2POp(dist.isend, compact, dist.get_global_rank(group, o), group))
            elif rank in others:
                it = items[i]
                view = _dest_view(it, dest_boxes[it.dest], dests[it.dest])
                compact = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
                ops.append(dist.P2POp(dist.irecv, compact, dist.get_global_rank(group, reader), group))
                if compact is not view:
                    pending.append((view, compact))
                timer.count("received", compact.numel() * compact.element_size())
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        with torch.no_grad():
            for view, compact in pending:
                view.copy_(compact)


def check_file_sizes(storage: Storage, manifest: Manifest, items: Sequence[ReadItem], object_ranges) -> None:
    """Fail before anything is read (and so before any parameter is overwritten) when a data file
    is missing or shorter than the bytes this rank needs; the error names what lies past the end.

    `object_ranges` holds (object key, ObjectEntry) pairs. One size query per file.
    """
    items = stored_grids(manifest, items)
    ends: dict[int, int] = {}   # file -> the end of the last byte needed there
    records, columns = (items.objects, items.columns) if isinstance(items, ReadPlan) else (items, None)
    for it in records:
        end = _stored_end(it.saved)
        if it.saved.file >= 0 and ends.get(it.saved.file, -1) < end:
            ends[it.saved.file] = end
    if columns is not None:
        files, at = np.unique(columns.file, return_inverse=True)
        top = np.zeros(len(files), dtype=np.int64)
        np.maximum.at(top, at.reshape(-1), columns.offset + columns.nbytes)
        for f, end in zip(files.tolist(), top.tolist()):
            ends[f] = max(ends.get(f, -1), end)
    objects = [(key, e) for key, e in object_ranges if e.inline is None]
    for _, e in objects:
        ends[e.file] = max(ends.get(e.file, -1), e.offset + e.nbytes)
    for fi, end in ends.items():
        path = manifest.files[fi].path
        size = storage.size(path)
        if size < end:   # name what lies past the end (built only for a short file)
            require_length(storage, path, size, _contents(items, objects, fi), "manifest")


def _stored_end(sb) -> int:
    """The file offset just past a saved box's stored bytes (its stored chunks when compressed)."""
    return sb.sums.file_end if sb.sums is not None and sb.sums.stored is not None else sb.offset + sb.nbytes


def _contents(items: Sequence[ReadItem], objects: list, fi: int) -> list[tuple[int, str]]:
    """(end, what) of every box and object this rank reads from file `fi`."""
    what = [(_stored_end(it.saved), f"tensor {it.name!r} box offsets={list(it.saved.offsets)} "
             f"lengths={list(it.saved.lengths)}") for it in items if it.saved.file == fi]
    what += [(e.offset + e.nbytes, f"object {key!r}") for key, e in objects if e.file == fi]
    return what
