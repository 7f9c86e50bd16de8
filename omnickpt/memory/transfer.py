"""Files between ranks of the memory tier: a node file (and a manifest) sent to a peer rank and
received straight into mapped shared memory (transfer_files: peer replicas and their repair)."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch


# ---------------------------------------------------------------------- moving files between ranks
def _map(path: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the file's pages (shared mapping: no copy in or out of shared memory)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def transfer_files(group: Any, *, dst: int | None = None, files: Sequence[tuple[str, str]] = (),
                   extra: bytes | None = None, src: int | None = None, into: str | None = None) -> bytes | None:
    """Send files (name, local path) and an optional byte string to global rank `dst`, and/or
    receive the same from global rank `src` into the directory `into` (files under their names);
    returns the byte string received. Non-blocking sends and receives in three rounds (sizes,
    names, bytes), so ranks that both send and receive never wait on each other's order. The file
    bytes go from and to mapped shared memory, with no copy on either side. Received names are
    checked: a peer cannot make us write outside `into`."""
    import torch.distributed as dist
    keep: list[torch.Tensor] = []   # tensors must outlive their requests

    def _round(send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        reqs = []
        if send is not None:
            keep.append(send)
            reqs.append(dist.isend(send, dst=dst, group=group))
        if recv is not None:
            reqs.append(dist.irecv(recv, src=src, group=group))
        for r in reqs:
            r.wait()

    meta_out = None
    if dst is not None:
        sizes = [os.path.getsize(p) for _, p in files]
        meta_out = json.dumps({"files": [[n, s] for (n, _), s in zip(files, sizes)],
                               "extra": None if extra is None else len(extra)}).encode()
    n_in = torch.empty(1, dtype=torch.int64) if src is not None else None
    _round(torch.tensor([len(meta_out)], dtype=torch.int64) if meta_out is not None else None, n_in)
    raw_in = torch.empty(int(n_in), dtype=torch.uint8) if n_in is not None else None
    _round(torch.frombuffer(bytearray(meta_out), dtype=torch.uint8) if meta_out is not None else None, raw_in)
    reqs = []
    if dst is not None:
        _send_files(group, dst, files, sizes, extra, keep, reqs)
    got = None
    if src is not None:
        got = _receive_files(group, src, json.loads(bytes(raw_in.numpy())), into, keep, reqs)
    for r in reqs:
        r.wait()
    return None if got is None else bytes(got.numpy())


def _send_files(group: Any, dst: int, files: Sequence[tuple[str, str]], sizes: list[int], extra: bytes | None,
                keep: list[torch.Tensor], reqs: list) -> None:
    """transfer_files' third round, sending side: post a send of each non-empty file and of `extra`."""
    import torch.distributed as dist
    for (_, path), size in zip(files, sizes):
        if size:
            keep.append(_map(path, size))
            reqs.append(dist.isend(keep[-1], dst=dst, group=group))
    if extra:
        keep.append(torch.frombuffer(bytearray(extra), dtype=torch.uint8))
        reqs.append(dist.isend(keep[-1], dst=dst, group=group))


def _receive_files(group: Any, src: int, meta: dict, into: str, keep: list[torch.Tensor],
                   reqs: list) -> torch.Tensor | None:
    """transfer_files' third round, receiving side: create each file `meta` names under `into` and post
    a receive into its mapping; returns the buffer the byte string arrives in (None if none is sent)."""
    import torch.distributed as dist
    from omnickpt.format.manifest import safe_relative_path
    for name, size in meta["files"]:
        path = os.path.join(into, *safe_relative_path(name, f"replica from rank {src}").split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            if size:
                # Reserve the pages now: a full tmpfs then fails here with ENOSPC, not with
                # SIGBUS while the bytes are written through the mapping.
                os.posix_fallocate(f.fileno(), 0, size)
        if size:
            keep.append(_map(path, size))
            reqs.append(dist.irecv(keep[-1], src=src, group=group))
    if meta["extra"] is None:
        return None
    buf = torch.empty(meta["extra"], dtype=torch.uint8)
    if meta["extra"]:
        reqs.append(dist.irecv(buf, src=src, group=group))
    return buf
