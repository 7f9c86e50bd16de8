"""The adapter registry (omnickpt/adapters/__init__.py) and large plain tensors inside plain values
(omnickpt/adapters/generic.py).

The registry is checked without processes: its order, first claim wins, an adapter added by a test
claims its own type and round-trips it, and a registry entry that is not an adapter is refused.
Large tensors are saved and loaded for real: in one process, and on 2 gloo ranks that hold
different values (each gets its own back) with loads across world sizes 2 -> 1 and 1 -> 2.
"""
from __future__ import annotations

import pytest
import torch

import omnickpt
from dist import run_ranks
from omnickpt.adapters import (ADAPTERS, Adapter, DataLoaderAdapter, Fsdp1Adapter, GenericAdapter,
                               MegatronModelAdapter, MegatronOptimizerAdapter, ModuleAdapter, OptimizerAdapter,
                               adapter_for, as_registry, check_framework, collect_load, collect_save)
from omnickpt.adapters.base import LoadTarget, SaveItems, full_shard
from omnickpt.adapters.generic import parse_per_rank_name, per_rank_name
from omnickpt.data import ReshardableSampler
from omnickpt.errors import MismatchError, UnsupportedError
from omnickpt.format import ShardRef
from omnickpt.storage import storage_for

BIG = 1 << 19          # float32 elements: 2 MiB, above the 1 MiB threshold


# ---------------------------------------------------------------------- the registry
def test_registry_order_most_specific_first_generic_last():
    kinds = [type(a) for a in ADAPTERS]
    assert kinds[-1] is GenericAdapter
    # Each adapter that claims a subset of another's values comes before it.
    assert kinds.index(MegatronModelAdapter) < kinds.index(ModuleAdapter)
    assert kinds.index(Fsdp1Adapter) < kinds.index(ModuleAdapter)
    assert kinds.index(MegatronOptimizerAdapter) < kinds.index(OptimizerAdapter)
    assert kinds.index(DataLoaderAdapter) < kinds.index(GenericAdapter)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ReshardableSampler(10, dp_rank=0, dp_size=1)   # Stateful too: the generic adapter would take it
    state = {"model": model, "opt": opt, "loader": sampler, "extra": {"a": 1}, "rng": omnickpt.RNGState()}
    got = {k: type(adapter_for(k, v, state)) for k, v in state.items()}
    assert got == {"model": ModuleAdapter, "opt": OptimizerAdapter, "loader": DataLoaderAdapter,
                   "extra": GenericAdapter, "rng": GenericAdapter}


class Celsius:
    """A user type no built-in adapter knows: the generic adapter would refuse to encode it."""

    def __init__(self, degrees: float):
        self.degrees = degrees


class CelsiusAdapter(Adapter):
    name = "celsius"

    def __init__(self, tag: str = "celsius"):
        self.tag = tag

    def claims(self, value, state):
        return isinstance(value, Celsius)

    def save_items(self, key, value, state):
        return SaveItems(shards=[full_shard(f"{key}/degrees", torch.tensor([value.degrees]))],
                         objects={key: {"unit": self.tag}})

    def load_target(self, key, value, state):
        dest = torch.zeros(1, dtype=torch.float32)
        target = LoadTarget(prefix=f"{key}/", shards=[full_shard(f"{key}/degrees", dest)], objects=[key])

        def finish(objects):
            value.degrees = float(dest[0])
        target.finish = finish
        return target


def test_an_added_adapter_claims_its_own_type_and_first_claim_wins():
    state = {"temp": Celsius(21.5), "extra": {"a": 1}}
    registry = as_registry((CelsiusAdapter(), *ADAPTERS))
    saved = dict(collect_save(state, registry))
    assert [s.name for s in saved["temp"].shards] == ["temp/degrees"]
    assert saved["temp"].objects == {"temp": {"unit": "celsius"}}
    assert saved["extra"].objects == {"extra": {"a": 1}}      # everything else as before
    # Without it, the generic adapter takes the value as an object (which the encoding refuses).
    assert dict(collect_save(state))["temp"].objects["temp"] is state["temp"]
    # Two adapters claim the same type: the first one in the registry handles it.
    first = dict(collect_save(state, (CelsiusAdapter("first"), CelsiusAdapter("second"), *ADAPTERS)))
    assert first["temp"].objects == {"temp": {"unit": "first"}}
    # The load side: the destination it declares is what the engine fills, finish installs it.
    target = Celsius(0.0)
    (key, t), _ = collect_load({"temp": target, "extra": {}}, registry)
    t.shards[0].local.copy_(saved["temp"].shards[0].local)
    t.finish({})
    assert key == "temp" and target.degrees == 21.5


