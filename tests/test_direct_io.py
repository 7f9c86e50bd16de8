"""Durable writes of large files go to the device with O_DIRECT where the file system allows it
(omnickpt/storage/local.py): the bytes on disk are the same whatever the alignment of the buffer
and the file offsets, and the aligned middle really bypasses the page cache (mincore says so)."""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

from omnickpt.engine.staging import StagingPool
from omnickpt.storage.base import Segment
from omnickpt.storage.local import LocalStorage, direct_part

PAGE = 4096


def test_direct_part_takes_whole_pages_aligned_in_file_and_memory():
    assert direct_part(0, 0, 3 * PAGE + 5) == (0, 3 * PAGE)
    assert direct_part(100, 100, 3 * PAGE) == (PAGE - 100, 2 * PAGE + PAGE - 100)
    assert direct_part(0, 64, 10 * PAGE) == (0, 0)          # memory and file misaligned differently
    assert direct_part(64, 64 + PAGE, 10 * PAGE) == (PAGE - 64, 10 * PAGE - 64)
    assert direct_part(0, 0, PAGE - 1) == (0, 0)             # not one whole page


def _resident_pages(path: str) -> list[bool]:
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        npages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * npages)()
        ptr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return [bool(v & 1) for v in vec]


@pytest.mark.parametrize("shift", [0, 64, 4095])
@pytest.mark.parametrize("direct", [True, False])
def test_durable_write_is_bitwise_whatever_the_alignment(tmp_path, shift, direct):
    pool = StagingPool()
    n = (9 << 20) + 12345
    buf = pool.acquire(n + shift)
    assert buf.data_ptr() % PAGE == 0                        # staging is page-aligned
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    buf[shift:shift + n].copy_(data)
    view = memoryview(buf.numpy())[shift:shift + n]
    # two segments, the second at an unaligned offset, as a data file's tensors and objects are
    segs = [Segment(0, view[:5 << 20]), Segment((5 << 20) + 7, view[5 << 20:])]
    size = (5 << 20) + 7 + (n - (5 << 20))
    store = LocalStorage(str(tmp_path), direct_io=direct)
    store.write_file("data/f.bin", size, segs, None, durable=True)
    got = open(tmp_path / "data" / "f.bin", "rb").read()
    want = bytes(view[:5 << 20]) + b"\0" * 7 + bytes(view[5 << 20:])
    assert len(got) == size and got == want


def test_the_aligned_middle_bypasses_the_page_cache(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    pool = StagingPool()
    n = 16 << 20
    buf = pool.acquire(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    LocalStorage(str(tmp_path / "d"), direct_io=True).write_file(
        "f.bin", n, [Segment(0, memoryview(buf.numpy()))], None, durable=True)
    LocalStorage(str(tmp_path / "b"), direct_io=False).write_file(
        "f.bin", n, [Segment(0, memoryview(buf.numpy()))], None, durable=True)
    direct, buffered = _resident_pages(str(tmp_path / "d" / "f.bin")), _resident_pages(str(tmp_path / "b" / "f.bin"))
    if sum(buffered) == 0:
        pytest.skip("this file system keeps no written pages in the page cache; nothing to compare")
    # O_DIRECT leaves (nearly) nothing in the page cache; the buffered write leaves it full
    assert sum(direct) < len(direct) // 10, f"{sum(direct)} of {len(direct)} pages resident after O_DIRECT"
    assert sum(buffered) > len(buffered) // 2
