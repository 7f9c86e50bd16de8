"""Resume equivalence: N training steps without a break give the same losses as saving at step k,
loading into fresh model/optimizer/scheduler objects and training on to N.

Same layout (plain 1 -> plain 1, FSDP2 2 ranks -> FSDP2 2 ranks): bit for bit, dropout included.
Across layouts (FSDP2 2 -> plain 1, DDP 2 -> FSDP2 2): within float tolerance, since the gradient
reductions add in another order. The data is sampled from torch's global RNG, the same stream on
every rank (each rank trains on its slice of the global batch), so a resumed run only sees the
same batches if the RNG state came back; the scheduler only gives the same learning rates if its
state came back, and Adam only takes the same steps if its moments did.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import omnickpt
from dist import run_ranks
from models import TinyGPT, apply_layout

STEPS, SAVE_AT = 8, 3
GLOBAL_BATCH, SEQ = 4, 8
DATA_SEED = 1234
# Across layouts only the summation order of the gradient reductions differs.
RTOL, ATOL = 1e-5, 1e-6


def make(layout: str, *, dropout: float, init_seed: int = 0, mesh=None):
    """A fresh TinyGPT in `layout` with its AdamW and a cosine schedule."""
    torch.manual_seed(init_seed)
    model = apply_layout(TinyGPT(dropout=dropout), layout, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    return model, opt, sched


def seed_data() -> None:
    # every rank the same streams: the batches are global, each rank takes its slice
    torch.manual_seed(DATA_SEED)
    random.seed(DATA_SEED)
    np.random.seed(DATA_SEED)


def train(model, opt, sched, steps: int) -> list[float]:
    """`steps` steps; returns each step's loss averaged over the global batch."""
    import torch.distributed as dist

    from omnickpt.adapters.module import unwrap
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    vocab = unwrap(model).vocab
    losses = []
    for _ in range(steps):
        tokens = torch.randint(vocab, (GLOBAL_BATCH, SEQ + 1))[rank::world]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def state_of(model, opt, sched, step: int) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "rng": omnickpt.RNGState(), "extra": {"step": step}}


def full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from omnickpt.adapters.module import unwrap
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
            for n, p in unwrap(model).named_parameters()}


def resume(path: str, layout: str, *, dropout: float, mesh=None) -> tuple[list[float], dict, int]:
    """Fresh objects (another init, another RNG state), load `path`, train to STEPS."""
    model, opt, sched = make(layout, dropout=dropout, init_seed=7, mesh=mesh)
    torch.manual_seed(999)
    state = state_of(model, opt, sched, -1)
    omnickpt.load(path, state)
    step = state["extra"]["step"]
    return train(model, opt, sched, STEPS - step), full_params(model), step


def _worker(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}

    # FSDP2 -> FSDP2, bitwise, with dropout and an async save that training runs on from
    # while it is persisted (the snapshot, not the live parameters, must be what lands).
    model, opt, sched = make("fsdp2", dropout=0.1, mesh=mesh)
    seed_data()
    out["fsdp2_ref"] = train(model, opt, sched, STEPS)
    out["fsdp2_ref_params"] = full_params(model)

    model, opt, sched = make("fsdp2", dropout=0.1, mesh=mesh)
    seed_data()
    losses = train(model, opt, sched, SAVE_AT)
    handle = omnickpt.save(f"{root}/fsdp2", state_of(model, opt, sched, SAVE_AT), async_save=True)
    losses += train(model, opt, sched, STEPS - SAVE_AT)
    handle.wait()
    out["fsdp2_saving_run"] = losses
    out["fsdp2_resumed"], out["fsdp2_resumed_params"], out["fsdp2_resumed_step"] = resume(
        f"{root}/fsdp2", "fsdp2", dropout=0.1, mesh=mesh)

    # Cross-layout sources (no dropout: its masks depend on the local batch shape).
    for layout in ("fsdp2", "ddp"):
        model, opt, sched = make(layout, dropout=0.0, mesh=mesh)
        seed_data()
        out[f"{layout}_nodrop_ref"] = train(model, opt, sched, STEPS)
        model, opt, sched = make(layout, dropout=0.0, mesh=mesh)
        seed_data()
        train(model, opt, sched, SAVE_AT)
        omnickpt.save(f"{root}/{layout}_nodrop", state_of(model, opt, sched, SAVE_AT),
                      async_save=layout == "ddp").wait()

    # DDP 2 -> FSDP2 2
    out["ddp_to_fsdp2"], _, _ = resume(f"{root}/ddp_nodrop", "fsdp2", dropout=0.0, mesh=mesh)
    return out


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    results = run_ranks(2, _worker, str(root))
    return root, results


@pytest.fixture
def in_process():
    """For the tests that train in the pytest process itself: they reseed and restore its global
    RNGs, so give them back afterwards; and one intra-op thread, since spinning thread pools on a
    busy 2-core machine make these tiny steps ten times slower."""
    saved, threads = omnickpt.RNGState().state_dict(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    omnickpt.RNGState().load_state_dict(saved)


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    assert np.allclose(got, want, rtol=RTOL, atol=ATOL), f"{what}: {got} vs {want}"


def test_plain_resume_is_bitwise(tmp_path, in_process):
    model, opt, sched = make("plain", dropout=0.1)
    seed_data()
    ref = train(model, opt, sched, STEPS)
    ref_params = full_params(model)

    model, opt, sched = make("plain", dropout=0.1)
    seed_data()
    train(model, opt, sched, SAVE_AT)
    omnickpt.save(tmp_path / "ckpt", state_of(model, opt, sched, SAVE_AT)).wait()

    losses, params, step = resume(str(tmp_path / "ckpt"), "plain", dropout=0.1)
    assert step == SAVE_AT
    assert losses == ref[SAVE_AT:]
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


def test_fsdp2_resume_is_bitwise(two_rank_runs):
    _, results = two_rank_runs
    for r in results:
        assert r["fsdp2_resumed_step"] == SAVE_AT
        # the run that saved asynchronously trained on unperturbed
        assert r["fsdp2_saving_run"] == r["fsdp2_ref"]
        assert r["fsdp2_resumed"] == r["fsdp2_ref"][SAVE_AT:]
        for name, p in r["fsdp2_ref_params"].items():
            assert torch.equal(r["fsdp2_resumed_params"][name], p), name


def test_ddp_to_fsdp2_resume_matches(two_rank_runs):
    _, results = two_rank_runs
    for r in results:
        _assert_close(r["ddp_to_fsdp2"], r["ddp_nodrop_ref"][SAVE_AT:], "DDP 2 -> FSDP2 2")


def test_fsdp2_to_plain_resume_matches(two_rank_runs, in_process):
    root, results = two_rank_runs
    ref = results[0]["fsdp2_nodrop_ref"]
    losses, _, step = resume(f"{root}/fsdp2_nodrop", "plain", dropout=0.0)
    assert step == SAVE_AT
    _assert_close(losses, ref[SAVE_AT:], "FSDP2 2 -> plain 1")

    # The tolerance still tells a real resume from a broken one: the same weights with a fresh
    # optimizer, schedule and RNG (what a loader that only restored the model would give) miss it.
    model, opt, sched = make("plain", dropout=0.0, init_seed=7)
    omnickpt.load(f"{root}/fsdp2_nodrop", {"model": model})
    seed_data()
    wrong = train(model, opt, sched, STEPS - SAVE_AT)
    assert not np.allclose(wrong, ref[SAVE_AT:], rtol=RTOL * 100, atol=ATOL * 100)
