"""Lossless compression of stored chunks: "zstd", and "bytesplit-zstd" (each element's bytes split
into planes, byte k of every element together, then zstd).

Why the split: in float weights and optimizer moments the sign/exponent byte of neighbouring
elements varies little while the low mantissa bytes are close to random; interleaved, zstd sees
near-random bytes everywhere, split into planes it finds the exponent plane's redundancy (the idea
of the byte-shuffle filters of HDF5/Blosc, and of the exponent/mantissa split behind the ~1.3-1.5x
lossless ratios on bf16/fp32 weights). Each chunk is compressed on its own, so that a ranged or
resharded read decompresses only the chunks it needs; a chunk's checksum covers its stored
(compressed) bytes, so corruption is caught before anything is decompressed.

Pure functions over bytes; no state. zstandard objects are not thread-safe, so each call makes
its own (a few microseconds against a 1 MiB chunk's milliseconds).

Stored chunks are untrusted: a frame is a claim about its size, and zstd inflates up to ~32768
times (a 128 KiB frame of RLE blocks holds 4 GiB). So nothing is decompressed before its frame
header declares exactly the chunk's raw length from the manifest (`frame_problem`); libzstd then
decodes into that many bytes and fails on any frame whose blocks do not add up to it.
"""
from __future__ import annotations

import numpy as np

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format.quant import SCHEMES, dequantize_into, quantize, stored_size

CODECS = ("zstd", "bytesplit-zstd")
DEFAULT_LEVEL = 3
# What a manifest may name: the lossless codecs, "none" (the chunked layout with every chunk stored
# raw: a checkpoint whose only encoded tensors are quantized ones) and, per tensor, the lossy
# quantization schemes of format/quant.py.
STORED_CODECS = CODECS + ("none",)
TENSOR_CODECS = SCHEMES


def check_codec(codec: str | None) -> str | None:
    if codec is not None and codec not in CODECS:
        raise ValueError(f"compression={codec!r}: must be one of {', '.join(map(repr, CODECS))} or None")
    return codec


def _zstd():
    try:
        import zstandard
    except ImportError as e:   # a core dependency; only a broken install lacks it
        raise ImportError("compression needs the zstandard package: pip install zstandard") from e
    return zstandard


