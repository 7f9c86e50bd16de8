"""Issue 17, foreign formats: a hostile or careless user against the DCP and Hugging Face readers and exporters
(omnickpt/formats/dcp.py, hf.py, export.py).

- a DCP export never drops or mis-keys a value: top-level tensors are keyed as dcp.save keys them (real
  `dcp.load` reads them back), keys that collide once DCP joins their paths with "." are refused naming
  both, with nothing written; a full disk is a StorageError naming the file, the destination left as found;
- decoders are bounded: a deflated value item (or Megatron's common.pt) that inflates past the 256 MiB cap
  is refused before it is inflated, and a hostile data.pkl is a CorruptCheckpointError naming the file;
- a Hugging Face Hub cache snapshot (links into its own blobs/) loads; links anywhere else are refused;
- an HF export never writes an optimizer's moments as the model, and says which entry it wrote.

The full-disk tests mount a 1 MiB tmpfs (root only; skipped where mount is not permitted).
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import struct
import subprocess
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import omnickpt
from dist import run_ranks
from models import hand_made_dcp
from omnickpt.convert import convert
from omnickpt.errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError, UnsupportedError
from omnickpt.export.dcp import export_dcp
from omnickpt.export.hf import export_hf
from omnickpt.formats import dcp as dcp_format
from omnickpt.storage import storage_for
from omnickpt.transforms import Rename


# ---------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _small_disk(path, size: str = "1m"):
    """A tmpfs of `size` mounted at `path`: a real full disk (ENOSPC), not a mock."""
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): the full-disk test needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _peak_growth(fn) -> int | None:
    """How far the process's peak resident memory rose above its current one while `fn` ran (None where
    the peak cannot be reset: then only the error is checked)."""
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")     # resets VmHWM to the current RSS
    except OSError:
        fn()
        return None
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


class _Pid:
    """A persistent id in a hand-made data.pkl: torch's ("storage", type, key, location, numel)."""

    def __init__(self, pid):
        self.pid = pid


class _Rebuild:
    """A call of torch._utils._rebuild_tensor_v2 in a hand-made data.pkl, with any arguments."""

    def __init__(self, *args, fn=torch._utils._rebuild_tensor_v2):
        self.fn, self.args = fn, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Pid) else None

    def reducer_override(self, obj):
        return (obj.fn, obj.args) if isinstance(obj, _Rebuild) else NotImplemented


def _data_pkl(obj) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def _tensor_pkl(storage, offset=0, size=(2, 1), stride=(1, 1)) -> bytes:
    return _data_pkl(_Rebuild(storage, offset, size, stride, False, collections.OrderedDict()))


def _float_storage(numel=2, key="0", kind=torch.FloatStorage):
    return _Pid(("storage", kind, key, "cpu", numel))


def _archive(pkl: bytes, storage: bytes = bytes(8)) -> bytes:
    """A torch.save-like archive (stored entries) with data.pkl `pkl` and storage "0"."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", storage)
    return out.getvalue()


def _inflating_archive(nbytes: int) -> bytes:
    """A torch.save archive of one float32 tensor whose storage entry is `nbytes` of zeros, deflated to about
    nbytes / 1000, its sizes and CRC declared truthfully: what torch.load inflates in full. Built without
    holding `nbytes`: after a full flush, each MiB of zeros deflates to the same block."""
    mib = bytes(1 << 20)
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    first, block = z.compress(mib) + z.flush(zlib.Z_FULL_FLUSH), z.compress(mib) + z.flush(zlib.Z_FULL_FLUSH)
    assert z.compress(mib) + z.flush(zlib.Z_FULL_FLUSH) == block
    last = z.compress(mib) + z.flush(zlib.Z_FINISH)
    n = nbytes >> 20
    stream = first + block * (n - 2) + last
    crc = 0
    for _ in range(n):
        crc = zlib.crc32(mib, crc)
    entries = [("archive/data.pkl", 0, _tensor_pkl(_float_storage(nbytes // 4), size=(nbytes // 4,), stride=(1,)),
                None, None),
               ("archive/byteorder", 0, b"little", None, None),
               ("archive/data/0", 8, stream, nbytes, crc)]
    out, central = bytearray(), bytearray()
    for name, method, data, size, crc32 in entries:
        size = len(data) if size is None else size
        crc32 = zlib.crc32(data) if crc32 is None else crc32
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc32, len(data), size, len(name), 0)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc32, len(data), size,
                               len(name), 0, 0, 0, 0, 0, len(out)) + name.encode()
        out += header + name.encode() + data
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central),
                                 len(out), 0)
    return bytes(out)


def _replace_item(path, fqn: str, item: bytes) -> None:
    """Put `item` in place of the stored item of `fqn` in the DCP folder `path` (the metadata follows)."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    data = (path / "__0_0.distcp").read_bytes()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    at, old = info.offset, info.length
    for v in md.storage_data.values():
        if v.offset > at:
            v.offset += len(item) - old
    info.length = len(item)
    (path / "__0_0.distcp").write_bytes(data[:at] + item + data[at + old:])
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _adam_after_a_step(model: nn.Module) -> torch.optim.Adam:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()
    return opt


