"""Hostile and unusual state: what cannot be saved is refused by name before anything is written,
what was saved as something else is named as such, and a damaged object value fails a load (or
`verify`) with CorruptCheckpointError instead of crashing the process.

Real saves and loads on real files; the damage is done to the bytes on disk.
"""
from __future__ import annotations

import json

from omnickpt.format import manifest_document
import os
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch
from torch import nn

import omnickpt
from omnickpt import CorruptCheckpointError, MismatchError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format import checksum
from omnickpt.format.objects import MAX_DEPTH, decode_object, encode_object, validate_object

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed: int, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, out))


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(module: nn.Module, values: dict[str, torch.Tensor]) -> bool:
    now = module.state_dict()
    return now.keys() == values.keys() and all(torch.equal(now[k], v) for k, v in values.items())


def _run_python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: a crash (SIGSEGV) there fails the test, not pytest."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


# -------------------------------------------------------------------------------- damaged objects
def _nested_tuples(levels: int) -> bytes:
    """An object payload of `levels` tuples inside each other, as encode_object lays a tuple out
    (extension 2 holding a msgpack list), built by hand: encode_object refuses to write it."""
    payload = msgpack.packb([1])
    for _ in range(levels - 1):
        payload = msgpack.packb([msgpack.ExtType(2, payload)])
    return msgpack.packb(msgpack.ExtType(2, payload))


def _ext_chain(levels: int) -> bytes:
    """Extensions directly inside extensions: each level's payload is the next extension."""
    data = msgpack.packb(1)
    for _ in range(levels):
        data = msgpack.packb(msgpack.ExtType(2, data))
    return data


def test_deeply_nested_payloads_raise_instead_of_crashing_the_process():
    # Before the bound, msgpack's ext_hook recursed once per level in C: a few hundred levels
    # overflowed the C stack (SIGSEGV). In a subprocess, so that a crash cannot take pytest down.
    result = _run_python("""
        import msgpack
        from omnickpt.errors import CheckpointError
        from omnickpt.format.objects import decode_object, validate_object
        import tests.test_hostile_state as t
        for name, data in (("tuples", t._nested_tuples(5000)), ("chain", t._ext_chain(5000)),
                           ("lists", b"\\x91" * 900 + b"\\x01")):
            for fn in (decode_object, validate_object):
                try:
                    fn(data, where="cfg")
                    print(name, "decoded")
                except CheckpointError as e:
                    print(name, type(e).__name__, str(e)[:60])
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 6, result.stdout
    for line in lines:
        assert "CorruptCheckpointError object 'cfg'" in line, line


def test_a_hand_made_deep_object_in_a_real_checkpoint_fails_the_load_and_verify(tmp_path):
    """Put a 3000-level payload into a saved checkpoint (with a matching checksum, so that only
    decoding can notice), then load it in a subprocess."""
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1), "cfg": {"lr": 0.1}}).wait()
    _replace_object(ckpt, "cfg", _nested_tuples(3000))
    result = _run_python(f"""
        import torch, omnickpt
        from tests.test_hostile_state import _model, _values, _same
        from omnickpt.cli import main as cli
        target = _model(7)
        before = _values(target)
        try:
            omnickpt.load({ckpt!r}, {{"model": target, "cfg": {{}}}})
            print("loaded")
        except omnickpt.CheckpointError as e:
            print(type(e).__name__, "|", e)
        print("untouched", _same(target, before))
        print("verify", cli(["verify", {ckpt!r}]))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "CorruptCheckpointError | " in out and "object 'cfg'" in out and "damaged" in out, out
    assert "untouched True" in out, out
    assert "verify 1" in out, out      # `omnickpt verify` decodes objects (validate_object), so it reports it


def _replace_object(ckpt: str, key: str, payload: bytes) -> None:
    """Append `payload` to the object's data file and point the manifest's record for `key` at it,
    with its true checksum: bytes that are intact as stored but were never written by omnickpt."""
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        doc = manifest_document(f.read())
    entry = doc["objects"][key][0]
    fentry = doc["files"][entry["file"]]
    path = os.path.join(ckpt, fentry["path"])
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(payload)
    fentry["bytes"] = offset + len(payload)
    entry.update(offset=offset, nbytes=len(payload), checksum=checksum(payload))
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(doc, f)


def _ext(code: int, value) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(value, use_bin_type=True)), use_bin_type=True)


