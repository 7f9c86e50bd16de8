"""Incremental checkpoints' links to sibling steps: sibling paths, LinkedStorage's routing, and
retention that never deletes data a kept checkpoint still names."""
import json
import logging
import os
import struct

import pytest

from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from omnickpt.format import FileEntry
from omnickpt.steps import committed_steps, referenced_files, retire, step_dir
from omnickpt.storage import LocalStorage
from omnickpt.storage.linked import LinkedStorage, sibling_path, with_siblings

PRELUDE = struct.Struct("<8sIIQII")


# ---------------------------------------------------------------------- sibling_path
@pytest.mark.parametrize("path, want", [
    ("ckpt/global_step_3", "ckpt/global_step_1"),
    ("ckpt/global_step_3/", "ckpt/global_step_1"),
    ("a/b/ckpt/global_step_3//", "a/b/ckpt/global_step_1"),
    ("/abs/ckpt/global_step_3", "/abs/ckpt/global_step_1"),
    ("/abs/ckpt/global_step_3/", "/abs/ckpt/global_step_1"),
    ("global_step_3", "global_step_1"),                  # relative to the working directory, as the storage reads it
    ("/global_step_3", "/global_step_1"),
    ("file:///abs/ckpt/global_step_3", "file:///abs/ckpt/global_step_1"),
    ("file:///abs/ckpt/global_step_3/", "file:///abs/ckpt/global_step_1"),
    ("file://rel/global_step_3", "file://rel/global_step_1"),
    ("s3://bucket/prefix/global_step_3", "s3://bucket/prefix/global_step_1"),
    ("s3://bucket/global_step_3/", "s3://bucket/global_step_1"),
    ("s3://bucket/a/b/global_step_3", "s3://bucket/a/b/global_step_1"),
    ("shm://job/global_step_3", "shm://job/global_step_1"),
    ("shm://job/node0/global_step_3", "shm://job/node0/global_step_1"),
    ("memory://a/b", "memory://a/global_step_1"),
    ("fsspec+s3://bucket/ck/global_step_3", "fsspec+s3://bucket/ck/global_step_1"),
    ("simplecache::s3://bucket/ck/global_step_3", "simplecache::s3://bucket/ck/global_step_1"),
])
def test_sibling_path(path, want):
    assert sibling_path(path, "global_step_1") == want


def test_sibling_path_resolves_dot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / ".")
    assert sibling_path(".", "global_step_1") == os.path.join(os.path.dirname(str(tmp_path)), "global_step_1")
    assert sibling_path(str(tmp_path / "ck" / "x" / ".."), "s") == str(tmp_path / "s")


@pytest.mark.parametrize("path", ["s3://bucket", "s3://bucket/", "shm://job", "memory://a", "/", "", "file:///",
                                  "s3://bucket/ck/..", "zip://member::s3://bucket/a.zip"])
def test_sibling_path_refuses_no_parent(path):
    with pytest.raises(ValueError):
        sibling_path(path, "global_step_1")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_sibling_path_refuses_bad_name(name):
    with pytest.raises(ValueError):
        sibling_path("/x/global_step_3", name)


# ---------------------------------------------------------------------- LinkedStorage
@pytest.fixture
def two_steps(tmp_path):
    for step, payload in ((1, b"one" * 10), (2, b"two" * 5)):
        d = tmp_path / step_dir(step) / "data"
        d.mkdir(parents=True)
        (d / "x.bin").write_bytes(payload)
    return tmp_path


def test_linked_reads_sibling(two_steps):
    path = str(two_steps / "global_step_2")
    st = LinkedStorage(LocalStorage(path), path)
    assert st.read_bytes("data/x.bin") == b"two" * 5                       # its own file
    assert st.read_bytes("../global_step_1/data/x.bin") == b"one" * 10     # the sibling's
    assert st.size("../global_step_1/data/x.bin") == 30
    assert st.size("data/x.bin") == 15
    assert st.exists("../global_step_1/data/x.bin")
    assert not st.exists("../global_step_1/data/y.bin")
    assert not st.exists("../global_step_9/data/x.bin")
    buf = bytearray(4)
    st.read_into("../global_step_1/data/x.bin", 2, [memoryview(buf)])
    assert bytes(buf) == b"eone"
    assert st.describe("../global_step_1/data/x.bin") == str(two_steps / "global_step_1" / "data" / "x.bin")
    assert st.describe("data/x.bin") == str(two_steps / "global_step_2" / "data" / "x.bin")
    # the sibling's storage is made once, and other calls go to the checkpoint's own storage
    st.read_bytes("../global_step_1/data/x.bin")
    assert sorted(st._siblings) == ["global_step_1", "global_step_9"]
    assert st.list("data") == ["data/x.bin"]
    assert st.children() == ["data"]
    assert st.root == str(two_steps / "global_step_2")