# ---------------------------------------------------------------------- DCP export: every value, keyed as DCP keys it
def test_a_dcp_export_of_top_level_tensors_is_keyed_as_dcp_save_keys_them(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    weights = {"layer.weight": torch.randn(3, 2), "bias": torch.arange(3.0)}
    save_file(weights, str(hf / "model.safetensors"))
    flat = str(tmp_path / "flat")     # the tensors at the top level of the state: no "model/" above them
    convert(str(hf), flat, to="omnickpt", transforms=[Rename.regex("^model/", "")], progress=False)
    assert sorted(omnickpt.api.read_manifest(storage_for(flat)).tensors) == ["bias", "layer.weight"]
    out = str(tmp_path / "dcp")
    export_dcp(flat, out, progress=False)
    sd = {"layer.weight": torch.zeros(3, 2), "bias": torch.zeros(3)}
    dcp.load(sd, checkpoint_id=out, no_dist=True)    # torch itself: "layer.weight." would be a missing key
    assert all(torch.equal(sd[k], weights[k]) for k in weights)


def _save_per_rank_values(rank, world_size, path):
    # a plain tensor of 2 MiB is saved per rank ("big/@rank<r>"); the export writes the lowest rank's
    omnickpt.save(path, {"model": nn.Linear(2, 2), "big": torch.full((512, 1024), float(rank + 1))})


def test_a_dcp_export_writes_the_lowest_ranks_per_rank_tensor_and_skips_the_others(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "dcp")
    run_ranks(2, _save_per_rank_values, src)
    assert {"big/@rank0", "big/@rank1"} <= set(omnickpt.api.read_manifest(storage_for(src)).tensors)
    export_dcp(src, out, progress=False)
    sd = {"big": torch.zeros(512, 1024)}
    dcp.load(sd, checkpoint_id=out, no_dist=True)
    assert torch.equal(sd["big"], torch.full((512, 1024), 1.0))


def test_a_dcp_export_refuses_keys_that_collide_naming_both_and_writes_nothing(tmp_path):
    src = str(tmp_path / "src")
    # a careless state: the module "model" has a tensor "weight", and a plain value sits at "model.weight"
    omnickpt.save(src, {"model": nn.Linear(2, 2), "model.weight": 5})
    new = tmp_path / "new"
    with pytest.raises(UnsupportedError) as err:
        export_dcp(src, str(new), progress=False)
    message = str(err.value)
    assert "'model.weight'" in message and "tensor 'model/weight'" in message and "object 'model.weight'" in message
    assert "Nothing was written" in message
    assert not new.exists()                      # the destination is left as it was: absent
    empty = tmp_path / "empty"
    empty.mkdir()
    omnickpt.save(str(tmp_path / "src2"), {"cfg": {"a.b": 1, "a": {"b": 2}}})
    with pytest.raises(UnsupportedError, match=r"'cfg.a.b'.*\['cfg', 'a.b'\].*\['cfg', 'a', 'b'\]|"
                                               r"\['cfg', 'a.b'\].*\['cfg', 'a', 'b'\].*'cfg.a.b'"):
        export_dcp(str(tmp_path / "src2"), str(empty), progress=False)
    assert os.listdir(empty) == []               # ... or empty


def test_a_dcp_export_to_a_full_disk_is_a_storage_error_and_leaves_nothing(tmp_path):
    src = str(tmp_path / "src")
    omnickpt.save(src, {"model": nn.Linear(1024, 1024)})     # 4 MiB of weights onto a 1 MiB disk
    with _small_disk(tmp_path / "disk") as disk:
        with pytest.raises(StorageError) as err:
            export_dcp(src, str(disk / "out"), progress=False)
        assert str(disk / "out" / "__0_0.distcp") in str(err.value)
        assert "ENOSPC" in str(err.value) and "free space" in str(err.value)
        assert os.listdir(disk) == []            # the folder the export made is gone too


def test_an_hf_export_to_a_full_disk_is_a_storage_error_and_leaves_nothing(tmp_path):
    src = str(tmp_path / "src")
    omnickpt.save(src, {"model": nn.Linear(1024, 1024)}, metadata={"config": {"model_type": "x"}})
    with _small_disk(tmp_path / "disk") as disk:
        with pytest.raises(StorageError, match=rf"{disk / 'out'}/model.safetensors.*ENOSPC.*free space"):
            export_hf(src, str(disk / "out"), progress=False)
        assert os.listdir(disk) == []


# ---------------------------------------------------------------------- bounded decoders
INFLATED = 512 << 20     # twice the 256 MiB cap


def test_a_deflated_value_that_inflates_past_the_cap_is_refused_before_it_is_inflated(tmp_path):
    dcp.save({"model": {"w": torch.ones(2)}, "extra": {"blob": (torch.zeros(2),)}}, checkpoint_id=str(tmp_path),
             no_dist=True)
    bomb = _inflating_archive(INFLATED)
    assert len(bomb) < 2 << 20
    _replace_item(tmp_path, "extra.blob", bomb)
    for read in (lambda: dcp_format.read_manifest(storage_for(str(tmp_path))),
                 lambda: omnickpt.open(str(tmp_path)),
                 lambda: omnickpt.load(str(tmp_path), {"model": {"w": torch.zeros(2)}, "extra": None})):
        def run():
            with pytest.raises(CorruptCheckpointError) as err:
                read()
            assert str(tmp_path / "__0_0.distcp") in str(err.value) and "value 'extra.blob'" in str(err.value)
            assert "256 MiB" in str(err.value)
        grew = _peak_growth(run)
        assert grew is None or grew < 64 << 20, f"reading the metadata raised the peak memory by {grew >> 20} MiB"


def test_megatron_common_pt_goes_through_the_same_bounded_decoder(tmp_path):
    dcp.save({"decoder.weight": torch.ones(2, 2)}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (tmp_path / "common.pt").write_bytes(_inflating_archive(INFLATED))

    def run():
        with pytest.raises(CorruptCheckpointError, match=rf"{tmp_path / 'common.pt'}.*256 MiB"):
            dcp_format.read_manifest(storage_for(str(tmp_path)))
    grew = _peak_growth(run)
    assert grew is None or grew < 64 << 20, f"reading common.pt raised the peak memory by {grew >> 20} MiB"


# Hostile data.pkl variants the reader once let through: wrong types in persistent ids, negative or huge offsets
# and sizes, and unknown storage types were already refused (tests/test_dcp.py covers a few; a fuzz found no more).
_HOSTILE_TENSOR_PICKLES = {
    # a storage the pickle makes itself instead of naming one by persistent id: read as if it were one
    "storage as a plain tuple": lambda: _tensor_pkl((0, torch.float32, 2)),
    # ... with an element type that is no dtype: a bare AttributeError
    "storage as an untyped tuple": lambda: _data_pkl(_Rebuild(("0", "float32", 8), 0, (2, 1), (1, 1), False, None,
                                                              torch.float32, fn=torch._utils._rebuild_tensor_v3)),
    # a memo index of 2**26: the C unpickler allocates and zeroes a 1 GiB memo table for these 9 bytes
    "memo bomb": lambda: b"\x80\x02N" + b"r" + (1 << 26).to_bytes(4, "little") + b".",
}


@pytest.mark.parametrize("variant", sorted(_HOSTILE_TENSOR_PICKLES))
def test_a_hostile_data_pkl_is_corrupt_naming_the_file(tmp_path, variant):
    hand_made_dcp(tmp_path, _archive(_HOSTILE_TENSOR_PICKLES[variant]()))

    def run():
        with pytest.raises(CorruptCheckpointError, match=rf"{tmp_path / '__0_0.distcp'}.*'model.w'"):
            omnickpt.load(str(tmp_path), {"model": {"w": torch.zeros(2, 1)}})
    grew = _peak_growth(run)
    assert grew is None or grew < 64 << 20, f"{variant}: the peak memory rose by {grew >> 20} MiB"


def test_a_data_pkl_cannot_change_the_readers_own_functions(tmp_path):
    """BUILD with a slot state on a global would be setattr on it: on the reader's own rebuild recorder it
    would set __defaults__ for every later read in this process."""
    pkl = bytearray(_tensor_pkl(_float_storage()))
    # push the global, BUILD it with the state (None, {"__defaults__": (False, None, {"x": 1})}), pop it
    build = (b"ctorch._utils\n_rebuild_tensor_v2\n" + b"N}X\x0c\x00\x00\x00__defaults__(\x89N}X\x01\x00\x00\x00xK\x01st"
             b"s\x86b0")
    hostile = bytes(pkl[:2]) + build + bytes(pkl[2:])
    hand_made_dcp(tmp_path / "hostile", _archive(hostile))
    with pytest.raises(CorruptCheckpointError, match=rf"{tmp_path / 'hostile' / '__0_0.distcp'}.*'model.w'"):
        dcp_format.read_manifest(storage_for(str(tmp_path / "hostile")))
    saved = nn.Linear(1, 2, bias=False)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path / "clean"), no_dist=True)
    target = nn.Linear(1, 2, bias=False)
    omnickpt.load(str(tmp_path / "clean"), {"model": target})    # the next reader is unharmed
    assert torch.equal(target.weight, saved.weight)


