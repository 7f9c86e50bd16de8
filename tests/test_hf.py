"""Hugging Face interop (omnickpt/formats/hf.py): a safetensors folder written by transformers'
save_pretrained loads into any layout, and export_hf writes a folder from_pretrained accepts.

Everything runs on real transformers and safetensors with tiny Llama configs built locally. Expected
values come from transformers or safetensors themselves (from_pretrained, safe_open), never from
omnickpt, so a wrong byte offset or a dropped tensor shows up as a mismatch.
"""
from __future__ import annotations

import inspect
import json
import os
import struct

import pytest
import torch

import omnickpt
from dist import run_ranks
from omnickpt.errors import CheckpointError, CorruptCheckpointError, MismatchError, UnsupportedError
from omnickpt.export.hf import _tied_duplicates, export_hf
from omnickpt.formats.hf import read_manifest
from omnickpt.storage import storage_for
from omnickpt.transforms import Drop, Rename

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def llama_config(tied: bool = True):
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)


def llama(seed: int, tied: bool = True):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(tied))


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def folder_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, read by safetensors itself."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def holder(**tensors) -> torch.nn.Module:
    """A module whose state dict is `tensors` (as buffers: any dtype)."""
    m = torch.nn.Module()
    for k, t in tensors.items():
        m.register_buffer(k, t.clone())
    return m


def write_raw(path, header: dict, data: bytes, length: int | None = None) -> None:
    """A safetensors file with any header at all (no padding: data may start unaligned)."""
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tied Llama saved by save_pretrained in several shards with an index; (folder, its weights)."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    model = llama(0)
    model.save_pretrained(path, max_shard_size="20KB")
    return str(path), weights(model)


# ---------------------------------------------------------------------- reading the folder
def test_reader_points_each_tensor_at_its_bytes(hf_dir):
    path, _ = hf_dir
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(files) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    m = read_manifest(storage_for(path))
    assert m.layout["format"] == "hf" and m.world_size == 1 and m.layout["world_size"] == 1
    assert m.layout["metadata"]["config"]["tie_word_embeddings"] is True
    assert all(meta == {"format": "pt"} for meta in m.layout["safetensors_metadata"].values())
    assert [f.path for f in m.files] == files
    assert [f.bytes for f in m.files] == [os.path.getsize(os.path.join(path, f)) for f in files]
    expected = folder_tensors(path)
    assert set(m.tensors) == {f"model/{k}" for k in expected}
    assert "model/lm_head.weight" not in m.tensors   # save_pretrained stores the tied weight once
    for name, t in expected.items():
        entry = m.tensors[f"model/{name}"]
        (box,) = entry.boxes
        assert box.sums is None and entry.shape == tuple(t.shape) and box.lengths == tuple(t.shape)
        with open(os.path.join(path, m.files[box.file].path), "rb") as f:
            f.seek(box.offset)
            raw = f.read(box.nbytes)
        assert raw == t.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_not_a_hf_folder_reads_as_none(tmp_path):
    assert read_manifest(storage_for(str(tmp_path / "missing"))) is None
    assert read_manifest(storage_for(str(tmp_path))) is None
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert read_manifest(storage_for(str(tmp_path))) is None


def test_single_file_and_any_indexed_set_are_recognised(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, str(single / "model.safetensors"))
    assert set(read_manifest(storage_for(str(single))).tensors) == {"model/a", "model/b"}
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    save_file({"a": tensors["a"]}, str(indexed / "unet-1.safetensors"))
    save_file({"b": tensors["b"]}, str(indexed / "unet-2.safetensors"))
    (indexed / "unet.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "unet-1.safetensors", "b": "unet-2.safetensors"}}))
    m = read_manifest(storage_for(str(indexed)))
    assert [f.path for f in m.files] == ["unet-1.safetensors", "unet-2.safetensors"]
    target = holder(a=torch.zeros(2, 3), b=torch.zeros(4, dtype=torch.int64))
    omnickpt.load(str(indexed), {"model": target})
    assert all(torch.equal(getattr(target, k), tensors[k]) for k in tensors)


def test_unaligned_data_loads(tmp_path):
    """A header whose length is not a multiple of 8 puts every tensor at an odd file offset."""
    a = torch.randn(3, 5)
    b = torch.arange(7, dtype=torch.int16)
    data = a.numpy().tobytes() + b.numpy().tobytes()
    header = {"a": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]},
              "b": {"dtype": "I16", "shape": [7], "data_offsets": [60, 74]}}
    raw = json.dumps(header).encode() + b" "   # odd length
    assert (8 + len(raw)) % 4
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    target = holder(a=torch.zeros(3, 5), b=torch.zeros(7, dtype=torch.int16))
    omnickpt.load(str(tmp_path), {"model": target})
    assert torch.equal(target.a, a) and torch.equal(target.b, b)


