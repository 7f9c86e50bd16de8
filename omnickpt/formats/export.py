"""Moved: what every exporter shares (where it may write, its progress bar, the cleanup of a failed export)
lives in omnickpt.export.destination, above the readers. This module stays, empty, so that an old import
of one of those names says where it went (no import of the layer above)."""
from __future__ import annotations

_MOVED = ("FULL_DISK_HINT", "byte_progress", "local_dir", "make_destination", "remove_written")


def __getattr__(name: str):
    if name in _MOVED:
        # ImportError, not AttributeError: `from omnickpt.formats.export import local_dir` would replace an
        # AttributeError with a bare "cannot import name", losing where the name went.
        raise ImportError(f"{__name__}.{name} moved to omnickpt.export.destination.{name}", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__: list[str] = []
