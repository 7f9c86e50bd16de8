"""Lossy quantization of optimizer-state chunks (omnickpt/format/quant.py): the documented error
bounds hold element by element on real Adam moments, the reported error is the real one, the
payload layout is the documented one, and damaged payloads are refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnickpt.errors import CorruptCheckpointError
from omnickpt.format.quant import (BLOCK, QUANT_DTYPES, SCHEMES, check_scheme, dequantize_into, quantizable,
                                   quantize, stored_size)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def adam_moments() -> dict[str, torch.Tensor]:
    """exp_avg and exp_avg_sq of a Linear(64, 64) after 20 Adam steps, weight and bias flattened
    together (4160 elements: 16 whole blocks and a short one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        x, y = torch.randn(32, 64), torch.randn(32, 64)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    states = [opt.state[p] for p in model.parameters()]
    return {k: torch.cat([s[k].reshape(-1) for s in states]) for k in ("exp_avg", "exp_avg_sq")}


MOMENTS = adam_moments()


def raw_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def as_f64(raw: bytes, dtype_name: str) -> np.ndarray:
    """The chunk's elements as float64, decoded by torch (not by the code under test)."""
    return torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[dtype_name]).double().numpy()


def half_ulp(v: np.ndarray, dtype_name: str) -> np.ndarray:
    """Half the spacing of dtype_name at |v| (subnormals included): what rounding into it may add."""
    a = np.abs(v)
    if dtype_name == "bfloat16":   # bfloat16 keeps float32's exponent and 7 of its 23 mantissa bits
        return np.spacing(a.astype(np.float32)).astype(np.float64) * 2.0 ** 16 / 2
    np_dtype = {"float32": np.float32, "float16": np.float16, "float64": np.float64}[dtype_name]
    return np.spacing(a.astype(np_dtype)).astype(np.float64) / 2


def round_trip(raw: bytes, dtype_name: str, scheme: str):
    payload, err = quantize(memoryview(raw), dtype_name, scheme)
    out = bytearray(len(raw))
    dequantize_into(payload, dtype_name, scheme, memoryview(out), "opt/exp_avg chunk 0")
    return payload, err, bytes(out)


def per_block(x: np.ndarray, reduce) -> np.ndarray:
    """reduce() of each element's block, repeated per element."""
    pad = np.concatenate([x, np.zeros(-len(x) % BLOCK)])
    return np.repeat(reduce(pad.reshape(-1, BLOCK), axis=1), BLOCK)[:len(x)]


def block_absmax(x: np.ndarray) -> np.ndarray:
    return per_block(np.abs(x), np.max)


def assert_within_documented_bound(x: np.ndarray, xq: np.ndarray, dtype_name: str, scheme: str) -> None:
    """The bound of quant.py's docstring, element by element: a block with no negative value and a
    positive one below the linear grid's resolution is stored as square roots (t = sqrt(x)), any
    other linearly (t = |x|); the error e of t is s/2
    (int8) or t * 2**-4 + s * 2**-10 (fp8), s the block's scale; a value that would round to zero
    is stored as the smallest step instead (error at most that step); for roots |x - x'| <= e (2t + e)."""
    absmax = block_absmax(x)
    qmax = 127.0 if scheme == "int8" else 448.0
    floor = absmax / qmax * (0.5 if scheme == "int8" else 2.0 ** -10)
    below = per_block(((x > 0) & (x < floor * (1 - 1e-6))).astype(np.float64), np.max) > 0
    root = (per_block(np.where(x < 0, -1.0, 0.0), np.min) == 0) & (absmax > 0) & below
    t = np.where(root, np.sqrt(np.abs(x)), np.abs(x))
    s = np.where(root, np.sqrt(absmax), absmax) / qmax
    e = s / 2 if scheme == "int8" else t * 2.0 ** -4 + s * 2.0 ** -10
    smallest = s if scheme == "int8" else s * 2.0 ** -9
    e = np.where(root & (x != 0) & (t <= smallest / 2 * (1 + 1e-5)), np.maximum(e, smallest), e)
    bound = np.where(root, e * (2 * t + e), e)
    # slack: rounding x' into the chunk's dtype, and float32 arithmetic (a few 2**-24 of the block's absmax)
    slack = half_ulp(xq, dtype_name) + absmax * 2.0 ** -22
    excess = np.abs(x - xq) - (bound * (1 + 1e-5) + slack)
    worst = int(np.argmax(excess))
    assert excess[worst] <= 0, (worst, x[worst], xq[worst], bound[worst], slack[worst])
    assert not (root & (x != 0) & (xq == 0)).any(), "a second moment that is not zero came back as zero"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype_name", QUANT_DTYPES)
