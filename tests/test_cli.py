"""The `omnickpt` command line: inspect and verify on real checkpoints (1 and 2 ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli import main as cli
from omnickpt.cli.verify import verify
from models import flip_byte


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "rng": omnickpt.RNGState(),
            "extra": {"step": 3, "emb": torch.arange(6, dtype=torch.bfloat16)}}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    handle = omnickpt.save(str(path), _state())
    return path, handle.save_id


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err



# ----------------------------------------------------------------------------------------- inspect
def test_inspect_lists_tensors_layout_objects_files_and_totals(ckpt, capsys):
    path, save_id = ckpt
    rc, out, _ = _run(["inspect", path], capsys)
    assert rc == 0
    assert str(path) in out and save_id in out
    assert "saved by 1 rank(s); frameworks: model=plain" in out
    lines = out.splitlines()
    weight = next(line for line in lines if line.strip().startswith("model/0.weight"))
    assert weight.split()[1:] == ["[48,", "32]", "float32", "6.0", "KiB", "1"]      # name, shape, dtype, size, boxes
    for key in ("optim", "rng", "extra"):
        assert any(line.split()[:2] == [key, "0"] for line in lines), key    # key, ranks
    data = os.listdir(path / "data")
    assert len(data) == 1 and any(f"data/{data[0]}" in line for line in lines)
    assert lines[-1].startswith("total: 16 tensors in 16 boxes")


def test_inspect_json_is_a_complete_document_for_scripts(ckpt, capsys):
    path, save_id = ckpt
    rc, out, _ = _run(["inspect", "--json", path], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["save_id"] == save_id and doc["world_size"] == 1 and doc["format_version"] == omnickpt.format.FORMAT_VERSION
    assert doc["layout"] == {"world_size": 1, "frameworks": {"model": "plain", "optim": "torch.optim.adam.Adam"}}
    tensors = {t["name"]: t for t in doc["tensors"]}
    state = _state()
    for name, value in state["model"].state_dict().items():
        t = tensors[f"model/{name}"]
        assert t["shape"] == list(value.shape) and t["dtype"] == "float32"
        assert t["bytes"] == t["stored_bytes"] == value.numel() * 4 and t["boxes"] == 1
    assert tensors["optim/state/2.bias/exp_avg_sq"]["shape"] == [8]
    assert {o["key"]: o["ranks"] for o in doc["objects"]} == {"optim": [0], "rng": [0], "extra": [0]}
    (f,) = doc["files"]
    assert f["rank"] == 0 and f["bytes"] == os.path.getsize(path / f["path"])
    assert doc["totals"]["tensors"] == len(tensors) and doc["totals"]["file_bytes"] == f["bytes"]
    assert "box_list" not in tensors["model/0.weight"]

    rc, out, _ = _run(["inspect", "--json", "--boxes", path], capsys)
    (box,) = {t["name"]: t for t in json.loads(out)["tensors"]}["model/0.weight"]["box_list"]
    assert box["offsets"] == [0, 0] and box["lengths"] == [48, 32] and box["file"] == f["path"]


# ------------------------------------------------------------------------------------------ verify
def test_verify_passes_a_sound_checkpoint(ckpt, capsys):
    path, _ = ckpt
    rc, out, _ = _run(["verify", path], capsys)
    assert rc == 0 and out.startswith(f"OK {path}: 16 tensors in 16 boxes")
    rc, out, _ = _run(["verify", "--json", "--workers", "3", path], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["problems"] == [] and doc["boxes"] == 16 and doc["objects"] == 3
    assert doc["bytes_checked"] > 0


def test_verify_finds_exactly_the_damaged_box_or_object_whatever_the_chunking(ckpt):
    # Tiny chunks and tasks make every span straddle reads and tasks: each single flipped byte
    # must be blamed on exactly its own box, never on a neighbour.
    path, _ = ckpt
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(path)))
    file = path / manifest.files[0].path
    targets = [(f"tensor {name!r}", b.offset, b.nbytes) for name, t in manifest.tensors.items() for b in t.boxes]
    targets += [(f"object {key!r}", e.offset, e.nbytes) for key, es in manifest.objects.items() for e in es]
    for chunk, task in ((97, 1000), (4096, 64), (1 << 20, 1 << 20)):
        assert verify(str(path), workers=3, chunk_bytes=chunk, task_bytes=task).ok
        for what, offset, nbytes in targets:
            for pos in {offset, offset + nbytes - 1}:
                flip_byte(file, pos)
                report = verify(str(path), workers=3, chunk_bytes=chunk, task_bytes=task)
                flip_byte(file, pos)
                assert [p.what.split(" box")[0].split(" (ranks")[0] for p in report.problems] == [what], \
                    (chunk, task, what, pos, report.problems)
                assert report.problems[0].where == str(file)


def test_verify_reports_missing_and_truncated_files(ckpt, capsys):
    path, _ = ckpt
    (name,) = os.listdir(path / "data")
    data = path / "data" / name
    raw = data.read_bytes()
    data.write_bytes(raw[:100])
    rc, out, err = _run(["verify", path], capsys)
    assert rc == 1 and "FAILED" in err
    lines = out.splitlines()
    assert f"{data}: truncated: 100 bytes, the manifest records {len(raw)}" in lines
    assert any(line.startswith(f"{data}: tensor 'model/0.weight' box") and "truncated" in line for line in lines)
    os.remove(data)
    rc, out, _ = _run(["verify", path], capsys)
    assert rc == 1 and out.splitlines()[0].startswith(f"{data}: data file missing (written by rank 0")


def test_not_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    rc, out, err = _run(["inspect", tmp_path / "nothing"], capsys)
    assert rc == 1 and out == "" and "no such checkpoint" in err and "does not exist" in err
    # A CheckpointManager root: point at its steps.
    mgr = omnickpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(5, {"w": torch.ones(2)})
    mgr.save(7, {"w": torch.ones(2)})
    rc, _, err = _run(["verify", tmp_path / "run"], capsys)
    assert rc == 1 and "global_step_5, global_step_7" in err and f"{tmp_path / 'run'}/global_step_7" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{oops")
    rc, _, err = _run(["verify", tmp_path / "bad"], capsys)
    assert rc == 1 and "manifest.json: not valid JSON" in err


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["verify"], ["frobnicate", "x"]):
        with pytest.raises(SystemExit) as info:
            cli(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_python_dash_m_and_the_console_script(ckpt):
    path, save_id = ckpt
    out = subprocess.run([sys.executable, "-m", "omnickpt", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["save_id"] == save_id
    script = os.path.join(os.path.dirname(sys.executable), "omnickpt")
    if not os.path.exists(script):
        pytest.skip("the omnickpt console script is not installed in this environment")
    (name,) = os.listdir(path / "data")
    flip_byte(path / "data" / name, 0)
    out = subprocess.run([script, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "'model/0.weight'" in out.stdout, out


# --------------------------------------------------------------------------------------- two ranks
def _two_rank_save(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Linear(16, 16)                                # replicated, as under DDP
    sharded = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    handle = omnickpt.save(path, {"model": model, "sharded": sharded, "common": {"lr": 0.1},
                                  "mine": {"rank": rank}})
    return handle.save_id


def test_two_rank_checkpoint(tmp_path, capsys):
    from dist import run_ranks
    path = tmp_path / "ckpt"
    ids = run_ranks(2, _two_rank_save, str(path))
    assert ids[0] == ids[1]
    rc, out, _ = _run(["inspect", "--json", path], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["world_size"] == 2 and doc["save_id"] == ids[0]
    files = {f["rank"]: f for f in doc["files"]}
    assert sorted(files) == [0, 1]
    for f in files.values():
        assert f["bytes"] == os.path.getsize(path / f["path"]) and f"r0000{f['rank']}" in f["path"]
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["sharded"]["shape"] == [6, 4] and tensors["sharded"]["boxes"] == 2
    assert tensors["model/weight"]["boxes"] == 1                 # the replica is stored once
    objects = {o["key"]: o for o in doc["objects"]}
    assert objects["common"]["ranks"] == [0, 1] and objects["common"]["values"] == 1   # identical: once
    assert objects["mine"]["ranks"] == [0, 1] and objects["mine"]["values"] == 2       # per rank
    rc, out, _ = _run(["inspect", path], capsys)
    assert "saved by 2 rank(s)" in out and any(line.split()[:3] == ["mine", "0-1", "2"] for line in out.splitlines())

    assert _run(["verify", path], capsys)[0] == 0
    manifest = omnickpt.read_manifest(omnickpt.api.storage_for(str(path)))
    box = next(b for b in manifest.tensors["sharded"].boxes if manifest.files[b.file].rank == 1)
    file = path / manifest.files[box.file].path
    flip_byte(file, box.offset + 3)
    rc, out, _ = _run(["verify", path], capsys)
    assert rc == 1 and out.splitlines() == [
        f"{file}: tensor 'sharded' box offsets=[3, 0] lengths=[3, 4]: checksum mismatch "
        f"(manifest {box.checksum:#010x}, data {_crc(file, box):#010x}): the data file is corrupt; restore it or "
        "use an earlier checkpoint"]


def _crc(file, box) -> int:
    from omnickpt.format import checksum
    with open(file, "rb") as f:
        f.seek(box.offset)
        return checksum(f.read(box.nbytes))