@pytest.mark.parametrize("rel", ["../../etc/passwd", "../../x/data/x.bin", ".././data/x.bin", "../a\\b/x.bin",
                                 "../c:/x.bin", "../a\x00b/x.bin", "..//data/x.bin", "../global_step_1/../x",
                                 "../global_step_1/", "../global_step_1"])
def test_linked_refuses_unsafe(two_steps, rel):
    path = str(two_steps / "global_step_2")
    st = LinkedStorage(LocalStorage(path), path)
    with pytest.raises(UnsafeCheckpointError) as e:
        st.read_bytes(rel)
    assert repr(rel) in str(e.value)
    with pytest.raises(UnsafeCheckpointError):
        st.exists(rel)
    assert st.describe(rel)      # error messages never fail


def test_linked_refuses_writes_to_siblings(two_steps):
    path = str(two_steps / "global_step_2")
    st = LinkedStorage(LocalStorage(path), path)
    rel = "../global_step_1/data/x.bin"
    for call in (lambda: st.commit(rel, b"x"), lambda: st.create_exclusive(rel, b"x"), lambda: st.delete(rel),
                 lambda: st.delete_tree("../global_step_1"), lambda: st.write_file(rel, 0, [], None, durable=False)):
        with pytest.raises(ValueError):
            call()
    assert (two_steps / "global_step_1" / "data" / "x.bin").read_bytes() == b"one" * 10
    st.commit("data/y.bin", b"mine")                     # its own files as before
    assert (two_steps / "global_step_2" / "data" / "y.bin").read_bytes() == b"mine"
    st.delete("data/y.bin")
    assert not (two_steps / "global_step_2" / "data" / "y.bin").exists()


def test_with_siblings(two_steps):
    path = str(two_steps / "global_step_2")
    own = LocalStorage(path)
    assert with_siblings(own, path, [FileEntry("data/x.bin", 0, 15)]) is own
    assert with_siblings(own, path, []) is own
    linked = with_siblings(own, path, [FileEntry("data/x.bin", 0, 15), FileEntry("../global_step_1/data/x.bin", 0, 30)])
    assert isinstance(linked, LinkedStorage)
    assert linked.read_bytes("../global_step_1/data/x.bin") == b"one" * 10


# ---------------------------------------------------------------------- retention
def write_step(root, step: int, files: dict[str, bytes], refs: tuple[tuple[str, str], ...] = ()):
    """A step folder: real data files, and a version-3 manifest header (crc 0, no arrays: only its
    header is read here) listing them and the sibling files `refs` ((folder, path) pairs) it uses."""
    folder = root / step_dir(step)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    records = [{"path": rel, "rank": 0, "bytes": len(data)} for rel, data in files.items()]
    records += [{"path": p, "rank": 0, "bytes": 1, "base": base} for base, p in refs]
    write_manifest(folder, json.dumps({"format": "omnickpt", "version": 3, "files": records}).encode())


def write_manifest(folder, head: bytes, version: int = 3):
    head += b" " * (-(len(head) + PRELUDE.size) % 8)   # padded, as the real writer does
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_bytes(PRELUDE.pack(b"OMNICKPT", version, len(head), 0, 0, 0) + head)