@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_adam_moments_round_trip_within_the_documented_bound(scheme, dtype_name, moment):
    t = MOMENTS[moment].to(TORCH_DTYPES[dtype_name])
    raw = raw_of(t)
    payload, err, out = round_trip(raw, dtype_name, scheme)
    assert len(payload) == stored_size(t.numel(), scheme) == 4 * -(-t.numel() // BLOCK) + t.numel()
    x, xq = as_f64(raw, dtype_name), as_f64(out, dtype_name)
    assert err == float(np.abs(x - xq).max())
    assert err < np.abs(x).max() * 0.07
    # lossy, not a copy; except that float16 holds these exp_avg_sq only as subnormals, k * 2**-24
    # with k <= 38, and int8's grid of 127 steps per block then has every one of them
    assert err > 0 or (dtype_name, moment, scheme) == ("float16", "exp_avg_sq", "int8")
    assert_within_documented_bound(x, xq, dtype_name, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_payload_layout_is_the_documented_one(scheme):
    x = MOMENTS["exp_avg"][:1000].float()
    payload, _, _ = round_trip(raw_of(x), "float32", scheme)
    nb = -(-1000 // BLOCK)
    scales = np.frombuffer(payload, dtype="<f4", count=nb)
    q = np.frombuffer(payload, dtype=np.uint8, offset=4 * nb)
    assert len(q) == 1000
    xs = x.numpy()
    absmax = np.array([np.abs(xs[i:i + BLOCK]).max() for i in range(0, 1000, BLOCK)], dtype=np.float32)
    qmax = 127 if scheme == "int8" else 448
    np.testing.assert_allclose(scales, absmax / qmax, rtol=1e-6)
    y = xs / np.repeat(scales, BLOCK)[:1000]
    if scheme == "int8":
        assert np.abs(q.view(np.int8) - np.rint(y)).max() <= 1
        assert np.abs(q.view(np.int8)).max() == 127
    else:
        want = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert (q != want).mean() < 0.01   # float32 division may tip a tie


@pytest.mark.parametrize("scheme", SCHEMES)
def test_damaged_payloads_are_refused_naming_where(scheme):
    raw = raw_of(MOMENTS["exp_avg"].float())
    payload, _ = quantize(raw, "float32", scheme)
    out = memoryview(bytearray(len(raw)))
    for bad in (payload[:-1], payload + b"\0"):
        with pytest.raises(CorruptCheckpointError, match=r"^opt/w\.exp_avg chunk 7: .*wrong size.*damaged"):
            dequantize_into(bad, "float32", scheme, out, "opt/w.exp_avg chunk 7")
    nan_scale = np.frombuffer(payload, dtype=np.uint8).copy()
    nan_scale[:4] = np.frombuffer(np.array([np.nan], dtype="<f4").tobytes(), dtype=np.uint8)
    with pytest.raises(CorruptCheckpointError, match="opt/w.exp_avg chunk 7"):
        dequantize_into(nan_scale.tobytes(), "float32", scheme, out, "opt/w.exp_avg chunk 7")


def test_a_truncated_payload_names_where_and_says_damaged():
    raw = np.arange(1000, dtype=np.float32).tobytes()
    payload, _ = quantize(raw, "float32", "int8")
    with pytest.raises(CorruptCheckpointError) as e:
        dequantize_into(payload[:-1], "float32", "int8", memoryview(bytearray(len(raw))), "m/x chunk 2")
    assert str(e.value).startswith("m/x chunk 2: ") and "damaged" in str(e.value)


def test_an_fp8_nan_pattern_is_refused_as_damage():
    raw = np.ones(300, dtype=np.float32).tobytes()
    payload = bytearray(quantize(raw, "float32", "fp8")[0])
    payload[-1] = 0x7F
    with pytest.raises(CorruptCheckpointError, match="m/x chunk 0"):
        dequantize_into(bytes(payload), "float32", "fp8", memoryview(bytearray(len(raw))), "m/x chunk 0")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype_name", QUANT_DTYPES)
def test_all_zero_chunks_round_trip_exactly(scheme, dtype_name):
    raw = raw_of(torch.zeros(700, dtype=TORCH_DTYPES[dtype_name]))
    payload, err, out = round_trip(raw, dtype_name, scheme)
    assert err == 0.0 and out == raw
    assert payload[:4 * 3] == bytes(12)


def test_zero_blocks_next_to_busy_ones_stay_zero_and_keep_their_neighbours_precise():
    x = np.zeros(3 * BLOCK, dtype=np.float32)
    x[BLOCK:2 * BLOCK] = np.linspace(-1e-3, 1e-3, BLOCK)
    x[2 * BLOCK:] = 1e-9   # a block of tiny values keeps its own scale
    for scheme in SCHEMES:
        _, err, out = round_trip(x.tobytes(), "float32", scheme)
        xq = np.frombuffer(out, dtype=np.float32)
        assert (xq[:BLOCK] == 0).all()
        np.testing.assert_allclose(xq[2 * BLOCK:], 1e-9, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype_name", QUANT_DTYPES)
def test_non_finite_chunks_are_returned_raw_to_be_stored_exactly(bad, dtype_name):
    # one NaN/inf must not fail a whole save: its chunk is stored exactly instead
    t = torch.ones(600, dtype=TORCH_DTYPES[dtype_name])
    t[555] = bad
    for scheme in SCHEMES:
        assert quantize(raw_of(t), dtype_name, scheme) == (raw_of(t), 0.0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n", [1, 255, 257, 1000])
def test_chunks_that_are_not_whole_blocks(scheme, n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g) * torch.logspace(-6, 0, n)
    raw = raw_of(t)
    payload, err, out = round_trip(raw, "float32", scheme)
    assert len(payload) == stored_size(n, scheme) == 4 * -(-n // BLOCK) + n
    x, xq = as_f64(raw, "float32"), as_f64(out, "float32")
    assert err == float(np.abs(x - xq).max())
    assert_within_documented_bound(x, xq, "float32", scheme)


def test_float64_chunks_beyond_float32_range_are_returned_raw():
    raw = np.array([1.0, 1e300]).tobytes()
    assert quantize(raw, "float64", "int8") == (raw, 0.0)


def test_which_dtypes_and_schemes():
    assert all(quantizable(d) for d in ("float32", "bfloat16", "float16", "float64"))
    assert not any(quantizable(d) for d in ("int64", "int8", "uint8", "bool", "float8_e4m3fn", "complex64"))
    assert check_scheme(None) is None and check_scheme("int8") == "int8" and check_scheme("fp8") == "fp8"
    with pytest.raises(ValueError, match=r"quantize_optimizer='int4'"):
        check_scheme("int4")
    assert stored_size(0, "int8") == 0 and stored_size(BLOCK, "fp8") == BLOCK + 4
    assert stored_size(BLOCK + 1, "int8") == BLOCK + 1 + 8
