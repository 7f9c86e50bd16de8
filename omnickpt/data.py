"""Dataloader state that reshards when the data-parallel (DP) size changes.

A dataloader's state is split in two (docs/dataloader.md):
- a *replicated* part, the same on every DP rank: epoch, seed, where the current round of the
  epoch's global order starts;
- a *shard* per DP rank: that rank's cursor, the samples handed to it but not consumed yet, the
  tokens of its partly packed sequence.

An object takes part by implementing two methods (the `DataParallelStateful` protocol):

    dp_state_dict() -> {"replicated": R, "shard": S, "dp_rank": r, "dp_size": n}
    load_dp_state_dict(replicated: R, shards: {saved dp_rank: S}, saved_dp_size: int) -> None

omnickpt saves the dict of every rank; on load it hands every rank the replicated part and the
shards of *all* saved DP ranks (ranks of one DP group, tensor or pipeline peers, share a dp_rank
and are counted once), so the object can redistribute them at a new DP size with no sample lost or
repeated. `ReshardableSampler` and `PackedTokenLoader` here are reference implementations.

This module imports nothing from omnickpt but its errors: the adapter
(omnickpt/adapters/dataloader.py) depends on it, not the other way round.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch

from omnickpt.errors import CheckpointError, MismatchError

DP_STATE_KEYS = ("replicated", "shard", "dp_rank", "dp_size")


@runtime_checkable
class DataParallelStateful(Protocol):
    """State split into a replicated part and one shard per data-parallel rank (module docstring)."""

    def dp_state_dict(self) -> dict: ...

    def load_dp_state_dict(self, replicated: Any, shards: dict[int, Any], saved_dp_size: int) -> None: ...


def is_dp_stateful(value: Any) -> bool:
    return callable(getattr(value, "dp_state_dict", None)) and callable(getattr(value, "load_dp_state_dict", None))


def is_dp_state(value: Any) -> bool:
    """Whether `value` has the shape `dp_state_dict()` returns."""
    return isinstance(value, dict) and set(value) == set(DP_STATE_KEYS)


def check_dp_rank(dp_rank: int, dp_size: int, what: str) -> None:
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise ValueError(f"{what}: dp_rank={dp_rank!r}, dp_size={dp_size!r}; need integers with 0 <= dp_rank < dp_size")


def _check_shards(shards: dict[int, Any], saved_dp_size: int, what: str) -> None:
    missing = sorted(set(range(saved_dp_size)) - set(shards))
    if missing:
        raise CheckpointError(
            f"{what}: the checkpoint was saved at data-parallel size {saved_dp_size} but holds no state for "
            f"dp_rank(s) {missing}; every DP rank must take part in the save (pass the sampler or loader of "
            "every rank in the saved state)")


# ----------------------------------------------------------------------------- sampler
#
# Positions index the epoch's global order (a permutation of the dataset). Within a *round* that
# starts at global position `base`, DP rank r takes positions base + slot(r) + k * stride for
# k = 0, 1, ... where stride is the DP size of the round and slot(r) = (r - shift) % stride. Before
# that, a rank takes its `pending` positions: samples of an earlier round (at another DP size)
# that no rank had consumed when the state was resharded. A rank's shard is (pending, taken).

def _round_count(dataset_len: int, first: int, stride: int) -> int:
    """How many of first, first + stride, ... are below dataset_len."""
    return 0 if first >= dataset_len else (dataset_len - 1 - first) // stride + 1


def reshard_sampler_state(replicated: dict, shards: dict[int, dict], saved_dp_size: int,
                          dp_size: int) -> tuple[dict, list[dict]]:
    """Redistribute a `ReshardableSampler` state saved at `saved_dp_size` over `dp_size` ranks.

    Pure function. The positions some rank consumed stay consumed; every other position of the
    epoch goes to exactly one new rank. Positions the slower ranks had not reached in the saved
    round (ranks consume at different speeds: packing, uneven batches) are dealt round-robin in
    global order as the new ranks' `pending` positions, and the new round starts after them, with
    the round-robin continuing where the deal stopped, so per-rank counts differ by at most one.
    Returns the new replicated part and the new shard of each new DP rank.
    """
    _check_shards(shards, saved_dp_size, "sampler state")
    n, base, shift = replicated["stride"], replicated["base"], replicated["shift"]
    N = replicated["dataset_len"]
    if n != saved_dp_size:
        raise CheckpointError(f"sampler state: its round has stride {n} but it was saved at DP size {saved_dp_size}")
    furthest = max((s["taken"] for s in shards.values()), default=0)
    end = min(N, base + furthest * n)          # every position of the round below `end` was reached by some rank
    leftover: list[int] = []
    for r, s in shards.items():
        leftover.extend(int(p) for p in s["pending"])
        slot = (r - shift) % n
        leftover.extend(range(base + slot + s["taken"] * n, end, n))
    leftover.sort()
    if len(set(leftover)) != len(leftover):
        raise CheckpointError("sampler state: the saved shards hand the same sample to two ranks; the checkpoint "
                              "is inconsistent")
    new_replicated = dict(replicated, base=end, stride=dp_size, shift=len(leftover) % dp_size)
    new_shards = [{"pending": leftover[j::dp_size], "taken": 0} for j in range(dp_size)]
    return new_replicated, new_shards


class ReshardableSampler(torch.utils.data.Sampler):
    """A distributed sampler whose position survives a change of data-parallel size.

    Each epoch has one deterministic global order (a permutation of range(dataset_len) seeded by
    `seed + epoch`, or the identity when shuffle=False), consumed round-robin by the DP ranks:
    rank r yields global positions r, r + dp_size, r + 2 * dp_size, ... No padding: at the end of
    an epoch the ranks' counts differ by at most one, and no sample is repeated.

    Like torchdata's StatefulDistributedSampler: each `iter()` starts the current epoch from its
    beginning, except the first one after a state was loaded, which resumes it. `set_epoch(e)`
    with a new epoch starts that epoch; with the current one it keeps a loaded position (so the
    usual `for epoch in ...: sampler.set_epoch(epoch)` loop resumes correctly). One iteration at a
    time: iterators share the sampler's position.

    When loaded at another DP size the rest of the epoch is split among the new ranks (see
    `reshard_sampler_state`); at the same DP size every rank resumes exactly where it stopped.
    The saved seed wins over the constructor's, so the resumed epoch keeps its order.
    """

    def __init__(self, dataset_len: int, dp_rank: int, dp_size: int, *, seed: int = 0, shuffle: bool = True):
        check_dp_rank(dp_rank, dp_size, "ReshardableSampler")
        if dataset_len < 0:
            raise ValueError(f"ReshardableSampler: dataset_len={dataset_len} must be >= 0")
        self.dataset_len, self.dp_rank, self.dp_size = int(dataset_len), dp_rank, dp_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch = 0
        self._perm: tuple[int, int, torch.Tensor] | None = None     # (seed, epoch, permutation) cache
        self._resume = False
        self._start_epoch()

    # -- position
    def _start_epoch(self) -> None:
        self._base, self._stride, self._shift = 0, self.dp_size, 0
        self._pending: list[int] = []
        self._pending_done = 0
        self._taken = 0

    def _slot(self) -> int:
        return (self.dp_rank - self._shift) % self._stride

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._resume = False
            self._start_epoch()

    def permutation(self) -> torch.Tensor:
        """The global order of the current epoch (global position -> dataset index)."""
        if self._perm is None or self._perm[:2] != (self.seed, self.epoch):
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                perm = torch.randperm(self.dataset_len, generator=g)
            else:
                perm = torch.arange(self.dataset_len)
            self._perm = (self.seed, self.epoch, perm)
        return self._perm[2]

    def __len__(self) -> int:
        """Samples the next iteration yields on this rank (the rest of the epoch after a load)."""
        if not self._resume:
            return _round_count(self.dataset_len, self.dp_rank, self.dp_size)
        return (len(self._pending) - self._pending_done
                + _round_count(self.dataset_len, self._base + self._slot() + self._taken * self._stride, self._stride))

    def __iter__(self) -> Iterator[int]:
        # Decided here, not lazily in the generator, so that iter() itself consumes a loaded position
        # (torch and torchdata loaders call iter() on their sampler when they build their iterator).
        if not self._resume:
            self._start_epoch()
        self._resume = False
        return self._indices(self.permutation())

    def _indices(self, perm: torch.Tensor) -> Iterator[int]:
        # The position is advanced before each yield: whenever the consumer holds a sample, the
        # state already counts it as consumed.
        while self._pending_done < len(self._pending):
            pos = self._pending[self._pending_done]
            self._pending_done += 1
            yield int(perm[pos])
        while True:
            pos = self._base + self._slot() + self._taken * self._stride
            if pos >= self.dataset_len:
                return
            self._taken += 1
            yield int(perm[pos])

    # -- state
    def dp_state_dict(self) -> dict:
        replicated = {"dataset_len": self.dataset_len, "shuffle": self.shuffle, "seed": self.seed,
                      "epoch": self.epoch, "base": self._base, "stride": self._stride, "shift": self._shift}
        shard = {"pending": self._pending[self._pending_done:], "taken": self._taken}
        return {"replicated": replicated, "shard": shard, "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_dp_state_dict(self, replicated: dict, shards: dict[int, dict], saved_dp_size: int) -> None:
        differences = [f"{k}: {replicated[k]!r} in the checkpoint, {getattr(self, k)!r} here"
                       for k in ("dataset_len", "shuffle") if replicated[k] != getattr(self, k)]
        if differences:
            raise MismatchError(
                "ReshardableSampler: the checkpoint's epoch order cannot be continued with this sampler (" +
                "; ".join(differences) + "); build the sampler with the saved values, or leave it out of the "
                "loaded state to start over", differences)
        if saved_dp_size == self.dp_size:
            # Same DP size: every rank resumes exactly where it stopped; its own shard is enough
            # (the per-rank load_state_dict view passes only that one).
            if self.dp_rank not in shards:
                raise CheckpointError(f"ReshardableSampler: the checkpoint holds no state for dp_rank {self.dp_rank} "
                                      f"(DP size {saved_dp_size}); every DP rank must take part in the save")
            shard = shards[self.dp_rank]
        else:
            replicated, new_shards = reshard_sampler_state(replicated, shards, saved_dp_size, self.dp_size)
            shard = new_shards[self.dp_rank]
        self.seed, self.epoch = replicated["seed"], replicated["epoch"]
        self._base, self._stride, self._shift = replicated["base"], replicated["stride"], replicated["shift"]
        self._pending, self._pending_done = [int(p) for p in shard["pending"]], 0
        self._taken = int(shard["taken"])
        self._resume = True

    # The per-rank Stateful view, for loaders that call state_dict() on their sampler (torchdata's
    # StatefulDataLoader snapshots it in step with the batches it returns). It loads only at the
    # same DP size; omnickpt reshards through dp_state_dict.
    def state_dict(self) -> dict:
        return self.dp_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_dp_state_dict(state["replicated"], {state["dp_rank"]: state["shard"]}, state["dp_size"])


# ----------------------------------------------------------------------------- packed tokens

def reshard_token_buffers(buffers: dict[int, torch.Tensor], dp_size: int) -> list[torch.Tensor]:
    """The partly packed buffer of saved DP rank r goes, whole and in order, to new rank r % dp_size.

    Keeping each buffer whole keeps a split document's tokens contiguous; when shrinking, a new
    rank's buffer is the concatenation of its old ranks' buffers in rank order.
    """
    out = []
    for j in range(dp_size):
        parts = [torch.as_tensor(buffers[r], dtype=torch.int64).reshape(-1) for r in sorted(buffers) if r % dp_size == j]
        out.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
    return out


class PackedTokenLoader:
    """Packs variable-length documents into fixed-length token sequences, per DP rank.

    `documents[i]` is a 1-D sequence of token ids (list, numpy array or tensor). Each rank reads
    the documents its `ReshardableSampler` gives it, appends their tokens (and `eos_id` when set)
    to its buffer, and yields int64 batches of shape (batch_size, seq_len) cut from the buffer. The
    tokens that do not fill a batch stay in the buffer: they start the next batch, in the next
    epoch too. The state holds the sampler's state and the buffer; after a change of DP size the
    buffers are carried over to the new ranks (`reshard_token_buffers`), so no token is dropped or
    repeated. seq_len, batch_size and eos_id may change between save and load (tokens are tokens).
    """

    def __init__(self, documents: Sequence, seq_len: int, dp_rank: int, dp_size: int, *, batch_size: int = 1,
                 seed: int = 0, shuffle: bool = True, eos_id: int | None = None):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"PackedTokenLoader: seq_len={seq_len} and batch_size={batch_size} must be >= 1")
        self.documents, self.seq_len, self.batch_size, self.eos_id = documents, int(seq_len), int(batch_size), eos_id
        self.sampler = ReshardableSampler(len(documents), dp_rank, dp_size, seed=seed, shuffle=shuffle)
        self.buffer = torch.empty(0, dtype=torch.int64)

    @property
    def dp_rank(self) -> int:
        return self.sampler.dp_rank

    @property
    def dp_size(self) -> int:
        return self.sampler.dp_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self._batches(iter(self.sampler))

    def _batches(self, indices: Iterator[int]) -> Iterator[torch.Tensor]:
        need = self.batch_size * self.seq_len
        for i in indices:
            tokens = torch.as_tensor(self.documents[i], dtype=torch.int64).reshape(-1)
            if self.eos_id is not None:
                tokens = torch.cat([tokens, torch.tensor([self.eos_id], dtype=torch.int64)])
            # The sampler has counted document i and its tokens are now in the buffer: the state is
            # consistent at every yield below.
            self.buffer = torch.cat([self.buffer, tokens])
            while self.buffer.numel() >= need:
                batch, self.buffer = self.buffer[:need], self.buffer[need:].clone()
                yield batch.reshape(self.batch_size, self.seq_len)

    def dp_state_dict(self) -> dict:
        s = self.sampler.dp_state_dict()
        return {"replicated": {"sampler": s["replicated"]},
                "shard": {"sampler": s["shard"], "buffer": self.buffer.clone()},
                "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_dp_state_dict(self, replicated: dict, shards: dict[int, dict], saved_dp_size: int) -> None:
        self.sampler.load_dp_state_dict(replicated["sampler"], {r: s["sampler"] for r, s in shards.items()},
                                        saved_dp_size)
        if saved_dp_size == self.dp_size:
            self.buffer = torch.as_tensor(shards[self.dp_rank]["buffer"], dtype=torch.int64).reshape(-1).clone()
        else:
            self.buffer = reshard_token_buffers({r: s["buffer"] for r, s in shards.items()}, self.dp_size)[self.dp_rank]

    def state_dict(self) -> dict:
        return self.dp_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_dp_state_dict(state["replicated"], {state["dp_rank"]: state["shard"]}, state["dp_size"])


__all__ = ["DataParallelStateful", "PackedTokenLoader", "ReshardableSampler", "is_dp_stateful",
           "reshard_sampler_state", "reshard_token_buffers"]
