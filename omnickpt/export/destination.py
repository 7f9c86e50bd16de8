"""Where an export or conversion may write, checked once for every writer, and how a failed one leaves the
destination as it found it.

- `local_dir`: exporters write their files in place, tensor by tensor: a local folder only;
- `refuse_source`: never the source checkpoint itself;
- `refuse_occupied`: never over what is there (every file, or the files of the kind the writer makes);
- `Destination`: the checks, then the folder created when missing and every file written recorded, so
  that a failure removes them (and the folder, when the export made it).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

from tqdm.auto import tqdm

from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.storage import storage_for
from omnickpt.storage.base import os_failure

# The advice of an export's StorageError for a full device (storage.base.os_failure's `hint`).
FULL_DISK_HINT = "free space there, or export to a folder on another device (what this export had written was removed)"


def local_dir(dst: str) -> str:
    """The local folder behind `dst`: exporters write their files in place, tensor by tensor."""
    if dst.startswith("file://"):
        return dst[len("file://"):]
    if "://" in dst:
        raise UnsupportedError(f"export destination {dst}: only a local folder can be written (the files are "
                               "written in place, tensor by tensor); export locally, then upload the folder")
    return dst


def refuse_source(src: str, dst: str, out_dir: str) -> None:
    """UnsupportedError when the local folder `out_dir` (spelt `dst` by the caller) is the checkpoint `src`."""
    if os.path.isdir(out_dir) and os.path.realpath(out_dir) == os.path.realpath(storage_for(str(src)).root):
        raise UnsupportedError(f"export destination {dst} is the source checkpoint itself; pass another folder")


def refuse_occupied(where: str, names: Sequence[str], *, clashes: Callable[[str], bool] | None = None,
                    why: str = "an export never writes over existing files") -> None:
    """CheckpointError when the destination `where` already holds something a writer could clash with: any of
    `names` (its listing), or, with `clashes`, those of them it says would (files of the kind the writer makes:
    stale model shards beside new ones read as one model). The message names what is there and what to do."""
    there = sorted(n for n in names if clashes is None or clashes(n))
    if not there:
        return
    shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
    held = f"already holds {shown}" if clashes is not None else f"is not empty (it holds {shown})"
    raise CheckpointError(f"{where} {held}; {why}: remove {'them' if len(there) > 1 else 'it'} or pass an empty "
                          "or new folder")


def byte_progress(total: int, enabled: bool) -> tqdm | None:
    """A progress bar counting bytes written (None when not wanted)."""
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export") if enabled else None


def make_destination(out_dir: str) -> bool:
    """Create the export folder `out_dir` (and its parents); True when this call created it, so that a failed
    export can remove it again. StorageError (naming it, saying what to do) when it cannot be made."""
    if os.path.isdir(out_dir):
        return False
    try:
        os.makedirs(out_dir)
    except FileExistsError:
        return False   # made at the same moment by someone else: not ours to remove
    except OSError as e:
        raise os_failure("creating the export destination", out_dir, e, device=out_dir) from e
    return True


def remove_written(paths: list[str], created: str | None) -> None:
    """Undo a failed export: remove the files it wrote, then the folder `created` if the export made it (only
    when empty: anything else there is not the export's). Errors are ignored: the export's own error matters."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
    if created is not None:
        try:
            os.rmdir(created)
        except OSError:
            pass


class Destination:
    """The local folder an exporter writes: `Destination(src, dst)` checks that it is local and not the source;
    `refuse_occupied()` that it holds nothing the export clashes with. As a context manager it creates the
    folder when missing and, when the block fails, removes every file recorded with `wrote()` (and the folder
    when it was made here), then lets the error through."""

    def __init__(self, src: str, dst: str):
        self.dst = str(dst)
        self.path = local_dir(self.dst)
        refuse_source(src, self.dst, self.path)
        self.written: list[str] = []
        self.created = False

    def refuse_occupied(self, clashes: Callable[[str], bool] | None = None, why: str | None = None) -> None:
        if os.path.isdir(self.path):
            refuse_occupied(f"export destination {self.path}", os.listdir(self.path), clashes=clashes,
                            **({"why": why} if why else {}))

    def file(self, name: str) -> str:
        """The path of file `name` in the destination."""
        return os.path.join(self.path, name)

    def wrote(self, path: str) -> str:
        """Record `path` as the export's own (removed if the export fails); returns it."""
        self.written.append(path)
        return path

    def __enter__(self) -> "Destination":
        self.created = make_destination(self.path)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            remove_written(self.written, self.path if self.created else None)


__all__ = ["FULL_DISK_HINT", "Destination", "byte_progress", "local_dir", "make_destination", "refuse_occupied",
           "refuse_source", "remove_written"]
