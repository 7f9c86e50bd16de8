"""Dataloader state that reshards across data-parallel sizes (omnickpt/data.py,
omnickpt/adapters/dataloader.py).

The pure redistribution is checked in-process over random chains of DP sizes. The save/load path
runs on 4 real gloo ranks in one launch (starting ranks is the slow part): one save at DP size 4,
mid-epoch with the ranks at different positions; then loads into fresh objects at DP size 4 (exact
resume), and at DP sizes 3 and 2 through process groups of ranks [0, 1, 2] and [0, 1] (the epoch is
completed with no sample or token lost or repeated).
"""
from __future__ import annotations

import random

import pytest

import omnickpt
from dist import run_ranks
from omnickpt.adapters.dataloader import load_dataloader, save_dataloader
from omnickpt.data import PackedTokenLoader, ReshardableSampler, reshard_sampler_state
from omnickpt.errors import CheckpointError, MismatchError, UnsupportedError

N = 101          # samples per epoch: divisible by none of the DP sizes used
SEED = 7

try:
    import torchdata.stateful_dataloader  # noqa: F401
    HAVE_TORCHDATA = True
except ImportError:     # optional: the torchdata parts are skipped, the rest still runs
    HAVE_TORCHDATA = False


def _documents(n=61):
    """Documents of 1..25 tokens whose token ids are unique, so that a lost or repeated token shows."""
    docs, next_id = [], 0
    for i in range(n):
        length = random.Random(i).randint(1, 25)
        docs.append(list(range(next_id, next_id + length)))
        next_id += length
    return docs, next_id


def _take(it, k):
    out = []
    for _ in range(k):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _tokens(batches):
    return [t for b in batches for t in b.reshape(-1).tolist()]


def _simulate(objects_per_rank, saved_states, saved_dp_size):
    """Load `saved_states` (one dp_state_dict per saved DP rank) into each object, as the adapter does."""
    replicated = saved_states[0]["replicated"]
    shards = {s["dp_rank"]: s["shard"] for s in saved_states}
    for obj in objects_per_rank:
        obj.load_dp_state_dict(replicated, shards, saved_dp_size)


# ------------------------------------------------------------------ in-process: the redistribution

def test_sampler_reshard_chain_covers_each_sample_once():
    # Random chains of DP sizes with ranks stopping at different positions (the uneven case is what
    # makes `pending` positions): whatever the chain, the epoch is consumed exactly once, and right
    # after each reshard the ranks' remaining counts differ by at most one.
    rng = random.Random(0)
    for _ in range(150):
        sizes = [rng.randint(1, 7) for _ in range(4)]
        consumed, states, saved = [], None, None
        for i, n in enumerate(sizes):
            samplers = [ReshardableSampler(N, r, n, seed=SEED) for r in range(n)]
            if states is not None:
                _simulate(samplers, states, saved)
                if saved != n:
                    remaining = [len(s) for s in samplers]
                    assert max(remaining) - min(remaining) <= 1, (sizes, remaining)
            last = i == len(sizes) - 1
            for s in samplers:
                consumed += _take(iter(s), 10 ** 9 if last else rng.randint(0, 9))
            states, saved = [s.dp_state_dict() for s in samplers], n
        assert sorted(consumed) == list(range(N)), sizes


def test_packed_loader_reshard_chain_keeps_every_token_once():
    docs, total = _documents()
    rng = random.Random(1)
    for _ in range(60):
        sizes = [rng.randint(1, 6) for _ in range(3)]
        emitted, states, saved = [], None, None
        for i, n in enumerate(sizes):
            loaders = [PackedTokenLoader(docs, 7, r, n, batch_size=2, seed=SEED) for r in range(n)]
            if states is not None:
                _simulate(loaders, states, saved)
            last = i == len(sizes) - 1
            for ld in loaders:
                batches = _take(iter(ld), 10 ** 9 if last else rng.randint(0, 4))
                assert all(b.shape == (2, 7) for b in batches)
                emitted += _tokens(batches)
            states, saved = [ld.dp_state_dict() for ld in loaders], n
        leftover = [t for s in states for t in s["shard"]["buffer"].tolist()]
        assert sorted(emitted + leftover) == list(range(total)), sizes


