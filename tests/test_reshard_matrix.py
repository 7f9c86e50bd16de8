"""The resharding matrix: a checkpoint saved from any layout at world sizes 1, 2 and 4 loads into
any layout at world sizes 1 to 4, and every tensor comes back bit for bit.

Layouts: a plain module, DDP, FSDP2 (fully_shard), DTensor tensor parallel (column-wise fc1,
row-wise fc2) and FSDP2 x TP on a 2-D ("dp", "tp") mesh. The model's dimensions (7, 13, 5) are
divisible by none of 2, 3, 4, so the shards are uneven and at 4 ranks some are empty.

Cost: one 4-rank launch does everything. Every world size w runs on the sub-group of ranks
0..w-1 (sub-meshes of the same ranks), so all saves come first, then all loads, with the ranks
outside a scenario's group waiting at a barrier. Print the matrix with
    .venv/bin/python tests/test_reshard_matrix.py
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dist import run_ranks
from models import ToyMLP, apply_layout

SAVE_WORLD_SIZES = (1, 2, 4)
LOAD_WORLD_SIZES = (1, 2, 3, 4)
# 2-D meshes (dp, tp) per world size: every shape that fits, including degenerate ones
MESHES_2D = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2)]}
LAUNCH_SIZE = max(LOAD_WORLD_SIZES)

# What the matrix leaves out, and why.
SKIPPED = [
    ("plain at world size > 1, as a save layout",
     "a plain module on several ranks saves exactly the replicated boxes DDP saves (covered by ddp@2, ddp@4); "
     "as a load layout it is tested at every world size"),
    ("any layout saved at world size 3", "not asked for: saves at 1, 2, 4; world size 3 is a load size only"),
    ("2d with both mesh dims > 1 at world sizes 2 and 3", "impossible: 2 and 3 are prime (1xN / Nx1 meshes used)"),
    ("2d 4x1 and 1x4 at world size 4", "degenerate shapes already covered by 2x1 / 1x2 / 3x1 / 1x3; 2x2 is used"),
]


@dataclass(frozen=True)
class Layout:
    kind: str                       # one of models.LAYOUTS
    ws: int                         # world size (ranks 0..ws-1)
    mesh: tuple[int, int] | None = None   # (dp, tp) for "2d"

    @property
    def label(self) -> str:
        shape = f"-{self.mesh[0]}x{self.mesh[1]}" if self.mesh else ""
        return f"{self.kind}{shape}@{self.ws}"


def _layouts(world_sizes, *, plain_everywhere: bool) -> list[Layout]:
    out = []
    for ws in world_sizes:
        for kind in ("plain", "ddp", "fsdp2", "tp"):
            if kind == "plain" and ws > 1 and not plain_everywhere:
                continue
            out.append(Layout(kind, ws))
        out.extend(Layout("2d", ws, shape) for shape in MESHES_2D[ws])
    return out


SAVE_LAYOUTS = _layouts(SAVE_WORLD_SIZES, plain_everywhere=False)
LOAD_LAYOUTS = _layouts(LOAD_WORLD_SIZES, plain_everywhere=True)
PAIRS = [(s, d) for s in SAVE_LAYOUTS for d in LOAD_LAYOUTS]


def matrix_table() -> str:
    lines = [f"{len(SAVE_LAYOUTS)} save layouts x {len(LOAD_LAYOUTS)} load layouts = {len(PAIRS)} pairs",
             "save: " + ", ".join(s.label for s in SAVE_LAYOUTS),
             "load: " + ", ".join(d.label for d in LOAD_LAYOUTS),
             "every save layout loads into every load layout (all pairs); skipped:"]
    lines += [f"  - {what}: {why}" for what, why in SKIPPED]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- rank side
def _extra(label: str) -> dict:
    return {"epoch": 3, "tokens_seen": 123456789012, "name": f"run-{label}", "losses": [2.5, 1.25, 0.1],
            "nested": {"flag": True, "pair": (1, 2), "none": None, "ratio": 1 / 3}}


def _build(lay: Layout, meshes: dict, groups: dict, *, seed: int, stepped: bool):
    """Model, optimizer, scheduler in layout `lay`, all ranks starting from the same full tensors
    (seeded). stepped: take one AdamW step with gradients that are an elementwise function of the
    parameters, so each layout's step computes the same global numbers without a forward pass."""
    from omnickpt.adapters.module import unwrap
    torch.manual_seed(seed)
    model = ToyMLP()
    mesh = meshes.get((lay.ws, lay.mesh)) if lay.kind in ("fsdp2", "tp", "2d") else None
    model = apply_layout(model, lay.kind, mesh=mesh, group=groups[lay.ws])
    inner = unwrap(model)
    # two param groups, so the loader must map group membership by name
    decay = [p for n, p in inner.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    other = [p for n, p in inner.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    if stepped:
        for p in inner.parameters():
            p.grad = torch.cos(p.detach() * 3.0) * 0.1 + 0.02
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, sched


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _full_state(model, opt, sched, extra) -> dict:
    """Every tensor of the state as a full (unsharded) tensor, plus the plain values. Collective
    over the layout's mesh: every rank of the layout calls it, in the same order."""
    from omnickpt.adapters.module import unwrap
    inner = unwrap(model)
    names = {id(p): n for n, p in inner.named_parameters()}
    out = {f"model/{n}": _full(t) for n, t in inner.state_dict().items()}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                out[f"optim/{names[id(p)]}/{k}"] = _full(v) if isinstance(v, torch.Tensor) else v
    out["optim/param_groups"] = [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]
    out["sched"] = sched.state_dict()
    out["extra"] = dict(extra)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _diff(expected: dict, got: dict) -> list[str]:
    out = []
    for k in sorted(set(expected) | set(got)):
        if k not in got or k not in expected:
            out.append(f"{k}: {'missing after load' if k not in got else 'not in the saved state'}")
            continue
        e, g = expected[k], got[k]
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor) or not _same_bits(e, g):
                detail = (f"max |diff| {(e.double() - g.double()).abs().max().item():.3g}"
                          if isinstance(g, torch.Tensor) and e.shape == g.shape else f"got {g!r}")
                out.append(f"{k}: not bitwise equal ({detail})")
        elif e != g:
            out.append(f"{k}: expected {e!r}, got {g!r}")
    return out


def _rng_diff(expected: dict, got: dict) -> list[str]:
    out = []
    if expected["python"] != got["python"]:
        out.append("rng/python differs")
    if not all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(expected["numpy"], got["numpy"], strict=True)):
        out.append("rng/numpy differs")
    if not torch.equal(expected["torch"], got["torch"]):
        out.append("rng/torch differs")
    return out


