"""The S3 backend against a real S3-compatible server (moto's standalone server on 127.0.0.1),
directly and through a proxy that throttles, fails, loses answers, cuts downloads short and dies.

Cost: one moto server for the module (about 2 s to start), one 2-rank launch; the fault tests pay
botocore's real backoff (a SlowDown waits up to 1 s).
"""
from __future__ import annotations

import importlib.util
import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

boto3 = pytest.importorskip("boto3")
# Only looked up, not imported: moto runs in its own process, and the spawned ranks import this
# module (importing moto there would cost each rank seconds).
if importlib.util.find_spec("moto") is None:
    pytest.skip("moto[server] is not installed (pip install 'moto[server]')", allow_module_level=True)

import omnickpt  # noqa: E402
from dist import run_ranks  # noqa: E402
from models import ToyMLP  # noqa: E402
from models import full_values as _toy_full_values, stepped as _stepped, toy as _toy  # noqa: E402
from models import two_rank_fsdp2_roundtrip as _two_rank_fsdp2  # noqa: E402
from omnickpt.storage import Segment, storage_for  # noqa: E402
from omnickpt.storage.s3 import S3Storage  # noqa: E402
from s3server import AWS_ENV_TO_CLEAR, FaultProxy, MotoServer, aws_env  # noqa: E402

PART = 5 << 20      # S3's smallest part: multipart uploads without hundreds of MB of test data


@pytest.fixture(scope="module")
def moto_server():
    with MotoServer() as server:
        yield server


class S3Env:
    """A fresh bucket on the module's server, and the environment pointing boto3 at it."""

    def __init__(self, server: MotoServer, monkeypatch):
        self.server, self._mp = server, monkeypatch
        self.bucket = f"omnickpt-{uuid.uuid4().hex[:12]}"
        for k in AWS_ENV_TO_CLEAR:
            monkeypatch.delenv(k, raising=False)
        for k, v in aws_env(server.endpoint).items():
            monkeypatch.setenv(k, v)
        # the test's own view of the server, never through a proxy
        self.client = boto3.session.Session().client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))

    def use(self, endpoint: str, **env) -> None:
        """Send the library's requests to `endpoint` (e.g. a fault proxy), with extra settings."""
        self._mp.setenv("AWS_ENDPOINT_URL", endpoint)
        for k, v in env.items():
            self._mp.setenv(k, str(v))


@pytest.fixture
def s3(moto_server, monkeypatch):
    return S3Env(moto_server, monkeypatch)


@pytest.fixture
def proxy(moto_server):
    started = []

    def make(**faults) -> FaultProxy:
        started.append(FaultProxy(moto_server.port, **faults).start())
        return started[-1]
    yield make
    for p in started:
        p.stop()


# ----------------------------------------------------------------------------- states


