"""The storage protocol: what the engine needs from any place checkpoints live."""
from __future__ import annotations

from concurrent.futures import Executor
from typing import NamedTuple, Protocol, Sequence


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
