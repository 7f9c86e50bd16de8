"""omnickpt.open (the model-free reader), convert, and the diff / report / inspect tools of the command line,
on real checkpoints (1 and 2 ranks)."""
from __future__ import annotations

import fractions
import importlib
import json
import os

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli import main as cli
from omnickpt.convert import convert, parse_size, parse_transform
from omnickpt.errors import CheckpointError, CorruptCheckpointError, MismatchError, UnsafeCheckpointError
from omnickpt.layout import Box
from omnickpt.reader import CheckpointReader, slab_boxes

MiB = 1 << 20


from models import flip_byte  # noqa: E402
from test_cli import _run  # noqa: E402  (one copy of the CLI-driving helpers)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))


def _state(seed: int = 0) -> dict:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"step": 3, "name": "run-7", "emb": torch.arange(6.0)}}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    omnickpt.save(str(path), _state())
    return path


def _hf_reader_exists() -> bool:
    try:
        return hasattr(importlib.import_module("omnickpt.formats.hf"), "read_manifest")
    except ImportError:
        return False


def _exporter(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------ reader
def test_get_of_a_box_reads_only_the_chunks_it_needs_and_a_corrupt_chunk_elsewhere_does_not_matter(tmp_path):
    big = torch.randn(2048, 1024)                     # 8 MiB: 8 checksum chunks of 1 MiB, 256 rows each
    path = tmp_path / "big"
    omnickpt.save(str(path), {"w": omnickpt.ShardSpec(big, (0, 0), big.shape, name="w/big"), "model": nn.Linear(4, 4)})
    name = "w/big"
    with CheckpointReader(str(path)) as ckpt:
        assert name in ckpt.names()
        top = ckpt.get(name, box=(slice(0, 10),))
        assert torch.equal(top, big[:10])
        assert ckpt.bytes_read == MiB                  # the first chunk only, not 8 MiB
        tail = ckpt.get(name, box=Box((1800, 100), (200, 24)))
        assert torch.equal(tail, big[1800:2000, 100:124])
        assert ckpt.bytes_read == MiB + MiB            # rows 1800..2000 lie in the eighth chunk
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(path)))
    (box,) = manifest.tensors[name].boxes
    flip_byte(path / manifest.files[box.file].path, box.offset + 7 * MiB + 5)   # inside the last chunk
    with CheckpointReader(str(path)) as ckpt:
        assert torch.equal(ckpt.get(name, (slice(256, 300), slice(None))), big[256:300])   # chunk 2: intact
        with pytest.raises(CorruptCheckpointError, match=r"at bytes \[7340032, 8388608\) for tensor 'w/big'"):
            ckpt.get(name)
        with pytest.raises(CorruptCheckpointError):
            ckpt.get(name, (slice(2000, 2048),))
    with CheckpointReader(str(path), verify=False) as ckpt:   # on purpose: the damaged bytes come back
        assert not torch.equal(ckpt.get(name), big)


def test_get_accepts_boxes_slices_and_indexes_and_casts(ckpt):
    w = _state()["model"][0].weight.detach()
    with CheckpointReader(str(ckpt)) as c:
        assert torch.equal(c.get("model/0.weight"), w)
        assert torch.equal(c.get("model/0.weight", ((4, 2), (3, 5))), w[4:7, 2:7])
        assert torch.equal(c.get("model/0.weight", Box((4, 2), (3, 5))), w[4:7, 2:7])
        assert torch.equal(c.get("model/0.weight", (slice(-5, None), slice(3, 9))), w[-5:, 3:9])
        assert torch.equal(c.get("model/0.weight", 7), w[7])
        assert torch.equal(c.get("model/0.weight", (slice(1, 3), -1)), w[1:3, -1])
        assert c.get("model/0.weight", dtype="bf16").dtype == torch.bfloat16
        assert torch.equal(c.get("model/0.weight", dtype=torch.float16), w.half())
        assert c.get("model/0.weight", (slice(5, 5),)).shape == (0, 32)
        for bad in ((slice(0, 10, 2),), ((0, 0), (49, 1)), (60,), "rows"):
            with pytest.raises(ValueError):
                c.get("model/0.weight", bad)
        with pytest.raises(MismatchError, match="close names: model/0.weight") as info:
            c.get("model/0.wieght")
        assert isinstance(info.value, CheckpointError)
        info = c.info("model/0.weight")
        assert (info.shape, info.dtype, info.boxes, info.nbytes) == ((48, 32), torch.float32, 1, 48 * 32 * 4)
        assert c.layout["world_size"] == 1 and c.layout["frameworks"]["model"] == "plain"
        assert c.format == "omnickpt" and "optim/state/0.weight/exp_avg" in c


