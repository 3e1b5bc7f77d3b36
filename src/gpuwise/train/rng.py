"""Every random generator's state, as a checkpoint carries it: what makes resume bitwise exact."""

from __future__ import annotations

import random

import numpy as np
import torch


def forward_rng():
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_forward_rng(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def rng_state() -> dict:
    """Every generator's state as tensors and plain values, so that a checkpoint loads with
    `weights_only=True` (numpy's own state holds an ndarray, which that loader refuses)."""
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # the default legacy=True form of numpy's global (MT19937) generator
    kind, key, pos, has_gauss, gauss = legacy
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
