"""Trust: every loaded byte is verified (resharded or not), nothing is installed from a corrupt read,
no async save is lost at exit, hostile manifests and careless calls get clear errors.

Real saves on real files, real gloo ranks, real subprocesses for interpreter exit.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt import CheckpointError, CorruptCheckpointError, NotCommittedError, PlanError
from omnickpt.cli.verify import verify
from omnickpt.format import CHUNK_BYTES, FORMAT_VERSION, checksum, manifest_document
from models import flip_byte


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return manifest_document(f.read())


def _write_manifest(path, doc) -> None:
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(doc, f)


def _flip(path, file_rel: str, offset: int) -> None:
    flip_byte(os.path.join(path, file_rel), offset, 0x40)


def _big(seed: int) -> nn.Module:
    """A 4 MiB weight: four checksum chunks, so a rank of a 3-way reshard reads some of them only."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 1024, bias=False))


# ------------------------------------------------------------------ corrupt bytes in resharded loads
def _resharded_corrupt_load(rank, world_size, ckpt, good):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    model = _big(7)
    fully_shard(model, mesh=mesh)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    out = {}
    try:
        omnickpt.load(ckpt, {"model": model})
        out["error"] = None
    except CheckpointError as e:
        out["error"] = (type(e).__name__, str(e))
    out["untouched"] = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    # The good checkpoint still loads exactly, at this world size.
    omnickpt.load(good, {"model": model})
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["good_exact"] = all(torch.equal(full[k], v) for k, v in _big(1).state_dict().items())
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_a_flipped_byte_fails_a_resharded_load_on_every_rank_and_installs_nothing(tmp_path, world):
    from dist import run_ranks
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    omnickpt.save(good, {"model": _big(1)}).wait()
    omnickpt.save(bad, {"model": _big(1)}).wait()
    doc = _manifest(bad)
    assert FORMAT_VERSION == 3 and doc["chunk_bytes"] == CHUNK_BYTES
    box = doc["tensors"]["model/0.weight"]["boxes"][0]
    assert len(box[5]) == 4                       # one CRC per MiB of the 4 MiB box
    victim = doc["files"][box[2]]["path"]
    # A byte in the third chunk (rows ~512-767): at 3 and 4 ranks only some ranks read it.
    _flip(bad, victim, box[3] + 2 * CHUNK_BYTES + 12345)
    results = run_ranks(world, _resharded_corrupt_load, bad, good)
    for r, out in enumerate(results):
        assert out["error"] is not None, f"rank {r} loaded corrupt bytes"
        cls, msg = out["error"]
        assert cls == "CorruptCheckpointError", (r, out["error"])
        assert "model/0.weight" in msg and "rank" in msg or "checksum mismatch" in msg, msg
        assert victim.split("/")[-1] in msg and "offsets=[0, 0]" in msg, msg
        assert out["untouched"], f"rank {r}: parameters changed by a failed load"
        assert out["good_exact"]


def test_a_partial_read_reads_whole_chunks_not_whole_boxes(tmp_path):
    # A load of rows 0..9 of the 4 MiB weight (a ShardSpec target) reads the first chunk only.
    ckpt = str(tmp_path / "c")
    omnickpt.save(ckpt, {"model": _big(1)}).wait()
    dest = torch.zeros(10, 1024)
    spec = omnickpt.ShardSpec(dest, offsets=(0, 0), global_shape=(1024, 1024), name="model/0.weight")
    result = omnickpt.load(ckpt, {"part": spec}, strict=False)
    assert torch.equal(dest, _big(1)[0].weight.detach()[:10])
    assert result.report["total_bytes"] == CHUNK_BYTES
    # A flip in the fourth chunk does not concern this read; one in the first does.
    doc = _manifest(ckpt)
    box = doc["tensors"]["model/0.weight"]["boxes"][0]
    _flip(ckpt, doc["files"][0]["path"], box[3] + 3 * CHUNK_BYTES + 5)
    omnickpt.load(ckpt, {"part": spec}, strict=False)
    _flip(ckpt, doc["files"][0]["path"], box[3] + 5)
    dest.fill_(7.0)
    with pytest.raises(CorruptCheckpointError, match=r"model/0\.weight"):
        omnickpt.load(ckpt, {"part": spec}, strict=False)
    assert bool((dest == 7.0).all()), "a corrupt read was installed"