def test_objects_are_decoded_safely_and_pickle_needs_consent(tmp_path):
    path = tmp_path / "p"
    omnickpt.save(str(path), {"plain": {"lr": 0.1, "betas": (0.9, 0.99)}, "odd": {"f": fractions.Fraction(1, 3)}},
                  allow_pickle=True)
    with CheckpointReader(str(path)) as c:
        assert c.objects(["plain"]) == {"plain": {"lr": 0.1, "betas": (0.9, 0.99)}}
        with pytest.raises(UnsafeCheckpointError, match="pickle"):
            c.objects()
        assert c.objects(["odd"], allow_pickle=True)["odd"] == {"f": fractions.Fraction(1, 3)}
        with pytest.raises(MismatchError, match="no object 'nope'"):
            c.objects(["nope"])


def test_slab_boxes_tile_the_tensor_in_order():
    for shape, limit in (((10, 4), 8), ((3, 5, 7), 6), ((17,), 5), ((), 1), ((0, 4), 3), ((2, 3), 100)):
        seen = torch.zeros(shape, dtype=torch.int32)
        for b in slab_boxes(shape, limit):
            assert b.numel <= max(limit, 1) or b.numel == 1
            seen[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))] += 1
        assert bool((seen == 1).all()), (shape, limit)


# ------------------------------------------------------------------------------------- two ranks
def _two_rank_save(rank: int, world: int, path: str) -> None:
    import time
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    sharded = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    big = distribute_tensor(torch.randn(512, 256, generator=torch.Generator().manual_seed(1)), mesh, [Shard(0)])
    if rank == 1:
        time.sleep(0.05)   # rank 1 arrives late: its exchange waits less, rank 0's more
    omnickpt.save(path, {"model": nn.Linear(16, 16), "sharded": sharded, "big": big, "mine": {"rank": rank}})


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    from dist import run_ranks
    path = tmp_path_factory.mktemp("two") / "ckpt"
    run_ranks(2, _two_rank_save, str(path))
    return path


def test_reader_on_a_two_rank_checkpoint(two_rank):
    with CheckpointReader(str(two_rank)) as c:
        assert c.info("sharded").boxes == 2 and c.layout["world_size"] == 2
        assert torch.equal(c.get("sharded"), torch.arange(24.0).reshape(6, 4))
        assert torch.equal(c.get("sharded", (slice(2, 5), slice(1, 3))), torch.arange(24.0).reshape(6, 4)[2:5, 1:3])
        assert c.objects(["mine"]) == {"mine": {"rank": 0}}
        assert c.objects(["mine"], rank=1) == {"mine": {"rank": 1}}
        assert c.objects(["mine"], all_ranks=True) == {"mine": {0: {"rank": 0}, 1: {"rank": 1}}}


