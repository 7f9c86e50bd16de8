"""Chunk compression (omnickpt/format/codec.py): lossless round trips, the byte split really finds
the exponent planes' redundancy, and damaged chunks are refused by name."""
from __future__ import annotations

import pytest
import torch

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format.codec import CODECS, check_codec, compress, decompress_into


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("extra", [0, 3])
def test_round_trip_is_bitwise(codec, dtype, extra):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(100_003, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 256, (100_003,), generator=g, dtype=dtype)
    raw = t.view(torch.uint8).numpy().tobytes() + b"\x01\x02\x03"[:extra]
    stored = compress(raw, codec, t.element_size())
    out = bytearray(len(raw))
    decompress_into(stored, codec, t.element_size(), memoryview(out), "w chunk 0")
    assert bytes(out) == raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_byte_split_compresses_float_weights_better_than_plain_zstd(dtype):
    g = torch.Generator().manual_seed(1)
    raw = (torch.randn(1 << 18, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()
    plain = len(compress(raw, "zstd", dtype.itemsize))
    split = len(compress(raw, "bytesplit-zstd", dtype.itemsize))
    assert split < plain * 0.95, (plain, split)
    assert split < len(raw)


@pytest.mark.parametrize("codec", CODECS)
def test_damaged_or_mis_sized_chunks_are_refused_naming_where(codec):
    raw = (torch.arange(50_000, dtype=torch.float32) / 7).view(torch.uint8).numpy().tobytes()
    stored = bytearray(compress(raw, codec, 4))
    stored[len(stored) // 2] ^= 0xFF
    stored[-4] ^= 0xFF
    with pytest.raises(CorruptCheckpointError, match="model/w chunk 3"):
        decompress_into(bytes(stored), codec, 4, memoryview(bytearray(len(raw))), "model/w chunk 3")
    good = compress(raw, codec, 4)
    with pytest.raises(CorruptCheckpointError, match="manifest says|does not decompress"):
        decompress_into(good, codec, 4, memoryview(bytearray(len(raw) + 8)), "model/w chunk 3")


def test_unknown_codecs_are_refused():
    assert check_codec(None) is None and check_codec("zstd") == "zstd"
    with pytest.raises(ValueError, match="compression='lz4'"):
        check_codec("lz4")