def test_sampler_epoch_semantics():
    s = ReshardableSampler(10, 0, 2, seed=SEED)
    first = list(s)
    assert len(first) == 5 and list(s) == first     # a new iter() starts the epoch over, like DistributedSampler
    _take(iter(s), 2)
    state = s.dp_state_dict()
    t = ReshardableSampler(10, 0, 2, seed=123)      # the saved seed wins: the epoch keeps its order
    t.load_state_dict(state)
    t.set_epoch(0)                                  # the same epoch: the loaded position is kept
    assert len(t) == 3 and list(t) == first[2:]
    assert list(t) == first                         # ...once; the next iter() starts the epoch over
    t.load_state_dict(state)
    t.set_epoch(1)                                  # another epoch: it starts from its beginning
    other = ReshardableSampler(10, 1, 2, seed=SEED)
    other.set_epoch(1)
    epoch1 = list(t)
    assert epoch1 != first and sorted(epoch1 + list(other)) == list(range(10))


def test_load_errors_name_what_is_wrong():
    states = [ReshardableSampler(N, r, 4).dp_state_dict() for r in range(4)]
    with pytest.raises(CheckpointError, match=r"dp_rank\(s\) \[2\]"):
        reshard_sampler_state(states[0]["replicated"], {r: states[r]["shard"] for r in (0, 1, 3)}, 4, 2)
    with pytest.raises(MismatchError, match="dataset_len: 101 in the checkpoint, 100 here"):
        _simulate([ReshardableSampler(100, 0, 2)], states, 4)

    # The adapter: a missing DP rank and TP peers that disagree are refused, with the key named.
    target = load_dataloader("data", ReshardableSampler(N, 0, 2))
    with pytest.raises(CheckpointError, match=r"data: saved at data-parallel size 4 but no rank saved dp_rank\(s\) \[3\]"):
        target.finish({"data": {0: states[0], 1: states[1], 2: states[2]}})
    moved = ReshardableSampler(N, 1, 4)
    _take(iter(moved), 3)
    with pytest.raises(CheckpointError, match="ranks 1 and 4 both saved dp_rank 1 with different shards"):
        target.finish({"data": {0: states[0], 1: states[1], 2: states[2], 3: states[3], 4: moved.dp_state_dict()}})

    class Bad:
        def dp_state_dict(self):
            return {"replicated": {}, "shard": {}, "dp_rank": 3, "dp_size": 2}

        def load_dp_state_dict(self, replicated, shards, saved_dp_size):
            pass
    with pytest.raises(UnsupportedError, match="loader: dp_rank=3, dp_size=2"):
        save_dataloader("loader", Bad())


@pytest.mark.skipif(not HAVE_TORCHDATA, reason="torchdata is not installed (pip install torchdata)")
def test_stateful_dataloader_with_workers_reshards():
    # With workers the loader's sampler runs ahead of the batches returned (prefetch); the sampler
    # state that omnickpt reshards must be the one StatefulDataLoader snapshotted with the last batch
    # returned, not the live one. In this process: worker processes cannot start inside the gloo ranks.
    from torchdata.stateful_dataloader import StatefulDataLoader
    before, states = [], {}
    for r in range(4):
        sampler = ReshardableSampler(N, r, 4, seed=SEED)
        loader = StatefulDataLoader(list(range(N)), batch_size=3, num_workers=1, prefetch_factor=4, sampler=sampler)
        it = iter(loader)
        before += [int(x) for b in _take(it, 2 + r % 2) for x in b]
        states[r] = save_dataloader("td", loader).objects["td"]
        assert sampler.dp_state_dict()["shard"]["taken"] > 3 * (2 + r % 2)     # the live sampler ran ahead
        del it
    after = []
    for r in range(3):
        loader = StatefulDataLoader(list(range(N)), batch_size=3, sampler=ReshardableSampler(N, r, 3, seed=SEED))
        load_dataloader("td", loader).finish({"td": states})
        after += [int(x) for b in loader for x in b]
    _check_epoch([before], [after], "StatefulDataLoader with workers")


