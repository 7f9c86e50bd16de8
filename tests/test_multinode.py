"""omnickpt across simulated machines (tests/nodes.py: network namespaces with their own addresses,
their own /dev/shm and local disk, a shared folder and an S3 server on a storage network), two
machines of two ranks launched by `torchrun --nnodes 2`. The job is tests/nodes_worker.py.

What one machine's processes cannot show: a node's memory is lost with the node and restored from
its peer's replica on another machine; a job shrinks to the machines left; a link cut during a save
fails every survivor by name within the timeout and commits nothing; a save sends no tensor bytes
between machines; a machine's death leaves the other machine's replica to save the last step.
Values are compared bitwise with the state each step had."""
from __future__ import annotations

import json
import os

import pytest
import torch

from nodes import Cluster, available, await_file, signal_file

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes_worker.py")
REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated machines: {REASON}")


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(2, str(tmp_path / "cluster"))
    c.up()
    try:
        yield c
    finally:
        c.close()
        assert c.leftovers() == [], "the harness left something behind"


def run(c: Cluster, phase: str, args: dict, *, machines=None, nproc=2, timeout=180) -> None:
    procs = c.torchrun(WORKER, [phase, json.dumps(args)], nproc=nproc, machines=machines)
    codes = c.wait(procs, timeout)
    assert codes == [0] * len(procs), c.logs(procs)


def read(out: str, name: str):
    path = os.path.join(out, name)
    if name.endswith(".pt"):
        return torch.load(path)
    with open(path) as f:
        return json.load(f)


def assert_same(expected: dict, got: dict, what: str) -> None:
    assert expected.keys() == got.keys(), f"{what}: {sorted(set(expected) ^ set(got))}"
    bad = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not bad, f"{what}: not bitwise equal: {bad}"


def make_bucket(c: Cluster, name: str) -> None:
    import boto3
    from s3server import aws_env
    env = aws_env(c.s3_endpoint)
    boto3.client("s3", endpoint_url=c.s3_endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"]
                 ).create_bucket(Bucket=name)


def s3_keys(c: Cluster, bucket: str, prefix: str) -> list[str]:
    import boto3
    from s3server import aws_env
    env = aws_env(c.s3_endpoint)
    client = boto3.client("s3", endpoint_url=c.s3_endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for p in pages for o in p.get("Contents", [])]


# ---------------------------------------------------------------------- layouts and traffic
def test_fsdp2_and_hsdp_saved_to_shared_folder_and_s3_load_on_one_machine_of_three_ranks(cluster):
    c, out = cluster, os.path.join(cluster.workdir, "out")
    c.start_s3()
    make_bucket(c, "ckpt")
    run(c, "layouts_save", {"out": out, "shared": c.shared, "s3": "s3://ckpt/job"})
    loads = [[f"{layout}-{store}", f"{base}/{layout}"] for layout in ("fsdp", "hsdp")
             for store, base in (("shared", c.shared), ("s3", "s3://ckpt/job"))]
    run(c, "layouts_load", {"out": out, "load": loads}, machines=[0], nproc=3)
    for tag, _ in loads:
        assert_same(read(out, f"{tag.split('-')[0]}-expected.pt"), read(out, f"loaded-{tag}.pt"), tag)
    # A save sends no checkpoint bytes between machines: what crosses the fabric is coordination.
    # Each machine saves about half of the ~6.3 MB of state (HSDP: half of the replicas' boxes).
    report = {}
    for k in (0, 1):
        for save, sent in read(out, f"sent-node{k}.json").items():
            report[f"node{k} {save}"] = sent
            assert sent["eth0"] < 200_000, (save, sent)           # fabric: records, plan, barriers
            if save.endswith("/s3"):
                assert sent["eth1"] > 2_000_000, (save, sent)     # storage: this machine's tensors
    print("\nbytes each machine sent per save (eth0: to the other machine, eth1: to S3):",
          json.dumps(report, indent=1))


# ---------------------------------------------------------------------- memory tier across machines
def _remaining(info: dict) -> list[int]:
    return sorted(i for r in info["remaining"] for i in r)


def test_memory_tier_restores_a_replaced_machine_from_its_peer_and_shrinks_to_one_machine(cluster):
    """Steps in each machine's own /dev/shm with peer replicas (ranks_per_node from torchrun). Machine
    1 dies and is replaced by an empty one: its ranks get node 1's step back from the replica on
    machine 0, exactly, root unread. Then the job restarts on machine 0 alone: from memory where the
    peer replica covers the lost node, from root where it does not; the sampler's epoch reshards."""
    c, out = cluster, os.path.join(cluster.workdir, "out")
    run(c, "memory_save", {"out": out, "shared": c.shared})
    for r in range(4):
        lay = read(out, f"layout-r{r}.json")
        assert lay["ranks_per_node"] == 2, lay                   # LOCAL_WORLD_SIZE, not given
        assert lay["memory_steps"] == [3] and lay["root_steps"] == [2], lay
    c.kill(1, wipe=True)
    assert os.listdir(c.shm(1)) == []
    step2, step3 = read(out, "step2.pt"), read(out, "step3.pt")
    everything = set(range(96))

    run(c, "memory_restore", {"out": out, "shared": c.shared, "tag": "replaced"})
    info = read(out, "restored-replaced.json")
    assert info["report"]["tier"] == "memory" and info["report"]["step"] == 3, info
    assert info["report"]["repaired_nodes"] == [1], info
    assert_same(step3, read(out, "restored-replaced.pt"), "restored on a replaced machine")
    # same world size: every rank resumes where it stopped
    assert _remaining(info) == sorted(everything - set(read(out, "seen-step3.json")))

    c.kill(1, wipe=True)   # lost again: the job goes on without it
    run(c, "memory_shrink", {"out": out, "shared": c.shared}, machines=[0])
    peers, alone = read(out, "restored-shrink-peers.json"), read(out, "restored-shrink-alone.json")
    assert peers["report"]["tier"] == "memory" and peers["report"]["step"] == 3, peers
    assert peers["report"]["resharded"] is True, peers
    assert_same(step3, read(out, "restored-shrink-peers.pt"), "shrunk, from memory")
    assert alone["report"]["tier"] == "durable" and alone["report"]["step"] == 2, alone
    assert_same(step2, read(out, "restored-shrink-alone.pt"), "shrunk, from root")
    for info, step in ((peers, 3), (alone, 2)):
        rest = _remaining(info)
        assert len(rest) == len(set(rest)), "a sample would be seen twice"
        assert set(rest) == everything - set(read(out, f"seen-step{step}.json")), "the epoch did not reshard"


