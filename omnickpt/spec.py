"""ShardSpec: explicit sharding for hand-written parallel code that omnickpt does not detect."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class ShardSpec:
    """`local` is the box starting at `offsets` of a global tensor of shape `global_shape`.

    Put it anywhere in the state (top level or inside dicts/lists); on load, `local` is filled in
    place with that box of the checkpoint's tensor, whatever layout saved it. Ranks holding the
    same box are replicas and it is written once (`replicated=True` documents that intent).
    `name` overrides the tensor's name in the checkpoint (default: its path in the state).
    """
    local: torch.Tensor
    offsets: Sequence[int]
    global_shape: Sequence[int]
    replicated: bool = False
    name: str | None = None

    def __post_init__(self):
        # map, not generators: hand-sharded states make these by the 10^5
        self.offsets = tuple(map(int, self.offsets))
        self.global_shape = tuple(map(int, self.global_shape))
        shape = self.local.shape
        if not (len(self.offsets) == len(self.global_shape) == len(shape)):
            raise ValueError(f"ShardSpec {self.name or ''}: local shape {tuple(shape)}, offsets {self.offsets} and "
                             f"global shape {self.global_shape} must have the same number of dimensions")
        if any(o < 0 or o + n > g for o, n, g in zip(self.offsets, shape, self.global_shape)):
            raise ValueError(f"ShardSpec {self.name or ''}: box at {self.offsets} of shape {tuple(shape)} does not fit "
                             f"in the global shape {self.global_shape}")
