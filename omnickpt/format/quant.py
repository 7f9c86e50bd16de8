"""Opt-in lossy quantization of stored chunks of optimizer moments (MOMENTS: Adam's exp_avg /
exp_avg_sq, momentum buffers, ...): "int8" and "fp8" (float8 e4m3fn), one float32 scale per BLOCK
elements.

Why only optimizer state, and only on request: the moments are running averages that the next
steps keep overwriting, so the error of a resume from them (int8: up to 0.4% of each block's
largest value, 0.8% for second moments; fp8: up to ~6% of each value, ~13% of a second moment)
fades, while weights are kept exact. A 4-byte float32
moment becomes ~1.016 bytes (3.9x smaller; 1.97x for bf16/fp16, 7.9x for float64).

Why per-block scales: a moment tensor spans many orders of magnitude across its elements (exp_avg_sq
of a rarely-used embedding row against a busy one); one scale per 256 neighbouring elements keeps
each block's small values from being rounded away by a large value elsewhere in the tensor.

Payload of one chunk of n elements (stored_size(n) = 4 * ceil(n / BLOCK) + n bytes):

    ceil(n / BLOCK) float32 scales, little-endian, scale k for elements [k*BLOCK, (k+1)*BLOCK)
        (the last block may be shorter); a negative scale marks a block stored as square roots
    n bytes, one per element, each the code q of t = x (linear block) or t = sqrt(x) (root block):
        "int8": q as a two's-complement int8 in [-127, 127];  t' = q * |scale|,
                |scale| = max |t| of the block / 127  (0 for an all-zero block)
        "fp8":  q as the bit pattern of a float8_e4m3fn (never the NaN patterns 0x7f / 0xff);
                t' = float(q) * |scale|,  |scale| = max |t| / 448  (448 is e4m3fn's largest finite)
    x' = t' for a linear block, t'^2 for a root block.

Root blocks: a block with no negative value whose positive values reach below the linear grid's
resolution (absmax / 254 for int8, absmax / 448 * 2**-10 for fp8: a second moment, exp_avg_sq, whose
values span many orders of magnitude) is stored as square roots, because on a linear grid of 127
steps every value below absmax/254 would read back as 0, and a zero second moment turns Adam's next
update of that element into m / eps. On roots the grid reaches values 254^2 times below absmax, and
its error is relative to sqrt(x), which is what Adam divides by. For the same reason no value of a
root block that is not zero is stored as 0: one that would round to 0 is stored as the smallest code
(int8 1, fp8 2**-9).

Error of one element (before x' is rounded into the chunk's dtype, which adds half an ulp of that
dtype at x', e.g. 2**-9 relative for bfloat16; and up to float32 rounding, ~2**-23 of the block's
absmax, from doing the arithmetic in float32), with s = |scale| and e the error of t:
    "int8": e <= s / 2;   "fp8": e <= t * 2**-4 + s * 2**-10 (half an ulp of e4m3 at t/s: 3 mantissa
            bits; below e4m3's normal range, half its smallest subnormal step 2**-9)
    a root block's value stored as the smallest code instead of 0: e <= that code's value (s, or s * 2**-9)
    linear block: |x - x'| <= e;   root block: |x - x'| <= e * (2 * sqrt(x) + e)
    (int8 on a root block: at most ~absmax / 127, and ~(1/127) * sqrt(absmax * x) for small x)
quantize() returns, besides the payload, the measured max |x - x'| over the chunk (float64), so
that the caller can record what was lost.

Arithmetic is float32 (float64 chunks: scales from their float32 values, but dequantized into
float64). Pure functions over bytes; no state.

Chunks that cannot be quantized within these rules are stored raw instead, exactly (quantize returns
the raw bytes, which are not smaller than a payload, and the format tells a raw chunk by its stored
length): a chunk holding nan or inf (no scale represents them; one diverged element must not fail a
whole save), float64 values beyond float32's range (the scales are float32), and a chunk whose
payload would read back a non-zero value of a block with no negative value as 0 (a second moment
below what the scale or the tensor's dtype can express: subnormals, float64 values below float32's
range) or a finite value as inf (rounding into float16 / bfloat16 at the top of their range). Those
chunks cost their raw size and add nothing to the recorded error.
"""
from __future__ import annotations