def test_report_table_png_and_trace(two_rank, tmp_path, capsys):
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    rc, out, _ = _run(["report", two_rank, "--png", png, "--trace", trace], capsys)
    assert rc == 0
    saved = json.loads((two_rank / "report.json").read_text())
    lines = out.splitlines()
    assert lines[0].startswith(f"save report for {two_rank}")
    header = next(line for line in lines if line.strip().startswith("RANK"))
    for phase in ("PLAN", "EXCHANGE", "SNAPSHOT", "CHECKSUM", "WRITE", "STALL", "TOTAL"):
        assert phase in header.split()
    assert [line.split()[0] for line in lines[lines.index(header) + 1:][:2]] == ["0", "1"]
    phases = {p: v for p, v in saved["phases"].items() if p != "stall"}
    slow = max(phases, key=lambda p: phases[p]["max"])
    assert f"slowest phase: {slow} on rank {phases[slow]['slowest_rank']}" in out
    assert "slowest rank: " in out

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    if "events" in saved["per_rank"][0]:    # recorded phase starts: one span per recorded phase
        want = sorted((r, e[0]) for r, rec in enumerate(saved["per_rank"]) for e in rec["events"])
    else:                                   # totals only: one span per rank and phase
        want = sorted((r, p) for r, rec in enumerate(saved["per_rank"]) for p in rec["seconds"])
    assert sorted((e["pid"], e["name"]) for e in spans) == want
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}

    rc, out, _ = _run(["report", "--json", two_rank], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["world_size"] == 2 and [r["rank"] for r in doc["table"]] == [0, 1]
    assert doc["slowest_phase"]["phase"] == slow and doc["timeline_exact"] == ("events" in saved["per_rank"][0])
    assert doc["table"][1]["seconds"] == saved["per_rank"][1]["seconds"]

    # a report kept in a file (a load's, say) works too; a folder with no report is a clear error
    report_file = tmp_path / "load.json"
    state = {"model": nn.Linear(16, 16)}
    report_file.write_text(json.dumps(omnickpt.load(str(two_rank), state, strict=False).report))
    rc, out, _ = _run(["report", report_file], capsys)
    assert rc == 0 and out.startswith("load report") and "READ" in out
    os.remove(tmp_path / "load.json")
    rc, _, err = _run(["report", tmp_path], capsys)
    assert rc == 1 and "not a committed checkpoint" in err


def test_report_uses_recorded_phase_starts_when_a_report_has_them_and_reads_the_memory_tier_report(tmp_path, capsys):
    from omnickpt.cli.report import summary, timeline, trace
    report = {"kind": "save", "path": "x", "per_rank": [
        {"seconds": {"plan": 0.1, "write": 0.5}, "bytes": {"written": 10},
         "events": [["plan", 0.0, 0.1], ["write", 0.3, 0.5]]},
        {"seconds": {"plan": 0.2, "write": 0.1}, "bytes": {"written": 20}, "t0": 1000.5,
         "events": [["plan", 0.0, 0.2], ["write", 0.25, 0.1]]}]}
    report["per_rank"][0]["t0"] = 1000.0
    tl = timeline(report)
    assert tl.exact and tl.spans[0] == [("plan", 0.0, 0.1), ("write", 0.3, 0.5)]
    assert tl.spans[1] == [("plan", 0.5, 0.2), ("write", 0.75, 0.1)]          # rank 1 began 0.5 s later
    doc = summary(report)
    assert doc["slowest_phase"] == {"phase": "write", "rank": 0, "seconds": 0.5, "median": 0.3}
    assert doc["slowest_rank"] == {"rank": 0, "seconds": 0.6} and doc["total_bytes"] == 30
    assert [e["ts"] for e in trace(report)["traceEvents"] if e["ph"] == "X" and e["pid"] == 0] == [0.0, 300000.0]

    persist = tmp_path / "persist.json"
    persist.write_text(json.dumps({"kind": "persist", "total_bytes": 5, "seconds_per_rank": [0.5, 0.7]}))
    rc, out, _ = _run(["report", persist], capsys)
    assert rc == 0 and "slowest phase: persist on rank 1 (0.7000 s" in out
    persist.write_text('{"kind": "save", "per_rank": [{"seconds": {"plan": "soon"}}]}')
    rc, _, err = _run(["report", persist], capsys)
    assert rc == 1 and "no per-rank phase seconds" in err


# ----------------------------------------------------------------------------------------- diff
def test_diff_equal_checkpoints_exit_0(ckpt, tmp_path, capsys):
    other = tmp_path / "again"
    omnickpt.save(str(other), _state())
    rc, out, _ = _run(["diff", ckpt, other], capsys)
    assert rc == 0 and out.splitlines()[-1] == "SAME (atol=0, rtol=0)"
    assert "tensors (16): 16 equal" in out and "objects (2): 2 equal" in out
    rc, out, _ = _run(["diff", "--json", ckpt, other], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["same"] and doc["tensor_counts"] == {"equal": 16}
    assert all(t["max_abs"] == 0 for t in doc["tensors"])


def test_diff_names_what_differs_beyond_the_tolerance(ckpt, tmp_path, capsys):
    state = _state()
    with torch.no_grad():
        state["model"][0].weight[3, 4] += 0.5
        state["model"][2].bias[0] += 1e-6
    state["extra"]["step"] = 4
    other = tmp_path / "other"
    omnickpt.save(str(other), state)
    rc, out, _ = _run(["diff", ckpt, other], capsys)
    assert rc == 1 and out.splitlines()[-1] == "DIFFERENT (atol=0, rtol=0)"
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  model/")}
    assert rows["model/0.weight"][1] == "differs" and rows["model/0.weight"][-3] == "0.5"
    assert rows["model/0.weight"][-1] == "1"                      # one element beyond the tolerance
    assert rows["model/2.bias"][1] == "differs"
    assert any(line.split()[:2] == ["extra", "differs"] and "['step']: 3 vs 4" in line for line in out.splitlines())

    rc, out, _ = _run(["diff", "--atol", "1e-5", "--json", ckpt, other], capsys)
    doc = json.loads(out)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert rc == 1 and tensors["model/2.bias"]["status"] == "close"
    assert tensors["model/0.weight"]["status"] == "differs" and tensors["model/0.weight"]["mismatched"] == 1
    assert tensors["model/0.weight"]["max_abs"] == pytest.approx(0.5)


def test_diff_lists_shape_mismatches_and_missing_tensors(ckpt, tmp_path, capsys):
    torch.manual_seed(0)
    other = tmp_path / "other"
    omnickpt.save(str(other), {"model": nn.Sequential(nn.Linear(32, 40), nn.ReLU(), nn.Linear(40, 8), nn.Linear(8, 2)),
                               "extra": {"step": 3, "name": "run-7", "emb": torch.arange(6.0)}})
    rc, out, _ = _run(["diff", "--json", ckpt, other], capsys)
    doc = json.loads(out)
    t = {r["name"]: r for r in doc["tensors"]}
    assert rc == 1
    assert t["model/0.weight"]["status"] == "shape" and t["model/0.weight"]["shape_b"] == [40, 32]
    assert t["model/3.weight"]["status"] == "only in B" and t["optim/state/0.weight/exp_avg"]["status"] == "only in A"
    assert {o["key"]: o["status"] for o in doc["objects"]} == {"optim": "only in A", "extra": "equal"}
    rc, out, _ = _run(["diff", ckpt, other], capsys)
    line = next(x for x in out.splitlines() if x.strip().startswith("model/0.weight"))
    assert line.split()[1:4] == ["shape", "[48,32]", "[40,32]"]


def test_diff_streams_big_tensors_in_slabs_with_the_same_result(tmp_path):
    from omnickpt.cli.diff import diff
    torch.manual_seed(0)
    a = torch.randn(300, 70)
    b = a.clone()
    b[17, 3] += 2.0
    b[250, 69] = float("nan")
    b[251, 0] *= 1 + 1e-7
    a[5, 5] = b[5, 5] = float("inf")                                       # equal infinities are equal
    a[6, 6] = b[6, 6] = float("nan")                                       # and so are NaNs in one place
    for name, t in (("a", a), ("b", b)):
        omnickpt.save(str(tmp_path / name), {"w": omnickpt.ShardSpec(t, (0, 0), t.shape, name="w")})
    whole = diff(str(tmp_path / "a"), str(tmp_path / "b"), rtol=1e-6)
    slabs = diff(str(tmp_path / "a"), str(tmp_path / "b"), rtol=1e-6, slab_bytes=8 * 50)   # 50 elements a slab
    (row,) = whole.tensors
    assert slabs.tensors == whole.tensors
    assert row["status"] == "differs" and row["mismatched"] == 2            # the +2 and the NaN; not the 1e-7
    assert row["max_abs"] == float("inf") and whole.differs


# -------------------------------------------------------------------------------------- convert
def test_convert_to_omnickpt_copies_every_tensor_and_object_and_verifies(ckpt, tmp_path, capsys):
    dst = tmp_path / "copy"
    rc, out, _ = _run(["convert", ckpt, dst, "--to", "omnickpt", "--max-shard-size", "4KB", "--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["tensors"] == 16 and result["objects"] == 2 and result["files"] > 3
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(dst)))
    assert len(manifest.tensors["model/0.weight"].boxes) > 1               # 6 KiB split across 4 KB files
    assert all(f.bytes <= 4000 for f in manifest.files)
    assert manifest.layout["converted_from"]["format"] == "omnickpt"
    assert _run(["verify", dst], capsys)[0] == 0
    rc, out, _ = _run(["diff", ckpt, dst], capsys)
    assert rc == 0, out
    state = _state(seed=1)
    omnickpt.load(str(dst), state)
    assert torch.equal(state["model"][0].weight, _state()["model"][0].weight)
    assert state["optim"].state_dict()["param_groups"][0]["lr"] == 0.01

    # never over existing files
    rc, _, err = _run(["convert", ckpt, dst, "--to", "omnickpt"], capsys)
    assert rc == 1 and "not empty" in err


def test_convert_casts_selects_a_key_and_applies_transforms(ckpt, tmp_path):
    dst = tmp_path / "bf16"
    out = convert(str(ckpt), str(dst), to="omnickpt", key="model", dtype="bfloat16", progress=False,
                  transforms=[parse_transform('Rename({"0.weight": "first.weight"})')])
    assert out["tensors"] == 4 and out["objects"] == 0
    with CheckpointReader(str(dst)) as c:
        assert sorted(c.names()) == ["model/0.bias", "model/2.bias", "model/2.weight", "model/first.weight"]
        assert c.info("model/first.weight").dtype == torch.bfloat16
        assert torch.equal(c.get("model/first.weight"), _state()["model"][0].weight.detach().bfloat16())


def test_a_failed_conversion_leaves_nothing_behind(ckpt, tmp_path):
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(ckpt)))
    (box,) = manifest.tensors["model/2.weight"].boxes
    flip_byte(ckpt / manifest.files[box.file].path, box.offset)
    dst = tmp_path / "copy"
    with pytest.raises(CorruptCheckpointError, match="model/2.weight"):
        convert(str(ckpt), str(dst), to="omnickpt", max_shard_size=2048, progress=False)
    assert not (dst / "manifest.json").exists() and not os.listdir(dst / "data")