def _planes(raw: memoryview, itemsize: int) -> bytes:
    """Byte k of every element together, k = 0..itemsize-1 (a trailing partial element, which whole
    chunks of whole elements never have, stays at the end as it is)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    whole = len(a) // itemsize * itemsize
    split = a[:whole].reshape(-1, itemsize).T.tobytes()
    return split + a[whole:].tobytes()


def _unplanes(data: bytes, itemsize: int, out: memoryview) -> None:
    a = np.frombuffer(data, dtype=np.uint8)
    whole = len(a) // itemsize * itemsize
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[:whole].reshape(-1, itemsize)[:] = a[:whole].reshape(itemsize, -1).T
    dst[whole:] = a[whole:]


def compress(raw: memoryview | bytes, codec: str, itemsize: int, level: int = DEFAULT_LEVEL) -> bytes:
    """The stored bytes of one chunk."""
    raw = memoryview(raw).cast("B")
    data = _planes(raw, itemsize) if codec == "bytesplit-zstd" and itemsize > 1 else raw
    return _zstd().ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(data)


# The zstd frame magic, and the longest frame header (magic 4, descriptor 1, window 1, dictionary
# id 4, content size 8): what `frame_problem` needs to judge a frame.
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
FRAME_HEADER_MAX = 18


def frame_problem(head: memoryview | bytes, raw_len: int) -> str | None:
    """Why a stored chunk whose first bytes are `head` (FRAME_HEADER_MAX of them, or the whole
    chunk if shorter) cannot be the zstd frame of a `raw_len`-byte chunk as `compress` writes it,
    or None. Reads the frame header only: `verify` calls it on bytes it has checksummed, and
    `decompress_into` before anything is allocated from the frame."""
    head = bytes(head[:FRAME_HEADER_MAX])
    if head[:4] != _ZSTD_MAGIC:
        return f"the compressed chunk does not start with a zstd frame (it starts {head[:4].hex() or 'empty'})"
    zstd = _zstd()
    try:
        params = zstd.get_frame_parameters(head)
    except zstd.ZstdError as e:
        return f"the compressed chunk's zstd frame header is damaged ({e})"
    if params.content_size == zstd.CONTENTSIZE_UNKNOWN:
        # every frame compress() writes declares it; without it the decoder could not be bounded
        return "the compressed chunk's zstd frame does not declare its size"
    if params.content_size != raw_len:
        return (f"the compressed chunk declares {params.content_size} bytes, the manifest says {raw_len} "
                "(nothing was decompressed)")
    if params.dict_id:
        return f"the compressed chunk needs zstd dictionary {params.dict_id}, which omnickpt never uses"
    return None


def decompress_into(stored: memoryview | bytes, codec: str, itemsize: int, out: memoryview, where: str) -> None:
    """Decompress one chunk's stored bytes into `out` (exactly its raw size), or raise
    CorruptCheckpointError naming `where` when they do not decompress to that many bytes. Never
    holds more than len(out) decompressed bytes, whatever the stored frame claims."""
    zstd = _zstd()
    n = len(out)
    problem = frame_problem(stored, n)
    if problem:
        raise CorruptCheckpointError(f"{where}: {problem}; the checkpoint is damaged: restore the data file or load "
                                     "an earlier checkpoint")
    try:
        # The header declares n bytes, so that is all the decoder allocates (max_output_size only
        # bounds frames without a size, which frame_problem refused); trailing bytes are damage.
        data = zstd.ZstdDecompressor().decompress(bytes(stored), max_output_size=n, allow_extra_data=False)
    except zstd.ZstdError as e:
        raise CorruptCheckpointError(f"{where}: the compressed chunk does not decompress ({e}); the checkpoint "
                                     "is damaged") from None
    if len(data) != n:
        raise CorruptCheckpointError(f"{where}: the compressed chunk holds {len(data)} bytes, the manifest says {n}; "
                                     "the checkpoint is damaged")
    if codec == "bytesplit-zstd" and itemsize > 1:
        _unplanes(data, itemsize, out)
    else:
        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


def encode_chunk(raw: memoryview, codec: str, itemsize: int, dtype: str) -> tuple[memoryview, float]:
    """(the stored bytes of one chunk, the largest error of a lossy codec: 0.0 for lossless). A
    chunk is stored raw, exactly, when its encoding would not be smaller (the reader tells it by
    its stored length); so is every chunk of codec "none"."""
    raw = memoryview(raw).cast("B")
    if codec == "none":
        return raw, 0.0
    if codec in SCHEMES:
        stored, error = quantize(raw, dtype, codec)
    else:
        stored, error = compress(raw, codec, itemsize), 0.0
    return (raw, 0.0) if len(stored) >= len(raw) else (memoryview(stored), error)


def stored_problem(stored_len: int, raw_len: int, codec: str | None, itemsize: int) -> str | None:
    """Why a chunk of `raw_len` raw bytes cannot be stored in `stored_len` bytes with `codec` (the
    tensor's: a quantization scheme, else the checkpoint's), judged from the manifest alone; None
    when it can, or when only its bytes can tell (a zstd frame: `frame_problem`)."""
    if stored_len == raw_len:
        return None     # stored raw
    if codec == "none":
        return (f"the chunk is stored in {stored_len} of its {raw_len} bytes in a checkpoint that stores every chunk "
                "raw")
    if codec in SCHEMES:
        if raw_len % itemsize:
            return f"the quantized chunk of {raw_len} bytes is not a whole number of {itemsize}-byte elements"
        want = stored_size(raw_len // itemsize, codec)
        if stored_len != want:
            return (f"the quantized chunk is stored in {stored_len} bytes; {codec} stores {raw_len // itemsize} "
                    f"elements in {want}")
    return None


def decode_into(stored: memoryview | bytes, codec: str, itemsize: int, dtype: str | None, out: memoryview,
                where: str) -> None:
    """The raw bytes of one encoded chunk (shorter than `out`: a chunk as long is stored raw)."""
    if codec in SCHEMES:
        if dtype is None:
            raise CorruptCheckpointError(f"{where}: a quantized chunk of a tensor of unknown dtype")
        dequantize_into(stored, dtype, codec, out, where)
    elif codec == "none":
        raise CorruptCheckpointError(f"{where}: the chunk is shorter than its raw length in a checkpoint that stores "
                                     "it raw; the checkpoint is damaged")
    else:
        decompress_into(stored, codec, itemsize, out, where)
