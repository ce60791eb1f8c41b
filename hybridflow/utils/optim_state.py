"""The never-stepped values of an optimizer's state, shared by the engine (state allocated at setup) and
the checkpoint loader (a checkpoint saved before the first step)."""

from __future__ import annotations

import torch


@torch.no_grad()
def zero_state(optimizer: torch.optim.Optimizer) -> None:
    """Put allocated optimizer state back to its never-stepped values (zero moments, step 0), in place."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif key == "step":
                state[key] = 0
