"""AdamW and its learning-rate schedules (constant or cosine, both with linear warm-up)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "cosine")


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (sharded DTensors under FSDP2 work as they are)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters; nothing to optimise")
    # foreach=True keeps the step to a few fused kernels on GPU; it also works on DTensor shards.
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=True)


def lr_multiplier(
    step: int,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """The factor applied to the base learning rate after ``step`` optimizer steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps  # the transformers/verl convention: the first step runs at lr 0
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * min(progress, 1.0)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int = 1,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A LambdaLR with linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
    return LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, warmup_steps, total_steps, min_lr_ratio)
    )
