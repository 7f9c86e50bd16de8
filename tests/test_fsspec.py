"""The fsspec backend on real fsspec filesystems: memory:// (in-process), file:// through fsspec
(`fsspec+file://`, shared by the ranks of a multi-process test), and s3fs against a real
S3-compatible server (moto on 127.0.0.1) when s3fs is installed.

Cost: one 2-rank launch; the s3fs test starts a moto server (about 2 s).
"""
from __future__ import annotations

import importlib.util
import os
import random
import re
import uuid

import pytest
import torch

pytest.importorskip("fsspec")

import omnickpt  # noqa: E402
from dist import run_ranks  # noqa: E402
from models import ToyMLP  # noqa: E402
from models import full_values as _full_values, toy as _toy  # noqa: E402
from models import two_rank_fsdp2_roundtrip as _two_rank_fsdp2  # noqa: E402
from omnickpt.cli.verify import verify  # noqa: E402
from omnickpt.storage import Segment, storage_for  # noqa: E402
from omnickpt.storage.fsspec_store import FsspecStorage  # noqa: E402
from test_bad_input import _file_size_limit  # noqa: E402


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    """A fresh checkpoint root on each fsspec filesystem that runs here."""
    if request.param == "memory":
        # memory:// is one store per process: a unique root per test, removed afterwards
        parent = f"memory://omnickpt-test-{uuid.uuid4().hex[:12]}"
        yield f"{parent}/ck"
        storage_for(parent).delete_tree("")
    else:
        yield f"fsspec+file://{tmp_path}/ck"


# ----------------------------------------------------------------------------- the backend itself
def test_storage_protocol(url):
    st = storage_for(url)
    assert isinstance(st, FsspecStorage) and st.describe("data/x.bin") == f"{url}/data/x.bin"
    assert not st.exists("") and st.list() == [] and st.children() == []
    st.commit("manifest.json", b'{"v": 1}')
    st.commit("manifest.json", b'{"v": 2}')            # replaces
    st.commit(".omnickpt/s1/r00000.json", b"{}")
    st.write_file("data/a.bin", 5, [Segment(1, memoryview(b"bcd"))], None, durable=True)
    assert st.read_bytes("manifest.json") == b'{"v": 2}'
    assert st.read_bytes("data/a.bin") == b"\0bcd\0"  # gaps between segments read back as zeros
    assert st.exists("") and st.exists("data") and st.exists("data/a.bin") and not st.exists("data/b.bin")
    assert st.size("data/a.bin") == 5
    # no temp file of the two commits is left behind
    assert st.list() == [".omnickpt/s1/r00000.json", "data/a.bin", "manifest.json"]
    assert st.list("data") == ["data/a.bin"] and st.list("dat") == [] and st.list("data/a.bin") == []
    assert st.children() == [".omnickpt", "data", "manifest.json"] and st.children("nope") == []
    assert storage_for(url.rsplit("/", 1)[0]).children() == [url.rsplit("/", 1)[1]]
    buf = bytearray(4)
    st.read_into("data/a.bin", 1, [memoryview(buf)[:1], memoryview(buf)[1:1], memoryview(buf)[1:]])
    assert buf == b"bcd\0"

    # Missing things: the API turns FileNotFoundError into "not committed"; data files are corruption.
    with pytest.raises(FileNotFoundError, match=re.escape(f"{url}/nope.json does not exist")):
        st.read_bytes("nope.json")
    with pytest.raises(omnickpt.CorruptCheckpointError, match="data/gone.bin is missing"):
        st.read_into("data/gone.bin", 0, [memoryview(bytearray(3))])
    with pytest.raises(omnickpt.CorruptCheckpointError, match="data/gone.bin is missing"):
        st.size("data/gone.bin")
    with pytest.raises(omnickpt.CorruptCheckpointError, match="data/a.bin is truncated: needed bytes up to 13, "
                       "the file has 5"):
        st.read_into("data/a.bin", 3, [memoryview(bytearray(10))])
    with pytest.raises(omnickpt.StorageError, match="overlaps another"):
        st.write_file("data/c.bin", 4, [Segment(0, memoryview(b"abc")), Segment(2, memoryview(b"x"))], None,
                      durable=False)

    st.delete("manifest.json")
    st.delete("manifest.json")                         # deleting what is gone is fine
    with pytest.raises(omnickpt.NotCommittedError, match="has data files but no manifest"):
        omnickpt.read_manifest(st)
    st.delete_tree("data")
    assert st.list() == [".omnickpt/s1/r00000.json"]
    st.delete_tree("")
    assert st.list() == [] and not st.exists("")


