"""The operator tools as library functions: verify, diff, describe and the report reader importable
from `omnickpt`, the command line a thin layer over them, and report.json's shapes read through one
normalising step."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import omnickpt
from omnickpt.cli import main as cli
from omnickpt.monitor.report import summary, timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    omnickpt.save(str(path), {"model": model, "extra": {"step": 3}})
    return str(path)


# ------------------------------------------------------------------------------- the public surface
def test_one_name_per_concept_at_the_top_level():
    from omnickpt.compare import diff
    from omnickpt.contents import describe
    from omnickpt.integrity import verify
    from omnickpt.reader import CheckpointReader, read_report
    assert omnickpt.verify is verify and omnickpt.diff is diff and omnickpt.describe is describe
    assert omnickpt.read_report is read_report
    # the reader: one class, called as omnickpt.open (like safetensors.safe_open), typed as CheckpointReader
    assert omnickpt.open is CheckpointReader and omnickpt.CheckpointReader is CheckpointReader
    assert len(omnickpt.__all__) == len(set(omnickpt.__all__))
    assert all(hasattr(omnickpt, name) for name in omnickpt.__all__)
    assert {"verify", "diff", "describe", "read_report", "CheckpointReader"} <= set(omnickpt.__all__)
    assert "open" not in omnickpt.__all__ and "open_checkpoint" not in omnickpt.__all__   # never shadows the builtin


def test_open_checkpoint_is_a_deprecated_alias_of_omnickpt_open(tmp_path):
    from omnickpt.reader import open_checkpoint
    path = _save(tmp_path / "ck")
    with pytest.warns(DeprecationWarning, match=r"omnickpt\.open"):
        reader = open_checkpoint(path, workers=1)
    with reader:
        assert isinstance(reader, omnickpt.CheckpointReader) and "model/weight" in reader
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with omnickpt.open(path) as reader:   # the new name warns nothing
            assert reader.info("model/weight").shape == (4, 8)


def test_the_old_cli_module_paths_still_name_the_same_functions():
    import omnickpt.cli.diff as cdiff
    import omnickpt.cli.inspect as cinspect
    import omnickpt.cli.report as creport
    import omnickpt.cli.verify as cverify
    from omnickpt.monitor import report as mreport
    assert cverify.verify is omnickpt.verify and cdiff.diff is omnickpt.diff
    assert cinspect.describe is omnickpt.describe and creport.read_report is omnickpt.read_report
    for name in ("summary", "timeline", "trace", "draw_png", "write_trace", "Timeline", "rank_total"):
        assert getattr(creport, name) is getattr(mreport, name), name
    from omnickpt.contents import name_tree
    assert cinspect.name_tree is name_tree and callable(cinspect.format_tree)


def test_importing_omnickpt_imports_no_command_line_code():
    code = "import sys, omnickpt; print(sorted(m for m in sys.modules if m.startswith('omnickpt.cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def _imports(rel: str) -> set[str]:
    with open(os.path.join(ROOT, rel)) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("omnickpt")}


def test_library_modules_import_no_cli_and_monitor_stays_a_leaf():
    for rel in ("omnickpt/integrity.py", "omnickpt/compare.py", "omnickpt/contents.py", "omnickpt/reader.py",
                "omnickpt/monitor/report.py", "omnickpt/monitor/__init__.py"):
        assert not any(m.startswith("omnickpt.cli") for m in _imports(rel)), rel
    assert _imports("omnickpt/monitor/report.py") <= {"omnickpt.errors"}


# ------------------------------------------------------------------ the functions and the commands agree
def test_the_library_functions_give_what_the_commands_print(tmp_path, capsys):
    a, b = _save(tmp_path / "a"), _save(tmp_path / "b", seed=1)
    report = omnickpt.verify(a)
    assert report.ok and report.tensors == 2
    assert cli(["verify", "--json", a]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == report.tensors

    doc = omnickpt.describe(a, values=False)
    assert {t["name"] for t in doc["tensors"]} == {"model/weight", "model/bias"}
    assert cli(["inspect", "--json", "--no-values", a]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == doc["tensors"]

    same, other = omnickpt.diff(a, a), omnickpt.diff(a, b)
    assert not same.differs and other.differs
    assert cli(["diff", "--json", a, b]) == 1
    assert json.loads(capsys.readouterr().out)["tensor_counts"] == other.as_dict()["tensor_counts"]

    saved = omnickpt.read_report(a)
    assert saved["kind"] == "save" and summary(saved)["world_size"] == 1
    assert cli(["report", "--json", a]) == 0
    assert json.loads(capsys.readouterr().out)["table"] == summary(saved)["table"]


def test_verify_text_output_is_the_command_layer(tmp_path):
    from omnickpt.cli.verify import format_text
    path = _save(tmp_path / "ck")
    text = format_text(omnickpt.verify(path))
    assert text.startswith("OK ") and "2 tensors in 2 boxes" in text


# ----------------------------------------------------------------------------- report shapes
def test_every_report_shape_reads_into_the_same_timeline():
    per_rank = [{"seconds": {"plan": 1.0, "write": 2.0, "commit": 0.5, "stall": 1.5},
                 "bytes": {"written": 7, "read": 1}},
                {"seconds": {"plan": 1.0, "write": 4.0, "mystery": 0.25}, "bytes": {"written": 9, "read": 2}}]
    save = timeline({"kind": "save", "per_rank": per_rank})
    assert not save.exact and save.phases == ["plan", "write", "commit", "mystery", "stall"]
    assert save.bytes == [7, 9]
    # totals only: phases end to end, the commit after every rank's last phase, the stall from 0
    assert save.spans[0] == [("plan", 0.0, 1.0), ("write", 1.0, 2.0), ("commit", 5.25, 0.5), ("stall", 0.0, 1.5)]
    assert save.spans[1] == [("plan", 0.0, 1.0), ("write", 1.0, 4.0), ("mystery", 5.0, 0.25)]
    assert timeline({"kind": "convert", "per_rank": per_rank}).bytes == [7, 9]
    assert timeline({"kind": "load", "per_rank": per_rank}).bytes == [1, 2]
    persist = timeline({"kind": "persist", "total_bytes": 5, "seconds_per_rank": [0.5, 0.7]})
    assert persist.phases == ["persist"] and persist.spans == [[("persist", 0.0, 0.5)], [("persist", 0.0, 0.7)]]
    assert persist.bytes == [0, 0]


@pytest.mark.parametrize("doc", [{}, {"per_rank": []}, {"per_rank": [{"seconds": {"plan": True}}]},
                                 {"per_rank": [["plan", 1.0]]}, {"seconds_per_rank": "fast"}])
def test_a_report_of_no_known_shape_is_a_clear_error(doc):
    with pytest.raises(omnickpt.CorruptCheckpointError, match="no per-rank phase seconds"):
        timeline({"path": "r.json", **doc})