def test_registry_checks():
    with pytest.raises(TypeError, match=r"adapters\[1\].*save_items, load_target"):
        as_registry((CelsiusAdapter(), object()))
    with pytest.raises(TypeError, match="non-empty sequence"):
        as_registry(())
    with pytest.raises(UnsupportedError, match=r"'temp' \(int\): no adapter claims it.*celsius"):
        collect_save({"temp": 3}, (CelsiusAdapter(),))
    with pytest.raises(ValueError, match="min_tensor_bytes"):
        GenericAdapter(min_tensor_bytes=-1)


class JaxishAdapter(CelsiusAdapter):
    frameworks = {"jaxish": frozenset({"jaxish"})}

    def detect(self, value):
        return "jaxish"


def test_framework_names_come_from_the_registry():
    state = {"temp": Celsius(1.0), "model": torch.nn.Linear(2, 2)}
    with pytest.raises(UnsupportedError, match="not one of"):
        check_framework(state, "jaxish")
    registry = (JaxishAdapter(), *ADAPTERS)
    with pytest.raises(UnsupportedError, match="'model': plain"):
        check_framework(state, "jaxish", registry)
    check_framework({"temp": Celsius(1.0)}, "jaxish", registry)
    check_framework({"model": torch.nn.Linear(2, 2)}, "plain", registry)


# ---------------------------------------------------------------------- large tensors in plain values
def test_per_rank_names():
    assert per_rank_name("extra/buf", 3) == "extra/buf/@rank3"
    assert parse_per_rank_name("extra/buf/@rank3") == ("extra/buf", 3)
    assert parse_per_rank_name("a/@rank1/@rank12") == ("a/@rank1", 12)
    for name in ("extra/buf", "extra/buf/@rank", "extra/buf/@rank01", "/@rank1", "x/@rank-1", "x/@rank\u0663"):
        assert parse_per_rank_name(name) is None, name


class BigStateful:
    """A Stateful whose state_dict() holds a large tensor (load_state_dict gets it back)."""

    def __init__(self, seed):
        self.table = torch.randn(BIG, generator=torch.Generator().manual_seed(seed))
        self.count = seed

    def state_dict(self):
        return {"table": self.table, "count": self.count}

    def load_state_dict(self, sd):
        self.table = sd["table"].clone()
        self.count = sd["count"]