MALFORMED = {
    "tensor payload not a list": _ext(1, 7),
    "tensor payload too short": _ext(1, ["float32", [2]]),
    "unknown tensor dtype": _ext(1, ["complex32", [1], b"\0" * 4]),
    "dtype given as a number": _ext(1, [5, [1], b"\0" * 4]),
    "negative shape": _ext(1, ["float32", [-1], b""]),
    "huge shape, no bytes": _ext(1, ["float32", [1 << 40, 1 << 40], b"\0" * 4]),
    "empty but overflowing strides": _ext(1, ["float32", [0, 1 << 40, 1 << 40], b""]),
    "bytes shorter than the shape": _ext(1, ["float32", [3], b"\0" * 4]),
    "bytes longer than the shape": _ext(1, ["int64", [1], b"\0" * 9]),
    "shape holding a string": _ext(1, ["float32", ["2"], b"\0" * 8]),
    "numpy array of unknown dtype": _ext(3, ["<q9", [1], b"\0" * 8]),
    "numpy array, wrong byte count": _ext(3, ["<f4", [4], b"\0" * 8]),
    "numpy scalar, wrong byte count": _ext(6, ["<f8", b"\0" * 3]),
    "unknown torch dtype value": _ext(7, "FloatTensor"),
    "tuple payload not a list": _ext(2, {"a": 1}),
    "set of lists": _ext(5, [[1], [2]]),
    "shard reference not UTF-8": msgpack.packb(msgpack.ExtType(8, b"\xff\xfe")),
    "extension inside a tensor payload": msgpack.packb(msgpack.ExtType(1, msgpack.packb(
        ["float32", [1], msgpack.ExtType(2, msgpack.packb([1]))]))),
    "truncated": encode_object({"a": [1, 2, 3], "b": "text"})[:-3],
    "trailing bytes": encode_object({"a": 1}) + b"\x00",
    "text not UTF-8": b"\xa2\xff\xfe",
    "set as a dict key": msgpack.packb({msgpack.ExtType(5, msgpack.packb([1])): 1}),
    "containers too deep": b"\x91" * (MAX_DEPTH + 1) + b"\x01",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_every_malformed_payload_is_a_corrupt_object_named_by_its_key(case):
    data = MALFORMED[case]
    for fn in (decode_object, validate_object):
        with pytest.raises(CorruptCheckpointError, match=r"object 'sched'.*damaged"):
            fn(data, where="sched")


def test_a_malformed_object_in_a_real_checkpoint_leaves_the_model_untouched(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1), "rng": {"state": torch.arange(4)}}).wait()
    _replace_object(ckpt, "rng", encode_object({"state": torch.arange(4)}).replace(b"int64", b"int65"))
    target = _model(7)
    before = _values(target)
    with pytest.raises(CorruptCheckpointError, match=r"object 'rng'.*unknown dtype 'int65'.*damaged"):
        omnickpt.load(ckpt, {"model": target, "rng": {}})
    assert _same(target, before)


def test_validate_object_decodes_everything_but_never_unpickles(tmp_path):
    marker = tmp_path / "ran"
    shell = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    evil = msgpack.packb({"ok": [1, (2, 3)], "trap": msgpack.ExtType(4, shell)}, use_bin_type=True)
    validate_object(evil, where="sched")        # a pickled value is opaque bytes to it
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"object 'sched'.*allow_pickle=True"):
        decode_object(evil, where="sched")
    assert not marker.exists()
    # a good value validates; a refused numpy dtype is refused by both
    validate_object(encode_object({"t": torch.ones(2), "a": np.arange(3), "s": {1, 2}}), where="x")
    obj_array = _ext(3, ["|O", [1], b"\0" * 8])
    for fn in (decode_object, validate_object):
        with pytest.raises(UnsafeCheckpointError, match="numpy dtype"):
            fn(obj_array, where="x")


