"""Ulysses sequence parallelism: the sp ranks of a data-parallel group split each packed micro-batch's tokens.

DeepSpeed-Ulysses as verl applies it, on the packed (remove-padding) layout. Every rank of a group holds the
whole micro-batch on the host (the driver hands every rank of the group the same share, as it does for a
tensor-parallel replica), pads its one packed row of S tokens to a multiple of sp and keeps the slice of
S/sp tokens that is its own. The embedding, the norms, the MLPs, RoPE (each token keeps its true position id:
the rank slices the group's packed position ids, so the rotation is exact) and the LM head then run on that
slice only, so activations per rank fall as 1/sp. Around attention an all-to-all swaps sequence shards for
head shards: each rank attends over the whole packed row with H/sp query heads (the packed bounds are the
group's, the pad tokens their own sequence), and a second all-to-all swaps back. KV heads fewer than sp are
replicated first so that every rank has the KV head of its query heads. The per-token log-probs, entropies
or values are all-gathered back into the micro-batch's order, so the loss sees whole sequences.

Gradients: every rank of a group computes the same loss from the same gathered scores, and backpropagates
the part of it that belongs to its own tokens; the parts sum to the group's gradient. FSDP2 averages over
all W ranks while the loss is scaled for W/sp data-parallel groups, so the gather's backward multiplies by
sp (verl's ``grad_scaler``), and the update equals the sp=1 update.

Applied as torchtitan applies a layout: ``apply_ulysses`` marks the attention modules with their group and
hooks the scoring root's input and output; nothing else in the engine knows about it.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from hybridflow.config.parallel import size_key
from hybridflow.engine.ops.packed_attention import (
    BOUNDS_KWARG,
    PACKED_ATTENTION,
    ULYSSES_ATTENTION,
    packed_attention,
    packed_mask,
)
from hybridflow.engine.ops.packing import ScoringInputs, to_device
from hybridflow.models.families import check_layer_split
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

ULYSSES_ATTR = "ulysses"  # the attribute of an attention module that holds its SequenceGroup


@dataclass(frozen=True)
class SequenceGroup:
    """The sp ranks that split a sequence: their process group, their size, this rank's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    kv_repeat: int = 1  # each KV head repeated this many times before the all-to-all (KV heads < sp)


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's part of a packed micro-batch sits: scored tokens ``[start, start + counts[rank])``."""

    counts: tuple[int, ...]  # scored tokens of each sp rank, in rank order
    rank: int

    @property
    def start(self) -> int:
        """The first of this rank's scored tokens in the micro-batch's order."""
        return sum(self.counts[: self.rank])


def check_ulysses(config: Any, sp: int, role: str = "actor") -> None:
    """Raise UserError naming the fields when ``sp`` cannot split this model's attention heads."""
    check_layer_split(config, size_key(role, "sp"), sp, "sequence parallelism (Ulysses)")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    problems = []
    if heads % sp:
        problems.append(f"num_attention_heads={heads} is not a multiple of it")
    if kv % sp and sp % kv:
        problems.append(f"num_key_value_heads={kv} neither is a multiple of it nor divides it")
    if problems:
        raise UserError(
            f"{size_key(role, 'sp')}={sp} does not split this model's attention: "
            f"{'; '.join(problems)}; use a sequence-parallel size that divides the heads"
        )


def _hf_model(root: nn.Module) -> PreTrainedModel:
    for module in root.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"{type(root).__name__} holds no Hugging Face model")


