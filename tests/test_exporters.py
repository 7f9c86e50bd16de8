"""The exporters (omnickpt/export/) above the readers (omnickpt/formats/): both read their source through the
checkpoint reader, share one destination check and one cleanup, and the readers never import them."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

import omnickpt
from omnickpt.errors import CheckpointError, UnsupportedError
from omnickpt.export import dcp as export_dcp_module
from omnickpt.export import export_dcp, export_hf
from omnickpt.export import hf as export_hf_module
from omnickpt.export.destination import Destination, refuse_occupied


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    path = str(tmp_path / "ckpt")
    omnickpt.save(path, {"model": model}).wait()
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Spy(omnickpt.reader.CheckpointReader):
    """A CheckpointReader that records the tensors read through it."""
    opened: list[str] = []
    read: list[str] = []

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        _Spy.opened.append(path)

    def read_into(self, wanted, dests):
        _Spy.read.extend(name for name, _ in wanted)
        super().read_into(wanted, dests)


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_both_exporters_read_through_the_checkpoint_reader(ckpt, tmp_path, monkeypatch, fmt):
    src, values = ckpt
    module, export = (export_hf_module, export_hf) if fmt == "hf" else (export_dcp_module, export_dcp)
    monkeypatch.setattr(module, "CheckpointReader", _Spy)
    _Spy.opened, _Spy.read = [], []
    out = str(tmp_path / fmt)
    export(src, out, progress=False)
    assert _Spy.opened == [src]
    assert sorted(set(_Spy.read)) == sorted(f"model/{k}" for k in values)
    # and what was written reads back, through the same reader, as the source's values
    with omnickpt.open(out) as back:
        assert back.format == fmt
        for k, v in values.items():
            assert torch.equal(back.get(f"model/{k}"), v)


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_a_failed_export_leaves_the_destination_as_it_found_it(ckpt, tmp_path, monkeypatch, fmt):
    src, _ = ckpt
    module, export = (export_hf_module, export_hf) if fmt == "hf" else (export_dcp_module, export_dcp)

    class Failing(omnickpt.reader.CheckpointReader):
        def read_into(self, wanted, dests):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "CheckpointReader", Failing)
    made = tmp_path / "new" / fmt
    with pytest.raises((OSError, CheckpointError)):
        export(src, str(made), progress=False)
    assert not made.exists()            # the export made the folder: it is gone again
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "tokenizer.json").write_text("{}")
    if fmt == "hf":   # a Hugging Face folder may hold other files beside the model's
        with pytest.raises((OSError, CheckpointError)):
            export(src, str(kept), progress=False)
        assert os.listdir(kept) == ["tokenizer.json"]


def test_one_destination_check_for_every_writer(ckpt, tmp_path):
    src, _ = ckpt
    with pytest.raises(UnsupportedError, match="is the source checkpoint itself"):
        Destination(src, src)
    with pytest.raises(UnsupportedError, match="only a local folder"):
        Destination(src, "s3://bucket/x")
    dest = Destination(src, str(tmp_path / "out"))
    dest.refuse_occupied()             # does not exist yet: nothing to clash with
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("x")
    dest.refuse_occupied(lambda n: n.endswith(".safetensors"))    # only the writer's own kind clashes
    with pytest.raises(CheckpointError, match=r"is not empty \(it holds a.txt\)"):
        dest.refuse_occupied()
    with pytest.raises(CheckpointError, match="already holds a, b, c and 1 more"):
        refuse_occupied("here", ["d", "c", "b", "a"], clashes=lambda n: True)
    refuse_occupied("here", [])


def test_destination_removes_only_what_the_export_wrote(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine-not").write_text("keep")
    with pytest.raises(RuntimeError):
        with Destination(str(tmp_path / "src"), str(out)) as dest:
            with open(dest.wrote(dest.file("part")), "w") as f:
                f.write("x")
            raise RuntimeError("boom")
    assert os.listdir(out) == ["mine-not"]   # not made by the export: the folder stays, its file too


@pytest.mark.parametrize("old, new", [
    ("omnickpt.formats.hf.export_hf", "omnickpt.export.hf.export_hf (omnickpt.export.export_hf)"),
    ("omnickpt.formats.hf.TOP_LEVEL", "omnickpt.export.hf.TOP_LEVEL"),
    ("omnickpt.formats.hf._tied_duplicates", "omnickpt.export.hf._tied_duplicates"),
    ("omnickpt.formats.dcp.export_dcp", "omnickpt.export.dcp.export_dcp (omnickpt.export.export_dcp)"),
    ("omnickpt.formats.dcp.EXPORT_CHUNK_BYTES", "omnickpt.export.dcp.EXPORT_CHUNK_BYTES"),
    ("omnickpt.formats.export.local_dir", "omnickpt.export.destination.local_dir"),
])
def test_old_import_paths_name_the_exporters_new_home(old, new):
    # The readers keep no alias into the layer above: an old path fails, naming where the name lives now,
    # both as an attribute and as `from ... import` (which keeps an ImportError's message intact).
    module_name, _, name = old.rpartition(".")
    module = importlib.import_module(module_name)
    message = re.escape(f"{old} moved to {new}")
    with pytest.raises(ImportError, match=f"^{message}$"):
        getattr(module, name)
    with pytest.raises(ImportError, match=f"^{message}$"):
        exec(f"from {module_name} import {name}", {})
    for home in re.findall(r"omnickpt\.[\w.]+\w", new):   # and every path the message gives leads to it
        home_module, _, home_name = home.rpartition(".")
        assert hasattr(importlib.import_module(home_module), home_name), home
    with pytest.raises(AttributeError):
        module.no_such_name


def test_readers_import_no_exporter():
    code = ("import sys, omnickpt.formats, omnickpt.formats.dcp, omnickpt.formats.hf, omnickpt.formats.deepspeed, "
            "omnickpt.formats.export; "
            "print(sorted(m for m in sys.modules if m.startswith('omnickpt.export') or m == 'omnickpt.convert'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from omnickpt.formats import READERS
    assert [r.name for r in READERS] == ["hf", "dcp", "deepspeed"] and all(r.read is not None for r in READERS)