# ---------------------------------------------------------------------- hostile or ambiguous folders
def _hostile(tmp_path, name: str, header: dict, data: bytes, length: int | None = None) -> str:
    folder = tmp_path / name
    folder.mkdir()
    write_raw(folder / "model.safetensors", header, data, length)
    return str(folder)


@pytest.mark.parametrize("case, header, data, length, words", [
    ("length past the file", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 1 << 20,
     "runs past"),
    ("huge length", {}, b"", 1 << 40, "runs past"),
    ("overlap", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
    ("bad dtype", {"a": {"dtype": "XYZ", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype"),
    ("size vs shape", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
    ("offsets past data", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None,
     "outside"),
    ("negative dim", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, b"", None, "shape"),
    ("float offsets", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, b"\0" * 8, None,
     "data_offsets"),
    ("not an object", {"a": [1, 2]}, b"", None, "not an object"),
    ("bad metadata", {"__metadata__": {"format": 5}}, b"", None, "__metadata__"),
])
def test_hostile_header_is_refused_naming_file_and_tensor(tmp_path, case, header, data, length, words):
    folder = _hostile(tmp_path, case.replace(" ", "_"), header, data, length)
    with pytest.raises(CorruptCheckpointError, match=words) as e:
        omnickpt.load(folder, {"model": holder(a=torch.zeros(2))})
    assert "model.safetensors" in str(e.value)
    if header and case not in ("length past the file", "bad metadata"):
        assert "'a'" in str(e.value)


def test_duplicate_keys_and_garbage_header_are_refused(tmp_path):
    folder = tmp_path / "dup"
    folder.mkdir()
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], ' \
          b'"data_offsets": [0, 4]}}'
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CorruptCheckpointError, match="twice"):
        read_manifest(storage_for(str(folder)))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"\xff\xfe{[x" + b"\0" * 4)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.*not valid JSON"):
        read_manifest(storage_for(str(folder)))
    (folder / "model.safetensors").write_bytes(b"\1\0")
    with pytest.raises(CorruptCheckpointError, match="too short"):
        read_manifest(storage_for(str(folder)))


