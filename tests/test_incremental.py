"""Incremental checkpoints (engine/incremental.py): only changed blocks are written, the rest
referenced in an earlier checkpoint next to it; retention keeps referenced data; loading, verify
and resharding see nothing different; a damaged referenced block is caught."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli.verify import verify
from omnickpt.engine.incremental import Base, WriteMeta, block_hashes, plan_pieces, rows_per_block
from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format import Manifest
from models import flip_byte

ROWS, DIM = 4096, 64     # a 1 MiB fp32 embedding table: 256 B rows, 256 rows per 64 KiB block


def _model(seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"emb": nn.Embedding(ROWS, DIM), "head": nn.Linear(DIM, 8)})


def _touch(model: nn.ModuleDict, rows) -> None:
    with torch.no_grad():
        model["emb"].weight[torch.as_tensor(rows)] += 1.0


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _manifest(path) -> Manifest:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return Manifest.decode(f.read())


def _pair(tmp_path, rows) -> tuple[nn.ModuleDict, str, str]:
    """A full incremental save to a/, `rows` of the table changed, an incremental save to b/ against a/."""
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(a, {"model": model}, incremental=True)
    _touch(model, rows)
    omnickpt.save(b, {"model": model}, incremental=True, base=a)
    return model, a, b


def test_only_changed_blocks_are_written_and_the_first_checkpoint_can_be_retired(tmp_path):
    model = _model()
    with omnickpt.CheckpointManager(str(tmp_path), incremental=True, keep_last=1) as mgr:
        full = mgr.save(1, {"model": model}).wait()
        _touch(model, [5, 3000])                        # two rows: two 64 KiB blocks change
        inc = mgr.save(2, {"model": model}).wait()
        assert mgr.steps() == [2]                       # step 1 retired as a checkpoint...
        assert not os.path.exists(tmp_path / "global_step_1" / "manifest.json")
        back = _model(seed=1)
        mgr.load(2, {"model": back})
    assert _same(back, model)
    assert full["incremental"]["base"] is None and full["incremental"]["written_bytes"] >= ROWS * DIM * 4
    i = inc["incremental"]
    assert i["base"] == "global_step_1" and i["chain"] == 1
    # two changed blocks + the head (always rewritten when it changed; here it did not) at most
    assert i["written_bytes"] <= 3 * (64 << 10) + 4096, i
    assert i["referenced_bytes"] >= ROWS * DIM * 4 - 2 * (64 << 10)
    # ...but its data the kept step references stays, and verify reads it through step 2
    assert glob.glob(str(tmp_path / "global_step_1" / "data" / "*.bin"))
    report = verify(str(tmp_path / "global_step_2"))
    assert report.ok, report.problems


def test_inspect_says_what_an_incremental_checkpoint_references(tmp_path, capsys):
    from omnickpt.cli import main as cli
    model, a, b = _pair(tmp_path, [9])
    assert cli(["inspect", b]) == 0
    out = capsys.readouterr().out
    assert "incremental (chain 1, compared with a)" in out and "../a/data/" in out


def test_corruption_of_a_referenced_block_is_caught_by_verify_and_load(tmp_path):
    model, a, b = _pair(tmp_path, [0])
    m = _manifest(b)
    emb = m.tensors["model/emb.weight"]
    referenced = [box for box in emb.boxes if m.files[box.file].path.startswith("../a/")]
    assert referenced, [m.files[box.file].path for box in emb.boxes]
    box = referenced[-1]
    data = glob.glob(os.path.join(a, "data", "*.bin"))[0]
    flip_byte(data, box.offset + box.nbytes // 2, 0x40)
    report = verify(b)
    assert not report.ok and any("checksum" in p.message and "a/data" in p.where for p in report.problems)
    with pytest.raises(CorruptCheckpointError, match="a/data"):
        omnickpt.load(b, {"model": _model(seed=1)})


def test_a_save_over_its_own_folder_references_the_previous_files_and_removes_the_rest(tmp_path):
    path = str(tmp_path / "ckpt")
    model = _model()
    omnickpt.save(path, {"model": model}, incremental=True)
    first = set(os.listdir(os.path.join(path, "data")))
    _touch(model, list(range(0, ROWS, 2)))           # every block changes: nothing of the first is needed
    with torch.no_grad():
        for p in model["head"].parameters():
            p += 1.0
    omnickpt.save(path, {"model": model}, incremental=True)
    _touch(model, [7])
    rep = omnickpt.save(path, {"model": model}, incremental=True).wait()
    files = set(os.listdir(os.path.join(path, "data")))
    assert not files & first                          # the first save's file was no longer referenced
    assert len(files) == 2 and rep["incremental"]["referenced_bytes"] > 0
    back = _model(seed=3)
    omnickpt.load(path, {"model": back})
    assert _same(back, model)


def test_full_every_bounds_the_chain(tmp_path):
    model = _model()
    chains = []
    with omnickpt.CheckpointManager(str(tmp_path), incremental=True, full_every=3, keep_last=2) as mgr:
        for step in range(7):
            _touch(model, [step * 300])             # another block each step
            chains.append(mgr.save(step, {"model": model}, async_save=step % 2 == 1).wait()["incremental"]["chain"])
        back = _model(seed=2)
        mgr.load_latest({"model": back})
    assert chains == [0, 1, 2, 0, 1, 2, 0]
    assert _same(back, model)
    # kept: 5 (references the blocks 4 and 3 wrote) and 6 (full); 3 and 4 hold only what 5 references
    folders = sorted(n for n in os.listdir(tmp_path) if n.startswith("global_step_"))
    assert folders == ["global_step_3", "global_step_4", "global_step_5", "global_step_6"]
    assert not any(os.path.exists(tmp_path / f"global_step_{s}" / "manifest.json") for s in (3, 4))


def test_an_ordinary_checkpoint_as_base_gives_a_full_save_and_bad_options_are_refused(tmp_path):
    model = _model()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    omnickpt.save(a, {"model": model})                # no block hashes
    rep = omnickpt.save(b, {"model": model}, incremental=True, base=a).wait()
    assert rep["incremental"]["chain"] == 0 and rep["incremental"]["referenced_bytes"] == 0
    with pytest.raises(ValueError, match="same folder"):
        omnickpt.save(str(tmp_path / "x" / "c"), {"model": model}, incremental=True, base=b)
    with pytest.raises(UnsupportedError, match="compression"):
        omnickpt.save(str(tmp_path / "d"), {"model": model}, incremental=True, compression="zstd")
    with pytest.raises(ValueError, match="incremental=True"):
        omnickpt.save(str(tmp_path / "e"), {"model": model}, base=a)
    with pytest.raises(omnickpt.CheckpointError, match="no checkpoint"):
        omnickpt.save(str(tmp_path / "f"), {"model": model}, incremental=True, base=str(tmp_path / "nothing"))


def test_a_manifest_naming_a_base_outside_its_root_is_refused(tmp_path):
    model, a, b = _pair(tmp_path, [1])
    m = _manifest(b)
    m.files = [type(f)(f.path.replace("../a/", "../../etc/"), f.rank, f.bytes) if f.path.startswith("../") else f
               for f in m.files]
    with pytest.raises(UnsafeCheckpointError):
        Manifest.decode(m.encode())


def test_pieces_reference_unchanged_runs_of_one_base_box():
    """The pure rule: blocks equal to the base's at the same rows become referenced runs."""
    rows, dim = 1000, 16
    t = torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim)
    meta = WriteMeta("w", (rows, dim), "float32", (0, 0), (rows, dim), 4)
    block = 4096
    rpb = rows_per_block(meta.lengths, 4, block)
    assert rpb == 64
    data = memoryview(t.numpy()).cast("B")
    h = block_hashes(data, meta.lengths, 4, block)
    assert len(h) == -(-rows // rpb)

    class FakeBase(Base):     # the base's lookup, answered from the same hashes
        def __init__(self):
            self.usable, self.block_bytes = True, block

        def unchanged(self, meta, hashes):
            same = hashes == h
            return same, np.zeros(len(hashes), dtype=np.int64), np.arange(len(hashes)) * rpb * dim * 4 + 640

    t2 = t.clone()
    t2[200] += 1                       # block 3
    h2 = block_hashes(memoryview(t2.numpy()).cast("B"), meta.lengths, 4, block)
    runs = plan_pieces(meta, h2, FakeBase(), block)
    assert runs == [(0, 192, 0, 640), (192, 64, None, 0), (256, rows - 256, 0, 640 + 256 * dim * 4)]


def _sharded_incremental(rank, world, a, b):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh("cpu", torch.arange(world))

    def fsdp2(full):
        emb = nn.Embedding(ROWS, DIM)
        with torch.no_grad():
            emb.weight.copy_(full)
        fully_shard(emb, mesh=mesh)
        return emb
    torch.manual_seed(0)
    full = torch.randn(ROWS, DIM)
    omnickpt.save(a, {"model": fsdp2(full)}, incremental=True)
    full[[10, ROWS - 3]] += 2.0            # a row in each rank's shard
    rep = omnickpt.save(b, {"model": fsdp2(full)}, incremental=True, base=a).wait()
    return full, rep


def test_a_two_rank_fsdp2_incremental_checkpoint_loads_at_one_rank(tmp_path):
    from dist import run_ranks
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (full, rep), _ = run_ranks(2, _sharded_incremental, a, b)
    assert 0 < rep["incremental"]["written_bytes"] <= 2 * (64 << 10) + 4096
    assert rep["incremental"]["referenced_bytes"] >= ROWS * DIM * 4 - 2 * (64 << 10)
    plain = nn.Embedding(ROWS, DIM)
    omnickpt.load(b, {"model": plain})
    assert torch.equal(plain.weight.detach(), full)
    with omnickpt.CheckpointReader(b) as r:
        assert torch.equal(r.get("model/weight", ((100, 0), (50, DIM))), full[100:150])
    assert verify(b).ok


def test_a_managers_save_can_ask_for_incremental_per_call(tmp_path):
    model = _model()
    with omnickpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": model}, incremental=True).wait()
        _touch(model, [1])
        rep = mgr.save(2, {"model": model}, incremental=True).wait()
        plain = mgr.save(3, {"model": model}).wait()
    assert rep["incremental"]["base"] == "global_step_1" and rep["incremental"]["referenced_bytes"] > 0
    assert "incremental" not in plain


def test_a_smaller_block_writes_fewer_bytes_for_scattered_rows_and_a_new_size_starts_a_full_save(tmp_path):
    rows = list(range(0, ROWS, 37))                    # 111 scattered rows: every 64 KiB block changes
    written = {}
    for block in (65536, 4096):
        model = _model()
        a, b = str(tmp_path / f"a{block}"), str(tmp_path / f"b{block}")
        omnickpt.save(a, {"model": model}, incremental=True, block_bytes=block)
        _touch(model, rows)
        rep = omnickpt.save(b, {"model": model}, incremental=True, base=a, block_bytes=block).wait()
        assert rep["incremental"]["chain"] == 1
        written[block] = rep["incremental"]["written_bytes"]
        back = _model(seed=4)
        omnickpt.load(b, {"model": back})
        assert _same(back, model)
        assert _manifest(b).block_bytes == block
    assert written[4096] * 2 < written[65536], written     # (and > 64 written runs: gathered into one write)
    # a base hashed on another grid cannot be compared with: a full save on the new one
    rep = omnickpt.save(str(tmp_path / "c"), {"model": model}, incremental=True, base=str(tmp_path / "b65536"),
                        block_bytes=4096).wait()
    assert rep["incremental"]["chain"] == 0 and rep["incremental"]["referenced_bytes"] == 0
    with pytest.raises(ValueError, match="block_bytes"):
        omnickpt.CheckpointManager(str(tmp_path / "m"), incremental=True, block_bytes=0)


def test_the_memory_tier_refuses_incremental_by_name(tmp_path):
    with pytest.raises(UnsupportedError, match="memory tier"):
        omnickpt.TieredCheckpointManager(str(tmp_path), memory="shm://inc-refused", incremental=True)


def test_without_a_base_an_incremental_save_compares_with_the_last_one_committed_next_to_it(tmp_path):
    model = _model()
    with omnickpt.Checkpointer() as ckpt:
        ckpt.save(str(tmp_path / "s1"), {"model": model}, incremental=True)
        _touch(model, [3])
        rep = ckpt.save(str(tmp_path / "s2"), {"model": model}, incremental=True).wait()
        assert rep["incremental"]["base"] == "s1" and rep["incremental"]["chain"] == 1
        # not next to it: a full save
        rep = ckpt.save(str(tmp_path / "elsewhere" / "s3"), {"model": model}, incremental=True).wait()
        assert rep["incremental"]["chain"] == 0
    back = _model(seed=5)
    omnickpt.load(str(tmp_path / "s2"), {"model": back})
    assert _same(back, model)


def test_an_incremental_checkpoint_converts_to_dcp_and_hugging_face(tmp_path):
    from omnickpt.cli import main as cli
    model, a, b = _pair(tmp_path, [2000])
    for to in ("dcp", "hf"):
        out = str(tmp_path / f"out-{to}")
        assert cli(["convert", b, out, "--to", to] + (["--key", "model"] if to == "hf" else [])) == 0
        back = _model(seed=6)
        omnickpt.load(out, {"model": back})
        assert _same(back, model), to


def test_convert_makes_a_self_contained_copy_of_an_incremental_checkpoint(tmp_path):
    import shutil

    from omnickpt.cli import main as cli
    model, a, b = _pair(tmp_path, [1234])
    c = str(tmp_path / "copy")
    assert cli(["convert", b, c, "--to", "omnickpt"]) == 0
    shutil.rmtree(a)
    with pytest.raises(CorruptCheckpointError, match="checkpoint 'a' next to .* references"):
        omnickpt.load(b, {"model": _model(seed=7)})       # its base is gone: said so
    back = _model(seed=7)
    omnickpt.load(c, {"model": back})
    assert _same(back, model)
    assert not any(f.path.startswith("../") for f in _manifest(c).files)