def test_transform_spelling_is_parsed_never_evaluated():
    t = parse_transform('SplitFused("mlp.fc1.weight", into=["mlp.gate.weight", "mlp.up.weight"], dim=0)')
    assert type(t).__name__ == "SplitFused" and t.dim == 0
    assert type(parse_transform('Rename.regex("^model/module\\\\.", "model/")')).__name__ == "Rename"
    for bad in ('__import__("os").system("true")', 'Rename(open("x"))', 'os.system("x")', "Rename", "1 +"):
        with pytest.raises(ValueError):
            parse_transform(bad)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 << 30
    assert parse_size(4096) == parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


def test_convert_to_hf_and_back(ckpt, tmp_path, capsys):
    src = tmp_path / "model_only"
    omnickpt.save(str(src), {"model": _model()})
    dst = tmp_path / "hf"
    rc, out, err = _run(["convert", src, dst, "--to", "hf"], capsys)
    assert rc == 0, err
    assert any(n.endswith(".safetensors") for n in os.listdir(dst))
    if _hf_reader_exists():
        rc, out, _ = _run(["diff", src, dst], capsys)
        assert rc == 0, out


def test_convert_to_dcp(ckpt, tmp_path, capsys):
    dst = tmp_path / "dcp"
    rc, _, err = _run(["convert", ckpt, dst, "--to", "dcp"], capsys)
    assert rc == 0, err
    assert (dst / ".metadata").exists()
    if _exporter("omnickpt.formats.dcp", "read_manifest") is not None:   # and back: DCP -> omnickpt
        assert _run(["diff", ckpt, dst], capsys)[0] == 0
        back = tmp_path / "back"
        rc, _, err = _run(["convert", dst, back, "--to", "omnickpt"], capsys)
        assert rc == 0, err
        assert _run(["verify", back], capsys)[0] == 0 and _run(["diff", ckpt, back], capsys)[0] == 0
    rc, _, err = _run(["convert", ckpt, tmp_path / "dcp2", "--to", "dcp", "--dtype", "bfloat16"], capsys)
    assert rc == 1 and "dtype" in err