def test_values_nested_to_the_limit_round_trip_and_deeper_ones_are_refused_by_name(tmp_path):
    deep = 1
    for i in range(MAX_DEPTH):
        deep = [deep] if i % 3 == 0 else (deep,) if i % 3 == 1 else {"k": deep}
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"cfg": deep}).wait()
    state = {"cfg": None}
    omnickpt.load(ckpt, state)
    assert state["cfg"] == deep
    with pytest.raises(UnsupportedError, match=rf"'cfg/.*nested more than {MAX_DEPTH} levels"):
        omnickpt.save(str(tmp_path / "deeper"), {"cfg": {"x": deep}})
    assert not omnickpt.is_committed(str(tmp_path / "deeper"))


# ------------------------------------------------------------------------------ zero-element tensors
class _WithEmpty(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.empty = nn.Linear(4, 0)             # weight (0, 4), bias (0,)
        self.fc = nn.Linear(4, 2)


def _empty_round_trip(ckpt: str, seed: int) -> dict:
    """Save modules holding zero-element tensors (one of them nothing else), load them strictly."""
    model, only = _WithEmpty(seed), nn.Linear(4, 0)
    omnickpt.save(ckpt, {"model": model, "only": only}).wait()
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        tensors = manifest_document(f.read())["tensors"]
    target = _WithEmpty(seed + 100)
    other = nn.Linear(4, 0)
    omnickpt.load(ckpt, {"model": target, "only": other})
    return {"entries": {k: (v["shape"], v["boxes"]) for k, v in tensors.items() if "empty" in k or "only" in k},
            "loaded": _same(target, _values(model)),
            "shapes": (tuple(other.weight.shape), tuple(other.bias.shape))}


def test_zero_element_tensors_save_and_load_strictly(tmp_path):
    out = _empty_round_trip(str(tmp_path / "ckpt"), 1)
    assert out["entries"] == {"model/empty.weight": ([0, 4], []), "model/empty.bias": ([0], []),
                              "only/weight": ([0, 4], []), "only/bias": ([0], [])}
    assert out["loaded"] and out["shapes"] == ((0, 4), (0,))


def _two_rank_empty(rank: int, world: int, root: str) -> dict:
    return _empty_round_trip(os.path.join(root, "ckpt"), 1)


def test_zero_element_tensors_on_two_ranks(tmp_path):
    from dist import run_ranks
    for out in run_ranks(2, _two_rank_empty, str(tmp_path)):
        assert out["entries"]["model/empty.weight"] == ([0, 4], []) and out["entries"]["only/bias"] == ([0], [])
        assert out["loaded"] and out["shapes"] == ((0, 4), (0,))


# ---------------------------------------------------------------------------------- optimizer kinds
def _stepped(model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _optimizer_snapshot(opt: torch.optim.Optimizer):
    sd = opt.state_dict()
    return ({i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for i, st in sd["state"].items()},
            [{k: v for k, v in g.items()} for g in sd["param_groups"]])


def _same_optimizer(opt: torch.optim.Optimizer, snap) -> bool:
    state, groups = _optimizer_snapshot(opt)
    return groups == snap[1] and state.keys() == snap[0].keys() and all(
        st.keys() == snap[0][i].keys() and all(torch.equal(v, snap[0][i][k]) if isinstance(v, torch.Tensor)
                                               else v == snap[0][i][k] for k, v in st.items())
        for i, st in state.items())


@pytest.mark.parametrize("stepped", [True, False], ids=["stepped-adam", "fresh-adam"])
def test_an_sgd_checkpoint_is_refused_by_adam_before_anything_is_installed(tmp_path, stepped):
    ckpt = str(tmp_path / "ckpt")
    saved = _model(1)
    omnickpt.save(ckpt, {"model": saved, "optim": _stepped(saved, torch.optim.SGD(saved.parameters(), lr=0.1,
                                                                                   momentum=0.9))}).wait()
    target = _model(7)
    adam = torch.optim.Adam(target.parameters(), lr=1e-3)
    if stepped:
        _stepped(target, adam)
    before, opt_before = _values(target), _optimizer_snapshot(adam)
    with pytest.raises(MismatchError) as info:
        omnickpt.load(ckpt, {"model": target, "optim": adam})
    msg = str(info.value)
    assert "optim:" in msg and "momentum_buffer" in msg and "strict=False" in msg, msg
    if stepped:
        assert "['exp_avg', 'exp_avg_sq', 'step']" in msg, msg
    else:
        assert "torch.optim.sgd.SGD" in msg and "torch.optim.adam.Adam" in msg, msg
    assert any("optim:" in d for d in info.value.differences)
    assert _same(target, before) and _same_optimizer(adam, opt_before)

    # strict=False loads the model and leaves the optimizer as it was, saying why
    result = omnickpt.load(ckpt, {"model": target, "optim": adam}, strict=False)
    assert _same(target, _values(saved)) and _same_optimizer(adam, opt_before)
    assert any(d.startswith("optim:") and "momentum_buffer" in d for d in result.differences), result.differences
    _stepped(target, adam)      # and it still steps


def test_sgd_without_momentum_is_refused_by_adam_too(tmp_path):
    # SGD without momentum stores no state tensors: only the recorded class tells it apart.
    ckpt = str(tmp_path / "ckpt")
    saved = _model(1)
    omnickpt.save(ckpt, {"model": saved, "optim": _stepped(saved, torch.optim.SGD(saved.parameters(), lr=0.1))}).wait()
    target = _model(7)
    adam = _stepped(target, torch.optim.Adam(target.parameters()))
    with pytest.raises(MismatchError, match=r"optim: .*torch\.optim\.sgd\.SGD.*torch\.optim\.adam\.Adam"):
        omnickpt.load(ckpt, {"model": target, "optim": adam})


def test_the_normal_resume_into_a_fresh_optimizer_of_the_same_kind_works(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _model(1)
    opt = _stepped(saved, torch.optim.Adam(saved.parameters(), lr=0.01))
    omnickpt.save(ckpt, {"model": saved, "optim": opt}).wait()
    target = _model(7)
    fresh = torch.optim.AdamW(target.parameters(), lr=0.5)     # AdamW is an Adam: Adam's state fits it
    omnickpt.load(ckpt, {"model": target, "optim": fresh})
    assert fresh.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(fresh.state[p]["exp_avg"], opt.state[q]["exp_avg"])
               for p, q in zip(target.parameters(), saved.parameters()))
    _stepped(target, fresh)
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        assert manifest_document(f.read())["layout"]["frameworks"]["optim"] == "torch.optim.adam.Adam"


# --------------------------------------------------------------------- plain tensors in the state
def test_plain_tensors_are_checked_and_filled_in_place(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1), "t": torch.arange(4.0),
                         "extra": {"ema": torch.full((4,), 2.0), "step": 7, "nested": {"w": torch.ones(2, 2)}}}).wait()
    ema, w = torch.zeros(4), torch.zeros(2, 2)
    state = {"model": _model(7), "t": torch.zeros(4), "extra": {"ema": ema, "step": 0, "nested": {"w": w}}}
    t = state["t"]
    omnickpt.load(ckpt, state)
    # the caller's references see the loaded values; non-tensor values are written back
    assert state["t"] is t and torch.equal(t, torch.arange(4.0))
    assert state["extra"]["ema"] is ema and torch.equal(ema, torch.full((4,), 2.0))
    assert state["extra"]["nested"]["w"] is w and torch.equal(w, torch.ones(2, 2))
    assert state["extra"]["step"] == 7