# ---------------------------------------------------------------------- partitions and slow links
TIMEOUT = 8.0    # the Checkpointer's timeout in the partition job


def test_a_link_cut_during_an_async_save_fails_every_survivor_by_name_and_commits_nothing(cluster):
    """Saves to S3 over the storage network. With machine 1's links at 10 MB/s an async save
    completes (or fails by name). Then machine 1's links are cut while its ranks upload: both ranks
    of machine 0 raise CheckpointTimeoutError naming ranks 2 and 3 within the timeout (rank 1 hears
    the coordinator's verdict, it does not give up first), nothing of the step is committed, and
    the memory tier's next save fails by name instead of hanging in the peer replica transfer.
    The previous step then loads exactly on the machine left."""
    from omnickpt.format import MANIFEST_NAME
    c, out = cluster, os.path.join(cluster.workdir, "out")
    c.start_s3()
    make_bucket(c, "ckpt")
    args = {"out": out, "shared": c.shared, "s3": "s3://ckpt/part", "timeout": TIMEOUT}
    procs = c.torchrun(WORKER, ["partition", json.dumps(args)], nproc=2)
    try:
        await_file(out, "ready-slow.json", 120, procs)
        c.slow(1, 10e6)
        signal_file(out, "slowed.json")
        await_file(out, "ready-cut.json", 120, procs)
        c.heal(1)
        c.slow(1, 0.5e6, nets="s")      # ~3 MB to upload from machine 1: ~6 s, cut meanwhile
        signal_file(out, "storage-slowed.json")
        for r in (2, 3):
            await_file(out, f"saving-r{r}.json", 60, procs)
        c.cut(1)
        for r in (0, 1):
            await_file(out, f"tier-r{r}.json", 4 * TIMEOUT + 30, procs[:1])
    except Exception:
        print(c.logs(procs))
        raise
    c.kill(1)
    c.kill(0)   # its workers are done; torchrun's agent would wait at its exit barrier for machine 1's
    for r in range(4):
        slow = read(out, f"slow-r{r}.json")
        assert slow["error"] is None, slow   # 10 MB/s: the save completes
    for r in (0, 1):
        cut = read(out, f"cut-r{r}.json")
        assert cut["error"] is not None and cut["error"][0] == "CheckpointTimeoutError", cut
        assert "rank(s) 2, 3 did not report" in cut["error"][1], cut   # rank 1: the coordinator's verdict
        assert cut["seconds"] < TIMEOUT + 5, cut
        tier = read(out, f"tier-r{r}.json")
        assert tier["error"] is not None and tier["error"][0] == "CheckpointTimeoutError", tier
        assert "rank(s) [2]" in tier["error"][1] or "rank(s) [3]" in tier["error"][1], tier
        assert tier["seconds"] < TIMEOUT + 10, tier
    keys = s3_keys(c, "ckpt", "part/")
    assert any(k == f"part/step2/{MANIFEST_NAME}" for k in keys), keys
    assert not any(k == f"part/step3/{MANIFEST_NAME}" for k in keys), "the cut step was committed"
    run(c, "partition_load", {"out": out, "path": "s3://ckpt/part/step2"}, machines=[0])
    assert_same(read(out, "step2.pt"), read(out, "loaded.pt"), "the step before the cut")


# ---------------------------------------------------------------------- checkpoint at failure
def test_machine_death_leaves_the_other_machines_replica_to_save_the_last_step(cluster):
    """HSDP with one replica per machine (sharded within it). Machine 1 dies during step 3: machine
    0's ranks, a complete shard group, save step 2 over their own group; it loads on 3 ranks."""
    c, out = cluster, os.path.join(cluster.workdir, "out")
    procs = c.torchrun(WORKER, ["failure", json.dumps({"out": out, "shared": c.shared})], nproc=2)
    try:
        for r in (2, 3):
            await_file(out, f"dying-r{r}.json", 120, procs)
        c.kill(1)
        for r in (0, 1):
            await_file(out, f"failure-r{r}.json", 90, procs[:1])
    except Exception:
        print(c.logs(procs))
        raise
    c.kill(0)   # its workers are done; torchrun's agent would wait at its exit barrier for machine 1's
    saved = [read(out, f"failure-r{r}.json") for r in (0, 1)]
    for s in saved:
        assert s["role"].startswith("survivor"), s
        assert s["failure_save"]["saved"] is True and s["failure_save"]["step"] == 2, s
        assert sorted(s["failure_save"]["savers"]) == [0, 1], s
    path = os.path.join(c.shared, "failure", "global_step_2")
    run(c, "layouts_load", {"out": out, "load": [["failure", path]]}, machines=[0], nproc=3)
    assert_same(read(out, "failure-expected.pt"), read(out, "loaded-failure.pt"), "the step saved at failure")
