"""Storage backends behind one narrow interface, chosen from the checkpoint path's URL."""
from __future__ import annotations

from omnickpt.storage.base import Segment, Storage
from omnickpt.storage.local import LocalStorage


def storage_for(path: str) -> Storage:
    """The backend for `path`: a local path (or file://), s3://bucket/prefix; shm:// and fsspec
    URLs plug in here."""
    path = str(path)
    if path.startswith("file://"):
        return LocalStorage(path[len("file://"):])
    if path.startswith("s3://"):
        # imported here: boto3 is an optional extra, needed only by s3:// paths
        from omnickpt.storage.s3 import S3Storage
        return S3Storage(path)
    if path.startswith("shm://"):  # host shared memory (/dev/shm/omnickpt/NAME/...): the memory tier
        from omnickpt.storage.shm import ShmStorage
        return ShmStorage(path)
    if "://" in path:  # any other URL (and fsspec+SCHEME:// to force it): fsspec, an optional extra
        from omnickpt.storage.fsspec_store import FsspecStorage
        return FsspecStorage(path)
    return LocalStorage(path)


__all__ = ["LocalStorage", "Segment", "Storage", "storage_for"]