def _seed_rank_rngs(rank: int, salt: int) -> None:
    # every rank's streams differ, so a load that hands a rank another rank's RNG is caught
    torch.manual_seed(1000 + 17 * salt + rank)
    random.seed(2000 + 17 * salt + rank)
    np.random.seed(3000 + 17 * salt + rank)


def _make_meshes(rank: int) -> tuple[dict, dict]:
    """All meshes and groups, created on every rank in the same order (group creation is
    collective over the world, membership or not)."""
    from torch.distributed.device_mesh import DeviceMesh
    meshes, groups = {}, {}
    for ws in LOAD_WORLD_SIZES:
        mesh = DeviceMesh("cpu", torch.arange(ws))
        if rank < ws:
            meshes[(ws, None)] = mesh
            groups[ws] = mesh.get_group()
    for ws in LOAD_WORLD_SIZES:
        for shape in MESHES_2D[ws]:
            mesh = DeviceMesh("cpu", torch.arange(ws).view(*shape), mesh_dim_names=("dp", "tp"))
            if rank < ws:
                meshes[(ws, shape)] = mesh
    return meshes, groups


def _matrix_worker(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    import omnickpt
    meshes, groups = _make_meshes(rank)

    def ckpt(lay):
        return os.path.join(root, lay.label)

    def expected_file(lay, r=None):
        return os.path.join(root, "expected", f"{lay.label}{'' if r is None else f'-rng-r{r}'}.pt")

    os.makedirs(os.path.join(root, "expected"), exist_ok=True)
    consistency: dict[str, list[str]] = {}
    # ---- saves: each layout at its world size, after one real AdamW step
    for i, lay in enumerate(SAVE_LAYOUTS):
        if rank < lay.ws:
            model, opt, sched = _build(lay, meshes, groups, seed=0, stepped=True)
            extra = _extra(lay.label)
            full = _full_state(model, opt, sched, extra)
            _seed_rank_rngs(rank, i)
            rng = omnickpt.RNGState().state_dict()
            state = {"model": model, "optim": opt, "sched": sched, "extra": extra, "rng": omnickpt.RNGState()}
            # every other save is asynchronous (committed in the background), the rest synchronous
            omnickpt.save(ckpt(lay), state, process_group=groups[lay.ws], async_save=i % 2 == 1).wait()
            torch.save(rng, expected_file(lay, rank))
            if rank == 0:
                torch.save(full, expected_file(lay))
                # Every layout took the same step from the same start: the saved states must agree,
                # or the matrix would compare different numbers for different layouts.
                if i > 0:
                    ref = torch.load(expected_file(SAVE_LAYOUTS[0]), weights_only=False)
                    consistency[lay.label] = [d for d in _diff(ref, full) if not d.startswith("extra")]
        dist.barrier()

    # ---- loads: every saved checkpoint into every layout; every other one into a target that
    # already has optimizer state (filled in place) instead of a fresh one (state created by the loader)
    results: dict[tuple[str, str], list[str]] = {}
    for lay in LOAD_LAYOUTS:
        if rank < lay.ws:
            for j, src in enumerate(SAVE_LAYOUTS):
                warm = j % 2 == 1
                model, opt, sched = _build(lay, meshes, groups, seed=1, stepped=warm)
                extra = {"epoch": -1, "name": "stale"}
                state = {"model": model, "optim": opt, "sched": sched, "extra": extra, "rng": omnickpt.RNGState()}
                _seed_rank_rngs(rank, 99)
                problems: list[str] = []
                try:
                    result = omnickpt.load(ckpt(src), state, process_group=groups[lay.ws])
                    rng_now = omnickpt.RNGState().state_dict()
                    if result.differences:
                        problems.append(f"load reported differences {result.differences}")
                    got = _full_state(model, opt, sched, state["extra"])
                    problems += _diff(torch.load(expected_file(src), weights_only=False), got)
                    # same world size: every rank its own streams; otherwise ranks beyond the saved
                    # world take rank 0's (the RNGState contract)
                    rng_src = rank if rank < src.ws else 0
                    problems += _rng_diff(torch.load(expected_file(src, rng_src), weights_only=False), rng_now)
                except Exception as e:   # all ranks fail a load together, so the loop stays in step
                    problems.append(f"load failed: {type(e).__name__}: {e}")
                results[(src.label, lay.label)] = [f"rank {rank}: {p}" for p in problems]
        dist.barrier()
    return {"results": results, "consistency": consistency}


# ----------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard_matrix")
    per_rank = run_ranks(LAUNCH_SIZE, _matrix_worker, str(root), timeout=600)
    merged: dict[tuple[str, str], list[str]] = {}
    for out in per_rank:
        for pair, problems in out["results"].items():
            merged.setdefault(pair, []).extend(problems)
    return {"results": merged, "consistency": per_rank[0]["consistency"]}


def test_every_pair_was_run(matrix):
    assert set(matrix["results"]) == {(s.label, d.label) for s, d in PAIRS}


def test_save_layouts_hold_the_same_state(matrix):
    # not a property of omnickpt, but what makes the matrix meaningful: each layout saved the
    # same global numbers (a seeded start and one elementwise-deterministic AdamW step)
    bad = {k: v for k, v in matrix["consistency"].items() if v}
    assert not bad, bad


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{s.label}->{d.label}" for s, d in PAIRS])
def test_reshard(matrix, src, dst):
    problems = matrix["results"][(src.label, dst.label)]
    assert not problems, f"{src.label} -> {dst.label}:\n  " + "\n  ".join(problems)


if __name__ == "__main__":
    print(matrix_table())
    for s, d in PAIRS:
        print(f"{s.label} -> {d.label}")
