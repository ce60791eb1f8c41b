"""The global gradient norm of a training view whose parameters live on several meshes, and clipping by it.

Under FSDP2 alone every gradient is a DTensor sharded over the same one-dimensional mesh and torch's
``clip_grad_norm_`` computes the global norm. With tensor parallelism the layers' gradients are sharded over
``(tp, dp)`` while the embedding, norms and head are sharded over ``dp`` and replicated over ``tp``, and with
pipeline parallelism each stage holds other parameters. So: sum the squares of the local shards per
(mesh, placements) group, all-reduce each sum over the mesh dimensions its placements shard (never over a
replicated one, which would count a copy twice), add the groups, then add over the pipeline stages.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups over which ``grad``'s local pieces are disjoint parts of one tensor."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return ()
    # Not ``is_shard()``: FSDP2's dp placement of a tensor-parallel weight is a _StridedShard, which says no.
    # A dim of one rank sums nothing (FSDP2 over dp_rep = 1 beside tp x ep): no collective for it.
    return tuple(
        mesh.get_group(i)
        for i, p in enumerate(grad.placements)
        if not (p.is_replicate() or p.is_partial()) and mesh.size(i) > 1
    )


def global_grad_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of every gradient of the view (float32, the same on every rank)."""
    sums: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    for p in params:
        if p.grad is None:
            continue
        local = _local(p.grad).detach()
        key = _sharded_groups(p.grad)
        sums[key] = sums[key].to(local.device) + local.double().pow(2).sum()
    total = None
    for groups, value in sums.items():
        for group in groups:
            dist.all_reduce(value, group=group)
        total = value if total is None else total + value.to(total.device)
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt().float()


@torch.no_grad()
def clip_by_global_norm(
    params: list[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    counted: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Scale every gradient so the global norm is at most ``max_norm`` (> 0); returns the pre-clip norm.

    ``counted``: the parameters the norm sums (default all): a copy held on two stages (a tied head) is
    scaled on both but counted once."""
    norm = global_grad_norm(params if counted is None else counted, pp_group)
    value = float(norm)
    if max_norm > 0 and math.isfinite(value) and value > max_norm:
        coef = max_norm / (value + 1e-6)  # torch's clip_grad_norm_ formula, so the numbers compare
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(coef)
    return norm