def test_version_1_checkpoints_load_verify_and_say_what_they_lack(tmp_path, capsys):
    ckpt = str(tmp_path / "v1")
    model = _big(2)
    omnickpt.save(ckpt, {"model": model}).wait()
    doc = _manifest(ckpt)
    # Rewrite as version 1: one CRC of the whole box, no chunk_bytes.
    for t in doc["tensors"].values():
        for b in t["boxes"]:
            with open(os.path.join(ckpt, doc["files"][b[2]]["path"]), "rb") as f:
                f.seek(b[3])
                b[5] = checksum(f.read(b[4]))
    doc["version"] = 1
    del doc["chunk_bytes"]
    _write_manifest(ckpt, doc)
    target = _big(9)
    omnickpt.load(ckpt, {"model": target})
    assert torch.equal(target[0].weight, model[0].weight)
    report = verify(ckpt)
    assert report.ok and any("version 1" in n and "whole box" in n for n in report.notes)
    from omnickpt.cli import main as cli
    assert cli(["verify", ckpt]) == 0
    assert "note: format version 1" in capsys.readouterr().out
    # A partial read of a version-1 box reads (and checks) the whole box.
    box = doc["tensors"]["model/0.weight"]["boxes"][0]
    _flip(ckpt, doc["files"][0]["path"], box[3] + box[4] - 3)
    dest = torch.zeros(10, 1024)
    spec = omnickpt.ShardSpec(dest, offsets=(0, 0), global_shape=(1024, 1024), name="model/0.weight")
    with pytest.raises(CorruptCheckpointError):
        omnickpt.load(ckpt, {"part": spec}, strict=False)
    assert not dest.any()


# ------------------------------------------------------------------ no silent loss at exit
_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, omnickpt
    model = torch.nn.Linear(1500, 1500)
    state = {"model": model}
    if sys.argv[2] == "manager":
        manager = omnickpt.CheckpointManager(sys.argv[1])
        manager.save(3, state, async_save=True)
    else:
        omnickpt.save(sys.argv[1], state, async_save=True)
    torch.save(model.state_dict(), sys.argv[1] + ".expected")
    print("script done", flush=True)
