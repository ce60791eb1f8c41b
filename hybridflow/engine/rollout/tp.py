"""The rollout's tensor-parallel shard of a model (built from ``parallel.layout``'s rules) and the collectives
of a rollout group.

A mixture of experts' sparse blocks shard as ``MOE_RULES`` say: every expert sliced on its intermediate dim (rank
t holds rows of each expert's gate half and the same rows of its up half, and the matching columns of down), the
shared expert as a dense MLP, the router and the shared expert's gate replicated. Each rank's experts then give
a partial sum that the all-reduce after the MLP completes, exactly as a dense MLP's down projection does, and
every rank routes alike (the router is whole). ``moe_pieces`` is the box data the reshard plan needs;
``moe_problems`` (``parallel.layout``, checked by ``check_tp``) names the sizes a tp does not divide.
With ``rollout.expert_parallel_size`` = tp the experts are split whole instead (``split_experts``: rank t keeps
experts t * E / tp onward); the runner then adds only its experts' share of each token, before the same
all-reduce.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from hybridflow.engine.parallel.layout import check_tp, moe_problems  # noqa: F401 (re-exported: the MoE rules)
from hybridflow.models.family import FAMILIES, family_of
from hybridflow.models.moe import is_sparse_block

# (parameter name pattern, kind) of the sparse blocks of every mixture of experts with shard rules (HF's names,
# MoEBlock's too), from the families' entries (``FamilySpec.expert_rules``), in this module's kind names.
_MOE_KIND = {"experts_column": "experts_gate_up", "experts_row": "experts_down"}
MOE_RULES = tuple(
    dict.fromkeys(
        (pattern, _MOE_KIND.get(kind, kind))
        for spec in FAMILIES.values()
        for pattern, kind in spec.expert_rules()
    )
)
# The functional all-gather into one tensor: all_gather_single where torch has it (2.13 deprecates
# all_gather_tensor, with a FutureWarning at every call outside torch.compile), the older name elsewhere.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
# One (start, stop) per dimension: a box of a full tensor, or of a rank's buffer.
Box = tuple[tuple[int, int], ...]


def moe_kind(name: str) -> str | None:
    """The tensor-parallel kind of a sparse block's parameter (``MOE_RULES``), None for any other name."""
    return next((kind for pattern, kind in MOE_RULES if re.search(pattern, name)), None)


def moe_pieces(kind: str, shape: tuple[int, ...], tp: int, t: int) -> list[tuple[Box, Box]]:
    """What rank ``t`` of ``tp`` holds of a sparse block's full parameter of ``shape``: (box of the full
    tensor, box of the rank's buffer) pairs; the fused gate/up of the experts is two pieces, one per half."""
    whole = tuple((0, n) for n in shape)
    if tp == 1 or kind == "replicated":
        return [(whole, whole)]
    dim = {"column": 0, "row": 1, "experts_gate_up": 1, "experts_down": 2}[kind]
    rows = shape[dim] // (2 if kind == "experts_gate_up" else 1)
    part = rows // tp

    def at(d: int, lo: int, hi: int) -> Box:
        return tuple((lo, hi) if i == d else (0, n) for i, n in enumerate(shape))

    halves = 2 if kind == "experts_gate_up" else 1
    return [(at(dim, h * rows + t * part, h * rows + (t + 1) * part), at(dim, h * part, (h + 1) * part))
            for h in range(halves)]  # fmt: skip


def shard_config(config: Any, tp: int, ep: int = 1) -> Any:
    """The config of one rollout rank's shard (checked): local heads, intermediate sizes and vocabulary."""
    check_tp(config, tp, ep)
    return local_config(config, tp, ep)


