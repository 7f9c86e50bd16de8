"""RNGState: put it in the state to save and restore every random number generator of a rank."""
from __future__ import annotations

import random

import numpy as np
import torch


class RNGState:
    """Stateful view of Python's, NumPy's, torch's CPU and (when present) CUDA generators.

    Saved per rank: each rank resumes with its own streams; a rank that did not exist at save
    time takes rank 0's.
    """

    def state_dict(self) -> dict:
        sd = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])
        torch.set_rng_state(sd["torch"])
        if "cuda" in sd and torch.cuda.is_available():
            states = sd["cuda"][: torch.cuda.device_count()]
            torch.cuda.set_rng_state_all(states)