# ---------------------------------------------------------------------- Hugging Face Hub cache
def _hub_cache(root, files: dict[str, bytes]):
    """The layout huggingface_hub's snapshot_download leaves: models--org--name/{blobs/<hash>,
    snapshots/<revision>/<file> -> ../../blobs/<hash>, refs/main}; returns the snapshot folder."""
    repo = root / "models--org--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = f"{zlib.crc32(data):08x}{len(data):08x}"
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    return snapshot


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    return save(tensors)


def test_a_hub_cache_snapshot_loads_and_links_elsewhere_are_still_refused(tmp_path):
    model = nn.Linear(3, 2)
    snapshot = _hub_cache(tmp_path, {"model.safetensors": _safetensors_bytes(model.state_dict()),
                                     "config.json": json.dumps({"model_type": "tiny"}).encode()})
    target = nn.Linear(3, 2)
    omnickpt.load(str(snapshot), {"model": target})
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)
    assert omnickpt.api.read_manifest(storage_for(str(snapshot))).layout["metadata"]["config"] == {"model_type": "tiny"}
    # a link out of the repository (a secret beside the cache), or into another repository's blobs: refused
    (tmp_path / "secret").write_text("x")
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "abc").write_bytes(_safetensors_bytes(model.state_dict()))
    for link in ("../../../../secret", "../../../../models--org--other/blobs/abc", "../../refs/main"):
        os.remove(snapshot / "model.safetensors")
        os.symlink(link, snapshot / "model.safetensors")
        with pytest.raises(UnsafeCheckpointError, match="model.safetensors"):
            omnickpt.load(str(snapshot), {"model": nn.Linear(3, 2)})


