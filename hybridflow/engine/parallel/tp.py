"""Tensor parallelism for training: each decoder layer split Megatron-style over the ``tp`` mesh with DTensor.

Column-parallel q/k/v and gate/up (each rank computes its slice of the heads and of the MLP's intermediate
rows), row-parallel o and down (each rank's product is a partial sum, all-reduced into a replicated output),
as torchtitan applies it with ``parallelize_module``; which projections are which is the family's entry
(``models.family.FamilySpec.train_plan``: the projections the rollout's shard rules slice alike). The
attention code of the Hugging Face layer is left as it is: it reshapes with ``-1`` heads, so it runs on the
local heads. The embedding, the final norm and the LM head stay replicated across ``tp`` (FSDP2 still shards
them over ``dp``): our fused log-prob head reads a whole vocabulary row per token, and at the model sizes tp is
for, the head is a small part of the layers' memory (``benchmarks/views.py`` counts it). Gradients of replicated weights need no extra reduction: their
inputs are the same on every tensor-parallel rank after each row-parallel all-reduce, and DTensor's backward
of a column-parallel input sums the partial input gradients. The exception is Qwen3's per-head q/k norms,
which see only the rank's heads: the plan makes them replicated DTensors so that DTensor sums their
gradients over tp (``_STYLES``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hybridflow.config.parallel import size_key
from hybridflow.models.families import check_tensor_parallel, is_moe
from hybridflow.models.family import FamilySpec, family_of
from hybridflow.models.moe import is_sparse_block
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

# The DTensor style of each kind of a family's training plan (``FamilySpec.train_plan``). Qwen3's RMSNorms
# over each head's q and k ("head_norm") run on the rank's own heads, so as plain tensors each tp rank's
# weight gradient would be the sum over its heads only and the copies would drift apart. As replicated
# DTensors whose input is sharded on the heads dim of (b, s, heads, head_dim), the gradient is a partial sum
# that DTensor reduces over tp (FSDP2 redistributes it before its reduce-scatter over dp). SequenceParallel
# is torch's style for exactly that (a module with replicated weights on a sharded input), here on dim 2.
_STYLES = {
    "column": ColwiseParallel,
    "row": RowwiseParallel,
    "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
}


def check_train_tp(config: Any, tp: int, role: str = "actor") -> None:
    """Raise UserError naming the fields when ``tp`` cannot split this model's layers for training.

    Unlike the rollout, training cannot share a KV head between ranks (its gradient would be split), so the
    KV heads must divide by tp, as Megatron requires of its query groups. A mixture of experts keeps its MoE
    blocks whole on every tp rank. Families without shard rules (GPT-2, DeepSeek-V3) are refused first, naming
    the family.
    """
    check_tensor_parallel(config, size_key(role, "tp"), tp)
    if tp == 1:  # nothing to split (and a family without shard rules may lack the fields below)
        return
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    sizes = [("num_attention_heads", heads), ("num_key_value_heads", kv)]
    if not is_moe(config):  # a mixture of experts keeps its MLPs whole on every tp rank
        sizes.append(("intermediate_size", config.intermediate_size))
    problems = [f"{name}={value}" for name, value in sizes if value % tp]
    if problems:
        raise UserError(
            f"{size_key(role, 'tp')}={tp} does not split this model for training: {', '.join(problems)} "
            "(each must be a multiple of it); use a tensor-parallel size that divides them"
        )


def _plan(layer: nn.Module, family: FamilySpec) -> dict[str, Any]:
    """The layer's tensor-parallel plan, from its family's entry (``FamilySpec.train_plan``): the column and
    row projections and Qwen3's q/k norms; a MoE layer's attention only (its router, experts and shared expert
    stay whole on every tp rank: their input, the residual stream after o's all-reduce, is the same there, so
    their gradients are too)."""
    names = {name for name, _ in layer.named_modules()}
    block = getattr(layer, family.experts.block, None) if family.experts is not None else None
    plan = family.train_plan(block is not None and is_sparse_block(block))  # HF's sparse block or MoEBlock
    missing = [n for n, kind in plan.items() if n not in names and kind != "head_norm"]
    if missing:
        raise UserError(
            f"{type(layer).__name__} has no {missing}, which the {family.name} family's entry splits "
            "(models/family.py); set tensor_parallel_size=1 for this model"
        )
    return {n: _STYLES[kind]() for n, kind in plan.items() if n in names}


def apply_tp(layers: list[nn.Module], tp_mesh: DeviceMesh, config: Any) -> None:
    """Split every decoder layer's projections over ``tp_mesh`` in place (before FSDP2 shards them), as the
    family of ``config`` (the model's) says."""
    if tp_mesh.size() == 1:
        return
    check_tensor_parallel(config, "tensor_parallel_size", tp_mesh.size())
    family = family_of(config)
    assert family is not None  # has_shard_rules, checked above
    for layer in layers:
        parallelize_module(layer, tp_mesh, _plan(layer, family))
    logger.info("tensor parallelism: %d decoder layers split over %d ranks", len(layers), tp_mesh.size())
