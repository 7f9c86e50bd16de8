"""Optimizers behind wrappers (issue 19): Accelerate's AcceleratedOptimizer subclasses
torch.optim.Optimizer but skips Optimizer.__init__ (no step hooks of its own) and steps the optimizer it
holds as `.optimizer`. A lazy snapshot must hold back the inner optimizer's step, else an async save of
a prepared model crashed (AttributeError: no _optimizer_step_pre_hooks)."""
from __future__ import annotations

import pytest
import torch

import omnickpt

accelerate = pytest.importorskip("accelerate")


def test_a_lazy_async_save_of_an_accelerated_optimizer_keeps_the_values_of_the_save_call(tmp_path):
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model, opt = acc.prepare(torch.nn.Linear(256, 256), torch.optim.Adam(torch.nn.Linear(1, 1).parameters()))
    # Adam over the prepared model's parameters (prepare wraps the optimizer given)
    opt = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    at_save = model.weight.detach().clone()
    handle = omnickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": opt}, async_save=True)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()                                   # waits for the background copy of the saved values
    handle.wait()
    assert not torch.equal(model.weight, at_save)
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    omnickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(fresh.weight, at_save)
