"""Expert parallelism for training: each MoE block's experts split over an ``ep`` group, tokens sent to them.

As torchtitan does it (``expert_parallel.py``), the ep group is a sub-group of the data-parallel ranks (the
view's mesh is ``(dp_rep, ep)``, ep innermost): each rank of a group keeps E / ep whole experts (``Shard(0)``
of ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I)), and FSDP2 shards those over the
``dp_rep`` ranks holding the same experts, while everything else (attention, the router, shared experts) is
sharded by FSDP2 over every data-parallel rank as before. Routing runs on every rank on its own tokens with
the replicated router (``moe.route``); then ``dispatch_experts`` sends each (token, expert) assignment to the
rank holding the expert (an all-to-all of the counts per expert, then an autograd-aware all-to-all of the
token rows), runs the rank's local experts as one grouped GEMM (``moe.run_experts``), sends the rows back and
combines them with the routing weights. The split sizes are needed on the host (``all_to_all_single`` with
uneven splits), one sync per MoE layer, which training can afford.

A block's experts become an ``ExpertShard`` module holding the same two parameters (same names, so
checkpoints, exports and the reshard plan see the usual keys), and the block's ``experts_fn`` calls that
module, so that FSDP2's hooks gather its shard before the dispatch and reduce its gradient after.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hybridflow.models.family import FAMILIES
from hybridflow.models.moe import MoEBlock, moe_blocks, run_experts

logger = logging.getLogger(__name__)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient: the local experts' gradient made a mean over all dp ranks.

    A rank's expert gradient sums the tokens of every rank of its ep group, and FSDP2 averages it over the
    ``dp_rep`` ranks only (its mesh), while every other gradient is averaged over all dp = dp_rep x ep ranks.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``rows`` (sum(send), H) split by ``send`` to the group's ranks -> (sum(recv), H); differentiable (its
    backward is the all-to-all the other way, as torchtitan's dispatch uses it)."""
    out = funcol.all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return funcol.wait_tensor(out)


def dispatch_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Each token's k experts, run on the ranks of ``group`` holding them: x (N, H), ids/weights (N, k) with
    global expert ids, gate_up (E/ep, 2I, H) and down (E/ep, H, I) this rank's experts -> (N, H)."""
    ep, local = dist.get_world_size(group), gate_up.shape[0]
    flat = ids.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)  # by expert, hence by the rank holding it; token order kept
    tokens = order // ids.shape[1]  # (N*k,) the token of each sorted assignment
    counts = torch.bincount(flat, minlength=ep * local)  # (E,) assignments per expert
    got = torch.empty_like(counts)  # (ep * E/ep,): per source rank, its assignments to my experts
    dist.all_to_all_single(got, counts, group=group)
    got = got.view(ep, local)
    send, recv = counts.view(ep, local).sum(1).tolist(), got.sum(1).tolist()  # the host sync
    rows = _exchange(x[tokens], recv, send, group)  # (M, H) by source rank, then by local expert
    local_ids = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(got.reshape(-1))  # (M,)
    gate_up, down = _ScaleGrad.apply(gate_up, 1.0 / ep), _ScaleGrad.apply(down, 1.0 / ep)
    if rows.shape[0]:
        ones = weights.new_ones((rows.shape[0], 1))  # the routing weights are applied where the token lives
        y = run_experts(rows, local_ids[:, None], ones, gate_up, down)  # (M, H)
    else:  # no token for this rank's experts: a zero that still hands FSDP2 their (zero) gradients
        y = rows + 0.0 * (gate_up.sum() + down.sum())
    back = _exchange(y, send, recv, group)  # (N*k, H) in the sorted order
    back = (back * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, back)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertShard(nn.Module):
    """A MoE block's experts on one rank of an ep group: E/ep of them, reached by ``dispatch_experts``.

    The parameters keep the fused HF names and layout (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)),
    as DTensors ``Shard(0)`` over the ep mesh (FSDP2 then shards their local experts over ``dp_rep``).
    """

    def __init__(self, experts: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group()
        rank, size = mesh.get_local_rank(), mesh.size()
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach().chunk(size, dim=0)[rank].clone()  # every rank built the same weights
            shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), ids/weights (N, k) -> (N, H)."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        return dispatch_experts(x, ids, weights, gate_up, down, self.group)


class _CallShard:
    """A block's ``experts_fn`` under expert parallelism: calls its ``ExpertShard`` module (the tensors the
    block passes are the sharded parameters outside FSDP2's gathering; the module's own hooks gather them)."""

    def __init__(self, block: MoEBlock) -> None:
        self.block = block

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *_: Any) -> torch.Tensor:
        return self.block.experts(x, ids, weights)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[ExpertShard]:
    """Split every ``MoEBlock``'s experts over ``ep_mesh`` in place; returns the ``ExpertShard`` modules, for
    FSDP2 to shard over the ranks holding the same experts (before it shards the layers around them)."""
    if ep_mesh.size() == 1:
        return []
    shards = []
    for block in moe_blocks(model):
        block.experts = ExpertShard(block.experts, ep_mesh)
        block.experts_fn = _CallShard(block)
        shards.append(block.experts)
    logger.info("expert parallelism: %d MoE layers' experts split over %d ranks", len(shards), ep_mesh.size())
    return shards


# Every family's fused experts (``family.Experts.fused``): what expert parallelism splits.
_EXPERT_PARAMS = tuple(dict.fromkeys(n for s in FAMILIES.values() if s.experts for n in s.experts.fused))


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a MoE block's fused experts (split over ep; the router is not)."""
    return name.endswith(_EXPERT_PARAMS)