# ------------------------------------------------------------------ real ranks: save at 4, resume at 4, 3, 2

def _build(dp_rank, dp_size, docs, *, distributed_sampler=False):
    state = {"sampler": ReshardableSampler(N, dp_rank, dp_size, seed=SEED),
             "packed": PackedTokenLoader(docs, 8, dp_rank, dp_size, batch_size=2, seed=SEED)}
    if HAVE_TORCHDATA:
        from torchdata.stateful_dataloader import StatefulDataLoader
        state["td"] = StatefulDataLoader(list(range(N)), batch_size=3,
                                         sampler=ReshardableSampler(N, dp_rank, dp_size, seed=SEED + 1))
        if distributed_sampler:
            from torch.utils.data.distributed import DistributedSampler
            ds = DistributedSampler(list(range(N)), num_replicas=dp_size, rank=dp_rank, seed=SEED)
            state["td_dist"] = StatefulDataLoader(list(range(N)), batch_size=3, sampler=ds)
    return state


def _flat(batches):
    return [int(x) for b in batches for x in b]


def _rest(state, its=None):
    """What each loader yields to the end of the epoch (from `its`, live iterators, when given),
    and the packed buffer left."""
    its = its or {k: iter(v) for k, v in state.items()}
    out = {"sampler": list(its["sampler"]), "packed": _tokens(its["packed"])}
    out["buffer"] = state["packed"].buffer.tolist()
    for k in ("td", "td_dist"):
        if k in state:
            out[k] = _flat(its[k])
    return out


def _resume_at(rank, dp_size, group, root, docs):
    """Fresh objects at `dp_size` loaded from the DP-4 checkpoint over `group`, run to the end of the epoch."""
    import torch.distributed as dist
    state = _build(rank, dp_size, docs)
    omnickpt.load(f"{root}/dp4", state, process_group=group)
    out = {"after": _rest(state)}
    if HAVE_TORCHDATA:
        # A StatefulDataLoader over a DistributedSampler keeps a per-rank state: refused at another DP size.
        td_dist = _build(rank, dp_size, docs, distributed_sampler=True)["td_dist"]
        with pytest.raises(UnsupportedError) as e:
            omnickpt.load(f"{root}/dp4", {"td_dist": td_dist}, process_group=group)
        out["td_dist_error"] = str(e.value)
    # The checkpoint of tensor-parallel peers (2 DP ranks, each saved by 2 ranks) loads here too.
    tp = ReshardableSampler(N, rank, dp_size, seed=SEED)
    omnickpt.load(f"{root}/dp2tp2", {"sampler": tp}, process_group=group)
    out["tp_after"] = list(tp)
    dist.barrier(group)
    return out


