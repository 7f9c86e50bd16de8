"""What the command line and `import omnickpt` import (omnickpt/__init__.py's lazy public names).

`import omnickpt` imports no torch: the public names are imported on first use, so `omnickpt --help`,
`--version` and `clear-memory` start without torch, and `inspect` imports the reading side only, not
the save path, the adapters or a trainer. Each check runs in a fresh interpreter and reads
`sys.modules` (what was imported, not how long it took: timings live in benchmarks).
"""
from __future__ import annotations

import json
import subprocess
import sys

import torch

import omnickpt


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last, returned here."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_the_commands_that_need_no_torch_do_not_import_it():
    found = _run("""
import contextlib, io, json, sys
import omnickpt, omnickpt.cli
after_import = "torch" in sys.modules
from omnickpt.cli import main
for argv in (["--version"], ["--help"], ["inspect", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
after_help = "torch" in sys.modules
with contextlib.redirect_stdout(io.StringIO()) as text:
    rc = main(["clear-memory", "omnickpt-test-no-such-job"])
from omnickpt import CheckpointError, version     # an error class and a submodule: still no torch
print(json.dumps({"after_import": after_import, "after_help": after_help, "clear_rc": rc,
                  "clear": text.getvalue(), "at_end": "torch" in sys.modules,
                  "version": omnickpt.__version__}))
""")
    assert found == {"after_import": False, "after_help": False, "clear_rc": 0,
                     "clear": "freed 0 bytes of shared memory of job omnickpt-test-no-such-job\n",
                     "at_end": False, "version": omnickpt.__version__}


def test_inspect_imports_the_reading_side_only(tmp_path):
    model = torch.nn.Linear(4, 2)
    omnickpt.save(str(tmp_path / "ckpt"), {"model": model, "extra": {"step": 7}})
    found = _run(f"""
import contextlib, io, json, sys
from omnickpt.cli import main
with contextlib.redirect_stdout(io.StringIO()) as text:
    rc = main(["inspect", {str(tmp_path / "ckpt")!r}, "--json"])
heavy = ["omnickpt.api", "omnickpt.adapters", "omnickpt.manager", "omnickpt.saving", "omnickpt.loading",
         "omnickpt.memory", "omnickpt.compare", "omnickpt.export", "transformers", "lightning", "torchtitan"]
print(json.dumps({{"rc": rc, "doc": json.loads(text.getvalue()), "imported": [m for m in heavy if m in sys.modules]}}))
""")
    assert found["rc"] == 0
    assert found["imported"] == []
    assert [t["name"] for t in found["doc"]["tensors"]] == ["model/weight", "model/bias"]


def test_public_names_resolve_to_their_modules_and_import_no_trainer():
    found = _run("""
import importlib, json, sys
import omnickpt
ns = {}
exec("from omnickpt import *", ns)
wrong = [n for n in omnickpt.__all__
         if ns.get(n) is not getattr(importlib.import_module(omnickpt._PUBLIC[n][0]), omnickpt._PUBLIC[n][1])]
try:
    omnickpt.no_such_name
    missing = "no error"
except AttributeError as e:
    missing = str(e)
print(json.dumps({"all": sorted(omnickpt.__all__), "star": sorted(k for k in ns if not k.startswith("__")),
                  "wrong": wrong, "open": omnickpt.open is omnickpt.CheckpointReader,
                  "open_in_star": "open" in ns, "submodule": omnickpt.export.__name__,
                  "missing": missing, "dir": set(omnickpt.__all__) <= set(dir(omnickpt)),
                  "trainers": [m for m in ("transformers", "lightning", "torchtitan") if m in sys.modules]}))
""")
    assert found["star"] == found["all"] and found["wrong"] == []
    assert found["open"] and not found["open_in_star"]    # import * never shadows the builtin open
    assert found["submodule"] == "omnickpt.export"         # omnickpt.<submodule> after a bare import omnickpt
    assert found["missing"] == "module 'omnickpt' has no attribute 'no_such_name'"
    assert found["dir"]
    assert found["trainers"] == []                         # every public name, and still no trainer package
