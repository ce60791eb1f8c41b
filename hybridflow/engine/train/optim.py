"""AdamW and its learning-rate schedules (constant or cosine, both with linear warm-up)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from hybridflow.utils.optim_state import zero_state

SCHEDULES = ("constant", "cosine")


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (sharded DTensors under FSDP2 work as they are).

    On CUDA the fused implementation (one multi-tensor kernel reads and writes each parameter, gradient and
    moment once); elsewhere, parameters offloaded to the host included, the multi-tensor ``foreach`` one.
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters; nothing to optimise")
    impl = {"fused": True} if all(p.device.type == "cuda" for p in trainable) else {"foreach": True}
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **impl)


@torch.no_grad()
def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now (AdamW's moments, zero) instead of at its first step.

    torch allocates Adam's moments lazily, so before the first step a trained role holds a third of its
    steady-state memory. Anything sized from free memory in between, such as the rollout's KV cache, then
    gets a budget it loses at the next step: the W2 1.5B benchmark ran its first rollout in one wave and the
    later ones in two, recompiling the decode step for the new batch sizes. Allocating now also makes an
    out-of-memory show at setup rather than in the first update. The step runs on zero gradients at lr 0
    (as torch.distributed.checkpoint initialises state), which leaves the parameters and moments exactly as
    they were; the step counters are then reset, so the first real step is the one lazy init would take.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return  # a step is under way; its own init will run
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    zero_state(optimizer)  # the step counters back to 0 (the moments are zero already)


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
    num_cycles: float = 0.5,
) -> LambdaLR:
    """A LambdaLR with linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``.

    ``num_cycles`` cosine cycles span the steps after warm-up (0.5: one half-cosine from lr down to the floor).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
    return LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, schedule, warmup_steps, total_steps, min_lr_ratio, num_cycles),
    )