""")


@pytest.mark.parametrize("how", ["save", "manager"])
def test_an_async_save_in_flight_at_exit_is_committed(tmp_path, how):
    script = tmp_path / "s.py"
    script.write_text(_EXIT_SCRIPT)
    path = tmp_path / "ckpt"
    for trial in range(3):   # the loss depended on timing: try a few times
        target = path / str(trial)
        os.makedirs(target.parent, exist_ok=True)
        proc = subprocess.run([sys.executable, str(script), str(target), how], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        ckpt = target / "global_step_3" if how == "manager" else target
        model = nn.Linear(1500, 1500)
        omnickpt.load(str(ckpt), {"model": model})
        expected = torch.load(str(target) + ".expected")
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_an_async_save_that_cannot_commit_at_exit_fails_the_process_loudly(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(_EXIT_SCRIPT)
    target = tmp_path / "blocked"
    target.mkdir()
    (target / "data").write_text("a file where the data directory must go")
    proc = subprocess.run([sys.executable, str(script), str(target), "save"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "in flight at exit could not be committed" in proc.stderr and str(target) in proc.stderr
    # The failure is also logged when it happens, not only at exit.
    assert "async save to" in proc.stderr and "failed" in proc.stderr


# ------------------------------------------------------------------ careless calls
def test_unknown_keywords_are_a_type_error_and_bytecheckpoint_ones_work(tmp_path):
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="fast_savng"):
        omnickpt.save(str(tmp_path / "a"), {"model": model}, fast_savng=True)
    with pytest.raises(TypeError, match="stric"):
        omnickpt.load(str(tmp_path / "a"), {"model": model}, stric=False)
    assert not (tmp_path / "a").exists()
    called = []
    omnickpt.save(str(tmp_path / "b"), {"model": model}, framework="plain", fast_saving=True, global_steps=4,
                  callback=lambda: called.append(1), role="actor").wait()
    assert called == [1]
    assert (tmp_path / "b" / "latest").read_text().strip() == "4"
    assert _manifest(tmp_path / "b" / "global_step_4")["layout"]["role"] == "actor"
    omnickpt.load(str(tmp_path / "b" / "global_step_4"), {"model": model}, framework="plain", fast_loading=True,
                  role="actor")
    for bad in (-1, 2.7, True, "3"):
        with pytest.raises((TypeError, ValueError)):
            omnickpt.save(str(tmp_path / "c"), {"model": model}, global_steps=bad)


def test_a_missing_path_says_no_such_checkpoint_and_a_root_names_its_steps(tmp_path):
    model = nn.Linear(3, 2)
    with pytest.raises(NotCommittedError, match="no such checkpoint"):
        omnickpt.load(str(tmp_path / "nothing"), {"model": model})
    manager = omnickpt.CheckpointManager(str(tmp_path / "run"))
    manager.save(10, {"model": model})
    manager.close()
    with pytest.raises(NotCommittedError, match=r"global_step_10") as e:
        omnickpt.load(str(tmp_path / "run"), {"model": model})
    assert "load_latest" in str(e.value)


def test_zero_element_tensors_round_trip_strictly(tmp_path):
    for name, make, last in (("mixed", lambda: nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 0)), "1"),
                             ("only_empty", lambda: nn.Sequential(nn.Linear(4, 0)), "0")):
        torch.manual_seed(0)
        model = make()
        omnickpt.save(str(tmp_path / name), {"model": model}).wait()
        doc = _manifest(tmp_path / name)
        assert doc["tensors"][f"model/{last}.weight"]["shape"] == [0, 3 if last == "1" else 4]
        assert doc["tensors"][f"model/{last}.bias"] == {"shape": [0], "dtype": "float32", "boxes": []}
        target = make()
        omnickpt.load(str(tmp_path / name), {"model": target})   # strict
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))


def _different_paths(rank, world_size, root):
    out = {}
    for verb in ("save", "load"):
        try:
            if verb == "save":
                omnickpt.save(f"{root}/p{rank}", {"model": nn.Linear(3, 2)})
            else:
                omnickpt.load(f"{root}/shared" if rank == 0 else f"{root}/p1", {"model": nn.Linear(3, 2)})
            out[verb] = None
        except CheckpointError as e:
            out[verb] = str(e)
    return out


def test_load_and_save_check_that_every_rank_got_the_same_path(tmp_path):
    from dist import run_ranks
    omnickpt.save(str(tmp_path / "shared"), {"model": nn.Linear(3, 2)}).wait()
    omnickpt.save(str(tmp_path / "p1"), {"model": nn.Linear(3, 2)}).wait()
    for out in run_ranks(2, _different_paths, str(tmp_path)):
        for verb in ("save", "load"):
            assert out[verb] is not None and "different checkpoint paths" in out[verb], out
            assert "rank 0" in out[verb] and "rank 1" in out[verb]


def _diverged_replicas(rank, world_size, path):
    torch.manual_seed(0 if rank == 0 else 1)   # a forgotten broadcast: rank 1 initialised differently
    model = nn.Linear(5, 3)
    out = {}
    try:
        omnickpt.save(path, {"model": model}, check_replicas=True).wait()
        out["checked"] = None
    except PlanError as e:
        out["checked"] = str(e)
    torch.manual_seed(0)
    same = nn.Linear(5, 3)
    omnickpt.save(path, {"model": same}, check_replicas=True).wait()   # equal replicas pass the check
    return out


def test_replicas_that_differ_across_ranks_are_refused_on_request(tmp_path):
    from dist import run_ranks
    path = str(tmp_path / "c")
    for out in run_ranks(2, _diverged_replicas, path):
        msg = out["checked"]
        assert msg is not None and "model/weight" in msg and "[0] vs [1]" in msg, msg
    assert omnickpt.is_committed(path)


# ------------------------------------------------------------------ hostile manifests
def _saved(tmp_path):
    ckpt = str(tmp_path / "c")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    omnickpt.save(ckpt, {"model": model}).wait()
    return ckpt, model


@pytest.mark.parametrize("damage", ["version_negative", "huge_float", "nan", "deep", "bool_int", "float_offset",
                                    "crc_count", "crc_range"])
def test_hostile_manifest_values_are_refused_with_a_clear_error(tmp_path, damage):
    ckpt, model = _saved(tmp_path)
    raw = json.dumps(_manifest(ckpt), separators=(",", ":"))
    doc = json.loads(raw)
    box = doc["tensors"]["model/0.weight"]["boxes"][0]
    if damage == "version_negative":
        doc["version"] = -7
    elif damage == "bool_int":
        box[2] = False
    elif damage == "float_offset":
        box[3] = 0.5
    elif damage == "crc_count":
        box[5] = box[5] * 2
    elif damage == "crc_range":
        box[5] = [1 << 40]
    if damage == "huge_float":
        raw = raw.replace('"world_size":1', '"world_size":1e400', 1)
    elif damage == "nan":
        raw = raw.replace('"created":', '"created":NaN,"x":', 1)
    elif damage == "deep":
        raw = raw[:-1] + ',"layout2":' + "[" * 100000 + "]" * 100000 + "}"
    else:
        raw = json.dumps(doc)
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        f.write(raw)
    target = nn.Sequential(nn.Linear(6, 4))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        omnickpt.load(ckpt, {"model": target})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    with pytest.raises(CorruptCheckpointError):
        verify(ckpt)


def test_overlapping_boxes_cannot_hide_a_hole(tmp_path):
    # Two boxes of 2 rows each at rows 0 and 1: 4 rows' worth of elements, so counting says the
    # 4-row tensor is covered, but row 3 is in no box.
    ckpt = str(tmp_path / "c")
    omnickpt.save(ckpt, {"model": nn.Sequential(nn.Linear(6, 4))}).wait()
    doc = _manifest(ckpt)
    box = doc["tensors"]["model/0.weight"]["boxes"][0]
    half = box[4] // 2
    with open(os.path.join(ckpt, doc["files"][0]["path"]), "rb") as f:
        f.seek(box[3])
        data = f.read(box[4])
    first = [[0, 0], [2, 6], box[2], box[3], half, [checksum(data[:half])]]
    second = [[1, 0], [2, 6], box[2], box[3] + half, half, [checksum(data[half:])]]
    doc["tensors"]["model/0.weight"]["boxes"] = [first, second]
    _write_manifest(ckpt, doc)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        omnickpt.load(ckpt, {"model": nn.Sequential(nn.Linear(6, 4))})
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        verify(ckpt)
    # Without the overlap, the hole is named by both.
    second[0] = [2, 0]
    first[1] = [1, 6]
    first[4] = half // 2
    first[5] = [checksum(data[:half // 2])]
    _write_manifest(ckpt, doc)
    with pytest.raises(omnickpt.MismatchError, match="only"):
        omnickpt.load(ckpt, {"model": nn.Sequential(nn.Linear(6, 4))})
    report = verify(ckpt)
    assert not report.ok and any("hold" in str(p) and "model/0.weight" in str(p) for p in report.problems)


def test_a_checksum_chunk_count_follows_the_box_size(tmp_path):
    ckpt = str(tmp_path / "c")
    omnickpt.save(ckpt, {"model": _big(0), "small": torch.arange(3.0)}).wait()
    doc = _manifest(ckpt)
    for t in doc["tensors"].values():
        for b in t["boxes"]:
            assert len(b[5]) == math.ceil(b[4] / CHUNK_BYTES)
    assert verify(ckpt).ok


# ------------------------------------------------------------------ two jobs, one path
_HOLD = textwrap.dedent("""
    import sys, time
    from omnickpt.lease import acquire
    lease = acquire(sys.argv[1], "other-job", what="checkpoint")
    print("held", flush=True)
    time.sleep(120)
