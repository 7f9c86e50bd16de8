"""What a save reuses from the last one while the state's layout is unchanged (adapters/reuse.py,
saving._Reuse): a second save of the same layout collects nothing again, and any change of the
layout between two saves (a shape, a dtype, a key, a parameter's data, a DTensor placement) is
seen, so that the checkpoint holds the state as it is (loaded back and compared bitwise)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.adapters.module import ModuleAdapter
from omnickpt.adapters.optimizer import OptimizerAdapter
from dist import run_ranks


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4)).to(dtype)
    return m


def _stepped(model, opt):
    model(torch.randn(5, 6, dtype=next(model.parameters()).dtype)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _values(state) -> dict:
    """Every tensor the checkpoint of `state` holds, by name, as saved (copies)."""
    from omnickpt.adapters import collect_save
    return {s.name: s.local.detach().clone() for _, items in collect_save(state) for s in items.shards}


def _check_roundtrip(path, state, counted=None):
    """Read every tensor of `path` back and compare it bitwise with the state's (its adapters'
    calls here are not counted in `counted`)."""
    before = dict(counted or {})
    want = _values(state)
    if counted is not None:
        counted.update(before)
    with omnickpt.open(path) as reader:
        for name, t in want.items():
            got = reader.get(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got, t), name
        assert set(reader.names()) == set(want)


@pytest.fixture
def counted(monkeypatch):
    """How many times the module and optimizer adapters collected an entry."""
    calls = {"module": 0, "optimizer": 0}
    for cls, kind in ((ModuleAdapter, "module"), (OptimizerAdapter, "optimizer")):
        orig = cls.save_items

        def wrapped(self, key, value, state, orig=orig, kind=kind):
            calls[kind] += 1
            return orig(self, key, value, state)
        monkeypatch.setattr(cls, "save_items", wrapped)
    return calls


@pytest.mark.parametrize("async_save", [False, True])
def test_unchanged_layout_is_not_collected_again(tmp_path, counted, async_save):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _stepped(model, opt)
    state = {"model": model, "optimizer": opt, "step": 3}
    with omnickpt.Checkpointer() as ckpt:
        for i in range(3):
            ckpt.save(tmp_path / f"c{i}", state, async_save=async_save).wait()
            _check_roundtrip(tmp_path / f"c{i}", state, counted)
            _stepped(model, opt)     # values change between saves, the layout does not
        memo = ckpt._reuse[id(ckpt.comm())]
        assert counted == {"module": 1, "optimizer": 1}
        assert memo.entries.hits == 4 and memo.entries.misses == 0
        # and the learning rate (an object, not a tensor) is saved as it is at each save
        opt.param_groups[0]["lr"] = 0.125
        ckpt.save(tmp_path / "lr", state).wait()
    with omnickpt.open(tmp_path / "lr") as reader:
        assert reader.objects(["optimizer"])["optimizer"]["param_groups"][0]["lr"] == 0.125


def _change_shape(model, opt, state):
    with torch.no_grad():
        model[2].bias.data = torch.randn(5)               # the same Parameter object, shape [4] -> [5]


def _change_to_a_view(model, opt, state):
    with torch.no_grad():
        model[2].weight.data = torch.randn(8, 4).t()      # the same object and shape: non-contiguous new data


def _change_dtype(model, opt, state):
    model.to(torch.float64)                               # param.data = ...: the same Parameter objects


def _change_data(model, opt, state):
    with torch.no_grad():
        model[0].weight.data = torch.randn(8, 6)          # same object, shape and dtype: new storage


def _add_key(model, opt, state):
    state["extra"] = torch.arange(7.0)


def _add_buffer(model, opt, state):
    model[0].register_buffer("scale", torch.full((3,), 2.0))


def _buffer_not_persistent(model, opt, state):
    bn = model[3]
    running = bn._buffers["running_var"]
    del bn._buffers["running_var"]
    bn.register_buffer("running_var", running, persistent=False)


def _replace_module(model, opt, state):
    model[1] = nn.Linear(8, 8)                            # a child replaced (the optimizer knows none of it)


def _optimizer_reloaded(model, opt, state):
    import copy
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, same values


def _optimizer_state_dtype(model, opt, state):
    for st in opt.state.values():
        st["exp_avg"].data = st["exp_avg"].data.double()


def _transpose_in_place(model, opt, state):
    with torch.no_grad():                                 # same object, address, shape, dtype; new strides
        model[0].weight.as_strided_((8, 6), (1, 8))       # (what t_() does to a square matrix)


@pytest.mark.parametrize("change", [_change_shape, _change_to_a_view, _transpose_in_place, _change_dtype,
                                    _change_data, _add_key,
                                    _add_buffer, _buffer_not_persistent, _replace_module, _optimizer_reloaded,
                                    _optimizer_state_dtype])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_changed_layout_is_seen(tmp_path, counted, change, async_save):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _stepped(model, opt)
    state = {"model": model, "optimizer": opt}
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "a", state, async_save=async_save).wait()
        ckpt.save(tmp_path / "b", state, async_save=async_save).wait()   # reused
        before = dict(counted)
        change(model, opt, state)
        ckpt.save(tmp_path / "c", state, async_save=async_save).wait()
        _check_roundtrip(tmp_path / "c", state, counted)
        if change is not _add_key:        # a key of its own: the others are reused, their records are not
            assert counted != before      # collected anew
        # and, unchanged again, reused again with the new layout
        ckpt.save(tmp_path / "d", state, async_save=async_save).wait()
        _check_roundtrip(tmp_path / "d", state, counted)
        assert ckpt._reuse[id(ckpt.comm())].entries.hits >= 2


def test_hooks_or_extra_state_are_never_memoised(tmp_path, counted):
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"n": 1}

        def set_extra_state(self, state):
            pass
    hooked = nn.Linear(3, 3)
    hooked.register_state_dict_post_hook(lambda *a: None)
    for module in (WithExtra(3, 3), hooked):
        with omnickpt.Checkpointer() as ckpt:
            for i in range(2):
                ckpt.save(tmp_path / f"x{i}", {"model": module}).wait()
            assert not ckpt._reuse[id(ckpt.comm())].entries.entries
    assert counted["module"] == 4


# ---------------------------------------------------------------------------- DTensors, 2 ranks
def _dtensor_model(layout, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    if layout == "fsdp2":
        for m in model:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:   # parameters sharded by hand, as tensor parallelism leaves them
        for m in model:
            for name, p in list(m.named_parameters()):
                setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model


def _dtensor_changes(rank, world_size, root, layout):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from models import full_values, stepped
    mesh = init_device_mesh("cpu", (world_size,))
    model = _dtensor_model(layout, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stepped(model, opt)
    state = {"model": model, "optimizer": opt}
    out = {}
    ckpt = omnickpt.Checkpointer()

    def save_and_check(name):
        handle = ckpt.save(f"{root}/{name}", state, async_save=True)
        saved = full_values(model, opt)
        stepped(model, opt)            # right after an async save's call: must not reach the checkpoint
        handle.wait()
        fresh = _dtensor_model(layout, mesh)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        stepped(fresh, fresh_opt)
        ckpt.load(f"{root}/{name}", {"model": fresh, "optimizer": fresh_opt})
        got = full_values(fresh, fresh_opt)
        assert saved.keys() == got.keys()
        return [k for k in saved if not torch.equal(saved[k], got[k])]

    out["first"] = save_and_check("a")
    out["reused"] = save_and_check("b")
    memo = ckpt._reuse[id(ckpt.comm())].entries
    out["hits"] = memo.hits
    if layout == "fsdp2":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))    # new optimizer state tensors
    else:
        # Another placement of the same parameter object (as module._apply swaps a DTensor's
        # contents): sharded on dim 1 instead of dim 0.
        w = model[0].weight
        full = w.full_tensor().detach()
        torch.utils.swap_tensors(w, nn.Parameter(distribute_tensor(full, mesh, [Shard(1)])))
        opt.state.pop(w, None)       # its Adam state was laid out for the old placement
        stepped(model, opt)
    before = memo.misses
    out["changed"] = save_and_check("c")
    out["missed"] = memo.misses - before
    out["again"] = save_and_check("d")
    ckpt.close()
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "dtensor"])
def test_dtensor_reuse_and_placement_change(tmp_path, layout):
    res = run_ranks(2, _dtensor_changes, str(tmp_path), layout)
    for r in res:
        assert r["first"] == [] and r["reused"] == [] and r["changed"] == [] and r["again"] == [], r
        assert r["hits"] == 2          # the model and the optimizer, on the second save
        assert r["missed"] >= 1


def test_a_refused_entry_is_refused_again(tmp_path):
    """An entry the format cannot hold is not memoised: the next save refuses it again."""
    model = nn.Linear(3, 3)
    model.register_buffer("ghost", torch.empty(2, device="meta"))
    with omnickpt.Checkpointer() as ckpt:
        for _ in range(2):
            with pytest.raises(omnickpt.errors.UnsupportedError):
                ckpt.save(tmp_path / "x", {"model": model}).wait()


def test_an_optimizer_hook_added_later_is_seen(tmp_path, counted):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _stepped(model, opt)
    state = {"model": model, "optimizer": opt}
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "a", state).wait()
        opt.register_state_dict_pre_hook(lambda o: None)
        ckpt.save(tmp_path / "b", state).wait()
        ckpt.save(tmp_path / "c", state).wait()
    assert counted["optimizer"] == 3      # never reused once the optimizer has a state_dict hook
    _check_roundtrip(tmp_path / "c", state)


def _dtensor_shard_edits(rank, world_size):
    """The DTensor part of the fingerprint sees each in-place edit of a local shard it claims to
    see (adapters/reuse.py _tensors_sig), and an untouched DTensor gives an equal fingerprint."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from omnickpt.adapters.reuse import _tensors_sig
    mesh = init_device_mesh("cpu", (world_size,))
    t = distribute_tensor(torch.randn(4 * world_size, 4), mesh, [Shard(0)])
    plain = torch.randn(3)
    before = _tensors_sig([t, plain])
    out = {"unchanged": _tensors_sig([t, plain]) == before}
    local = t._local_tensor
    edits = {
        "new data, same shard object": lambda: local.set_(local.clone()),
        "narrowed in place": lambda: local.set_(local.untyped_storage(), 0, (2, 4), (4, 1)),
        "transposed in place": lambda: local.as_strided_((4, 4), (1, 4)),
        "another local shard": lambda: setattr(t, "_local_tensor", local.clone()),
        "another spec": lambda: setattr(t, "_spec", type(t._spec)(t._spec.mesh, t._spec.placements,
                                                                     t._spec.tensor_meta)),
    }
    for name, edit in edits.items():
        saved = (t._local_tensor, t._spec)
        keep = local.untyped_storage(), local.storage_offset(), local.shape, local.stride()
        sig = _tensors_sig([t, plain])
        edit()
        out[name] = _tensors_sig([t, plain]) != sig
        local.set_(*keep)
        t._local_tensor, t._spec = saved
    return out


def test_each_in_place_edit_of_a_dtensor_shard_changes_the_fingerprint():
    res = run_ranks(1, _dtensor_shard_edits)[0]
    assert res.pop("unchanged") is True
    assert all(res.values()), res
