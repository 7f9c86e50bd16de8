"""The coordinator's part of a save's commit: the manifest from the global plan and every rank's
RankResult. Boxes are built as columns (one row per box, no object per box: at 8192 ranks the
plan holds millions of them), one builder per writer: plain and compressed writes are a box each,
an incremental write is its runs of rows."""
from __future__ import annotations

import itertools
import time

import numpy as np

from omnickpt.engine.incremental import rows_per_block
from omnickpt.engine.persist import RankResult
from omnickpt.format import (
    CHUNK_BYTES,
    FORMAT_VERSION,
    ColumnTable,
    FileEntry,
    Manifest,
    ObjectEntry,
    dtype_from_name,
)
from omnickpt.planner import GlobalPlan


def build_manifest(plan: GlobalPlan, results: list[RankResult], *, save_id: str, layout: dict,
                   tool_version: str, incremental: dict | None = None) -> Manifest:
    """The manifest of a save from the plan and every rank's result. `incremental`: the header
    fields of an incremental save ({"block_bytes", "base", "chain"}); its results carry pieces."""
    files, file_index, codec = _files(results)
    if incremental is not None:
        boxes = _piece_boxes(plan, results, file_index, files, incremental["block_bytes"])
    else:
        boxes = _write_boxes(plan, results, file_index, codec)
    table, tid, order = _box_table(boxes, codec)
    bounds = np.searchsorted(tid, np.arange(len(plan.names) + 1))
    # Every tensor any rank holds gets an entry, even if all its boxes are empty.
    quantized = _quantized_tensors(plan, results)
    tensors = table.entries(plan.names, plan.shapes, plan.dtypes, bounds.tolist(),
                            {name: q["scheme"] for name, q in quantized.items()})
    block_hashes = _block_hashes(plan, boxes, order, bounds) if incremental is not None else {}
    inc = incremental or {}
    return Manifest(save_id=save_id, world_size=len(results), files=files, tensors=tensors,
                    objects=_object_entries(results, file_index), layout=layout, tool_version=tool_version,
                    created=time.time(), version=FORMAT_VERSION, chunk_bytes=CHUNK_BYTES, compression=codec,
                    block_bytes=inc.get("block_bytes"), hashes=block_hashes, base=inc.get("base"),
                    chain=inc.get("chain", 0), quantized=quantized)


def _files(results: list[RankResult]) -> tuple[list[FileEntry], dict[int, int], str | None]:
    """(the ranks' data files, rank -> its file's index, the save's codec)."""
    files: list[FileEntry] = []
    file_index: dict[int, int] = {}
    for r in results:
        if r.file is not None:
            file_index[r.rank] = len(files)
            files.append(FileEntry(r.file, r.rank, r.bytes))
    codecs = {r.codec for r in results if r.file is not None}
    if len(codecs) > 1:
        raise RuntimeError(f"ranks saved with different compression: {sorted(map(str, codecs))}")
    return files, file_index, codecs.pop() if codecs else None


