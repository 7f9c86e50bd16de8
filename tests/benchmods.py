"""A script of bench/ as a module, for the tests of its pure summaries (the benchmarks themselves run 2
ranks for minutes). bench/ is on sys.path while the script loads: the scripts import their neighbours."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str):
    """bench/<name>.py, loaded anew as module bench_<name>."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))
