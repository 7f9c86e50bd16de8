"""The managers' options as one value (omnickpt.manager.ManagerOptions): the keywords of both
managers build it, `options=` gives it whole, never both; checked when built, before any root is
touched."""
from __future__ import annotations

import pytest

import omnickpt
from omnickpt.manager import ManagerOptions


def test_keywords_and_options_build_the_same_manager(tmp_path):
    opts = ManagerOptions(keep_last=2, on_error="warn", every=3)
    for mgr in (omnickpt.CheckpointManager(str(tmp_path / "a"), keep_last=2, on_error="warn", every=3),
                omnickpt.CheckpointManager(str(tmp_path / "b"), options=opts)):
        with mgr:
            assert (mgr.keep_last, mgr.on_error, mgr.cadence_report()["interval"]) == (2, "warn", 3)


def test_options_and_keywords_together_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"do not also pass \['keep_last'\]"):
        omnickpt.CheckpointManager(str(tmp_path / "a"), options=ManagerOptions(), keep_last=2)
    with pytest.raises(TypeError, match=r"do not also pass \['keep_last'\]"):
        omnickpt.TieredCheckpointManager(str(tmp_path / "a"), memory="shm://never-made", options=ManagerOptions(),
                                         keep_last=2)


@pytest.mark.parametrize("bad", [dict(keep_last=0), dict(on_error="ignore"), dict(every=0),
                                 dict(max_overhead=2, every="auto"), dict(full_every=0), dict(block_bytes=-1)])
def test_bad_options_are_refused_when_built(tmp_path, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):   # the message names the first key
        ManagerOptions(**bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        omnickpt.CheckpointManager(str(tmp_path / "run"), **bad)
    assert not (tmp_path / "run").exists()