def files_of(root, step):
    d = root / step_dir(step)
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_referenced_files(tmp_path):
    st = LocalStorage(str(tmp_path))
    write_step(tmp_path, 2, {"data/b.bin": b"b"}, refs=(("global_step_1", "data/a.bin"),))
    assert referenced_files(st, "global_step_2") == {("global_step_1", "data/a.bin")}
    assert referenced_files(st, "global_step_7") == set()                 # no manifest
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "manifest.json").write_text('{"format": "omnickpt", "version": 2, "files": []}')
    assert referenced_files(st, "json") == set()
    for bad in (b"not json", b'{"files": 3}', b'{"files": [{"path": 1, "base": "x"}]}', b"[]", b'{"x": 1}'):
        write_manifest(tmp_path / "bad", bad)
        with pytest.raises(CorruptCheckpointError) as e:
            referenced_files(st, "bad")
        assert str(tmp_path / "bad") in str(e.value)
    (tmp_path / "bad" / "manifest.json").write_bytes(b"GARBAGE!" + bytes(40))
    with pytest.raises(CorruptCheckpointError):
        referenced_files(st, "bad")
    (tmp_path / "bad" / "manifest.json").write_bytes(PRELUDE.pack(b"OMNICKPT", 3, 1000, 0, 0, 0) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        referenced_files(st, "bad")
    write_manifest(tmp_path / "bad", b'{"files": []}', version=99)
    with pytest.raises(CorruptCheckpointError, match="version 99"):
        referenced_files(st, "bad")


def test_retire_keeps_referenced_data(tmp_path):
    st = LocalStorage(str(tmp_path))
    write_step(tmp_path, 1, {"data/a.bin": b"a1", "data/b.bin": b"b1", "extra/note": b"n"})
    write_step(tmp_path, 2, {"data/c.bin": b"c2", "data/d.bin": b"d2"}, refs=(("global_step_1", "data/a.bin"),))
    write_step(tmp_path, 3, {"data/e.bin": b"e3"},
               refs=(("global_step_1", "data/a.bin"), ("global_step_2", "data/c.bin")))
    assert retire(st, 1, 3) == [1, 2]
    # steps 1 and 2 are no checkpoints any more, but hold what step 3 reads
    assert committed_steps(st) == [3]
    assert files_of(tmp_path, 1) == ["data/a.bin"]
    assert files_of(tmp_path, 2) == ["data/c.bin"]
    assert files_of(tmp_path, 3) == ["data/e.bin", "manifest.json"]
    linked = LinkedStorage(LocalStorage(str(tmp_path / "global_step_3")), str(tmp_path / "global_step_3"))
    assert linked.read_bytes("../global_step_1/data/a.bin") == b"a1"
    assert linked.read_bytes("../global_step_2/data/c.bin") == b"c2"
    # a pass with nothing new changes nothing: the stripped folders are still named by step 3
    assert retire(st, 1, 3) == [1, 2]
    assert files_of(tmp_path, 1) == ["data/a.bin"] and files_of(tmp_path, 2) == ["data/c.bin"]

    # a full step 4 names nothing: every older folder goes whole
    write_step(tmp_path, 4, {"data/f.bin": b"f4"})
    assert retire(st, 1, 4) == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["global_step_4"]
    assert committed_steps(st) == [4]


def test_retire_counts_references_of_newer_and_pinned_steps(tmp_path):
    st = LocalStorage(str(tmp_path))
    write_step(tmp_path, 1, {"data/a.bin": b"a1", "data/b.bin": b"b1"})
    write_step(tmp_path, 2, {"data/c.bin": b"c2"})
    write_step(tmp_path, 3, {"data/d.bin": b"d3"})
    # step 5 (newer than upto: an abandoned run's, or committed first) names step 1's data
    write_step(tmp_path, 5, {"data/e.bin": b"e5"}, refs=(("global_step_1", "data/b.bin"),))
    assert retire(st, 1, 3) == [1, 2]
    assert files_of(tmp_path, 1) == ["data/b.bin"]
    assert not (tmp_path / "global_step_2").exists()
    assert committed_steps(st) == [3, 5]


def test_retire_in_a_sub_folder(tmp_path):
    st = LocalStorage(str(tmp_path))
    write_step(tmp_path / "node0", 1, {"data/a.bin": b"a1", "data/b.bin": b"b1"})
    write_step(tmp_path / "node0", 2, {}, refs=(("global_step_1", "data/a.bin"),))
    assert retire(st, 1, 2, rel="node0") == [1]
    assert files_of(tmp_path / "node0", 1) == ["data/a.bin"]
    assert committed_steps(st, "node0") == [2]


def test_retire_removes_nothing_when_references_are_unreadable(tmp_path, caplog):
    st = LocalStorage(str(tmp_path))
    write_step(tmp_path, 1, {"data/a.bin": b"a1"})
    write_step(tmp_path, 2, {"data/b.bin": b"b2"})
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "global_step_3" / "manifest.json").write_bytes(b"OMNICKPT" + os.urandom(8) + b"\xff" * 40)
    with caplog.at_level(logging.WARNING, logger="omnickpt"):
        assert retire(st, 1, 3) == []
    assert "step 3" in caplog.text and "removes no checkpoint" in caplog.text
    assert committed_steps(st) == [1, 2, 3]
    assert files_of(tmp_path, 1) == ["data/a.bin", "manifest.json"]
    assert files_of(tmp_path, 2) == ["data/b.bin", "manifest.json"]


def test_retire_without_references_as_before(tmp_path):
    st = LocalStorage(str(tmp_path))
    for s in (1, 2, 3):
        write_step(tmp_path, s, {"data/a.bin": b"a"})
    (tmp_path / "global_step_0").mkdir()       # an interrupted save's folder
    assert retire(st, 2, 3) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3"]
    assert retire(st, None, 3) == []