def test_dtype_without_counterpart_is_unsupported(tmp_path):
    folder = _hostile(tmp_path, "e8m0", {"s": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(UnsupportedError, match="model.safetensors.*'s'.*F8_E8M0"):
        read_manifest(storage_for(folder))


def test_several_files_without_index_is_a_clear_error(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "part-a.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "part-b.safetensors"))
    with pytest.raises(UnsupportedError, match="2 safetensors files.*no model.safetensors.index.json"):
        omnickpt.load(str(tmp_path), {"model": holder(a=torch.zeros(2))})


def test_index_and_files_must_agree(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors, which is not there"):
        read_manifest(storage_for(str(tmp_path)))
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="tensor 'b'.*does not hold it"):
        read_manifest(storage_for(str(tmp_path)))
    index.write_text(json.dumps({"weight_map": {"a": "../elsewhere/model.safetensors"}}))
    with pytest.raises(CheckpointError, match="escapes"):
        read_manifest(storage_for(str(tmp_path)))


# ---------------------------------------------------------------------- loading into layouts
def test_load_into_plain_llama_with_tied_embeddings(hf_dir):
    path, expected = hf_dir
    model = llama(7)
    result = omnickpt.load(path, {"net": model})   # any key: the folder binds to the only module
    assert result.differences == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
    got = weights(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    reference = transformers.LlamaForCausalLM.from_pretrained(path)
    assert all(torch.equal(got[k], v) for k, v in weights(reference).items())


def test_strict_load_still_reports_real_differences(hf_dir, tmp_path):
    path, _ = hf_dir
    # An untied target needs an lm_head the folder does not hold.
    with pytest.raises(MismatchError, match="model/lm_head.weight: missing from the checkpoint"):
        omnickpt.load(path, {"model": llama(1, tied=False)})
    # Our own checkpoints store both names of a tied parameter; one missing there stays a difference.
    own = str(tmp_path / "own")
    omnickpt.save(own, {"model": llama(2)}).wait()
    assert {"model/lm_head.weight", "model/model.embed_tokens.weight"} <= set(read_manifest_any(own).tensors)
    assert omnickpt.load(own, {"model": llama(3)}).differences == []
    with pytest.raises(MismatchError, match="model/lm_head.weight: missing"):
        omnickpt.load(own, {"model": llama(3)}, transforms=[Drop("model/lm_head.weight")])


def read_manifest_any(path):
    from omnickpt.api import read_manifest as read_any
    return read_any(storage_for(path))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{p}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _layouts_worker(rank, world_size, path):
    """run_ranks body: load the folder into FSDP2, TP and DDP; per layout the full tensors, whether the
    tied parameter is still one object, and the bytes this rank read."""
    import omnickpt.engine.load as engine
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel
    # Read exactly the byte ranges planned (no coalescing over gaps), so that the bytes each rank read
    # show that it read its own shards and nothing else.
    engine.COALESCE_GAP = 0
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    out = {}
    for layout in ("fsdp2", "tp", "ddp"):
        model = llama(10 + rank)   # different weights on each rank: only the load can make them equal
        if layout == "fsdp2":
            for block in model.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            target = model
        elif layout == "tp":
            target = parallelize_module(model, mesh, _tp_plan())
        else:
            target = DistributedDataParallel(model)
        sd = model.state_dict(keep_vars=True)
        tied = sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
        sharded = sum(isinstance(v, DTensor) for v in sd.values())
        result = omnickpt.load(path, {"model": target})
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()}
        out[layout] = {"tensors": full, "tied": tied, "sharded": sharded, "differences": result.differences,
                       "read": result.report["bytes_per_rank"]}
    return out


@pytest.fixture(scope="module")
def layouts(hf_dir):
    return run_ranks(2, _layouts_worker, hf_dir[0])


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "ddp"])
def test_load_into_two_rank_layouts(hf_dir, layouts, layout):
    path, expected = hf_dir
    stored = sum(t.numel() * t.element_size() for t in folder_tensors(path).values())
    for rank, per_layout in enumerate(layouts):
        got = per_layout[layout]
        assert got["tied"] and got["differences"] == []
        assert got["tensors"].keys() == expected.keys()
        bad = [k for k in expected if not torch.equal(got["tensors"][k], expected[k])]
        assert not bad, f"rank {rank}: {bad}"
    read = layouts[0][layout]["read"]
    if layout == "ddp":
        assert read == [stored, stored]   # replicas: every rank reads everything
    else:
        assert layouts[0][layout]["sharded"] > 0
        assert all(0 < r < stored for r in read)
        if layout == "fsdp2":   # every tensor is split along dim 0: the ranks' reads add up to the folder
            assert sum(read) == stored


# ---------------------------------------------------------------------- export
_INPUT = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7]])