""")


def test_a_second_live_job_cannot_write_a_path_and_a_dead_ones_lease_is_taken_over(tmp_path):
    path = str(tmp_path / "shared")
    model = nn.Linear(8, 4)
    omnickpt.save(path, {"model": model}).wait()
    other = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        for async_save in (False, True):
            with pytest.raises(omnickpt.CheckpointLockedError) as e:
                omnickpt.save(path, {"model": nn.Linear(8, 4)}, async_save=async_save).wait()
            assert "other-job" in str(e.value) and str(other.pid) in str(e.value)
        target = nn.Linear(8, 4)
        omnickpt.load(path, {"model": target})            # the previous checkpoint, exactly
        assert torch.equal(target.weight, model.weight)
        assert not [f for f in os.listdir(os.path.join(path, "data"))
                    if f not in {p["path"].split("/")[-1] for p in _manifest(path)["files"]}]
    finally:
        other.kill()
        other.wait()
    newer = nn.Linear(8, 4)
    with pytest.warns(RuntimeWarning, match="stale"):
        omnickpt.save(path, {"model": newer}).wait()     # the dead job's lease is taken over, and said so
    target = nn.Linear(8, 4)
    omnickpt.load(path, {"model": target})
    assert torch.equal(target.weight, newer.weight)
    assert not os.path.exists(os.path.join(path, ".omnickpt", "owner.json"))   # released after the commit


@pytest.mark.parametrize("how", ["declared_bytes", "hole"])
def test_a_huge_declared_optimizer_state_is_refused_before_memory_is_filled(tmp_path, how):
    import resource
    ckpt = str(tmp_path / "c")
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    omnickpt.save(ckpt, {"model": model, "optim": opt}).wait()
    doc = _manifest(ckpt)
    name = next(n for n in doc["tensors"] if n.endswith("/step"))
    n = 1 << 31                                    # 8 GiB of float32
    box = doc["tensors"][name]["boxes"][0]
    if how == "declared_bytes":                    # a consistent-looking lie: file sizes declared to match
        doc["files"][box[2]]["bytes"] = box[3] + 4 * n
        doc["tensors"][name] = {"shape": [n], "dtype": "float32",
                                "boxes": [[[0], [n], box[2], box[3], 4 * n, [0] * math.ceil(4 * n / CHUNK_BYTES)]]}
    else:                                          # a huge shape that its one stored element cannot cover
        doc["tensors"][name] = {"shape": [n], "dtype": "float32", "boxes": [[[0], [1], box[2], box[3], 4, box[5]]]}
    _write_manifest(ckpt, doc)
    target_model = nn.Linear(4, 3)
    target = torch.optim.Adam(target_model.parameters())
    before = {k: v.clone() for k, v in target_model.state_dict().items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Refused before anything is allocated: a state larger than its parameter does not fit it, and
    # one shaped like no parameter must be stored whole before it is allocated (and then unfilled).
    with pytest.raises((CorruptCheckpointError, omnickpt.MismatchError), match=r"truncated|hold 1 of|does not fit"):
        omnickpt.load(ckpt, {"model": target_model, "optim": target})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024   # KiB: nothing was filled
    assert all(torch.equal(v, before[k]) for k, v in target_model.state_dict().items())
    assert not target.state


def test_overlapping_shard_specs_are_refused_at_save(tmp_path):
    a = omnickpt.ShardSpec(torch.zeros(3, 4), offsets=(0, 0), global_shape=(5, 4), name="w")
    b = omnickpt.ShardSpec(torch.ones(3, 4), offsets=(2, 0), global_shape=(5, 4), name="w")
    with pytest.raises(PlanError, match=r"'w'.*overlap"):
        omnickpt.save(str(tmp_path / "c"), {"a": a, "b": b}).wait()
    assert not omnickpt.is_committed(str(tmp_path / "c"))
    # Equal boxes are replicas, adjacent ones tile: both save.
    c = omnickpt.ShardSpec(torch.ones(2, 4), offsets=(3, 0), global_shape=(5, 4), name="w")
    omnickpt.save(str(tmp_path / "d"), {"a": a, "c": c}).wait()


def test_overlap_detection_scales_to_many_row_blocks():
    from omnickpt.format import overlap_problem
    from omnickpt.layout import Box
    rows = [Box((i * 3, 0), (3, 8)) for i in range(5000)]
    assert overlap_problem((15000, 8), rows) is None
    rows[2500] = Box((2500 * 3 + 1, 0), (3, 8))
    assert "overlap" in overlap_problem((15000, 8), rows)
    cols = [Box((0, i), (4, 1)) for i in range(100)] + [Box((0, 50), (1, 2))]   # two dims vary: generic path
    assert "overlap" in overlap_problem((4, 100), cols)