import numpy as np
import torch

from omnickpt.errors import CorruptCheckpointError

SCHEMES = ("int8", "fp8")
BLOCK = 256
# The per-parameter state keys of torch.optim optimizers (torch 2.13) that quantize_optimizer stores
# quantized: running averages of gradients (first moments) and of their squares or norms (second
# moments), which the next steps keep overwriting, so a resume's error fades. Everything else stays
# exact: step counts; state that accumulates or stands for the weights themselves and never fades
# (Adagrad's sum, ASGD's ax / eta / mu, NAdam's mu_product, Rprop's prev / step_size, LBFGS's
# history); Adafactor's factored row_var / col_var (a few values per row, nothing to gain).
MOMENTS = frozenset({
    "exp_avg",          # Adam, AdamW, NAdam, RAdam, Adamax, SparseAdam: first moment
    "exp_avg_sq",       # Adam, AdamW, NAdam, RAdam, SparseAdam: second moment
    "max_exp_avg_sq",   # Adam / AdamW with amsgrad: the running maximum of the second moment
    "momentum_buffer",  # SGD, RMSprop (momentum > 0), Muon
    "square_avg",       # RMSprop, Adadelta: second moment
    "grad_avg",         # RMSprop centered: first moment
    "acc_delta",        # Adadelta: second moment of the updates
    "exp_inf",          # Adamax: exponentially weighted infinity norm (its second moment)
    "variance",         # Adafactor, unfactored (1-D) parameters: second moment
})
QUANT_DTYPES = ("float32", "bfloat16", "float16", "float64")

_QMAX = {"int8": 127.0, "fp8": 448.0}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_NUMPY = {"float32": "<f4", "float64": "<f8"}
_F32_MAX = float(np.finfo(np.float32).max)


def check_scheme(scheme: str | None) -> str | None:
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantize_optimizer={scheme!r}: must be 'int8', 'fp8' or None")
    return scheme


def quantizable(dtype_name: str) -> bool:
    return dtype_name in QUANT_DTYPES


def is_moment(name: str, optimizer_key: str) -> bool:
    """Whether tensor `name` of a checkpoint is a moment (MOMENTS) of the optimizer saved under
    `optimizer_key`: "<optimizer_key>/state/<parameter>/<state key>"."""
    prefix = f"{optimizer_key}/state/"
    return name.startswith(prefix) and name[len(prefix):].rpartition("/")[2] in MOMENTS


def stored_size(n_elements: int, scheme: str) -> int:
    check_scheme(scheme)
    return 4 * _n_blocks(n_elements) + n_elements


def _n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def _check_dtype(dtype_name: str) -> None:
    if dtype_name not in QUANT_DTYPES:
        raise ValueError(f"dtype {dtype_name!r} cannot be quantized: only {', '.join(QUANT_DTYPES)}")


def _decode(raw: memoryview | bytes, dtype_name: str) -> np.ndarray:
    """The chunk's elements as float32 (float64 stays float64); exact either way."""
    if dtype_name == "bfloat16":
        # bfloat16 is the top half of a float32, so widening is an exact shift (torch.frombuffer would
        # warn on the read-only buffers the caller usually passes)
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype_name == "float16":
        # numpy's float16 casts run ~20x slower than torch's on subnormals, which is where float16
        # keeps most of Adam's exp_avg_sq; the copy (a memcpy) gives torch the writable array it wants
        return torch.from_numpy(np.frombuffer(raw, dtype="<f2").copy()).float().numpy()
    return np.frombuffer(raw, dtype=_NUMPY[dtype_name])


