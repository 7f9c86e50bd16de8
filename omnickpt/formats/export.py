"""What every exporter of a foreign format shares: where it may write, its progress bar, and how a failed
export leaves the destination as it found it."""
from __future__ import annotations

import os

from tqdm.auto import tqdm

from omnickpt.errors import UnsupportedError

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


def byte_progress(total: int, enabled: bool) -> tqdm | None:
    """A progress bar counting bytes written (None when not wanted)."""
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export") if enabled else None


def make_destination(out_dir: str) -> bool:
    """Create the export folder `out_dir` (and its parents); True when this call created it, so that a failed
    export can remove it again. StorageError (naming it, saying what to do) when it cannot be made."""
    from omnickpt.storage.base import os_failure
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