def test_a_plain_tensor_of_another_shape_or_dtype_never_replaces_the_target(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _model(1)
    omnickpt.save(ckpt, {"model": saved, "t": torch.arange(10), "extra": {"ema": torch.arange(10), "step": 7}}).wait()

    def fresh():
        return {"model": _model(7), "t": torch.zeros(4), "extra": {"ema": torch.zeros(4), "step": 0}}

    state = fresh()
    model_before = _values(state["model"])
    with pytest.raises(MismatchError) as info:
        omnickpt.load(ckpt, state)
    msg = str(info.value)
    for name in ("t:", "extra/ema:"):
        assert name in msg, msg
    assert "shape [10] and dtype int64 in the checkpoint" in msg and "shape [4] and dtype float32 in the target" in msg
    assert _same(state["model"], model_before)
    assert torch.equal(state["t"], torch.zeros(4)) and state["extra"] == {"ema": state["extra"]["ema"], "step": 0}

    state = fresh()
    result = omnickpt.load(ckpt, state, strict=False)
    assert {d.split(":")[0] for d in result.differences} >= {"t", "extra/ema"}, result.differences
    assert state["t"].dtype == torch.float32 and torch.equal(state["t"], torch.zeros(4))
    assert torch.equal(state["extra"]["ema"], torch.zeros(4)) and state["extra"]["step"] == 7
    assert _same(state["model"], _values(saved))


# ---------------------------------------------------------- saved as one kind of entry, loaded as another
def test_a_state_dict_saved_and_loaded_into_a_module_is_named_as_such(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1).state_dict()}).wait()
    target = _model(7)
    before = _values(target)
    with pytest.raises(MismatchError, match=r"state entry 'model' was saved as a plain value .* the target is a "
                                            r"module with 4 tensor\(s\); save the module itself"):
        omnickpt.load(ckpt, {"model": target})
    assert _same(target, before)


