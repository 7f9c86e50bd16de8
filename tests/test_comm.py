"""Comm.all_gather_object on gloo: one all_gather when every rank's pickle fits its slot, a second
round when one does not; the objects come back exactly, in rank order, either way."""
from __future__ import annotations

from dist import run_ranks

from omnickpt.comm import SLOT_MAX, SLOT_MIN, SLOTS_BYTES, slot_bytes


def test_slots_stay_within_their_budget_at_any_scale():
    assert slot_bytes(2) == SLOT_MAX
    for world in (1, 2, 3, 7, 64, 1000, 4096, 100_000):
        slot = slot_bytes(world)
        assert SLOT_MIN <= slot <= SLOT_MAX and slot % 8 == 0
        if world >= SLOTS_BYTES // SLOT_MIN:
            assert slot == SLOT_MIN   # at scale, a slot is as small as a sizes round
        else:
            assert slot * world <= SLOTS_BYTES


def _gathers(rank, world):
    import torch.distributed as dist

    from omnickpt import comm as C
    c = C.Comm(timeout=60.0)
    calls = []
    real = C.dist.all_gather

    def counted(*a, **k):   # a spy: how many collectives each exchange made
        calls.append(a[1].numel())
        return real(*a, **k)
    C.dist.all_gather = counted
    try:
        out = {}
        cases = {
            "small": {"rank": rank, "digest": "ab" * 16, "none": None},
            "one_large": bytes(c._slot + 100) if rank == 1 else ("small", rank),
            "all_large": [rank] * (c._slot // 2) + [b"x" * rank],
        }
        for name, obj in cases.items():
            calls.clear()
            out[name] = (c.all_gather_object(obj), list(calls))
        # a pickle of exactly the slot's length still fits (the boundary)
        import pickle
        overhead = len(pickle.dumps(b"y" * 1000, protocol=pickle.HIGHEST_PROTOCOL)) - 1000
        filler = bytes([65 + rank]) * (c._slot - overhead)   # each rank its own, to check the order
        assert len(pickle.dumps(filler, protocol=pickle.HIGHEST_PROTOCOL)) == c._slot
        calls.clear()
        out["exact_fit"] = (c.all_gather_object(filler), list(calls))
        dist.barrier()
        return out, c._slot, c.collectives
    finally:
        C.dist.all_gather = real


def test_all_gather_object_in_one_round_when_it_fits_and_two_when_not():
    results = run_ranks(3, _gathers)
    slot = results[0][1]
    assert slot == slot_bytes(3)
    for rank, (out, _, collectives) in enumerate(results):
        assert collectives == 4   # each exchange counts once, whatever its rounds
        got, calls = out["small"]
        assert got == [{"rank": r, "digest": "ab" * 16, "none": None} for r in range(3)]
        assert calls == [8 + slot]
        got, calls = out["one_large"]
        assert got == [("small", 0), bytes(slot + 100), ("small", 2)]
        assert len(calls) == 2 and calls[1] > slot
        got, calls = out["all_large"]
        assert got == [[r] * (slot // 2) + [b"x" * r] for r in range(3)]
        assert len(calls) == 2
        got, calls = out["exact_fit"]
        assert got == [bytes([65 + r]) * len(got[0]) for r in range(3)]
        assert calls == [8 + slot]
