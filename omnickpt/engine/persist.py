"""Persist: a rank's data file written in the background, after its snapshot. A writer
(engine/writers.py: plain, compressed, incremental) lays the file out; one tail, the same for
all, chunks and checksums its bytes and writes it; the RankResult goes to the coordinator."""
from __future__ import annotations

import hashlib
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnickpt.engine.staging import checksums
from omnickpt.engine.writers import Encoding, Incremental, RankFile, compressed_file, incremental_file, plain_file
from omnickpt.format import CHUNK_BYTES, DATA_DIR, checksum
from omnickpt.monitor import PhaseTimer
from omnickpt.storage import Segment, Storage

if TYPE_CHECKING:   # persist takes the snapshot that engine/save.py makes
    from omnickpt.engine.save import Snapshot


def data_file_name(save_id: str, rank: int) -> str:
    return f"{DATA_DIR}/{save_id}-r{rank:05d}.bin"


@dataclass
class RankResult:
    """What one rank reports to the coordinator after persisting."""
    rank: int
    file: str | None
    bytes: int
    checksums: list[list[int]]                  # per write item, in plan order: CRC32C per CHUNK_BYTES chunk
    objects: list[tuple[str, int, int, int, str]] = field(default_factory=list)  # key, off, n, crc, digest
    timings: dict = field(default_factory=dict)
    error: str | None = None
    error_class: str = "CheckpointError"       # so that every rank raises the class the failing rank did
    # A compressed save (codec set) lays its file out anew: each write's file offset and the stored
    # length of each of its chunks (checksums are then those of the stored bytes).
    codec: str | None = None
    offsets: list[int] | None = None
    stored: list[list[int]] | None = None
    # An incremental save (engine/incremental.py): per write its runs of rows as [first row, rows,
    # ref, offset] (ref -1: in this rank's file at offset; else at offset of refs[ref], a file of
    # an earlier checkpoint as [path, rank, bytes]) and its block hashes; checksums then hold the
    # CRCs of each run's bytes, run after run.
    # With quantize_optimizer=: [write index, scheme, largest error] of each write whose chunks
    # are quantized (a list: the record travels as JSON).
    quantized: list[list] | None = None
    pieces: list[list[list[int]]] | None = None
    refs: list[list] | None = None
    hashes: list[list[int]] | None = None


_AS_THEY_ARE = Encoding()   # the writes' bytes as they are


def persist(storage: Storage, snap: Snapshot, rank: int, save_id: str, executor: Executor | None, *,
            durable: bool, timer: PhaseTimer, encoding: Encoding = _AS_THEY_ARE,
            incremental: Incremental | None = None) -> RankResult:
    """Write this rank's data file and checksum what it wrote. With `encoding.compression`, each
    CHUNK_BYTES chunk of each write is compressed on its own and the file laid out anew
    (RankResult.offsets, .stored); the checksums are those of the stored bytes. With
    `incremental`, only the blocks that changed since its base are written (RankResult.pieces).

    Not under gc_paused: an async save persists on a background thread, and the collector is the
    whole process's. Paused for a save's flight, it left training without collections while a save
    was in flight and with the deferred ones after, and a program's own gc.disable() in that time was
    undone when the save ended. A sync save persists inside Checkpointer.save, which pauses it."""
    if snap.cuda_event is not None:
        snap.cuda_event.synchronize()
    if incremental is not None:
        file = incremental_file(snap, incremental, executor, timer)
    elif encoding.compression is not None:
        file = compressed_file(snap, encoding, executor, timer)
    else:
        file = plain_file(snap)
    rel = data_file_name(save_id, rank) if file.written else None
    with timer.phase("checksum"):
        sums = _chunk_sums(file, executor)
        objs = [(k, off, n, checksum(mv), hashlib.blake2b(mv, digest_size=16).hexdigest())
                for k, off, n, mv in file.objects]
    if rel is not None:
        _write(storage, rel, file.file_bytes, file.segments, executor, durable, timer)
    if file.referenced is not None:
        timer.count("referenced", file.referenced)
    return RankResult(rank, rel, file.file_bytes if rel is not None else 0, sums, objs, **file.fields)


def _chunk_sums(file: RankFile, executor: Executor | None) -> list[list[int]]:
    """Per write the CRC32C of each CHUNK_BYTES chunk of its views. One CRC per chunk so that a
    partial (resharded) read can verify what it reads; the chunks of all writes are one flat list
    of tasks, so large boxes spread over the threads."""
    views = file.views
    chunks = views if file.chunked else [v[i:i + CHUNK_BYTES] for v in views for i in range(0, len(v), CHUNK_BYTES)]
    flat = checksums(chunks, executor)
    sums, pos = [], 0
    for n in file.counts:
        sums.append(flat[pos:pos + n])
        pos += n
    return sums


def _write(storage: Storage, rel: str, file_bytes: int, segments: list[Segment], executor: Executor | None,
           durable: bool, timer: PhaseTimer) -> None:
    t0 = time.perf_counter()
    phases = storage.write_file(rel, file_bytes, segments, executor, durable=durable) or {}
    elapsed = time.perf_counter() - t0
    timer.add("write", elapsed - sum(phases.values()), start=t0)
    at = t0 + elapsed - sum(phases.values())
    for name, secs in phases.items():   # sub-phases (fsync) end the write
        timer.add(name, secs, start=at)
        at += secs
    timer.count("written", file_bytes)