def test_a_module_saved_and_loaded_into_a_dict_of_its_tensors_fills_them(tmp_path):
    # A module's tensors are named by their place ("model/0.weight"), so a flat dict of named tensors
    # (model.state_dict(), get_model_state_dict) loads them in place (issue 19: DCP-shaped state dicts).
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1)}).wait()
    target = _model(7)
    omnickpt.load(ckpt, {"model": target.state_dict()})
    assert _same(target, _values(_model(1)))


def test_a_module_saved_and_loaded_into_a_dict_of_other_names_is_named_as_such(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    omnickpt.save(ckpt, {"model": _model(1)}).wait()
    target = _model(7)
    state = {"model": {f"other.{k}": v for k, v in target.state_dict().items()}}
    with pytest.raises(MismatchError, match=r"state entry 'model' was saved as a module \(plain\), 4 tensor\(s\) "
                                            r"such as .* but the target is a dict of 4 entries"):
        omnickpt.load(ckpt, state)
    assert _same(target, _values(_model(7)))


# --------------------------------------------------------------------------- refused before writing
def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return _model(1)


def test_a_model_on_the_meta_device_is_refused_on_save_and_on_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(UnsupportedError, match=r"tensor 'model/0\.weight' is on the meta device.*to_empty"):
        omnickpt.save(ckpt, {"model": _meta_model()})
    assert not omnickpt.is_committed(ckpt)
    omnickpt.save(ckpt, {"model": _model(1)}).wait()
    with pytest.raises(UnsupportedError, match=r"tensor 'model/0\.weight' of the state to load is on the meta "
                                               r"device.*module\.to_empty\(device=\.\.\.\) before loading"):
        omnickpt.load(ckpt, {"model": _meta_model()})
    materialized = _meta_model().to_empty(device="cpu")
    omnickpt.load(ckpt, {"model": materialized})
    assert _same(materialized, _values(_model(1)))


def _with_buffer(name: str, value: torch.Tensor) -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer(name, value)
    return m


UNSUPPORTED_TENSORS = {
    "complex32 buffer": (lambda: {"model": _with_buffer("b", torch.zeros(2, dtype=torch.complex32))},
                         r"tensor 'model/b' has dtype torch\.complex32.*it stores float64, float32"),
    "sparse buffer": (lambda: {"model": _with_buffer("b", torch.eye(3).to_sparse())},
                      r"tensor 'model/b' is a sparse_coo tensor.*to_dense"),
    "quantized tensor in a dict": (lambda: {"extra": {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0,
                                                                                        torch.qint8)}},
                                   r"tensor 'extra/q' .*(qint8|quantized)"),
    "complex32 top-level tensor": (lambda: {"t": torch.zeros(2, dtype=torch.complex32)},
                                   r"tensor 't' has dtype torch\.complex32"),
}
if hasattr(torch, "uint3"):
    UNSUPPORTED_TENSORS["uint3 buffer"] = (lambda: {"model": _with_buffer("b", torch.empty(2, dtype=torch.uint3))},
                                           r"tensor 'model/b' has dtype torch\.uint3")


