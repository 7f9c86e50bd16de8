"""Bad input: every way a checkpoint or a target state can be wrong fails loudly and safely.

Real saves on real files; the damage is done to the bytes on disk, the way crashes, disks and
hostile manifests do it.
"""
from __future__ import annotations

import json

from omnickpt.format import manifest_document
from fractions import Fraction
import os
import resource
import shutil
import signal
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt import (CheckpointError, CheckpointManager, CorruptCheckpointError, MismatchError, NotCommittedError,
                      UnsafeCheckpointError, UnsupportedError)
from omnickpt.cli import main as cli
from models import flip_byte


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(module: nn.Module, values: dict[str, torch.Tensor]) -> bool:
    now = module.state_dict()
    return now.keys() == values.keys() and all(torch.equal(now[k], v) for k, v in values.items())


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return manifest_document(f.read())


def _box_location(path, tensor: str) -> tuple[str, int, int]:
    """(data file, byte offset, byte length) of the first saved box of `tensor`."""
    doc = _manifest(path)
    _, _, fi, off, nbytes, _ = doc["tensors"][tensor]["boxes"][0]
    return os.path.join(path, doc["files"][fi]["path"]), off, nbytes



def _save_one(path, seed: int = 1) -> dict[str, torch.Tensor]:
    m = _model(seed)
    omnickpt.save(str(path), {"model": m, "extra": {"step": seed}})
    return _values(m)


def _verify_cli(path, capsys) -> tuple[int, list[str]]:
    rc = cli(["verify", str(path)])
    out = capsys.readouterr()
    return rc, [line for line in (out.out + out.err).splitlines() if line]


# ---------------------------------------------------------------------------------- not committed
def test_a_directory_without_a_manifest_is_not_a_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    os.remove(ckpt / "manifest.json")          # as if the save died just before its commit
    target = _model(7)
    before = _values(target)
    with pytest.raises(NotCommittedError, match="not a committed checkpoint") as info:
        omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    assert str(ckpt) in str(info.value) and "interrupted" in str(info.value)
    assert _same(target, before)
    assert not omnickpt.is_committed(str(ckpt))

    # data files only, never a manifest (a save killed while writing)
    partial = tmp_path / "partial"
    (partial / "data").mkdir(parents=True)
    (partial / "data" / "0123456789abcdef-r00000.bin").write_bytes(b"\0" * 100)
    with pytest.raises(NotCommittedError, match="not a committed checkpoint"):
        omnickpt.load(str(partial), {"model": target})
    with pytest.raises(NotCommittedError, match="no such checkpoint"):
        omnickpt.load(str(tmp_path / "nowhere"), {"model": target})

    for path in (ckpt, partial, tmp_path / "nowhere"):
        rc, lines = _verify_cli(path, capsys)
        expected = "no such checkpoint" if path == tmp_path / "nowhere" else "not a committed checkpoint"
        assert rc == 1 and any(expected in line for line in lines), lines


