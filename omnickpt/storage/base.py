"""The storage protocol: what the engine needs from any place checkpoints live."""
from __future__ import annotations

from concurrent.futures import Executor
from typing import NamedTuple, Protocol, Sequence

from omnickpt.errors import StorageError


class Segment(NamedTuple):
    """`data` goes to byte `offset` of a file."""
    offset: int
    data: memoryview


class Storage(Protocol):
    """All paths are relative to the checkpoint root, '/'-separated."""

    root: str

    def write_file(self, rel: str, size: int, segments: Sequence[Segment], executor: Executor | None,
                   *, durable: bool) -> dict[str, float]:
        """Create `rel` (replacing any old one) of `size` bytes from non-overlapping segments,
        in parallel on `executor`; durable=True returns only once the bytes are on stable storage.
        Returns seconds spent in named sub-phases (e.g. {"fsync": 0.1})."""

    def read_into(self, rel: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers`, in order, from the contiguous byte range starting at `offset`."""

    def read_bytes(self, rel: str) -> bytes: ...

    def exists(self, rel: str) -> bool: ...

    def size(self, rel: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of the files under `prefix` (recursively)."""

    def children(self, rel: str = "") -> list[str]:
        """Names directly under `rel` (files and sub-directories / common prefixes)."""

    def delete(self, rel: str) -> None: ...

    def delete_tree(self, rel: str) -> None:
        """Remove everything under `rel`."""

    def commit(self, rel: str, data: bytes) -> None:
        """Write `rel` atomically and durably: readers see the old file or the whole new one."""

    def describe(self, rel: str = "") -> str:
        """A human-readable location for error messages."""


# Helpers for backends that upload or stream a file assembled from segments.
def bytes_view(mv) -> memoryview:
    """A flat byte view of any buffer (tensor views from numpy may be typed or shaped)."""
    mv = memoryview(mv)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def cover(size: int, segments: Sequence[Segment], where: str) -> list[tuple[int, memoryview | int]]:
    """The file as (offset, piece) in order: the segments' bytes, and zero-length counts for the gaps
    between them (those bytes are zeros, as in a sparse local file)."""
    out: list[tuple[int, memoryview | int]] = []
    pos = 0
    for off, data in sorted(((s.offset, bytes_view(s.data)) for s in segments if len(s.data)), key=lambda s: s[0]):
        if off < pos or off + len(data) > size:
            raise StorageError(f"writing {where}: segment at byte {off} ({len(data)} bytes) overlaps another or "
                               f"runs past the file's {size} bytes (a bug in the caller)")
        if off > pos:
            out.append((pos, off - pos))
        out.append((off, data))
        pos = off + len(data)
    if pos < size:
        out.append((pos, size - pos))
    return out


def split(bufs: list[memoryview], chunk: int) -> list[tuple[int, list[memoryview]]]:
    """Cut a run of buffers into consecutive ranges of `chunk` bytes: (offset in the run, views)."""
    out: list[tuple[int, list[memoryview]]] = []
    pos, cur, room = 0, [], chunk
    for b in bufs:
        while len(b):
            take = min(room, len(b))
            cur.append(b[:take])
            b, room = b[take:], room - take
            if not room:
                out.append((pos, cur))
                pos, cur, room = pos + chunk, [], chunk
    if cur:
        out.append((pos, cur))
    return out
