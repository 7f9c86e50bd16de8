"""Background threads yield to training (omnickpt/engine/priority.py): an async save's persist thread
and I/O workers run nicer than the training thread, at the lowest best-effort I/O priority; the lazy
snapshot's copier (which an optimizer step may wait for) does not; background_nice=None opts out."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import omnickpt
from omnickpt.engine.priority import thread_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority") or threading.get_native_id is None,
                                reason="per-thread priorities are a Linux feature")
LOWEST_BEST_EFFORT = (2 << 13) | 7


def _save_and_look(tmp_path, **kw) -> dict:
    before = {t.ident for t in threading.enumerate()}   # other Checkpointers' threads (the default one's)
    ckpt = omnickpt.Checkpointer(**kw)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    ckpt.save(str(tmp_path / "c"), {"model": model, "optimizer": opt}, async_save=True).wait()
    seen = {}
    for t in threading.enumerate():
        if t.ident in before:
            continue
        for prefix in ("omnickpt-persist", "omnickpt-io", "omnickpt-snapshot"):
            if t.name.startswith(prefix) and t.native_id is not None:
                seen.setdefault(prefix, thread_priority(t.native_id))
    # A small save may write on the persist thread alone: ask an I/O worker (they read at load too).
    seen.setdefault("omnickpt-io", ckpt._io.submit(lambda: thread_priority(threading.get_native_id())).result())
    ckpt.close()
    return seen


def test_an_async_saves_background_threads_run_at_a_lower_priority(tmp_path):
    base, base_io = thread_priority(threading.get_native_id())
    seen = _save_and_look(tmp_path)
    assert set(seen) == {"omnickpt-persist", "omnickpt-io", "omnickpt-snapshot"}, seen
    for name in ("omnickpt-persist", "omnickpt-io"):
        nice, io = seen[name]
        assert nice == min(19, base + 10), (name, seen)
        if io is not None:
            assert io == LOWEST_BEST_EFFORT, (name, seen)
    assert seen["omnickpt-snapshot"] == (base, base_io), seen   # a step may wait for the copier


def test_background_nice_none_leaves_them_at_the_training_threads_priority(tmp_path):
    base = thread_priority(threading.get_native_id())
    seen = _save_and_look(tmp_path / "same", background_nice=None)
    assert all(p == base for p in seen.values()), seen


def test_an_async_save_in_flight_leaves_the_garbage_collector_to_the_program(tmp_path, monkeypatch):
    # The collector is the whole process's: a save persisting in the background must neither turn
    # it off for the training thread while it is in flight nor turn it back on when it ends after
    # the program turned it off meanwhile.
    import gc
    import threading

    import torch

    import omnickpt
    from omnickpt.storage.local import LocalStorage
    gate, entered = threading.Event(), threading.Event()
    real = LocalStorage.write_file

    def held(self, *args, **kwargs):
        entered.set()
        gate.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "write_file", held)
    assert gc.isenabled()
    try:
        with omnickpt.Checkpointer() as ckpt:
            handle = ckpt.save(str(tmp_path / "ck"), {"w": torch.randn(1000)}, async_save=True)
            assert entered.wait(30)
            assert gc.isenabled()   # training goes on with its collections
            gc.disable()            # the program's own choice, while the save is in flight
            gate.set()
            handle.wait()
            assert not gc.isenabled()
    finally:
        gate.set()
        gc.enable()