def _box_table(boxes: tuple, codec: str | None) -> tuple[ColumnTable, np.ndarray, np.ndarray]:
    """The boxes that hold bytes, sorted by tensor then offsets, as the manifest's column table;
    also their tensor ids and the order taken from `boxes`."""
    tid, offs, lens, file, file_offset, nbytes, n_crcs, crcs, stored, _, _ = boxes
    keep = nbytes > 0   # a tensor with no elements: its entry (shape, dtype) is the whole record
    if (n_crcs[keep] != -(-nbytes[keep] // CHUNK_BYTES)).any() or n_crcs[~keep].any():
        raise RuntimeError("a rank reported a checksum count that does not match its writes' chunk grid")
    crc0 = np.concatenate(([0], np.cumsum(n_crcs)))[:-1]
    sel = np.nonzero(keep)[0]
    order = sel[np.lexsort(tuple(offs[sel, d] for d in range(offs.shape[1] - 1, -1, -1)) + (tid[sel],))]
    crc_rows = _regroup(crc0[order], n_crcs[order])
    table = ColumnTable(offsets=offs[order].astype(np.int64), lengths=lens[order].astype(np.int64),
                        file=file[order], offset=file_offset[order], nbytes=nbytes[order],
                        sums_start=np.concatenate(([0], np.cumsum(n_crcs[order]))), crcs=crcs[crc_rows],
                        chunk_bytes=CHUNK_BYTES, stored=None if stored is None else stored[crc_rows], codec=codec)
    return table, tid[order], order


def _block_hashes(plan: GlobalPlan, boxes: tuple, order: np.ndarray, bounds: np.ndarray) -> dict[str, np.ndarray]:
    """Per tensor the block hashes of its boxes, in the manifest's box order."""
    n_hash, hashes = boxes[9], boxes[10]
    h0 = np.concatenate(([0], np.cumsum(n_hash)))[:-1]
    h_sorted = hashes[_regroup(h0[order], n_hash[order])]
    hb = np.concatenate(([0], np.cumsum(n_hash[order])))
    return {name: h_sorted[hb[bounds[t]]:hb[bounds[t + 1]]] for t, name in enumerate(plan.names)}


def _object_entries(results: list[RankResult], file_index: dict[int, int]) -> dict[str, list[ObjectEntry]]:
    """Each object once per distinct content, with the ranks that saved that content."""
    objects: dict[str, list[ObjectEntry]] = {}
    by_content: dict[tuple[str, str], ObjectEntry] = {}
    for r in results:
        for key, off, n, ck, digest in r.objects:
            seen = by_content.get((key, digest))
            if seen is not None:
                seen.ranks.append(r.rank)
                continue
            e = ObjectEntry([r.rank], file_index[r.rank], off, n, ck)
            by_content[(key, digest)] = e
            objects.setdefault(key, []).append(e)
    return objects


def _quantized_tensors(plan: GlobalPlan, results: list[RankResult]) -> dict[str, dict]:
    """Per quantized tensor: its scheme and the largest error any rank's chunks of it made. Every
    box of a tensor must be stored alike (the manifest holds one codec per tensor)."""
    out: dict[str, dict] = {}
    if not any(r.quantized for r in results):
        return out      # nothing quantized: no codecs to mix (and no loop over 10^4 writes)
    of_tensor: dict[int, set] = {}
    for r in results:
        a = int(plan.write_start[r.rank])
        marked = {int(i): (c, float(e)) for i, c, e in r.quantized or ()}
        for j in range(int(plan.write_start[r.rank + 1]) - a):
            t = int(plan.write_tensor[a + j])
            scheme, error = marked.get(j, (None, 0.0))
            of_tensor.setdefault(t, set()).add(scheme)
            if scheme is not None:
                name = plan.names[t]
                seen = out.setdefault(name, {"scheme": scheme, "max_error": 0.0})
                seen["max_error"] = max(seen["max_error"], error)
    mixed = [plan.names[t] for t, schemes in of_tensor.items() if len(schemes) > 1]
    if mixed:
        raise RuntimeError(f"ranks stored boxes of {mixed[0]!r} with different codecs: {sorted(map(str, of_tensor[plan.names.index(mixed[0])]))}")
    return out


def _regroup(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Indices of the runs [starts[i], starts[i] + counts[i]) one after the other."""
    bounds = np.concatenate(([0], np.cumsum(counts)))
    return np.arange(int(bounds[-1]), dtype=np.int64) + np.repeat(starts - bounds[:-1], counts)


# ---------------------------------------------------------------------- plain and compressed writes
def _write_boxes(plan: GlobalPlan, results: list[RankResult], file_index: dict[int, int], codec: str | None):
    """One box per write of the plan, in result order, as columns."""
    ranks = np.array([r.rank for r in results], dtype=np.int64)
    file_of = np.full(len(plan.write_start) - 1, -1, dtype=np.int64)
    file_of[[r.rank for r in results if r.file is not None]] = [file_index[r.rank] for r in results if r.file is not None]
    n_crcs = _checksum_counts(plan, results)
    # Rows in result order (each rank's writes in plan order), as the checksums come.
    rows = np.concatenate([np.arange(plan.write_start[k], plan.write_start[k + 1]) for k in ranks.tolist()]
                          + [np.zeros(0, dtype=np.int64)])
    crcs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(r.checksums) for r in results),
                       dtype=np.uint32, count=int(n_crcs.sum()))
    stored, file_offset = None, plan.write_offset[rows]
    if codec is not None:
        stored, file_offset = _compressed_offsets(results, int(n_crcs.sum()), len(rows))
    rank_of = np.repeat(np.arange(len(plan.write_start) - 1), np.diff(plan.write_start))[rows]
    none = np.zeros(len(rows), dtype=np.int64)
    return (plan.write_tensor[rows], plan.write_offsets[rows], plan.write_lengths[rows], file_of[rank_of],
            np.asarray(file_offset, dtype=np.int64), plan.write_nbytes[rows].astype(np.int64), n_crcs, crcs, stored,
            none, np.zeros(0, dtype=np.uint64))


def _checksum_counts(plan: GlobalPlan, results: list[RankResult]) -> np.ndarray:
    """How many checksums each write has, in result order (checked: one list per write)."""
    counts = []
    for r in results:
        a, b = int(plan.write_start[r.rank]), int(plan.write_start[r.rank + 1])
        if b - a != len(r.checksums):
            raise RuntimeError(f"rank {r.rank} reported {len(r.checksums)} checksums for {b - a} writes")
        counts.append(np.fromiter(map(len, r.checksums), dtype=np.int64, count=b - a))
    return np.concatenate(counts + [np.zeros(0, dtype=np.int64)])


def _compressed_offsets(results: list[RankResult], n_chunks: int, n_writes: int) -> tuple[np.ndarray, np.ndarray]:
    """(each chunk's stored length, each write's file offset): a compressed file is laid out by its
    rank (chunks shrink), so offsets come from the results."""
    stored = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(r.stored or ()) for r in results),
                         dtype=np.int64, count=n_chunks)
    file_offset = np.concatenate([np.asarray(r.offsets if r.offsets is not None else [], dtype=np.int64)
                                  for r in results] + [np.zeros(0, dtype=np.int64)])
    if len(file_offset) != n_writes:
        raise RuntimeError("a rank of a compressed save reported no file offset for some of its writes")
    return stored, file_offset


# ---------------------------------------------------------------------- incremental writes
def _piece_boxes(plan: GlobalPlan, results: list[RankResult], file_index: dict[int, int], files: list[FileEntry],
                 block_bytes: int):
    """An incremental save's boxes: each write becomes its runs of rows (engine/incremental.py),
    stored in its rank's file or in a file of an earlier checkpoint (added to `files` once)."""
    ref_of: dict[str, int] = {}
    cols: list[list] = [[] for _ in range(8)]   # tid, offs, lens, file, offset, nbytes, n_crcs, n_hash
    crcs: list[int] = []
    hashes: list[int] = []
    for r in results:
        a, b = int(plan.write_start[r.rank]), int(plan.write_start[r.rank + 1])
        if r.pieces is None or len(r.pieces) != b - a or len(r.checksums) != b - a or len(r.hashes or ()) != b - a:
            raise RuntimeError(f"rank {r.rank} reported no runs, checksums or hashes for some of its {b - a} writes")
        ref_files = _ref_files(r, files, ref_of, file_index.get(r.rank, -1))
        for j in range(b - a):
            for col, part in zip(cols, _run_columns(plan, r, a + j, j, ref_files, block_bytes)):
                col.append(part)
            crcs.extend(r.checksums[j])
            hashes.extend(r.hashes[j])
    tid, offs, lens, file, offset, nbytes, n_crcs, n_hash = cols
    width = plan.write_offsets.shape[1] if plan.write_offsets.ndim == 2 else 0
    i64, none = np.int64, np.zeros(0, dtype=np.int64)
    cat = lambda parts: np.concatenate(parts + [none])   # noqa: E731
    return (cat(tid), np.concatenate(offs + [np.zeros((0, width), dtype=i64)]).astype(i64),
            np.concatenate(lens + [np.zeros((0, width), dtype=i64)]).astype(i64), cat(file), cat(offset),
            cat(nbytes), cat(n_crcs), np.array(crcs, dtype=np.uint32), None, cat(n_hash),
            np.array(hashes, dtype=np.uint64))


def _ref_files(r: RankResult, files: list[FileEntry], ref_of: dict[str, int], own: int) -> np.ndarray:
    """The file index of each of a rank's refs (the earlier checkpoints' files, each added to
    `files` once), then `own`: ref -1 (this rank's file) picks it."""
    refs = []
    for path, rank, size in r.refs or ():
        if path not in ref_of:
            ref_of[path] = len(files)
            files.append(FileEntry(path, int(rank), int(size)))
        refs.append(ref_of[path])
    return np.array(refs + [own], dtype=np.int64)


def _run_columns(plan: GlobalPlan, r: RankResult, row: int, j: int, ref_files: np.ndarray, block_bytes: int):
    """The runs of write `j` of rank result `r` (plan row `row`) as columns: no Python per run (a
    scattered update makes 10^4-10^5). Returns (tensor ids, offsets, lengths, files, file offsets,
    nbytes, checksum counts, hash counts), checked against what the rank reported."""
    t = int(plan.write_tensor[row])
    nd = len(plan.shapes[t])
    o0, l0 = plan.write_offsets[row].astype(np.int64), plan.write_lengths[row].astype(np.int64)
    item = dtype_from_name(plan.dtypes[t]).itemsize
    row_bytes = (int(np.prod(l0[1:nd])) if nd else 1) * item
    rpb = rows_per_block(tuple(l0[:nd].tolist()), item, block_bytes)
    p = np.asarray(r.pieces[j], dtype=np.int64).reshape(-1, 4)
    first, rows = p[:, 0], p[:, 1]
    o, ln = np.repeat(o0[None, :], len(p), axis=0), np.repeat(l0[None, :], len(p), axis=0)
    if nd:
        o[:, 0] += first
        ln[:, 0] = rows
    n = rows * row_bytes
    k = -(-n // CHUNK_BYTES)
    if int(k.sum()) != len(r.checksums[j]):
        raise RuntimeError(f"rank {r.rank} reported {len(r.checksums[j])} checksums for runs of "
                           f"{int(k.sum())} chunks")
    # Runs start on the block grid and cover the write in order: their hashes, one after the
    # other, are the write's.
    h = np.where(n > 0, -(-rows // rpb), 0) if nd else np.where(n > 0, 1, 0)
    if int(h.sum()) != len(r.hashes[j]):
        raise RuntimeError(f"rank {r.rank} reported {len(r.hashes[j])} block hashes for runs of "
                           f"{int(h.sum())} blocks")
    return np.full(len(p), t, dtype=np.int64), o, ln, ref_files[p[:, 2]], p[:, 3], n, k, h