def _encode_into(vals: np.ndarray, dtype_name: str, out: memoryview) -> None:
    """Round vals (float32 or float64) to nearest-even into out as dtype_name."""
    if dtype_name in ("bfloat16", "float16"):
        half = torch.from_numpy(np.ascontiguousarray(vals)).to(getattr(torch, dtype_name))
        np.frombuffer(out, dtype="<i2")[:] = half.view(torch.int16).numpy()
    else:
        np.frombuffer(out, dtype=_NUMPY[dtype_name])[:] = vals


def _blocks(a: np.ndarray) -> np.ndarray:
    """a as (blocks, BLOCK), zero-padded at the end (zeros change no absmax and quantize to 0)."""
    pad = -len(a) % BLOCK
    if pad:
        a = np.concatenate([a, np.zeros(pad, dtype=a.dtype)])
    return a.reshape(-1, BLOCK)


def quantize(raw: memoryview | bytes, dtype_name: str, scheme: str) -> tuple[bytes, float]:
    """(the stored payload of one chunk, the max |x - x'| its dequantization makes, in float64), or
    (the chunk's raw bytes, 0.0) when it cannot be quantized within the rules of the module docstring:
    the caller stores it raw, exactly (codec.encode_chunk keeps anything not smaller than raw)."""
    check_scheme(scheme)
    _check_dtype(dtype_name)
    raw = memoryview(raw).cast("B")
    if len(raw) % _ITEMSIZE[dtype_name]:
        raise ValueError(f"a {dtype_name} chunk of {len(raw)} bytes is not a whole number of elements")
    x = _decode(raw, dtype_name)
    n = len(x)
    if n == 0:
        return b"", 0.0
    if dtype_name == "float64" and not max(x.max(), -x.min()) <= _F32_MAX:
        return bytes(raw), 0.0   # nan, inf, or beyond the float32 scales: stored exactly
    xb = _blocks(x.astype(np.float32, copy=False))
    # max and -min instead of abs().max(): no temporary the size of the chunk; nan propagates
    bmax, bmin = xb.max(axis=1), xb.min(axis=1)
    absmax = np.maximum(bmax, -bmin)
    if not np.isfinite(absmax).all():
        return bytes(raw), 0.0   # nan or inf (a diverged element): stored exactly, the save goes on
    qmax = _QMAX[scheme]
    # Non-negative blocks (second moments) are stored as square roots: a linear grid of 127 steps
    # would round every value below absmax/254 to nothing, and exp_avg_sq spans many more orders of
    # magnitude within a block than exp_avg does; on roots it spans half as many.
    # Only where the linear grid would lose a value: a narrow block keeps the linear grid's smaller
    # absolute error.
    floor = absmax / np.float32(qmax) * np.float32(0.5 if scheme == "int8" else 2.0 ** -10)
    root = (bmin >= 0) & (bmax > 0) & ((xb > 0) & (xb < floor[:, None])).any(axis=1)
    mag = np.where(root, np.sqrt(absmax), absmax)
    # abs: an all-zero block's -min is -0.0, whose scale would dequantize its zeros as -0.0
    scales = np.abs(mag / np.float32(qmax)).astype(np.float32)
    root &= scales > 0
    # a zero scale (all-zero block, or one so small that absmax/qmax underflows) divides by 1
    # instead: its elements are then |x| < 1 and round to 0, the nearest the payload can say
    divisor = np.where(scales > 0, scales, np.float32(1))[:, None]
    src = np.where(root[:, None], np.sqrt(np.maximum(xb, 0)), xb)
    y = np.clip(src / divisor, -qmax, qmax).reshape(-1)[:n]
    # In a root block a value that is not zero is never stored as zero: a second moment read back as
    # 0 turns Adam's next update of that element into m / eps (10^6 times too large). A signed block
    # (a first moment) may round its smallest values to 0: the update of that element only shrinks.
    live = (x != 0) & np.repeat(root, BLOCK)[:n]
    if scheme == "int8":
        q = np.rint(y).astype(np.int8)
        flushed = live & (q == 0)
        q[flushed] = np.where(x[flushed] > 0, 1, -1)
        q = q.view(np.uint8)
    else:
        # the clip above also keeps torch versions that turn >448 into NaN instead of saturating honest
        q = torch.from_numpy(np.ascontiguousarray(y)).to(torch.float8_e4m3fn).view(torch.uint8).numpy().copy()
        flushed = live & ((q & 0x7F) == 0)
        q[flushed] = np.where(x[flushed] > 0, 0x01, 0x81)   # e4m3fn's smallest subnormal, 2**-9
    # a negative scale marks a block of square roots
    payload = np.where(root, -scales, scales).astype("<f4").tobytes() + q.tobytes()
    back = bytearray(len(raw))
    dequantize_into(payload, dtype_name, scheme, memoryview(back), "quantize")
    x_back = _decode(back, dtype_name)
    # What the reader will see is checked, not predicted: a scale that underflows (subnormal blocks),
    # float64 values below float32's range and the rounding into float16 can still read a second
    # moment back as 0 or a finite value as inf; such a chunk is stored exactly instead.
    nonneg = np.repeat(bmin >= 0, BLOCK)[:n]
    if not np.isfinite(x_back).all() or ((x_back == 0) & (x != 0) & nonneg).any():
        return bytes(raw), 0.0
    # the ufunc casts to float64 in small buffers: ~10x faster than two float64 copies of the chunk
    diff = np.subtract(x, x_back, dtype=np.float64)
    err = float(max(diff.max(), -diff.min()))
    return payload, err