@pytest.mark.parametrize("case", sorted(UNSUPPORTED_TENSORS))
def test_tensors_the_format_cannot_hold_are_refused_by_name_before_writing(tmp_path, case):
    make, pattern = UNSUPPORTED_TENSORS[case]
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(UnsupportedError, match=pattern):
        omnickpt.save(ckpt, make())
    assert not omnickpt.is_committed(ckpt) and not os.path.exists(os.path.join(ckpt, "data"))


@pytest.mark.parametrize("state, pattern", [
    (lambda: {"w\ud800": torch.zeros(2)}, r"state key 'w\\ud800' is not valid Unicode"),
    (lambda: {"model": _with_buffer("w\ud800", torch.zeros(2))}, r"tensor 'model/w\\ud800': its name is not valid"),
    (lambda: {"extra": {"name": "caf\udce9"}}, r"'extra/name': the text 'caf\\udce9' is not valid Unicode"),
    (lambda: {"extra": {"caf\udce9": 1}}, r"'extra': the dict key 'caf\\udce9' is not valid Unicode"),
], ids=["state-key", "buffer-name", "text-value", "dict-key"])
def test_names_and_text_that_are_not_unicode_are_refused_with_their_repr(tmp_path, state, pattern):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(UnsupportedError, match=pattern) as info:
        omnickpt.save(ckpt, state())
    str(info.value).encode("utf-8")     # the message itself can be printed and sent to other ranks
    assert not omnickpt.is_committed(ckpt)


def test_dict_keys_load_back_as_keys_or_are_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    value = {(1, "a"): 2, 3: "three", 1.5: None, None: [1], b"raw": True, (2, (3, 4)): {"x": 1}}
    omnickpt.save(ckpt, {"extra": value}).wait()
    state = {"extra": None}
    omnickpt.load(ckpt, state)
    assert state["extra"] == value
    with pytest.raises(UnsupportedError, match=r"'extra': the dict key frozenset\(\{1\}\) holds a set.*tuple"):
        omnickpt.save(ckpt, {"extra": {frozenset({1}): 2}})
    with pytest.raises(UnsupportedError, match=r"extra: a value of type builtins\.object cannot be saved without "
                                               r"pickle.*allow_pickle=True"):
        omnickpt.save(ckpt, {"extra": {object(): 2}})
    with pytest.raises(UnsupportedError, match=r"'extra/n': the integer 1180591620717411303424 does not fit in 64"):
        omnickpt.save(ckpt, {"extra": {"n": 2 ** 70}})
    state = {"extra": None}
    omnickpt.load(ckpt, state)          # the refused saves left the checkpoint as it was
    assert state["extra"] == value