# ---------------------------------------------------------------------- HF export: a model, never an optimizer
def test_an_hf_export_never_writes_optimizer_state_as_the_model_and_names_what_it_wrote(tmp_path):
    model = nn.Linear(4, 3)
    opt = _adam_after_a_step(model)
    src = str(tmp_path / "src")
    omnickpt.save(src, {"model": model, "optim": opt})
    with pytest.raises(UnsupportedError, match=r"'optim' holds an optimizer's state \(torch.optim.adam.Adam.*'model'"):
        export_hf(src, str(tmp_path / "asked"), key="optim", progress=False)
    assert not (tmp_path / "asked").exists()
    out = export_hf(src, str(tmp_path / "default"), progress=False)
    assert out["key"] == "model" and out["entry"] == "state entry 'model' (plain)"
    # the model's tensors at the top level of the state (renamed there), the optimizer beside them
    flat = str(tmp_path / "flat")
    convert(src, flat, to="omnickpt", transforms=[Rename.regex("^model/", "")], progress=False)
    out = export_hf(flat, str(tmp_path / "flat_hf"), progress=False)
    assert out["key"] == "" and out["entry"] == "the top-level tensors of the state"
    written = load_file(str(tmp_path / "flat_hf" / "model.safetensors"))
    assert written.keys() == {"weight", "bias"} and torch.equal(written["weight"], model.weight.detach())
    # only the optimizer's state left: refused, naming it
    only = str(tmp_path / "only")
    convert(src, only, to="omnickpt", key="optim", progress=False)
    with pytest.raises(UnsupportedError, match=r"no state entry holds a model's weights.*'optim'"):
        export_hf(only, str(tmp_path / "only_hf"), progress=False)


def test_a_dcp_model_saved_at_the_top_level_beside_its_optimizer_reads_as_the_model(tmp_path):
    """dcp.save({**linear.state_dict(), "optimizer": ...}): names without dots, which the optimizer's state
    names: the model's, so that load and export find it (the export wrote the Adam moments before)."""
    model = nn.Linear(4, 3)
    opt = _adam_after_a_step(model)
    dcp.save({**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "d"), no_dist=True)
    manifest = dcp_format.read_manifest(storage_for(str(tmp_path / "d")))
    assert manifest.layout["implied_keys"] == ["model"] and {"model/weight", "model/bias"} <= set(manifest.tensors)
    out = export_hf(str(tmp_path / "d"), str(tmp_path / "hf"), progress=False)
    assert out["key"] == "model"
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(written["weight"], model.weight.detach()) and torch.equal(written["bias"], model.bias.detach())
    target = nn.Linear(4, 3)
    target_opt = torch.optim.Adam(target.parameters(), lr=0.1)
    omnickpt.load(str(tmp_path / "d"), {"model": target, "optimizer": target_opt})
    assert torch.equal(target_opt.state[target.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