def _fp8_values() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns (NaN for 0x7f and 0xff)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def dequantize_into(stored: memoryview | bytes, dtype_name: str, scheme: str, out: memoryview, where: str) -> None:
    """Write one chunk's dequantized elements, in dtype_name, into `out` (exactly its raw size), or
    raise CorruptCheckpointError naming `where` when the stored bytes cannot be this chunk's payload."""
    check_scheme(scheme)
    _check_dtype(dtype_name)
    out = memoryview(out).cast("B")
    itemsize = _ITEMSIZE[dtype_name]
    n = len(out) // itemsize
    want = stored_size(n, scheme)
    if len(stored) != want or len(out) % itemsize:
        raise CorruptCheckpointError(f"{where}: the quantized chunk has the wrong size ({len(stored)} bytes, {want} "
                                     f"expected for {n} {dtype_name} elements, {scheme}); the checkpoint is damaged")
    if n == 0:
        return
    nb = _n_blocks(n)
    signed = np.frombuffer(stored, dtype="<f4", count=nb)
    if not np.isfinite(signed).all():
        raise CorruptCheckpointError(f"{where}: the quantized chunk has a non-finite scale; the checkpoint is damaged")
    root, scales = signed < 0, np.abs(signed)
    q = np.frombuffer(stored, dtype=np.uint8, offset=4 * nb)
    if scheme == "int8":
        v = q.view(np.int8).astype(np.float32)
    else:
        v = _fp8_values()[q]
        if np.isnan(v).any():
            raise CorruptCheckpointError(f"{where}: the quantized chunk holds an fp8 NaN, which quantize never "
                                         "writes; the checkpoint is damaged")
    # float64 chunks multiply in float64: q (<= 8 significant bits) times a float32 scale is then exact.
    # So do float32 chunks at float32's top, where qmax * (absmax / qmax) may round above absmax and
    # overflow to inf: exact in float64, then clipped back to the largest float32.
    peak = scales.astype(np.float64) * _QMAX[scheme]
    peak = np.where(root, peak * peak, peak)
    top = dtype_name == "float32" and float(peak.max()) > 2.0 ** 127
    work = np.float64 if dtype_name == "float64" or top else np.float32
    vb = _blocks(v.astype(work, copy=False)) * scales.astype(work)[:, None]
    if root.any():
        vb[root] *= vb[root]      # a block of square roots
    vals = vb.reshape(-1)[:n]
    if top:
        np.clip(vals, -_F32_MAX, _F32_MAX, out=vals)
    _encode_into(vals, dtype_name, out)
