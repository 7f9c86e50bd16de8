"""References between checkpoint folders (omnickpt/steps.py): no save, garbage collection or
retention pass removes a data file that a committed checkpoint next to it, or a save in flight,
references; an incremental save checks its base's files before referencing them; a base, and a
reference read from a manifest, may only name the data files of a checkpoint folder next to it.

Cost: one 2-rank launch; the S3 test starts a moto server (about 2 s) when moto is installed."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import shutil
import threading
import uuid

import pytest
import torch
from torch import nn

import omnickpt
import omnickpt.api
import omnickpt.saving
from omnickpt.cli.verify import verify
from omnickpt.errors import CheckpointError, NotCommittedError, UnsafeCheckpointError
from omnickpt.format import FileEntry, Manifest
from omnickpt.lease import acquire
from omnickpt.steps import committed_steps, retire, step_dir
from omnickpt.storage import LocalStorage, storage_for

ROWS, DIM = 4096, 64     # a 1 MiB fp32 table: 16 blocks of 64 KiB


def _model(seed: int = 0) -> nn.Embedding:
    torch.manual_seed(seed)
    return nn.Embedding(ROWS, DIM)


def _touch(model: nn.Embedding, rows, by: float = 1.0) -> None:
    with torch.no_grad():
        model.weight[torch.as_tensor(rows)] += by


def _values(path: str) -> torch.Tensor:
    back = _model(seed=99)
    omnickpt.load(path, {"model": back})
    return back.weight.detach().clone()


def _manifest(path: str) -> Manifest:
    return Manifest.decode(storage_for(path).read_bytes("manifest.json"))


def _refs(path: str) -> list[str]:
    return [f.path for f in _manifest(path).files if f.path.startswith("../")]


def _pair(parent: str, rows=(5,)) -> tuple[nn.Embedding, torch.Tensor, str, str]:
    """a/ (full, incremental), then b/ (incremental against a/, `rows` changed): (model, b's values, a, b)."""
    model = _model()
    a, b = f"{parent}/a", f"{parent}/b"
    omnickpt.save(a, {"model": model}, incremental=True)
    _touch(model, list(rows))
    omnickpt.save(b, {"model": model}, incremental=True, base=a)
    assert _refs(b), "b references a"
    return model, model.weight.detach().clone(), a, b


class _Held:
    """Holds the persist of the async saves to one folder until released (a save in flight)."""

    def __init__(self, monkeypatch, folder: str):
        self.entered, self.go = threading.Event(), threading.Event()
        real = omnickpt.saving.persist

        def persist(storage, *args, **kwargs):
            if storage.describe().rstrip("/").endswith(folder):
                self.entered.set()
                assert self.go.wait(60)
            return real(storage, *args, **kwargs)
        monkeypatch.setattr(omnickpt.saving, "persist", persist)


# ---------------------------------------------------------------------- garbage collection
def test_a_save_into_a_base_keeps_what_a_newer_checkpoint_references_and_later_removes_it(tmp_path):
    model, at_b, a, b = _pair(str(tmp_path))
    first = set(os.listdir(f"{a}/data"))
    _touch(model, list(range(ROWS)), 7.0)
    omnickpt.save(a, {"model": model})                      # over the base: its old file is b's data
    assert torch.equal(_values(b), at_b)
    assert verify(b).ok
    assert first < set(os.listdir(f"{a}/data"))
    shutil.rmtree(b)                                        # nothing references it any more: collected
    omnickpt.save(a, {"model": model})
    assert not first & set(os.listdir(f"{a}/data"))
    assert torch.equal(_values(a), model.weight)


def test_a_save_whose_base_references_its_own_folder_keeps_those_files(tmp_path):
    """b, then a against b (all of it b's), then b again against a: what a took from b is b's own."""
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(b, {"model": model}, incremental=True)
    omnickpt.save(a, {"model": model}, incremental=True, base=b)
    _touch(model, [3000])
    omnickpt.save(b, {"model": model}, incremental=True, base=a)
    assert not _refs(b)
    shutil.rmtree(a)
    assert torch.equal(_values(b), model.weight)
    assert verify(b).ok


def test_garbage_collection_keeps_every_file_while_a_save_in_flight_references_the_folder(tmp_path, monkeypatch):
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(a, {"model": model}, incremental=True)
    _touch(model, [9])
    at_b = model.weight.detach().clone()
    held = _Held(monkeypatch, "/b")
    with omnickpt.Checkpointer() as other:
        handle = other.save(b, {"model": model}, incremental=True, base=a, async_save=True)
        assert held.entered.wait(60)
        _touch(model, list(range(ROWS)), 3.0)
        omnickpt.save(a, {"model": model})                  # b has read a's manifest: nothing of a may go
        held.go.set()
        assert handle.wait()["incremental"]["referenced_bytes"] > 0
    assert torch.equal(_values(b), at_b)
    assert not glob.glob(f"{a}/.omnickpt/refs/*")           # the record went with the save


def test_a_save_that_fails_before_it_runs_gives_its_reference_records_back_at_once(tmp_path, monkeypatch):
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(a, {"model": model}, incremental=True)

    def broken(*args, **kwargs):
        raise omnickpt.StorageError("staging memory could not be had")

    monkeypatch.setattr(omnickpt.saving, "_snapshot", broken)   # fails after the base was chosen and its records taken
    with omnickpt.Checkpointer() as ckpt:
        with pytest.raises(omnickpt.StorageError) as failed:
            ckpt.save(b, {"model": model}, incremental=True, base=a)
        # the failure (and its traceback, which holds the job) is still alive: the records must be gone anyway,
        # or retention would keep a's files while this process lives (their heartbeat keeps them live)
        assert failed.value is not None and not glob.glob(f"{a}/.omnickpt/refs/*")


# ---------------------------------------------------------------------- managers: retention, rollback, failures
def test_retention_keeps_the_base_and_the_folder_of_another_managers_save_in_flight(tmp_path, monkeypatch):
    root = str(tmp_path)
    model = _model()
    held = _Held(monkeypatch, step_dir(2))
    with omnickpt.Checkpointer() as ca, omnickpt.Checkpointer() as cb:
        first = omnickpt.CheckpointManager(root, incremental=True, checkpointer=ca)
        first.save(1, {"model": model})
        _touch(model, [100])
        at_2 = model.weight.detach().clone()
        first.save(2, {"model": model}, async_save=True)
        assert held.entered.wait(60)
        second = omnickpt.CheckpointManager(root, keep_last=1, checkpointer=cb)
        second.save(3, {"model": _model(seed=3)})           # retires 1 and 2: one is a base, one in flight
        held.go.set()
        first.wait()
        assert torch.equal(_values(f"{root}/{step_dir(2)}"), at_2)
        second.close()
        first.close()
    assert committed_steps(LocalStorage(root)) == [2, 3]


def _three_steps(root: str, keep_last: int | None) -> torch.Tensor:
    model = _model()
    with omnickpt.CheckpointManager(root, incremental=True, keep_last=keep_last) as mgr:
        for step in (1, 2, 3):
            _touch(model, [step * 1000])
            mgr.save(step, {"model": model})
    return model.weight.detach().clone()


def test_a_rolled_back_manager_resaving_a_step_leaves_the_newer_steps_loadable(tmp_path):
    root = str(tmp_path)
    at_3 = _three_steps(root, keep_last=None)
    with pytest.warns(RuntimeWarning, match="newer than step 2"):
        # a deliberate rollback without a load first: overwrite=True says so (else refused, issue 19)
        with omnickpt.CheckpointManager(root, incremental=True, overwrite=True) as mgr:
            mgr.save(2, {"model": _model(seed=5)})          # step 3 took its unchanged blocks from step 2
            assert mgr.latest_step() == 3
            back = _model(seed=9)
            mgr.load_latest({"model": back})
    assert torch.equal(back.weight, at_3)
    assert verify(f"{root}/{step_dir(3)}").ok


def test_a_failed_save_into_a_stripped_step_keeps_the_files_a_kept_step_references(tmp_path):
    root = str(tmp_path)
    at_3 = _three_steps(root, keep_last=1)                   # 1 and 2: stripped to what 3 references
    assert committed_steps(LocalStorage(root)) == [3] and glob.glob(f"{root}/{step_dir(2)}/data/*")
    with pytest.warns(RuntimeWarning, match="newer than step 2"):
        with omnickpt.CheckpointManager(root, overwrite=True) as mgr:
            with pytest.raises(CheckpointError):
                mgr.save(2, {"model": _model(), "bad": threading.Lock()})   # refused: its folder is discarded
            assert mgr.latest_step() == 3
            back = _model(seed=9)
            mgr.load_latest({"model": back})
    assert torch.equal(back.weight, at_3)


# ---------------------------------------------------------------------- the rule on storage
def _step(root, step: int, files: dict[str, bytes] | None = None, refs: tuple[tuple[str, str], ...] = (),
          name: str | None = None) -> None:
    """A committed folder made by a real save (its manifest's header is what retention reads): a
    tiny model, plus extra `files`, and file records naming sibling files `refs` ((folder, path))."""
    path = str(root / (name or step_dir(step)))
    omnickpt.save(path, {"model": nn.Linear(2, 2)})
    for rel, data in (files or {}).items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    if refs:
        m = _manifest(path)
        m.files = m.files + [FileEntry(f"../{folder}/{p}", 0, 1) for folder, p in refs]
        storage_for(path).commit("manifest.json", m.encode())


def _files(root, name: str) -> list[str]:
    d = root / name
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_retention_counts_references_from_folders_that_are_not_steps(tmp_path):
    st = LocalStorage(str(tmp_path))
    _step(tmp_path, 1, {"data/kept.bin": b"k"})
    _step(tmp_path, 2)
    _step(tmp_path, 0, refs=(("global_step_1", "data/kept.bin"),), name="best")   # the user's own folder
    assert retire(st, 1, 2) == [1]
    assert _files(tmp_path, step_dir(1)) == ["data/kept.bin"]


def test_a_reference_record_keeps_a_retired_folder_until_it_is_released_or_stale(tmp_path):
    from omnickpt.steps import References
    st = LocalStorage(str(tmp_path))
    for s in (1, 2, 3):
        _step(tmp_path, s)
    held = References("a-job", "a test")
    held.hold(LocalStorage(str(tmp_path / step_dir(1))))
    assert retire(st, 1, 3) == [1, 2]
    assert not (tmp_path / step_dir(2)).exists()
    assert committed_steps(st) == [3]                       # 1 is no checkpoint any more...
    assert glob.glob(str(tmp_path / step_dir(1) / "data" / "*"))   # ...but holds all its data
    held.release()
    assert retire(st, 1, 3) == [1]
    assert not (tmp_path / step_dir(1)).exists()
    # a record no job renewed within its ttl (its save died elsewhere) protects nothing, and is removed
    _step(tmp_path, 4)
    _step(tmp_path, 5)
    refs = tmp_path / step_dir(4) / ".omnickpt" / "refs"
    refs.mkdir(parents=True)
    (refs / "dead.json").write_text(json.dumps({"holder": "a-dead-job", "host": "elsewhere", "pid": 1,
                                                "renewed": 0.0, "ttl": 30.0}))
    assert retire(st, 1, 5) == [3, 4]
    assert sorted(os.listdir(tmp_path)) == [step_dir(5)]


def test_retention_leaves_a_folder_that_a_save_is_writing(tmp_path):
    st = LocalStorage(str(tmp_path))
    for s in (1, 2):
        _step(tmp_path, s)
    (tmp_path / step_dir(0)).mkdir()                        # a save to step 0 under way, elsewhere
    lease = acquire(LocalStorage(str(tmp_path / step_dir(0))), "another-job")
    try:
        assert retire(st, 1, 2) == [1]
        assert (tmp_path / step_dir(0) / ".omnickpt" / "owner.json").exists()
    finally:
        lease.release()
    assert retire(st, 1, 2) == [0]


# ---------------------------------------------------------------------- the base's files
@pytest.mark.parametrize("damage", ["missing", "short"])
def test_an_incremental_save_writes_the_blocks_of_a_lost_base_file_itself(tmp_path, caplog, damage):
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(a, {"model": model}, incremental=True)
    lost = glob.glob(f"{a}/data/*.bin")[0]
    if damage == "missing":
        os.remove(lost)
    else:
        os.truncate(lost, os.path.getsize(lost) // 2)
    _touch(model, [7])
    with caplog.at_level(logging.WARNING, logger="omnickpt"):
        rep = omnickpt.save(b, {"model": model}, incremental=True, base=a).wait()
    assert os.path.basename(lost) in caplog.text and "written by this save" in caplog.text
    assert rep["incremental"]["referenced_bytes"] == 0 and rep["incremental"]["written_bytes"] >= ROWS * DIM * 4
    assert not _refs(b)
    assert torch.equal(_values(b), model.weight)
    assert verify(b).ok


def _two_rank_lost_base(rank, world, a, b):
    """Each rank saves its half of the table's rows (ShardSpec); rank 1's base file is lost."""
    import torch.distributed as dist
    torch.manual_seed(0)
    full = torch.randn(ROWS, DIM)
    rows = ROWS // world

    def state():
        return {"model": {"weight": omnickpt.ShardSpec(full[rank * rows:(rank + 1) * rows].clone(), (rank * rows, 0),
                                                       (ROWS, DIM), name="model/weight")}}
    omnickpt.save(a, state(), incremental=True)
    if rank == 0:
        os.remove(glob.glob(os.path.join(a, "data", "*-r00001.bin"))[0])
    dist.barrier()
    full[[10, ROWS - 3]] += 2.0            # a row in each rank's half
    rep = omnickpt.save(b, state(), incremental=True, base=a).wait()
    return full, rep


def test_two_ranks_reference_what_is_left_of_a_base_and_write_the_rest(tmp_path):
    from dist import run_ranks
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (full, rep), _ = run_ranks(2, _two_rank_lost_base, a, b)
    half = ROWS * DIM * 4 // 2
    assert half - (64 << 10) <= rep["incremental"]["referenced_bytes"] < half   # rank 0's half, less its change
    assert all("-r00001" not in p for p in _refs(b))
    with omnickpt.CheckpointReader(b) as r:
        assert torch.equal(r.get("model/weight"), full)
    assert verify(b).ok


# ---------------------------------------------------------------------- what a base and a reference may name
def test_a_hidden_or_uncommitted_folder_is_refused_as_a_base(tmp_path):
    model, _, a, b = _pair(str(tmp_path))
    hidden = str(tmp_path / ".ssh")
    shutil.copytree(a, hidden)                               # even a real checkpoint, once hidden
    before = _files(tmp_path, ".ssh")
    with pytest.raises(UnsafeCheckpointError, match=r"\.ssh"):
        omnickpt.save(str(tmp_path / "c"), {"model": model}, incremental=True, base=hidden)
    assert _files(tmp_path, ".ssh") == before and not (tmp_path / "c").exists()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(NotCommittedError, match="plain"):
        omnickpt.save(str(tmp_path / "c"), {"model": model}, incremental=True, base=str(tmp_path / "plain"))
    assert _files(tmp_path, "plain") == ["notes.txt"]
    # the last checkpoint saved, when hidden, is no implicit base either: a full save
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(str(tmp_path / ".hidden"), {"model": model}, incremental=True)
        rep = ckpt.save(str(tmp_path / "d"), {"model": model}, incremental=True).wait()
    assert rep["incremental"]["base"] is None and not _refs(str(tmp_path / "d"))


@pytest.mark.parametrize("where", ["../.ssh/data/{name}", "../a/manifest.json", "../a/.omnickpt/owner.json",
                                   "../a/data/sub/{name}"])
def test_a_manifest_referencing_anything_but_a_siblings_data_files_is_refused_unopened(tmp_path, monkeypatch, where):
    _, _, a, b = _pair(str(tmp_path))
    name = os.path.basename(glob.glob(f"{a}/data/*.bin")[0])
    target = where.format(name=name)
    secret = tmp_path / target[3:]
    if not secret.exists():
        secret.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{a}/data/{name}", secret)             # what a load would read (and size) there
    m = _manifest(b)
    m.files = [FileEntry(target, f.rank, f.bytes) if f.path.startswith("../") else f for f in m.files]
    storage_for(b).commit("manifest.json", m.encode())
    opened = []
    for op in ("size", "read_into", "read_bytes", "exists"):
        real = getattr(LocalStorage, op)

        def spy(self, rel, *args, _real=real, **kwargs):
            opened.append(os.path.join(self.root, rel))
            return _real(self, rel, *args, **kwargs)
        monkeypatch.setattr(LocalStorage, op, spy)
    with pytest.raises(UnsafeCheckpointError, match=repr(target).replace(".", r"\.")):
        omnickpt.load(b, {"model": _model()})
    for reader in (verify, omnickpt.open):
        with pytest.raises(UnsafeCheckpointError):
            reader(b)
    assert not [p for p in opened if os.path.normpath(p) == str(secret)], opened


# ---------------------------------------------------------------------- S3 and fsspec
@pytest.fixture(scope="module")
def moto_server():
    if importlib.util.find_spec("boto3") is None or importlib.util.find_spec("moto") is None:
        pytest.skip("boto3 and moto[server] are needed for the S3 test")
    from s3server import MotoServer
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_parent(moto_server, monkeypatch):
    import boto3
    from s3server import AWS_ENV_TO_CLEAR, aws_env
    for k in AWS_ENV_TO_CLEAR:
        monkeypatch.delenv(k, raising=False)
    for k, v in aws_env(moto_server.endpoint).items():
        monkeypatch.setenv(k, v)
    bucket = f"omnickpt-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=moto_server.endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    return f"s3://{bucket}/ck"


@pytest.fixture
def memory_parent():
    pytest.importorskip("fsspec")
    parent = f"memory://omnickpt-refs-{uuid.uuid4().hex[:12]}"
    yield f"{parent}/ck"
    storage_for(parent).delete_tree("")


@pytest.fixture
def fsspec_file_parent(tmp_path):
    pytest.importorskip("fsspec")
    return f"fsspec+file://{tmp_path}/ck"      # an absolute path: fsspec+file:///tmp/...


def test_the_folders_next_to_an_absolute_fsspec_file_url_stay_absolute():
    from omnickpt.storage.linked import parent_path, sibling_path
    assert sibling_path("fsspec+file:///abs/ck/a", "b") == "fsspec+file:///abs/ck/b"
    assert parent_path("fsspec+file:///abs/ck/a") == "fsspec+file:///abs/ck"
    assert parent_path("s3://bucket/ck/a") == "s3://bucket/ck" and parent_path("a") == ""


@pytest.mark.parametrize("backend", ["s3", "fsspec-memory", "fsspec-file"])
def test_other_backends_keep_referenced_data_and_write_what_a_base_lost(request, backend, caplog):
    parent = request.getfixturevalue({"s3": "s3_parent", "fsspec-memory": "memory_parent",
                                      "fsspec-file": "fsspec_file_parent"}[backend])
    model, at_b, a, b = _pair(parent)
    _touch(model, list(range(ROWS)), 5.0)
    omnickpt.save(a, {"model": model}, incremental=True)     # over b's base
    assert torch.equal(_values(b), at_b)
    # a base object gone: the next save against it writes those blocks itself
    st = storage_for(a)
    for rel in st.list("data"):
        st.delete(rel)
    _touch(model, [11])
    c = f"{parent}/c"
    with caplog.at_level(logging.WARNING, logger="omnickpt"):
        rep = omnickpt.save(c, {"model": model}, incremental=True, base=a).wait()
    assert "written by this save" in caplog.text
    assert rep["incremental"]["referenced_bytes"] == 0
    assert torch.equal(_values(c), model.weight)