def test_scattered_write_and_parallel_ranged_reads(url):
    """A 40 MB file from hundreds of segments with gaps, in any order; read back through many
    buffers in one call (a range of several 16 MiB requests run at once) and in small pieces."""
    rng = random.Random(0)
    size = 40 << 20
    expected = bytearray(size)
    segments, pos = [], 0
    while pos < 1 << 20:
        pos += rng.choice((0, 0, 7, 4096))
        n = rng.randint(1, 20_000)
        data = rng.randbytes(n)
        segments.append(Segment(pos, memoryview(data)))
        expected[pos:pos + n] = data
        pos += n
    tail = torch.randint(0, 256, (size - pos - 99,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    segments.append(Segment(pos, memoryview(tail.numpy())))
    expected[pos:pos + len(tail)] = tail.numpy().tobytes()
    rng.shuffle(segments)
    st = storage_for(url)
    st.write_file("data/f.bin", size, segments, None, durable=True)
    assert st.size("data/f.bin") == size
    got = bytearray(size)
    mv = memoryview(got)
    cuts = sorted(rng.sample(range(1, size), 50))
    st.read_into("data/f.bin", 0, [mv[a:b] for a, b in zip([0] + cuts, cuts + [size])])
    assert got == expected
    part = bytearray(100_000)
    st.read_into("data/f.bin", (16 << 20) - 50_000, [memoryview(part)])
    assert part == expected[(16 << 20) - 50_000:(16 << 20) + 50_000]


def test_failed_write_leaves_no_file_and_failed_commit_keeps_the_old_manifest(tmp_path):
    """file:// through fsspec on a "full disk" (writes past 64 KiB fail with EFBIG, for real):
    the data file that failed half-way is removed, and a manifest commit that fails leaves the
    previous manifest whole (temp + rename) and no temp file."""
    st = FsspecStorage(f"file://{tmp_path}/ck")
    st.commit("manifest.json", b"old")
    big = memoryview(bytes(range(256)) * 1024)         # 256 KiB
    with _file_size_limit(64 << 10):
        with pytest.raises(omnickpt.StorageError, match=f"writing file://{tmp_path}/ck/data/x.bin failed.*"
                           "File too large"):
            st.write_file("data/x.bin", len(big), [Segment(0, big)], None, durable=True)
        with pytest.raises(omnickpt.StorageError, match=f"committing file://{tmp_path}/ck/manifest.json failed"):
            st.commit("manifest.json", big)
    assert st.read_bytes("manifest.json") == b"old"
    assert sorted(os.listdir(tmp_path / "ck")) == ["data", "manifest.json"] and not os.listdir(tmp_path / "ck/data")


def test_unknown_scheme_and_bad_url_say_what_to_do():
    with pytest.raises(omnickpt.UnsupportedError, match="nosuchfs://x/y: fsspec cannot open this URL"):
        storage_for("nosuchfs://x/y")


# ----------------------------------------------------------------------------- save / load


def _differing(expected: dict, got: dict) -> list[str]:
    assert expected.keys() == got.keys()
    return [k for k in expected if not torch.equal(expected[k], got[k])]


def _load_plain(url: str) -> dict:
    model, opt = _toy("plain", 7)
    omnickpt.load(url, {"model": model, "optimizer": opt})
    return _full_values(model, opt)


def test_save_load_sync_async_and_manager(url):
    model, opt = _toy("plain", 1)
    expected = _full_values(model, opt)
    report = omnickpt.save(f"{url}/sync", {"model": model, "optimizer": opt}).wait()
    assert report["path"] == f"{url}/sync" and omnickpt.is_committed(f"{url}/sync")
    assert _differing(expected, _load_plain(f"{url}/sync")) == []

    # async: the checkpoint holds the values of the call, though training changes them right after
    handle = omnickpt.save(f"{url}/async", {"model": model, "optimizer": opt}, async_save=True,
                           snapshot="eager")   # edited by hand right after: the eager contract
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    assert handle.done() and _differing(expected, _load_plain(f"{url}/async")) == []
    for path in (f"{url}/sync", f"{url}/async"):
        report = verify(path)          # every data file read whole, every checksum checked
        assert report.ok and report.files == 1, [str(p) for p in report.problems]

    mgr = omnickpt.CheckpointManager(f"{url}/mgr", keep_last=1)
    small = ToyMLP()
    for step in (1, 2):
        with torch.no_grad():
            small.fc1.weight.fill_(float(step))
        mgr.save(step, {"model": small}, async_save=True)
    mgr.wait()
    # Retention left one step; `.omnickpt` holds the open manager's lease (owner record).
    assert mgr.steps() == [2] and storage_for(f"{url}/mgr").children() == [".omnickpt", "global_step_2", "latest"]
    fresh = ToyMLP()
    mgr.load_latest({"model": fresh})
    assert torch.equal(fresh.fc1.weight, torch.full_like(fresh.fc1.weight, 2.0))


def test_two_ranks_resharded_load_and_damaged_files(tmp_path):
    """2 FSDP2 ranks save (sync and async) to one fsspec file:// root; a plain module in this
    process loads it (2 -> 1); a truncated and a missing data file are named in the errors."""
    sync_url, async_url = f"fsspec+file://{tmp_path}/sync", f"fsspec+file://{tmp_path}/async"
    results = run_ranks(2, _two_rank_fsdp2, sync_url, async_url)
    saved = results[0][0]
    for rank, (_, mismatches) in enumerate(results):
        assert mismatches == {sync_url: [], async_url: []}, (rank, mismatches)
    data = storage_for(sync_url).list("data")
    assert sorted(p.rsplit("-", 1)[-1] for p in data) == ["r00000.bin", "r00001.bin"]
    for url in (sync_url, async_url):
        assert _differing(saved, _load_plain(url)) == [], url

    victim = tmp_path / "sync" / data[1]
    victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
    with pytest.raises(omnickpt.CorruptCheckpointError, match=re.escape(f"{sync_url}/{data[1]} is truncated")):
        _load_plain(sync_url)
    victim.unlink()
    with pytest.raises(omnickpt.CorruptCheckpointError, match=re.escape(f"{sync_url}/{data[1]} is missing")):
        _load_plain(sync_url)


# ----------------------------------------------------------------------------- s3fs on a real server
def _lose_first(match):
    """A FaultProxy lose_when: the answer to the first request that `match`es is lost."""
    lost = []

    def pred(method: str, path: str) -> bool:
        if match(method, path) and not lost:
            lost.append(path)
            return True
        return False
    return pred


_HAVE_S3FS = importlib.util.find_spec("s3fs") is not None and importlib.util.find_spec("moto") is not None


@pytest.mark.skipif(not _HAVE_S3FS, reason="needs s3fs and moto[server] (pip install s3fs 'moto[server]')")
def test_s3fs_against_a_real_s3_server(monkeypatch):
    """fsspec+s3:// (s3fs) on moto's server: the protocol, checkpoints interchangeable with the
    built-in s3:// backend, and an upload that fails half-way leaves no object (closing the
    s3fs file would have completed the multipart upload with the parts that made it)."""
    import boto3
    from s3server import AWS_ENV_TO_CLEAR, FaultProxy, MotoServer, aws_env

    with MotoServer() as server:
        for k in AWS_ENV_TO_CLEAR:
            monkeypatch.delenv(k, raising=False)
        for k, v in aws_env(server.endpoint).items():
            monkeypatch.setenv(k, v)
        client = boto3.session.Session().client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        bucket = f"omnickpt-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)

        def keys(prefix=""):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))

        # s3fs keeps one filesystem per set of options: name the endpoint so that it is this server
        opts = {"endpoint_url": server.endpoint}
        st = FsspecStorage(f"fsspec+s3://{bucket}/ck", storage_options=opts)
        st.commit("manifest.json", b"{}")
        st.write_file("data/a.bin", 5, [Segment(1, memoryview(b"bcd"))], None, durable=True)
        assert st.read_bytes("data/a.bin") == b"\0bcd\0" and st.size("data/a.bin") == 5
        assert st.list() == ["data/a.bin", "manifest.json"] and st.children() == ["data", "manifest.json"]
        with pytest.raises(omnickpt.CorruptCheckpointError, match="truncated"):
            st.read_into("data/a.bin", 6, [memoryview(bytearray(4))])     # starts past the end: HTTP 416
        with pytest.raises(omnickpt.CorruptCheckpointError, match="missing"):
            st.read_into("data/gone.bin", 0, [memoryview(bytearray(4))])
        whole = FsspecStorage(f"fsspec+s3://{bucket}", storage_options=opts)
        whole.delete_tree("")          # everything in the bucket, not the bucket
        assert keys() == [] and client.head_bucket(Bucket=bucket)

        # the same checkpoint through either backend
        model, opt = _toy("plain", 3)
        expected = _full_values(model, opt)
        omnickpt.save(f"s3://{bucket}/boto", {"model": model, "optimizer": opt}).wait()
        omnickpt.save(f"fsspec+s3://{bucket}/fs", {"model": model, "optimizer": opt}, async_save=True).wait()
        assert _differing(expected, _load_plain(f"fsspec+s3://{bucket}/boto")) == []
        assert _differing(expected, _load_plain(f"s3://{bucket}/fs")) == []

        # The answer to the first upload of part 2 is lost (moto stored it; the client gets a 500)
        # and no retry is allowed: the write fails. No object may appear. Closing the s3fs file
        # instead would upload the buffered rest as part 2 and complete the upload: an object 8 MiB
        # short of the 40 MiB written, silently (measured).
        proxy = FaultProxy(server.port, lose_when=_lose_first(
            lambda method, path: method == "PUT" and "partNumber=2&" in path + "&")).start()
        try:
            monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
            faulty = FsspecStorage(f"fsspec+s3://{bucket}/faulty", storage_options={
                "endpoint_url": proxy.endpoint, "default_block_size": 5 << 20, "skip_instance_cache": True})
            blob = memoryview(bytes(40 << 20))   # written 16 MiB at a time: parts of 16, 16, 8 MiB
            with pytest.raises(omnickpt.StorageError, match=re.escape(f"writing fsspec+s3://{bucket}/faulty/data/x.bin failed")):
                faulty.write_file("data/x.bin", len(blob), [Segment(0, blob)], None, durable=True)
            assert proxy.lost == 1
        finally:
            proxy.stop()
        assert keys("faulty/") == []
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []   # aborted

        # A save over an existing checkpoint that fails while uploading its data file: the
        # previous checkpoint at that path still loads (DCP's fsspec writer, whose file names
        # repeat from save to save, deletes the old data file in this case: measured).
        url = f"fsspec+s3://{bucket}/same"
        omnickpt.save(url, {"model": model, "optimizer": opt}).wait()
        proxy = FaultProxy(server.port, lose_when=_lose_first(
            lambda method, path: method == "PUT" and "/same/data/" in path)).start()
        from s3fs import S3FileSystem
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
            S3FileSystem.clear_instance_cache()     # a new s3fs object, which reads the endpoint
            newer, newer_opt = _toy("plain", 4)
            with pytest.raises(omnickpt.CheckpointError, match="lost on purpose"):
                omnickpt.save(url, {"model": newer, "optimizer": newer_opt}).wait()
            assert proxy.lost == 1
        finally:
            proxy.stop()
            monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
            S3FileSystem.clear_instance_cache()
        assert _differing(expected, _load_plain(url)) == []