def test_convert_a_hugging_face_folder_into_omnickpt(tmp_path, capsys):
    if not _hf_reader_exists():
        pytest.skip("omnickpt.formats.hf (the Hugging Face reader) does not exist yet: omnickpt cannot read "
                    "a Hugging Face folder to convert")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(hf))
    dst = tmp_path / "ours"
    rc, out, err = _run(["convert", hf, dst, "--to", "omnickpt"], capsys)
    assert rc == 0, err
    assert _run(["verify", dst], capsys)[0] == 0
    rc, out, _ = _run(["diff", hf, dst], capsys)
    assert rc == 0, out
    with CheckpointReader(str(hf)) as a, CheckpointReader(str(dst)) as b:
        assert a.format == "hf" and b.format == "omnickpt" and a.names() == b.names()
        name = next(n for n in a.names() if n.endswith("embed_tokens.weight"))
        assert torch.equal(a.get(name, (slice(3, 9),)), b.get(name)[3:9])


# -------------------------------------------------------------------------------------- inspect
def test_inspect_filter_tree_values_and_json(ckpt, capsys):
    rc, out, _ = _run(["inspect", ckpt, "--filter", "model/*.weight"], capsys)
    assert rc == 0 and "tensors (2 of 16 match model/*.weight" in out
    names = [line.split()[0] for line in out.splitlines() if line.startswith("  model/")]
    assert names == ["model/0.weight", "model/2.weight"]
    extra = next(line for line in out.splitlines() if line.split()[:1] == ["extra"])
    assert "'step': 3" in extra and "'name': 'run-7'" in extra and "tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in extra
    assert out.splitlines()[-1].startswith("total: 16 tensors in 16 boxes")

    rc, out, _ = _run(["inspect", ckpt, "--tree"], capsys)
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("tensors (")))
    tree = lines[start + 1:lines.index(next(line for line in lines if line.startswith("objects (")))]
    assert tree[0] == "  model  (4 tensors, 7.7 KiB)"
    assert tree[1] == "  ├── 0  (2 tensors, 6.2 KiB)"
    assert tree[2] == "  │   ├── weight  [48, 32] float32  6.0 KiB"
    assert "  optim/state  (12 tensors, 15.5 KiB)" in tree and "  │   ├── weight  (3 tensors, 12.0 KiB)" in tree

    rc, out, _ = _run(["inspect", "--json", "--tree", "--filter", "optim/*exp_avg_sq", ckpt], capsys)
    doc = json.loads(out)
    assert [t["name"] for t in doc["tensors"]] == ["optim/state/0.weight/exp_avg_sq", "optim/state/0.bias/exp_avg_sq",
                                                    "optim/state/2.weight/exp_avg_sq", "optim/state/2.bias/exp_avg_sq"]
    (top,) = doc["tree"]["children"]
    assert top["name"] == "optim/state" and top["tensors"] == 4 and len(top["children"]) == 2   # "0.", "2."
    assert doc["format"] == "omnickpt" and doc["totals"]["matched"] == 4
    objects = {o["key"]: o for o in doc["objects"]}
    assert objects["extra"]["reprs"][0]["ranks"] == [0] and "'run-7'" in objects["extra"]["reprs"][0]["repr"]
    assert "'betas': (0.9, 0.999)" in objects["optim"]["reprs"][0]["repr"]


def test_inspect_shows_pickled_values_without_unpickling(tmp_path, capsys):
    path = tmp_path / "p"
    omnickpt.save(str(path), {"odd": {"f": fractions.Fraction(1, 3)}}, allow_pickle=True)
    rc, out, _ = _run(["inspect", path], capsys)
    assert rc == 0 and "<pickled value: not decoded" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"omnickpt {omnickpt.__version__}"