def _scenarios(rank, world_size, root):
    import torch.distributed as dist
    docs, _ = _documents()
    state = _build(rank, 4, docs, distributed_sampler=True)
    its = {k: iter(v) for k, v in state.items()}
    # Mid-epoch, at different positions per rank (as packing makes them): odd ranks are one step ahead.
    before = {"sampler": _take(its["sampler"], 9 + rank % 2),
              "packed": _tokens(_take(its["packed"], 2 + rank % 2)),
              "buffer": state["packed"].buffer.tolist()}
    if HAVE_TORCHDATA:
        before["td"] = _flat(_take(its["td"], 2 + rank % 2))
        _take(its["td_dist"], 2)
    omnickpt.save(f"{root}/dp4", state).wait()
    # Tensor-parallel peers: ranks (0, 1) are DP rank 0 and (2, 3) DP rank 1; peers save identical states.
    tp = ReshardableSampler(N, rank // 2, 2, seed=SEED)
    tp_it = iter(tp)
    tp_before = _take(tp_it, 5 + rank // 2)
    omnickpt.save(f"{root}/dp2tp2", {"sampler": tp}).wait()
    out = {"before": before, "tp_before": tp_before, "tp_rest": list(tp_it),
           "uninterrupted": _rest(state, its)}      # the live iterators run on to the end of the epoch

    # Same DP size: fresh objects resume exactly.
    fresh = _build(rank, 4, docs, distributed_sampler=True)
    omnickpt.load(f"{root}/dp4", fresh)
    out["resumed"] = _rest(fresh)
    # Other DP sizes, over sub-groups (every rank creates every group, in the same order).
    groups = {3: dist.new_group([0, 1, 2]), 2: dist.new_group([0, 1])}
    for dp_size, group in groups.items():
        if rank < dp_size:
            out[dp_size] = _resume_at(rank, dp_size, group, root, docs)
    # All four ranks as tensor-parallel peers of a single DP rank: each gets the whole rest.
    peer = ReshardableSampler(N, 0, 1, seed=SEED)
    omnickpt.load(f"{root}/dp4", {"sampler": peer})
    out["peer_after"] = list(peer)
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataloader")
    return run_ranks(4, _scenarios, str(root))


def _check_epoch(before, after, what):
    consumed = [x for part in before + after for x in part]
    assert len(consumed) == len(set(consumed)), f"{what}: samples repeated"
    assert sorted(consumed) == list(range(N)), f"{what}: samples lost"


def test_same_size_resume_is_exact(scenarios):
    for r in scenarios:
        assert r["resumed"] == r["uninterrupted"]
        assert r["resumed"]["sampler"] and r["resumed"]["packed"]      # the save was mid-epoch
    _check_epoch([r["before"]["sampler"] for r in scenarios], [r["resumed"]["sampler"] for r in scenarios], "sampler")
    if HAVE_TORCHDATA:
        for key in ("td", "td_dist"):
            assert all(r["resumed"][key] == r["uninterrupted"][key] for r in scenarios)
        _check_epoch([r["before"]["td"] for r in scenarios], [r["resumed"]["td"] for r in scenarios], "torchdata")


@pytest.mark.parametrize("dp_size", [2, 3])
def test_resume_at_other_dp_size(scenarios, dp_size):
    saved = scenarios
    _, total = _documents()
    results = [r[dp_size] for r in scenarios[:dp_size]]
    after = [r["after"] for r in results]
    assert all(len(a["sampler"]) > 0 for a in after)
    _check_epoch([s["before"]["sampler"] for s in saved], [a["sampler"] for a in after], "sampler")
    # Tokens: emitted before + emitted after + what is left in the buffers = every token, once.
    tokens = [t for s in saved for t in s["before"]["packed"]] + [t for a in after for t in a["packed"] + a["buffer"]]
    assert sorted(tokens) == list(range(total))
    # The partly packed buffers were carried over: old rank r's unemitted tokens open new rank
    # r % dp_size's stream, in order.
    assert sum(len(s["before"]["buffer"]) for s in saved) > 0      # there were partly packed tokens to carry
    for j, a in enumerate(after):
        carried = [t for r, s in enumerate(saved) if r % dp_size == j for t in s["before"]["buffer"]]
        assert (a["packed"] + a["buffer"])[:len(carried)] == carried
    if HAVE_TORCHDATA:
        _check_epoch([s["before"]["td"] for s in saved], [a["td"] for a in after], "torchdata + ReshardableSampler")
        assert all("saved at data-parallel size 4 and is loaded at" in r["td_dist_error"] for r in results)
    _check_epoch([saved[r]["tp_before"] for r in (0, 2)], [r["tp_after"] for r in results], "TP-peer checkpoint")
    if dp_size == 2:    # the TP-peer checkpoint was saved at DP size 2: an exact resume
        assert [r["tp_after"] for r in results] == [saved[r]["tp_rest"] for r in (0, 2)]


def test_resume_into_tensor_parallel_peers(scenarios):
    _check_epoch([s["before"]["sampler"] for s in scenarios], [scenarios[0]["peer_after"]], "one DP rank")
    assert all(r["peer_after"] == scenarios[0]["peer_after"] for r in scenarios)
