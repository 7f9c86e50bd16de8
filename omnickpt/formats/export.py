"""Moved: what every exporter shares (where it may write, its progress bar, the cleanup of a failed export)
lives in omnickpt.export.destination, above the readers. These names stay importable from here, resolved on
first use, so that importing the readers of omnickpt.formats never imports the exporters."""
from __future__ import annotations

_MOVED = ("FULL_DISK_HINT", "byte_progress", "local_dir", "make_destination", "remove_written")


def __getattr__(name: str):
    if name in _MOVED:
        from omnickpt.export import destination
        return getattr(destination, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_MOVED)