def _big_state(seed: int) -> dict:
    """About 24 MB: a 12 MB weight and its momentum, so the data file spans several 5 MiB parts."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1500, 2000), torch.nn.ReLU(), torch.nn.Linear(2000, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _stepped(model, opt)
    return {"model": model, "optimizer": opt, "extra": {"step": seed}}


def _values(state: dict) -> dict:
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    names = {id(p): n for n, p in state["model"].named_parameters()}
    for p, s in state["optimizer"].state.items():
        for k, v in s.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["extra"] = dict(state["extra"])
    return out


def _assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for k, e in expected.items():
        if isinstance(e, torch.Tensor):
            assert torch.equal(e, got[k]), k
        else:
            assert e == got[k], k


def _load_values(url: str, seed: int = 99) -> dict:
    fresh = _big_state(seed)
    omnickpt.load(url, fresh)
    return _values(fresh)


# ----------------------------------------------------------------------------- the backend itself
def test_storage_protocol_on_s3(s3, monkeypatch):
    st = storage_for(s3.url("run/ck/"))
    assert isinstance(st, S3Storage) and st.describe("data/x.bin") == f"s3://{s3.bucket}/run/ck/data/x.bin"
    assert not st.exists("")
    st.commit("manifest.json", b'{"v": 1}')
    st.commit("manifest.json", b'{"v": 2}')            # replaces: readers see the whole new object
    st.commit(".omnickpt/s1/r00000.json", b"{}")
    st.write_file("data/a.bin", 5, [Segment(1, memoryview(b"bcd"))], None, durable=True)
    assert st.read_bytes("manifest.json") == b'{"v": 2}'
    assert st.read_bytes("data/a.bin") == b"\0bcd\0"  # gaps between segments read back as zeros
    assert st.exists("") and st.exists("data") and st.exists("data/a.bin") and not st.exists("data/b.bin")
    assert st.size("data/a.bin") == 5
    assert st.list() == [".omnickpt/s1/r00000.json", "data/a.bin", "manifest.json"]
    assert st.list("data") == ["data/a.bin"] and st.list("dat") == []
    assert st.children() == [".omnickpt", "data", "manifest.json"]
    assert storage_for(s3.url("run")).children() == ["ck"]
    buf = bytearray(4)
    st.read_into("data/a.bin", 1, [memoryview(buf)[:1], memoryview(buf)[1:1], memoryview(buf)[1:]])
    assert buf == b"bcd\0"

    # Missing things: the API turns FileNotFoundError into "not committed"; data files are corruption.
    with pytest.raises(FileNotFoundError, match=f"s3://{s3.bucket}/run/ck/nope.json"):
        st.read_bytes("nope.json")
    with pytest.raises(omnickpt.CorruptCheckpointError, match="data/gone.bin is missing"):
        st.read_into("data/gone.bin", 0, [memoryview(bytearray(3))])
    with pytest.raises(omnickpt.CorruptCheckpointError, match="missing"):
        st.size("data/gone.bin")
    with pytest.raises(omnickpt.CorruptCheckpointError, match="truncated"):
        st.read_into("data/a.bin", 3, [memoryview(bytearray(10))])
    with pytest.raises(omnickpt.StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        storage_for("s3://no-such-bucket-here/x").read_bytes("manifest.json")
    with pytest.raises(omnickpt.StorageError, match="no bucket name"):
        storage_for("s3:///x")
    with monkeypatch.context() as m:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            m.delenv(k)
        m.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        m.setenv("AWS_CONFIG_FILE", "/nonexistent")
        with pytest.raises(omnickpt.StorageError, match=f"GET s3://{s3.bucket}/run/ck/manifest.json failed: no AWS "
                           "credentials found; set AWS_ACCESS_KEY_ID"):
            storage_for(s3.url("run/ck")).read_bytes("manifest.json")

    st.delete("manifest.json")
    st.delete("manifest.json")                         # deleting what is gone is fine
    with pytest.raises(omnickpt.NotCommittedError, match="has data files but no manifest"):
        omnickpt.read_manifest(st)
    st.delete_tree("data")
    assert s3.keys("run/") == ["run/ck/.omnickpt/s1/r00000.json"]
    st.delete_tree("")
    assert s3.keys() == []


def test_multipart_upload_from_scattered_segments(s3):
    """A file given as hundreds of small segments at arbitrary offsets, with gaps, plus one large
    segment straddling part boundaries: uploaded as parallel 5 MiB parts, read back byte for byte."""
    rng = random.Random(0)
    size = 3 * PART + 12345
    expected = bytearray(size)
    segments, pos = [], 0
    while pos < 2 * PART:
        pos += rng.choice((0, 0, 7, 64, 4096))        # gaps (zeros) between some segments
        n = rng.randint(1, 40_000)
        data = rng.randbytes(n)
        segments.append(Segment(pos, memoryview(data)))
        expected[pos:pos + n] = data
        pos += n
    tail = bytearray(rng.randbytes(size - pos - 100))
    segments.append(Segment(pos, memoryview(tail)))
    expected[pos:pos + len(tail)] = tail
    rng.shuffle(segments)                              # the order given does not matter
    st = S3Storage(s3.url("mp"), part_size=PART)
    with ThreadPoolExecutor(4) as pool:
        phases = st.write_file("data/f.bin", size, segments, pool, durable=True)
    assert "complete" in phases
    head = s3.client.head_object(Bucket=s3.bucket, Key="mp/data/f.bin")
    assert head["ContentLength"] == size and head["ETag"].strip('"').endswith("-4")   # 4 parts
    got = bytearray(size)
    mv = memoryview(got)
    cuts = sorted(rng.sample(range(1, size), 50))
    st.read_into("data/f.bin", 0, [mv[a:b] for a, b in zip([0] + cuts, cuts + [size])])
    assert got == expected
    part = bytearray(100_000)
    st.read_into("data/f.bin", PART - 50_000, [memoryview(part)])
    assert part == expected[PART - 50_000:PART + 50_000]


# ----------------------------------------------------------------------------- save / load
def test_save_load_sync_async_and_manager(s3, monkeypatch):
    monkeypatch.setenv("OMNICKPT_S3_PART_SIZE", str(PART))
    state = _big_state(1)
    expected = _values(state)
    report = omnickpt.save(s3.url("sync"), state).wait()
    assert report["path"] == s3.url("sync")
    assert omnickpt.is_committed(s3.url("sync"))
    data_keys = s3.keys("sync/data/")
    assert len(data_keys) == 1
    # the ~24 MB data file went up as a multipart upload of 5 MiB parts
    assert s3.client.head_object(Bucket=s3.bucket, Key=data_keys[0])["ETag"].strip('"').endswith("-5")
    _assert_same(expected, _load_values(s3.url("sync")))

    # async: the checkpoint holds the values of the call, though training changes them right after
    handle = omnickpt.save(s3.url("async"), state, async_save=True,
                           snapshot="eager")   # edited by hand right after: the eager contract
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    handle.wait()
    assert handle.done() and omnickpt.is_committed(s3.url("async"))
    _assert_same(expected, _load_values(s3.url("async")))

    # CheckpointManager on S3: step prefixes, `latest`, retention
    small = ToyMLP()
    mgr = omnickpt.CheckpointManager(s3.url("mgr"), keep_last=1)
    for step in (1, 2):
        with torch.no_grad():
            small.fc1.weight.fill_(float(step))
        mgr.save(step, {"model": small}, async_save=True)
    mgr.wait()
    assert mgr.steps() == [2]
    assert not any(k.startswith("mgr/global_step_1/") for k in s3.keys("mgr/"))
    assert s3.client.get_object(Bucket=s3.bucket, Key="mgr/latest")["Body"].read().strip() == b"2"
    fresh = ToyMLP()
    mgr.load_latest({"model": fresh})
    assert torch.equal(fresh.fc1.weight, torch.full_like(fresh.fc1.weight, 2.0))


def test_two_ranks_fsdp2_and_resharded_load_to_one(s3):
    sync_url, async_url = s3.url("fsdp2/sync"), s3.url("fsdp2/async")
    results = run_ranks(2, _two_rank_fsdp2, sync_url, async_url)
    saved = results[0][0]
    for rank, (_, mismatches) in enumerate(results):
        assert mismatches == {sync_url: [], async_url: []}, (rank, mismatches)
    # both ranks wrote a data file
    assert sorted(k.rsplit("-", 1)[-1] for k in s3.keys("fsdp2/sync/data/")) == ["r00000.bin", "r00001.bin"]
    # 2 -> 1: a plain module in this process loads the FSDP2 checkpoint
    for url in (sync_url, async_url):
        model, opt = _toy("plain", 7)
        omnickpt.load(url, {"model": model, "optimizer": opt})
        got = _toy_full_values(model, opt)
        assert saved.keys() == got.keys()
        assert [k for k in saved if not torch.equal(saved[k], got[k])] == [], url


# ----------------------------------------------------------------------------- faults
def test_throttling_errors_and_broken_downloads_are_retried(s3, proxy, monkeypatch):
    """Every 3rd request fails (503 SlowDown / 500 in turn), the first CompleteMultipartUpload's
    answer is lost after the server did it, every 2nd download breaks off half-way: saves and
    loads still succeed and every checksum verifies."""
    monkeypatch.setenv("OMNICKPT_S3_PART_SIZE", str(PART))
    lost = []

    def lose_first_complete(method, path):
        if method == "POST" and "uploadId=" in path and not lost:
            lost.append(path)
            return True
        return False

    faulty = proxy(fail_every=3, truncate_every=2, lose_when=lose_first_complete)
    s3.use(faulty.endpoint)
    state = _big_state(2)
    expected = _values(state)
    omnickpt.save(s3.url("sync"), state).wait()
    omnickpt.save(s3.url("async"), state, async_save=True).wait()
    _assert_same(expected, _load_values(s3.url("sync")))      # load(verify=True) checks every checksum
    assert faulty.failed >= 5 and faulty.truncated >= 2 and faulty.lost == 1, \
        (faulty.requests, faulty.failed, faulty.truncated, faulty.lost)
    s3.use(s3.server.endpoint)      # the same load path once more is only slower through the proxy
    _assert_same(expected, _load_values(s3.url("async")))
    from omnickpt.cli.verify import verify
    for url in (s3.url("sync"), s3.url("async")):
        report = verify(url)          # every data file read whole, every checksum checked
        assert report.ok and report.files == 1, [str(p) for p in report.problems]

    # botocore's adaptive mode (client-side rate limiting on throttling) retries the same way
    s3.use(faulty.endpoint)
    faulty.truncate_every, failed_before = 0, faulty.failed
    adaptive = S3Storage(s3.url("adaptive"), retry_mode="adaptive")
    for i in range(4):
        adaptive.commit(f"o{i}", b"%d" % i)
    assert [adaptive.read_bytes(f"o{i}") for i in range(4)] == [b"0", b"1", b"2", b"3"]
    assert faulty.failed - failed_before >= 2


def test_server_dying_mid_save_commits_nothing(s3, proxy, monkeypatch):
    """The server dies during the multipart upload of a save (sync, then async): the save fails
    with a CheckpointError naming the s3:// path, nothing is committed, and once the server is
    back the checkpoint saved before it died loads."""
    monkeypatch.setenv("OMNICKPT_S3_PART_SIZE", str(PART))
    front = proxy()
    s3.use(front.endpoint, AWS_MAX_ATTEMPTS=2)        # give up quickly on a dead server
    good = _big_state(3)
    expected = _values(good)
    omnickpt.save(s3.url("good"), good).wait()

    for mode in ("sync", "async"):
        url = s3.url(f"bad-{mode}")
        # the server dies when the second part of the data file arrives: mid-upload
        front.die_when = lambda method, path: method == "PUT" and "partNumber=2&" in path + "&"
        with pytest.raises(omnickpt.CheckpointError) as err:
            omnickpt.save(url, _big_state(4), async_save=(mode == "async")).wait()
        assert front.died.is_set()
        assert f"s3://{s3.bucket}/bad-{mode}" in str(err.value), str(err.value)
        assert "cannot reach the S3 endpoint" in str(err.value), str(err.value)
        front.restart()
        assert not omnickpt.is_committed(url)
        assert f"bad-{mode}/manifest.json" not in s3.keys(f"bad-{mode}/")
        with pytest.raises(omnickpt.NotCommittedError):
            omnickpt.load(url, _big_state(5))
        # the previous checkpoint, at another prefix, is intact
        _assert_same(expected, _load_values(s3.url("good")))


def test_incremental_steps_on_s3_reference_the_previous_prefix_and_survive_retention(s3):
    """Incremental saves under an S3 root: the unchanged blocks are read from the previous step's
    prefix; retention keeps (only) the objects a kept step references; verify follows them."""
    from omnickpt.cli.verify import verify
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4096, 64)      # 1 MiB: 16 blocks of 64 KiB
    mgr = omnickpt.CheckpointManager(s3.url("inc"), keep_last=1, incremental=True)
    reports = []
    for step in (1, 2):
        with torch.no_grad():
            emb.weight[step * 100] += 1.0
        reports.append(mgr.save(step, {"model": emb}).wait())
    assert mgr.steps() == [2]
    assert reports[1]["incremental"]["base"] == "global_step_1"
    assert reports[1]["incremental"]["referenced_bytes"] >= 14 * (64 << 10)
    keys = s3.keys("inc/")
    assert not any(k.startswith("inc/global_step_1/manifest") for k in keys)
    assert any(k.startswith("inc/global_step_1/data/") for k in keys)   # referenced by step 2: kept
    fresh = torch.nn.Embedding(4096, 64)
    mgr.load_latest({"model": fresh})
    assert torch.equal(fresh.weight, emb.weight)
    assert verify(s3.url("inc/global_step_2")).ok