def _export_worker(rank, world_size, ckpt):
    """run_ranks body: a Llama under FSDP2 on 2 ranks takes one Adam step, then an omnickpt save of
    model and optimizer (with the HF config as metadata when save() takes it). Returns the full weights."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = llama(21)
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model(_INPUT, labels=_INPUT).loss.backward()
    opt.step()
    trained = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
               for k, v in model.state_dict().items()}
    kwargs = {}
    if "metadata" in inspect.signature(omnickpt.save).parameters:
        # to_dict() holds int keys (id2label), which JSON would turn into strings: take its JSON form
        kwargs["metadata"] = {"config": json.loads(model.config.to_json_string(use_diff=False))}
    # not under "model": export finds the module among the entries by their recorded frameworks
    omnickpt.save(ckpt, {"net": model, "optim": opt}, **kwargs).wait()
    return trained


@pytest.fixture(scope="module")
def fsdp2_ckpt(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    trained = run_ranks(2, _export_worker, ckpt)[0]
    return ckpt, trained


def _finish_folder(dst: str, result: dict) -> None:
    """Give the exported folder a config.json when the checkpoint carried none."""
    if not result["config"]:
        llama_config().save_pretrained(dst)


def test_export_fsdp2_checkpoint_gives_the_same_logits(fsdp2_ckpt, tmp_path):
    ckpt, trained = fsdp2_ckpt
    dst = str(tmp_path / "out")
    result = export_hf(ckpt, dst, progress=False)
    assert result["key"] == "net" and result["files"] == ["model.safetensors"]
    _finish_folder(dst, result)
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    if result["config"]:   # the config ties the embeddings: lm_head is written once, as save_pretrained does
        assert result["dropped"] == {"lm_head.weight": "model.embed_tokens.weight"}
        assert "lm_head.weight" not in folder_tensors(dst)
    exported = transformers.LlamaForCausalLM.from_pretrained(dst)
    reference = llama(0)
    reference.load_state_dict(trained)
    with torch.no_grad():
        assert torch.equal(exported(_INPUT).logits, reference(_INPUT).logits)
    assert all(torch.equal(v, trained[k]) for k, v in weights(exported).items())


def test_export_in_several_shards_with_index(fsdp2_ckpt, tmp_path):
    ckpt, trained = fsdp2_ckpt
    dst = str(tmp_path / "out")
    result = export_hf(ckpt, dst, max_shard_size=6000, workers=3, progress=False)
    n = len(result["files"])
    assert n > 2 and result["files"] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    on_disk = folder_tensors(dst)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in on_disk.values())
    assert set(index["weight_map"]) == set(on_disk)
    assert set(index["weight_map"].values()) == set(result["files"])
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(dst, file), "pt") as f:
            assert name in f.keys()
    for path in result["files"]:   # no file past the limit unless one tensor alone is larger
        with safe_open(os.path.join(dst, path), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 6000 or len(sizes) == 1
    assert all(torch.equal(v, trained[k]) for k, v in on_disk.items())
    _finish_folder(dst, result)
    exported = transformers.LlamaForCausalLM.from_pretrained(dst)
    assert all(torch.equal(v, trained[k]) for k, v in weights(exported).items())


def test_export_casts_to_bf16(fsdp2_ckpt, hf_dir, tmp_path):
    ckpt, trained = fsdp2_ckpt
    dst = str(tmp_path / "bf16")
    result = export_hf(ckpt, dst, dtype=torch.bfloat16, progress=False)
    on_disk = folder_tensors(dst)
    assert {t.dtype for t in on_disk.values()} == {torch.bfloat16}
    assert all(torch.equal(v, trained[k].to(torch.bfloat16)) for k, v in on_disk.items())
    # A Hugging Face folder is a source too; its config.json comes along with the new dtype.
    path, expected = hf_dir
    again = str(tmp_path / "again")
    result = export_hf(path, again, dtype=torch.bfloat16, progress=False)
    assert result["config"] and result["dropped"] == {}
    with open(os.path.join(again, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    model = transformers.LlamaForCausalLM.from_pretrained(again)
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(v, expected[k].to(torch.bfloat16)) for k, v in weights(model).items())


def test_export_applies_transforms_and_picks_the_key(fsdp2_ckpt, tmp_path):
    ckpt, trained = fsdp2_ckpt
    dst = str(tmp_path / "renamed")
    export_hf(ckpt, dst, transforms=[Rename.regex(r"/model\.layers\.", "/decoder.")], progress=False)
    on_disk = folder_tensors(dst)
    assert "decoder.0.mlp.up_proj.weight" in on_disk and not any(k.startswith("model.layers.") for k in on_disk)
    assert torch.equal(on_disk["decoder.1.self_attn.q_proj.weight"], trained["model.layers.1.self_attn.q_proj.weight"])
    with pytest.raises(MismatchError, match="no tensors under 'nope'"):
        export_hf(ckpt, str(tmp_path / "x"), key="nope", progress=False)


def test_export_refuses_corrupt_source_and_leaves_nothing(fsdp2_ckpt, tmp_path):
    import shutil
    ckpt, _ = fsdp2_ckpt
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    data = sorted(os.listdir(os.path.join(bad, "data")))[0]
    with open(os.path.join(bad, "data", data), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    dst = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        export_hf(bad, str(dst), progress=False)
    assert not dst.exists() or not os.listdir(dst)


def test_export_refuses_a_folder_holding_a_model(hf_dir, tmp_path):
    path, _ = hf_dir
    with pytest.raises(UnsupportedError, match="is the source checkpoint itself"):
        export_hf(path, path, progress=False)
    save_file({"stale": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="already holds model-00001-of-00002.safetensors"):
        export_hf(path, str(tmp_path), progress=False)
    with pytest.raises(UnsupportedError, match="only a local folder"):
        export_hf(path, "s3://bucket/x", progress=False)


def test_tied_duplicates_need_the_config_or_shared_bytes(tmp_path):
    own = str(tmp_path / "own")
    model = llama(4)
    omnickpt.save(own, {"model": model}).wait()
    tensors = {n.removeprefix("model/"): t for n, t in read_manifest_any(own).tensors.items()}
    assert _tied_duplicates(tensors, {"tie_word_embeddings": True}) == {"lm_head.weight": "model.embed_tokens.weight"}
    # Equal values alone are no tie: every RMSNorm weight starts as ones.
    assert _tied_duplicates(tensors, None) == {}
    assert _tied_duplicates(tensors, {"tie_word_embeddings": False}) == {}
    untied = str(tmp_path / "untied")
    omnickpt.save(untied, {"model": llama(4, tied=False)}).wait()
    tensors = {n.removeprefix("model/"): t for n, t in read_manifest_any(untied).tensors.items()}
    assert _tied_duplicates(tensors, {"tie_word_embeddings": True}) == {}