def local_config(config: Any, tp: int, ep: int = 1) -> Any:
    """``shard_config`` without the checks: local heads, intermediate sizes (experts' too unless ``ep`` > 1
    splits them whole: ``split_experts`` then keeps E / ep of them) and vocabulary."""
    local = copy.deepcopy(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local.num_attention_heads = heads // tp
    local.num_key_value_heads = max(kv // tp, 1)
    spec = family_of(config)
    experts = spec.experts if spec is not None else None
    sliced = [] if experts is None else [experts.shared_size, *([] if ep > 1 else [experts.size])]
    whole = ep > 1 and experts is not None and experts.size == "intermediate_size"  # Mixtral's experts' size
    local.intermediate_size = config.intermediate_size // (1 if whole else tp)
    for field in [f for f in sliced if f and f != "intermediate_size"]:  # a shared expert, each sliced expert
        if getattr(config, field, None):
            setattr(local, field, getattr(config, field) // tp)
    local.vocab_size = -(-config.vocab_size // tp)
    return local


def meta_model(model: nn.Module) -> nn.Module:
    """The whole model of ``model``'s class and config on the meta device (every layer, no storage): the
    names and shapes of all parameters, also when ``model`` is one pipeline stage."""
    with torch.device("meta"):
        return type(model)(copy.deepcopy(model.config))


def build_shard(
    model: nn.Module,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    ep: int = 1,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """An empty module of ``model``'s class in the shape of one rollout rank's shard (never the whole model).

    Built on the meta device and allocated on ``device`` in ``dtype`` without weight init (the reshard fills
    every weight). Buffers (the rotary frequencies) are the full model's own, in their own dtype (float32,
    as the trainer computes RoPE): ``model``'s, or ``buffers`` by name when ``model`` is a skeleton on the
    meta device (a rollout pool's rank, which holds no training module). ``ep`` = tp: each sparse block keeps
    E / tp whole experts.
    """
    config = shard_config(model.config, tp, ep) if tp > 1 else copy.deepcopy(model.config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            shard = type(model)(config)
            if ep > 1:
                split_experts(shard, ep)
    finally:
        torch.set_default_dtype(default)
    shard.to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):  # to_empty allocates the two apart
        shard.get_output_embeddings().weight = shard.get_input_embeddings().weight
    sources = dict(model.named_buffers()) if buffers is None else dict(buffers)
    for name, _ in list(shard.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        owner = shard.get_submodule(module_name) if module_name else shard
        owner._buffers[attr] = sources[name].detach().to(device).clone()
    for p in shard.parameters():
        p.requires_grad_(False)
    return shard.eval()


def split_experts(model: nn.Module, ep: int) -> int:
    """Shrink every sparse block's fused experts to E / ep (on their device, the meta one when building a
    shard): a rank of an expert-parallel rollout holds whole experts, the router stays whole. Returns how
    many blocks."""
    blocks = [m for m in model.modules() if is_sparse_block(m)]
    for block in blocks:
        experts = block.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = torch.empty((full.shape[0] // ep, *full.shape[1:]), dtype=full.dtype, device=full.device)
            setattr(experts, name, nn.Parameter(local, requires_grad=False))
        if hasattr(experts, "num_experts"):
            experts.num_experts = experts.gate_up_proj.shape[0]
    return len(blocks)


class RolloutTP:
    """The collectives of a tensor-parallel rollout rank: the runner calls these around its shard's math.

    Functional collectives (``torch.distributed._functional_collectives``), so the decode step still traces
    under ``torch.compile`` and the NCCL calls can be captured in CUDA graphs.
    """

    def __init__(self, group: dist.ProcessGroup, vocab_size: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.vocab_size = vocab_size  # the whole vocabulary
        self.vocab_part = -(-vocab_size // self.size)
        self.vocab_start = self.rank * self.vocab_part

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial products of a row-parallel projection over the group."""
        return funcol.all_reduce(x, "sum", self.group)

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max over the group (FP8 static activation scales' calibration: one scale for all)."""
        return funcol.all_reduce(x, "max", self.group)

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank embeds the ids in its slice, zeros elsewhere, then a sum."""
        local = ids - self.vocab_start  # (b, t)
        mine = (local >= 0) & (local < self.vocab_part)
        h = nn.functional.embedding(local.clamp(0, self.vocab_part - 1), weight)  # (b, t, hidden)
        return self.reduce(h * mine[..., None].to(h.dtype))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """(b, V / tp) logits of this rank's vocabulary slice -> (b, V), the same on every rank."""
        parts = _all_gather(local.contiguous(), 0, self.group)  # (tp * b, V / tp)
        b = local.shape[0]
        full = parts.view(self.size, b, self.vocab_part).permute(1, 0, 2).reshape(b, -1)  # (b, tp * V/tp)
        return full[:, : self.vocab_size]
