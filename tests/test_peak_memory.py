"""Host memory of async saves: a training loop that saves asynchronously and waits for each save
before the next (bench/scenario.py's phase 1) needs one copy of the rank's file in host memory
while a save is in flight (its staging), and nothing else the size of the state: no second
staging copy, no copy of the state made on the way to the file (contiguous copies of shards,
write buffers), no buffer left behind by a save. bench/memory_probe.py measures the same on the
benchmark's workloads, against DCP.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import omnickpt
from dist import run_ranks

MB = 1 << 20


def _state(seed: int = 0):
    """~48 MB: 4 M float32 parameters and Adam's two moments, in tensors of 4 MB (each large enough
    that a copy of it is memory of its own, not a reused fragment of the heap)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state_bytes(model, opt) -> int:
    tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if v.numel() > 1]
    return sum(t.numel() * t.element_size() for t in tensors)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"{field} not in /proc/self/status")


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _change(model) -> None:
    """A new state for the next save without allocating (an optimizer step's temporaries would blur
    the figures this test reads)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def test_waited_async_saves_hold_at_most_one_staging_buffer(tmp_path):
    model, opt = _state()
    size = _state_bytes(model, opt)
    with omnickpt.Checkpointer() as ckpt:
        for i in range(4):
            ckpt.save(tmp_path / f"s{i}", {"model": model, "optim": opt}, async_save=True).wait()
            _change(model)
        # At most one buffer the size of the file (the state and its few small objects), reused by
        # every save; a second one would mean two saves' staging at once although each was waited for.
        assert ckpt._pool.peak <= size + 2 * MB
        assert ckpt._pool.held <= ckpt._pool.peak


def test_async_saves_add_no_state_sized_memory_beyond_staging(tmp_path):
    model, opt = _state()
    size = _state_bytes(model, opt)
    state = {"model": model, "optim": opt}
    before = _status_mb("VmRSS")
    if not _can_reset_peak():   # the process's peak from here on (omnickpt itself never resets it)
        pytest.skip("/proc/self/clear_refs is not writable here: no peak RSS to read")
    with omnickpt.Checkpointer() as ckpt:
        peaks = []
        for i in range(5):
            handle = ckpt.save(tmp_path / f"s{i}", state, async_save=True)
            handle.wait()
            peaks.append(_status_mb("VmHWM"))
            _change(model)
        # One copy of the state (the staging, kept warm or not) plus threads and plans; a save that
        # made one more copy of the state (or of a large part of it) on its way to the file, or kept
        # a second staging buffer, would show here as about `size` more.
        extra = max(peaks) - before
        assert extra < 1.4 * size / MB, (f"async saves of a {size / MB:.0f} MB state raised the peak RSS by "
                                         f"{extra:.0f} MB (peaks {peaks}, before {before})")


def _fsdp2_saves(rank, world_size, root):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    local = sum(getattr(t, "_local_tensor", t).numel() * 4 for t in
                list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if v.numel() > 1])
    with omnickpt.Checkpointer() as ckpt:
        for i in range(3):
            ckpt.save(f"{root}/s{i}", {"model": model, "optim": opt}, async_save=True).wait()
            model(torch.randn(4, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return local, ckpt._pool.peak, ckpt._pool.held


def test_fsdp2_async_saves_stage_only_the_local_shards(tmp_path):
    """FSDP2: the staging pool holds at most this rank's shards (half the state on 2 ranks), once,
    not the full tensors an unsharded copy would need."""
    for local, peak, held in run_ranks(2, _fsdp2_saves, str(tmp_path)):
        assert peak <= local + 2 * MB
        assert held <= peak