def test_manager_never_reports_an_uncommitted_step(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    m1, m2 = _model(1), _model(2)
    mgr.save(1, {"model": m1})
    mgr.save(2, {"model": m2})
    assert mgr.latest_step() == 2
    os.remove(tmp_path / "global_step_2" / "manifest.json")    # step 2's save never committed
    assert mgr.latest_step() == 1 and mgr.steps() == [1]
    target = _model(9)
    mgr.load_latest({"model": target})
    assert _same(target, _values(m1))
    # A fresh manager (after a restart) sees the same.
    assert CheckpointManager(str(tmp_path)).latest_step() == 1


# ----------------------------------------------------------------------------------------- corrupt
def test_a_flipped_byte_names_the_file_and_the_tensor(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    file, off, nbytes = _box_location(ckpt, "model/2.weight")
    flip_byte(file, off + nbytes // 2)
    target = _model(7)
    with pytest.raises(CorruptCheckpointError) as info:
        omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    msg = str(info.value)
    assert file in msg and "'model/2.weight'" in msg and "checksum mismatch" in msg

    rc, lines = _verify_cli(ckpt, capsys)
    assert rc == 1
    problems = [line for line in lines if line.startswith(file)]
    assert len(problems) == 1, lines       # exactly the damaged box, nothing else
    assert "'model/2.weight'" in problems[0] and "checksum mismatch" in problems[0]


def test_a_flipped_byte_in_an_object_names_the_file_and_the_object(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    doc = _manifest(ckpt)
    entry = doc["objects"]["extra"][0]
    file = os.path.join(ckpt, doc["files"][entry["file"]]["path"])
    flip_byte(file, entry["offset"])
    with pytest.raises(CorruptCheckpointError) as info:
        omnickpt.load(str(ckpt), {"model": _model(7), "extra": {}})
    assert file in str(info.value) and "'extra'" in str(info.value)
    rc, lines = _verify_cli(ckpt, capsys)
    assert rc == 1 and any(line.startswith(file) and "'extra'" in line for line in lines), lines


def _truncate_inside(ckpt, tensor: str) -> str:
    file, off, nbytes = _box_location(ckpt, tensor)
    os.truncate(file, off + nbytes // 2)
    return file


def test_a_truncated_data_file_is_corrupt_and_named(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    file = _truncate_inside(ckpt, "model/2.bias")      # the last box of the file
    with pytest.raises(CorruptCheckpointError) as info:
        omnickpt.load(str(ckpt), {"model": _model(7), "extra": {}})
    assert file in str(info.value) and "truncated" in str(info.value)
    rc, lines = _verify_cli(ckpt, capsys)
    assert rc == 1
    assert any(line.startswith(file) and "'model/2.bias'" in line and "truncated" in line for line in lines), lines
    # boxes before the cut are intact, and verify does not blame them
    assert not any("'model/0.weight'" in line for line in lines), lines


def test_a_truncated_data_file_error_names_the_tensor(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    _truncate_inside(ckpt, "model/2.bias")
    with pytest.raises(CorruptCheckpointError, match="model/2.bias"):
        omnickpt.load(str(ckpt), {"model": _model(7), "extra": {}})


def test_a_missing_data_file_is_corrupt_and_named(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    file, _, _ = _box_location(ckpt, "model/0.weight")
    os.remove(file)
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        omnickpt.load(str(ckpt), {"model": _model(7), "extra": {}})
    assert file in str(info.value)
    rc, lines = _verify_cli(ckpt, capsys)
    assert rc == 1 and any(line.startswith(file) and "missing" in line for line in lines), lines


# ---------------------------------------------------------------------------------------- mismatch
def _saved_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.ModuleDict({"same": nn.Linear(4, 6), "wide": nn.Linear(6, 3), "prec": nn.Linear(3, 2),
                          "gone": nn.Linear(2, 2)})


def _target_net() -> nn.Module:
    torch.manual_seed(2)
    return nn.ModuleDict({"same": nn.Linear(4, 6), "wide": nn.Linear(6, 5), "prec": nn.Linear(3, 2).double(),
                          "new": nn.Linear(2, 2)})


EXPECTED_DIFFERENCES = {
    "model/wide.weight": "shape [3, 6] in the checkpoint, [5, 6] in the target",
    "model/wide.bias": "shape [3] in the checkpoint, [5] in the target",
    "model/prec.weight": "dtype float32 in the checkpoint, float64 in the target",
    "model/prec.bias": "dtype float32 in the checkpoint, float64 in the target",
    "model/gone.weight": "in the checkpoint but not in the target",
    "model/gone.bias": "in the checkpoint but not in the target",
    "model/new.weight": "missing from the checkpoint",
    "model/new.bias": "missing from the checkpoint",
    "counters": "missing from the checkpoint",
}


def _check_differences(differences: list[str]):
    assert len(differences) == len(EXPECTED_DIFFERENCES), differences
    for name, what in EXPECTED_DIFFERENCES.items():
        assert any(d.startswith(f"{name}:") and what in d for d in differences), (name, differences)


def test_every_difference_is_listed_in_one_mismatch_error(tmp_path):
    saved = _saved_net()
    omnickpt.save(str(tmp_path / "ckpt"), {"model": saved})
    target = _target_net()
    before = _values(target)
    with pytest.raises(MismatchError) as info:
        omnickpt.load(str(tmp_path / "ckpt"), {"model": target, "counters": {"n": 1}})
    _check_differences(info.value.differences)
    for name in EXPECTED_DIFFERENCES:
        assert name in str(info.value)                       # the message itself lists them all
    assert "strict=False" in str(info.value)                 # and says what to do
    assert _same(target, before)                             # a strict failure loads nothing


def test_non_strict_load_loads_what_matches_and_returns_the_rest(tmp_path):
    saved = _saved_net()
    omnickpt.save(str(tmp_path / "ckpt"), {"model": saved})
    target = _target_net()
    before = _values(target)
    state = {"model": target, "counters": {"n": 1}}
    result = omnickpt.load(str(tmp_path / "ckpt"), state, strict=False)
    _check_differences(result.differences)
    after = target.state_dict()
    for k in ("same.weight", "same.bias"):
        assert torch.equal(after[k], saved.state_dict()[k]), k        # loaded
        assert not torch.equal(after[k], before[k]), k                # (and that is a change)
    for k in ("wide.weight", "wide.bias", "prec.weight", "prec.bias", "new.weight", "new.bias"):
        assert torch.equal(after[k], before[k]), k                    # untouched
    assert state["counters"] == {"n": 1}


# ----------------------------------------------------------------------------------- unsafe paths
@pytest.mark.parametrize("escape", ["../outside.bin", "ABSOLUTE", "data/../../outside.bin"])
def test_a_manifest_path_escaping_the_checkpoint_is_refused(tmp_path, capsys, escape):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt)
    doc = _manifest(ckpt)
    # The escaping path leads to a valid copy of the data: following it would load "successfully",
    # so only the refusal makes this test pass.
    outside = tmp_path / "outside.bin"
    shutil.copy(os.path.join(ckpt, doc["files"][0]["path"]), outside)
    doc["files"][0]["path"] = str(outside) if escape == "ABSOLUTE" else escape
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    target = _model(7)
    before = _values(target)
    with pytest.raises(UnsafeCheckpointError, match="escapes the checkpoint directory") as info:
        omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    assert "manifest.json" in str(info.value)
    assert _same(target, before)
    for command in ("verify", "inspect"):
        assert cli([command, str(ckpt)]) == 1
        assert "escapes the checkpoint directory" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- overwrite
def _data_files(ckpt) -> set[str]:
    return set(os.listdir(ckpt / "data"))


def test_a_save_that_cannot_encode_leaves_the_previous_checkpoint_untouched(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _save_one(ckpt, seed=1)
    manifest_before = (ckpt / "manifest.json").read_bytes()
    files_before = _data_files(ckpt)
    with pytest.raises(UnsupportedError, match=r"extra.*allow_pickle"):
        omnickpt.save(str(ckpt), {"model": _model(2), "extra": {"when": object()}})
    assert (ckpt / "manifest.json").read_bytes() == manifest_before
    assert _data_files(ckpt) == files_before                  # nothing written at all
    target = _model(7)
    omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    assert _same(target, first)


@contextmanager
def _file_size_limit(nbytes: int):
    """Writes past `nbytes` fail with EFBIG in this process: a full disk, for real, even as root
    (where a read-only directory would not stop the write)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, capsys, async_save):
    ckpt = tmp_path / "ckpt"
    first = _save_one(ckpt, seed=1)
    manifest_before = (ckpt / "manifest.json").read_bytes()
    with _file_size_limit(4096):           # the data file is ~10 KiB
        with pytest.raises(CheckpointError, match="File too large"):
            handle = omnickpt.save(str(ckpt), {"model": _model(2), "extra": {"step": 2}}, async_save=async_save)
            handle.wait()
    assert (ckpt / "manifest.json").read_bytes() == manifest_before
    target = _model(7)
    omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    assert _same(target, first)
    rc, lines = _verify_cli(ckpt, capsys)      # the failed save's leftovers do not disturb it
    assert rc == 0, lines


def test_a_successful_overwrite_replaces_the_data_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_one(ckpt, seed=1)
    old_files = _data_files(ckpt)
    with _file_size_limit(4096):               # a failed save removes its partial file
        with pytest.raises(CheckpointError):
            omnickpt.save(str(ckpt), {"model": _model(3), "extra": {}})
    assert _data_files(ckpt) == old_files
    second = _save_one(ckpt, seed=2)
    doc = _manifest(ckpt)
    assert _data_files(ckpt) == {f["path"].split("/")[-1] for f in doc["files"]}
    assert not (_data_files(ckpt) & old_files)
    control = {os.path.relpath(os.path.join(d, f), ckpt / ".omnickpt").split(os.sep)[0]
               for d, _, files in os.walk(ckpt / ".omnickpt") for f in files}
    assert control == {doc["save_id"]}                          # old control records gone too
    target = _model(7)
    omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    assert _same(target, second)


# ------------------------------------------------------------------------------------------ pickle
def _touch(path: str) -> str:
    with open(path, "w") as f:
        f.write("code from the checkpoint ran")
    return "unpickled"


class Trap:
    """Unpickling this calls _touch(marker): the file appears iff checkpoint code executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_pickle_needs_opt_in_to_save_and_to_load_and_nothing_runs_without_it(tmp_path, capsys):
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    with pytest.raises(UnsupportedError, match=r"trap.*Trap.*allow_pickle=True"):
        omnickpt.save(str(ckpt), {"trap": Trap(str(marker))})
    assert not omnickpt.is_committed(str(ckpt))

    omnickpt.save(str(ckpt), {"trap": Trap(str(marker)), "model": _model(1)}, allow_pickle=True)
    assert not marker.exists()

    target = _model(7)
    state = {"trap": None, "model": target}
    with pytest.raises(UnsafeCheckpointError, match=r"trap.*pickle.*allow_pickle=True"):
        omnickpt.load(str(ckpt), state)
    assert not marker.exists()
    assert state["trap"] is None
    # Tools read it without running it either.
    assert cli(["verify", str(ckpt)]) == 0 and cli(["inspect", str(ckpt)]) == 0
    capsys.readouterr()
    assert not marker.exists()

    # The trap is real: with the opt-in, unpickling runs it.
    omnickpt.load(str(ckpt), state, allow_pickle=True)
    assert marker.exists() and state["trap"] == "unpickled"


# -------------------------------------------------------------------------------------- two ranks
def _two_rank_bad_inputs(rank: int, world: int, root: str) -> dict:
    """Run on 2 gloo ranks: each bad input in turn, on a replicated (DDP-style) model that both
    ranks write half of."""
    import torch.distributed as dist
    ckpt = os.path.join(root, "ckpt")
    out: dict = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:        # recorded for the parent to check, per rank
            out[key] = (type(e).__name__, str(e))

    def load_matches(seed) -> bool:
        target = _model(100 + rank)
        omnickpt.load(ckpt, {"model": target, "extra": {}})
        return _same(target, _values(_model(seed)))

    omnickpt.save(ckpt, {"model": _model(1), "extra": {"rank": rank}})
    out["writers"] = sorted(f["rank"] for f in _manifest(ckpt)["files"])

    # rank 1 holds a value that cannot be encoded: nobody writes anything
    extra = {"rank": rank, "bad": object()} if rank == 1 else {"rank": rank}
    attempt("encode", lambda: omnickpt.save(ckpt, {"model": _model(2), "extra": extra}))
    out["after_encode"] = load_matches(1)

    # rank 1's disk is full: rank 0 writes its file, but nothing commits
    def full_disk_save():
        if rank == 1:
            with _file_size_limit(1024):
                omnickpt.save(ckpt, {"model": _model(3), "extra": {"rank": rank}})
        else:
            omnickpt.save(ckpt, {"model": _model(3), "extra": {"rank": rank}})
    attempt("write", full_disk_save)
    out["after_write"] = load_matches(1)

    # a flipped byte in the file rank 1 wrote: both ranks read that box, both fail
    doc = _manifest(ckpt)
    victim = next(name for name, t in doc["tensors"].items() if doc["files"][t["boxes"][0][2]]["rank"] == 1)
    file, off, _ = _box_location(ckpt, victim)
    out["victim"], out["victim_file"] = victim, file
    if rank == 0:
        flip_byte(file, off)
    dist.barrier()
    attempt("corrupt", lambda: load_matches(1))
    dist.barrier()
    if rank == 0:
        flip_byte(file, off)            # repaired
    dist.barrier()

    # rank 1's target differs in shape: both ranks fail before reading
    def mismatched_load():
        target = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 9 if rank == 1 else 8))
        omnickpt.load(ckpt, {"model": target, "extra": {}})
    attempt("mismatch", mismatched_load)

    # a successful overwrite: only its files remain, the failed save's leftovers are gone
    omnickpt.save(ckpt, {"model": _model(4), "extra": {"rank": rank}})
    dist.barrier()
    doc = _manifest(ckpt)
    out["data_after_overwrite"] = sorted(os.listdir(os.path.join(ckpt, "data")))
    out["manifest_files"] = sorted(f["path"].split("/")[-1] for f in doc["files"])
    out["after_overwrite"] = load_matches(4)

    # the manifest disappears (an interrupted save): not a checkpoint on any rank
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(ckpt, "manifest.json"))
    dist.barrier()
    attempt("uncommitted", lambda: load_matches(4))
    return out


def test_bad_inputs_on_two_ranks(tmp_path):
    from dist import run_ranks
    r0, r1 = run_ranks(2, _two_rank_bad_inputs, str(tmp_path))
    assert r0["writers"] == [0, 1]            # both ranks wrote: the failures below hit a real 2-file save
    # encode failure on rank 1: rank 1 says why, rank 0 raises the same class and says who and why
    assert r1["encode"][0] == "UnsupportedError" and "allow_pickle" in r1["encode"][1]
    assert r0["encode"][0] == "UnsupportedError" and "rank 1" in r0["encode"][1] and "allow_pickle" in r0["encode"][1]
    # a write failure on rank 1 fails the save on both ranks, naming rank 1
    for r in (r0, r1):
        assert r["write"] is not None and "rank 1" in r["write"][1] and "File too large" in r["write"][1], r["write"]
        assert r["after_encode"] and r["after_write"]
    for r in (r0, r1):
        assert r["corrupt"][0] == "CorruptCheckpointError", r["corrupt"]
        assert r["victim_file"] in r["corrupt"][1] and repr(r["victim"]) in r["corrupt"][1]
    assert r1["mismatch"][0] == "MismatchError" and "model/2.weight" in r1["mismatch"][1]
    assert r0["mismatch"] is not None and "rank 1" in r0["mismatch"][1] and r0["mismatch"][0] == "MismatchError"
    for r in (r0, r1):
        assert r["data_after_overwrite"] == r["manifest_files"] and len(r["manifest_files"]) == 2
        assert r["after_overwrite"]
        assert r["uncommitted"][0] == "NotCommittedError" and "not a committed checkpoint" in r["uncommitted"][1]


def test_a_pickled_object_refused_on_load_leaves_the_model_untouched(tmp_path):
    # Objects are decoded before any tensor is read, so a refused load changes nothing.
    ckpt = tmp_path / "ckpt"
    model = _model(1)
    omnickpt.save(str(ckpt), {"model": model, "extra": {"f": Fraction(1, 3)}}, allow_pickle=True).wait()
    target = _model(7)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(omnickpt.UnsafeCheckpointError):
        omnickpt.load(str(ckpt), {"model": target, "extra": {}})
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
