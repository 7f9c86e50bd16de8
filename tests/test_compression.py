"""Compressed checkpoints: save(compression=...) stores each 1 MiB chunk compressed on its own
(docs/format.md); loads, resharded loads, partial reads, verify and the readers decompress."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli.verify import verify
from omnickpt.errors import CorruptCheckpointError
from omnickpt.format import MANIFEST_NAME, Manifest
from omnickpt.format.codec import CODECS

from dist import run_ranks
from models import flip_byte, full_values, toy

MiB = 1 << 20


def _manifest(path) -> Manifest:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return Manifest.decode(f.read())


def _data_bytes(path) -> int:
    d = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))



def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(600, 1000, generator=g) * 0.02   # 2.4 MB: three chunks, the last one short
    return {
        "fp32": weights,
        "bf16": weights[:300].bfloat16(),
        "int64": torch.arange(200_000) // 7,
        "int8": torch.randint(-128, 127, (3 * MiB // 2,), dtype=torch.int8, generator=g),  # random: stored raw
        "uint8": torch.zeros(1000, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _specs(values: dict) -> dict:
    return {k: omnickpt.ShardSpec(v, (0,) * v.dim(), v.shape) for k, v in values.items()}


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_is_exact_for_every_dtype_and_shape(tmp_path, codec):
    values = _values()
    path = str(tmp_path / "ck")
    model = nn.Linear(3, 2)
    omnickpt.save(path, {"t": _specs(values), "model": model}, compression=codec)
    out = {k: torch.full_like(v, 7) for k, v in values.items()}
    fresh = nn.Linear(3, 2)
    omnickpt.load(path, {"t": _specs(out), "model": fresh})
    for k, v in values.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert torch.equal(fresh.weight, model.weight)
    m = _manifest(path)
    assert m.compression == codec
    cols = m.tensors["t/fp32"].columns
    assert cols.codec == codec and len(cols.stored) == 3 and (cols.stored < MiB).all()
    # Random int8 does not compress: its chunks are stored raw (stored length == raw length).
    assert m.tensors["t/int8"].columns.stored.tolist() == [MiB, MiB // 2]
    raw = sum(v.numel() * v.element_size() for v in values.values())
    assert _data_bytes(path) < 0.8 * raw
    report = verify(path)
    assert report.ok, report.problems
    assert any(codec in note for note in report.notes)


def test_an_uncompressed_manifest_is_unchanged(tmp_path):
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"t": _specs({"w": torch.randn(10, 10)})})
    raw = open(os.path.join(path, MANIFEST_NAME), "rb").read()
    assert b"compression" not in raw and b'"stored"' not in raw
    assert _manifest(path).compression is None


def test_a_bad_codec_name_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="compression='lz4'.*zstd"):
        omnickpt.save(str(tmp_path / "ck"), {"t": {"w": torch.ones(3)}}, compression="lz4")
    assert not os.path.exists(tmp_path / "ck" / MANIFEST_NAME)


def test_a_corrupt_byte_in_a_compressed_chunk_names_file_and_tensor(tmp_path):
    values = _values()
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"t": _specs(values)}, compression="bytesplit-zstd")
    m = _manifest(path)
    (box,) = m.tensors["t/fp32"].boxes
    a, b = box.sums.file_chunk(1)
    assert b - a < MiB   # really compressed
    data_file = os.path.join(path, m.files[box.file].path)
    flip_byte(data_file, (a + b) // 2)
    out = {k: torch.zeros_like(v) for k, v in values.items()}
    with pytest.raises(CorruptCheckpointError, match=rf"{m.files[box.file].path}.*at bytes \[{a}, {b}\).*'t/fp32'"):
        omnickpt.load(path, {"t": _specs(out)})
    assert not out["fp32"].any() and not out["int64"].any()   # verified before anything is installed
    # Rows in the intact first chunk still read (the damaged chunk is not touched).
    with omnickpt.open(path) as ckpt:
        assert torch.equal(ckpt.get("t/fp32", (slice(0, 100),)), values["fp32"][:100])
    report = verify(path)
    assert not report.ok and "'t/fp32'" in str(report.problems[0])


def test_a_partial_read_reads_only_the_compressed_chunks_it_needs(tmp_path):
    big = torch.randn(2048, 1024) * 0.01   # 8 MiB: 8 chunks
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"w": omnickpt.ShardSpec(big, (0, 0), big.shape, name="w/big")}, compression="bytesplit-zstd")
    (box,) = _manifest(path).tensors["w/big"].boxes
    stored = box.sums.stored
    assert len(stored) == 8 and sum(stored) < 8 * MiB
    # Rows 300..400 lie in the second chunk only.
    part = torch.zeros(100, 1024)
    res = omnickpt.load(path, {"w": omnickpt.ShardSpec(part, (300, 0), big.shape, name="w/big")})
    assert torch.equal(part, big[300:400])
    assert res.report["bytes_per_rank"][0] == stored[1]
    with omnickpt.open(path) as ckpt:
        assert torch.equal(ckpt.get("w/big", (slice(1800, 2000), slice(100, 124))), big[1800:2000, 100:124])
        assert ckpt.bytes_read == stored[7]
        assert torch.equal(ckpt.get("w/big"), big)


def test_a_stored_length_past_its_chunk_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"t": _specs({"w": torch.zeros(300_000)})}, compression="zstd")
    m = _manifest(path)
    m.tensors["t/w"].columns.stored[0] = MiB + 1
    with pytest.raises(CorruptCheckpointError, match="stored chunk length"):
        Manifest.decode(m.encode())


def test_export_and_convert_read_a_compressed_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    src = str(tmp_path / "ck")
    omnickpt.save(src, {"model": model}, compression="zstd")
    from omnickpt.convert import convert
    convert(src, str(tmp_path / "hf"), to="hf", key="model", progress=False)
    convert(src, str(tmp_path / "dcp"), to="dcp", progress=False)
    convert(src, str(tmp_path / "plain"), to="omnickpt", progress=False)
    for dst in ("hf", "dcp", "plain"):
        with omnickpt.open(str(tmp_path / dst)) as ckpt:
            for name, v in model.state_dict().items():
                assert torch.equal(ckpt.get(f"model/{name}"), v), (dst, name)


# ------------------------------------------------------------------------------- resharded
def _save_fsdp2(rank, world_size, sync_path, async_path):
    from torch.distributed.device_mesh import DeviceMesh
    model, opt = toy("fsdp2", 0, DeviceMesh("cpu", torch.arange(world_size)))
    saved = full_values(model, opt)
    omnickpt.save(sync_path, {"model": model, "optimizer": opt}, compression="bytesplit-zstd")
    # async: the ranks' results (offsets, stored lengths) travel through storage records
    omnickpt.save(async_path, {"model": model, "optimizer": opt}, compression="zstd", async_save=True).wait()
    return saved


def _load_fsdp2(rank, world_size, paths):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    out = []
    for path in paths:
        model, opt = toy("fsdp2", 5, mesh)
        omnickpt.load(path, {"model": model, "optimizer": opt})
        out.append(full_values(model, opt))
    return out


def test_resharded_loads_of_compressed_fsdp2_checkpoints_are_exact(tmp_path):
    paths = [str(tmp_path / "sync"), str(tmp_path / "async")]
    saved = run_ranks(2, _save_fsdp2, *paths)[0]
    for path in paths:
        assert _manifest(path).compression is not None
        report = verify(path)
        assert report.ok, report.problems
    for world in (1, 3):
        got = run_ranks(world, _load_fsdp2, paths)[0]
        for path, values in zip(paths, got):
            assert values.keys() == saved.keys()
            bad = [k for k in saved if not torch.equal(saved[k], values[k])]
            assert not bad, (world, path, bad)


def test_transforms_read_windows_of_compressed_boxes(tmp_path):
    from omnickpt.transforms import SplitFused
    fused = torch.randn(1024, 600) * 0.01   # 2.4 MB: three chunks
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"w": omnickpt.ShardSpec(fused, (0, 0), fused.shape, name="fc")}, compression="bytesplit-zstd")
    rows = [SplitFused("fc", into=["gate", "up"])]
    cols = [SplitFused("fc", into=["left", "right"], sizes=[250, 350], dim=1)]
    with omnickpt.open(path, transforms=rows) as ckpt:
        assert torch.equal(ckpt.get("up"), fused[512:])
        assert torch.equal(ckpt.get("gate", (slice(400, 450),)), fused[400:450])
    with omnickpt.open(path, transforms=cols) as ckpt:
        assert torch.equal(ckpt.get("right"), fused[:, 250:])
        assert torch.equal(ckpt.get("left", (slice(700, 900),)), fused[700:900, :250])


def test_a_manager_passes_compression_through(tmp_path):
    w = torch.zeros(512, 1024)
    with omnickpt.CheckpointManager(str(tmp_path)) as manager:
        manager.save(1, {"w": omnickpt.ShardSpec(w, (0, 0), w.shape, name="w")}, compression="zstd").wait()
        out = torch.ones_like(w)
        manager.load_latest({"w": omnickpt.ShardSpec(out, (0, 0), w.shape, name="w")})
    assert torch.equal(out, w)
    m = _manifest(str(tmp_path / "global_step_1"))
    assert m.compression == "zstd" and _data_bytes(str(tmp_path / "global_step_1")) < 100_000


def test_a_model_and_its_adam_state_round_trip(tmp_path):
    # Many single-box tensors: the load planner's batched path for tensors with few boxes.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    omnickpt.save(path, {"model": model, "optimizer": opt}, compression="bytesplit-zstd")
    assert _data_bytes(path) < 0.95 * sum(p.numel() * 4 * 3 for p in model.parameters())
    fresh = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 4))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    omnickpt.load(path, {"model": fresh, "optimizer": fresh_opt})
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], fresh_opt.state[b][k]), k