def apply_ulysses(
    root: nn.Module, layers: list[nn.Module], group: dist.ProcessGroup, role: str = "actor"
) -> None:
    """Split the scoring ``root``'s sequences over ``group`` (before FSDP2 wraps it; every rank calls it).

    The model must already use the packed attention (remove-padding): Ulysses splits the one packed row.
    """
    model, sp = _hf_model(root), dist.get_world_size(group)
    if getattr(model.config, "_attn_implementation", None) != PACKED_ATTENTION:
        path = "critic.model.use_remove_padding" if role == "critic" else "model.use_remove_padding"
        raise UserError(f"{size_key(role, 'sp')}={sp} needs packed sequences; set {path}=true")
    check_ulysses(model.config, sp, role)
    kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    seq = SequenceGroup(group, sp, dist.get_rank(group), kv_repeat=max(1, sp // kv))
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise UserError(
                f"{type(layer).__name__} has no self_attn: sequence parallelism covers Llama-family layers; "
                f"set {role}.ulysses_sequence_parallel_size=1 for this model"
            )
        setattr(attention, ULYSSES_ATTR, seq)
    model.set_attn_implementation(ULYSSES_ATTENTION)
    hooks = _RootHooks(seq)
    root.register_forward_pre_hook(hooks.shard)
    root.register_forward_hook(hooks.gather)
    logger.info("sequence parallelism: %d decoder layers, sequences split over %d ranks", len(layers), sp)


class _RootHooks:
    """The scoring root's input sharded on the way in, its per-token output gathered on the way out."""

    def __init__(self, seq: SequenceGroup) -> None:
        self.seq = seq
        self.shard_of_call: SequenceShard | None = None

    def shard(self, module: nn.Module, args: tuple) -> tuple:
        inputs, *rest = args
        local, self.shard_of_call = shard_inputs(inputs, self.seq.size, self.seq.rank)
        return (local, *rest)

    def gather(self, module: nn.Module, args: tuple, output: Any) -> Any:
        shard, self.shard_of_call = self.shard_of_call, None
        if isinstance(output, tuple):
            return tuple(None if t is None else gather_scores(t, shard, self.seq.group) for t in output)
        return gather_scores(output, shard, self.seq.group)


def shard_inputs(inputs: ScoringInputs, sp: int, rank: int) -> tuple[ScoringInputs, SequenceShard]:
    """This rank's slice of a packed micro-batch: S padded to a multiple of sp, S/sp tokens each.

    The pad tokens form one sequence of their own at the end (in the bounds), so no real token attends to
    them, and they are never scored. The scored rows are sorted, so each rank's are one contiguous range.
    """
    if inputs.seq_bounds is None:
        raise UserError("sequence parallelism needs packed sequences; set model.use_remove_padding=true")
    S = inputs.input_ids.shape[1]
    width = -(-S // sp)  # tokens per rank
    lo, hi = rank * width, (rank + 1) * width
    bounds = list(inputs.seq_bounds) + ([width * sp] if width * sp > S else [])
    host_rows = (
        inputs.host_gather_index if inputs.host_gather_index is not None else inputs.gather_index.cpu()
    )
    edges = torch.tensor([r * width for r in range(sp + 1)], dtype=host_rows.dtype)
    cuts = torch.searchsorted(host_rows, edges).tolist()  # host tensors: no device sync
    counts = tuple(b - a for a, b in itertools.pairwise(cuts))
    mine = slice(cuts[rank], cuts[rank + 1])
    device = inputs.input_ids.device
    local = replace(
        inputs,
        input_ids=F.pad(inputs.input_ids, (0, width * sp - S))[:, lo:hi],  # (1, S/sp)
        position_ids=F.pad(inputs.position_ids, (0, width * sp - S))[:, lo:hi],  # (1, S/sp)
        gather_index=inputs.gather_index[mine] - lo,  # (m,) rows of the local hidden states
        labels=inputs.labels[mine],  # (m,)
        scatter_index=inputs.scatter_index[mine],  # (m,)
        seq_bounds=bounds,
        cu_seqlens=None
        if inputs.cu_seqlens is None
        else to_device(torch.tensor(bounds, dtype=torch.int32), device),
        host_gather_index=None,
    )
    return local, SequenceShard(counts, rank)


class _GatherScores(torch.autograd.Function):
    """All-gather per-token scores of uneven counts; backward keeps this rank's part, times the group size."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, shard: SequenceShard, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.shard = shard
        width = max(1, *shard.counts)  # gloo gathers equal sizes: pad every part to the largest
        padded = F.pad(local, (0, width - local.shape[0])).contiguous()  # (width,)
        parts = [torch.empty_like(padded) for _ in shard.counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, shard.counts)])  # (M,)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        s = ctx.shard
        # Each rank's loss is the group's whole loss; FSDP2 averages over W = dp * sp ranks, the loss is
        # scaled for dp groups: times sp makes the sum of the parts the group's gradient (verl's grad_scaler).
        return grad[s.start : s.start + s.counts[s.rank]] * len(s.counts), None, None


def gather_scores(local: torch.Tensor, shard: SequenceShard, group: dist.ProcessGroup) -> torch.Tensor:
    """The micro-batch's scores (M,) from each rank's (m,) scores of its own tokens, in token order."""
    return _GatherScores.apply(local, shard, group)


def seq_to_heads(x: torch.Tensor, seq: SequenceGroup) -> torch.Tensor:
    """(1, h, S/sp, D) of this rank's tokens -> (1, h/sp, S, D) of every token, this rank's heads."""
    _, h, s, d = x.shape
    send = x[0].reshape(seq.size, h // seq.size, s, d).contiguous()  # (sp, h/sp, s, D): part j to rank j
    got = funcol.all_to_all_single_autograd(send.flatten(), None, None, seq.group)  # part i from rank i
    got = got.view(seq.size, h // seq.size, s, d).transpose(0, 1)  # (h/sp, sp, s, D): rank i's tokens
    return got.reshape(1, h // seq.size, seq.size * s, d)


def heads_to_seq(x: torch.Tensor, seq: SequenceGroup) -> torch.Tensor:
    """(1, S, h/sp, D) of every token, this rank's heads -> (1, S/sp, h, D) of this rank's tokens."""
    _, S, hl, d = x.shape
    s = S // seq.size
    send = x[0].reshape(seq.size, s, hl, d).contiguous()  # (sp, s, h/sp, D): rank j's tokens to rank j
    got = funcol.all_to_all_single_autograd(send.flatten(), None, None, seq.group)  # heads of rank i
    got = got.view(seq.size, s, hl, d).transpose(0, 1)  # (s, sp, h/sp, D)
    return got.reshape(1, s, seq.size * hl, d)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,  # (1, H, S/sp, D)
    key: torch.Tensor,  # (1, KVH, S/sp, D)
    value: torch.Tensor,  # (1, KVH, S/sp, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Packed attention over the whole row with this rank's heads; returns (1, S/sp, H, D).

    Calls without packed bounds (HF ``generate``) or modules without a group run the packed attention.
    """
    seq: SequenceGroup | None = getattr(module, ULYSSES_ATTR, None)
    if seq is None or kwargs.get(BOUNDS_KWARG) is None:
        return packed_attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if seq.kv_repeat > 1:  # fewer KV heads than ranks: each rank gets a copy of its query heads' KV head
        key = key.repeat_interleave(seq.kv_repeat, dim=1)  # (1, sp, S/sp, D)
        value = value.repeat_interleave(seq.kv_repeat, dim=1)
    q, k, v = (seq_to_heads(t, seq) for t in (query, key, value))  # (1, H/sp | KVH/sp, S, D)
    out, _ = packed_attention(module, q, k, v, attention_mask, dropout, scaling, is_causal, **kwargs)
    return heads_to_seq(out, seq), None  # (1, S/sp, H, D)


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
AttentionMaskInterface.register(ULYSSES_ATTENTION, packed_mask)