def _values(seed):
    g = torch.Generator().manual_seed(seed)
    return {"buf": torch.randn(BIG, generator=g), "small": torch.arange(10) + seed, "step": seed,
            "nested": [torch.randn(3, BIG // 3 + 1, generator=g).to(torch.bfloat16), "tag"]}


def test_large_tensor_in_a_dict_goes_through_the_tensor_path(tmp_path):
    extra, top = _values(1), torch.randn(BIG, generator=torch.Generator().manual_seed(9))
    omnickpt.save(str(tmp_path), {"extra": extra, "top": top, "obj": BigStateful(4)}).wait()

    manifest = omnickpt.read_manifest(storage_for(str(tmp_path)))
    assert {"extra/buf/@rank0", "extra/nested/0/@rank0", "top/@rank0", "obj/table/@rank0"} <= set(manifest.tensors)
    assert not any("small" in n for n in manifest.tensors)
    # The objects hold references, not the bytes: a few hundred bytes each, the small tensor inline.
    assert max(e.nbytes for es in manifest.objects.values() for e in es) < 4096
    with omnickpt.open(str(tmp_path)) as ckpt:
        assert torch.equal(ckpt.get("extra/buf/@rank0"), extra["buf"])
        assert torch.equal(ckpt.get("extra/nested/0/@rank0"), extra["nested"][0])
        saved = ckpt.objects(["extra"])["extra"]
        assert saved["buf"] == ShardRef("extra/buf/@rank0")
        assert torch.equal(saved["small"], extra["small"]) and saved["step"] == 1

    # In place: the target's own tensors are filled (every reference sees the values), bitwise.
    target = _values(2)
    buf, nested = target["buf"], target["nested"][0]
    top2, obj = torch.zeros(BIG), BigStateful(5)
    state = {"extra": target, "top": top2, "obj": obj}
    omnickpt.load(str(tmp_path), state)
    assert state["extra"] is target and target["buf"] is buf and target["nested"][0] is nested
    assert torch.equal(buf, extra["buf"]) and torch.equal(nested, extra["nested"][0])
    assert torch.equal(target["small"], extra["small"]) and target["step"] == 1 and target["nested"][1] == "tag"
    assert state["top"] is top2 and torch.equal(top2, top)
    assert torch.equal(obj.table, BigStateful(4).table) and obj.count == 4

    # Into an empty target the tensors are new (CPU) tensors written back, of the saved dtype.
    empty = {"extra": {}}
    omnickpt.load(str(tmp_path), empty, strict=False)
    assert torch.equal(empty["extra"]["buf"], extra["buf"])
    assert empty["extra"]["nested"][0].dtype == torch.bfloat16
    assert torch.equal(empty["extra"]["nested"][0], extra["nested"][0])


def test_large_tensor_of_another_shape_is_a_difference(tmp_path):
    omnickpt.save(str(tmp_path), {"extra": {"buf": torch.ones(BIG)}}).wait()
    other = torch.zeros(BIG + 1)
    with pytest.raises(MismatchError, match=r"extra/buf/@rank0: shape"):
        omnickpt.load(str(tmp_path), {"extra": {"buf": other}})
    state = {"extra": {"buf": other}}
    result = omnickpt.load(str(tmp_path), state, strict=False)
    assert any("extra/buf/@rank0: shape" in d for d in result.differences)
    assert state["extra"]["buf"] is other and not other.any()     # kept, untouched


def _two_ranks(rank, world_size, root):
    extra = _values(10 + rank)
    omnickpt.save(f"{root}/two", {"extra": extra}).wait()
    out = {}
    # Each rank gets its own values back.
    target = _values(0)
    omnickpt.load(f"{root}/two", {"extra": target})
    out["own"] = all(torch.equal(target[k], extra[k]) for k in ("buf", "small")) and target["step"] == 10 + rank \
        and torch.equal(target["nested"][0], extra["nested"][0])
    # A checkpoint saved by one process: every rank loads its (rank 0's) value.
    target = {"buf": torch.zeros(BIG)}
    omnickpt.load(f"{root}/one", {"extra": target}, strict=True)
    out["scale_up"] = torch.equal(target["buf"], _values(7)["buf"])
    return out


def test_two_ranks_with_different_values_each_get_theirs(tmp_path):
    omnickpt.save(f"{tmp_path}/one", {"extra": _values(7)}).wait()
    res = run_ranks(2, _two_ranks, str(tmp_path))
    assert [r["own"] for r in res] == [True, True]
    assert [r["scale_up"] for r in res] == [True, True]
    manifest = omnickpt.read_manifest(storage_for(f"{tmp_path}/two"))
    assert {"extra/buf/@rank0", "extra/buf/@rank1"} <= set(manifest.tensors)
    # Each rank wrote its own tensor; the objects differ (they name different tensors).
    assert sorted(r for e in manifest.objects["extra"] for r in e.ranks) == [0, 1]
    # 2 -> 1: a single process gets rank 0's value, and rank 1's tensors are no strict difference.
    target = _values(0)
    omnickpt.load(f"{tmp_path}/two", {"extra": target}, strict=True)
    assert torch.equal(target["buf"], _values(10)["buf"]) and target["step"] == 10


def _memory_tier(rank, world_size, root, job):
    # One rank per simulated node: each node saves on a process group of its own (node-local rank 0
    # on both), so the per-rank names must come from the job-wide rank for the merged durable copy
    # to keep both ranks' tensors.
    from omnickpt.storage.shm import clear_memory
    mgr = omnickpt.TieredCheckpointManager(root, memory=f"shm://{job}", ranks_per_node=1, persist_every=1)
    try:
        mgr.save(1, {"extra": _values(20 + rank)}, async_save=True)
        mgr.wait()
        target = {"buf": torch.zeros(BIG)}
        res = mgr.load_latest({"extra": target})
        got = (res.report["tier"], torch.equal(target["buf"], _values(20 + rank)["buf"]))
    finally:
        mgr.close()
        if rank == 0:
            clear_memory(job)
    return got


def test_memory_tier_keeps_every_ranks_tensor(tmp_path):
    import uuid
    root = str(tmp_path / "durable")
    assert run_ranks(2, _memory_tier, root, f"test-{uuid.uuid4().hex[:10]}") == [("memory", True)] * 2
    path = f"{root}/global_step_1"    # the durable copy: merged from the two nodes' manifests
    manifest = omnickpt.read_manifest(storage_for(path))
    assert {"extra/buf/@rank0", "extra/buf/@rank1"} <= set(manifest.tensors)
    target = {"buf": torch.zeros(BIG)}
    omnickpt.load(path, {"extra": target})
    assert torch.equal(target["buf"], _values(20)["buf"])


def test_a_fitted_shard_still_refuses_local_data_of_another_shape():
    from omnickpt.adapters.base import TensorShard
    from omnickpt.layout import Box
    local = torch.zeros(2, 2)
    ok = TensorShard.fitted("w", (4, 2), torch.float32, Box((2, 0), (2, 2)), local)
    assert (ok.name, ok.shape, ok.dtype, ok.box, ok.local) == ("w", (4, 2), torch.float32, Box((2, 0), (2, 2)), local)
    with pytest.raises(UnsupportedError, match="tensor 'w': local data of shape \\(3, 2\\)"):
        TensorShard.fitted("w", (4, 2), torch.float32, Box((2, 0), (2, 2)), torch.zeros(3, 2))
    assert full_shard("s", torch.zeros(())).box == Box((), ())
