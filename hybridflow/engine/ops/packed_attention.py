"""Attention for packed (remove-padding) batches that never builds a dense mask.

Given packed position ids and no attention mask, transformers builds a dense (S, S) block-diagonal mask;
with a mask SDPA can neither use its causal kernels nor GQA without repeating K/V, and it computes every
score: at 16k tokens that was ~1.2 s of a 2.2 s training step on an H200. Here the work is exactly the
block-diagonal part: on GPU in half precision one flash varlen call covers all sequences
(``varlen_attention``, an op that ``torch.compile`` keeps inside the compiled layer); elsewhere each packed
sequence gets its own causal SDPA call on a slice of the packed tensors (GQA native). The sequence bounds
travel as a host tensor (no device sync per layer) and, for the flash kernels, once per micro-batch as a
device tensor.

Registered with transformers under ``hybridflow_packed``. Calls without bounds (e.g. HF ``generate`` with
an attention mask) fall through to transformers' own SDPA attention and mask. Packed calls pass
``packed_mask_placeholder`` as the attention mask: transformers hands an already-4D mask through untouched,
which skips its packed-sequence detection on the position ids (a device-to-host sync per forward).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.engine.ops.exact_attention import packed_exact_attention
from hybridflow.engine.ops.invariant import exact_on
from hybridflow.engine.ops.varlen_attention import flash_supported, varlen_attention

PACKED_ATTENTION = "hybridflow_packed"
ULYSSES_ATTENTION = "hybridflow_ulysses"  # the packed attention split over sequence-parallel ranks
PACKED_IMPLEMENTATIONS = (PACKED_ATTENTION, ULYSSES_ATTENTION)  # both take packed bounds and no mask
BOUNDS_KWARG = "packed_seq_bounds"  # (n + 1,) host tensor: the start of each sequence, then S
CU_SEQLENS_KWARG = "packed_cu_seqlens"  # the same bounds as int32 on the device (flash kernels)


def packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for packed or unpadded inputs (the attention is causal per sequence); SDPA's otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed_mask_placeholder(device: torch.device | str) -> torch.Tensor:
    """An empty 4D mask for packed forwards: transformers passes it through without building a mask."""
    return torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=device)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,  # (1, H, S, D)
    key: torch.Tensor,  # (1, KVH, S, D)
    value: torch.Tensor,  # (1, KVH, S, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence; returns (1, S, H, D) like transformers' SDPA path.

    With bounds, ``attention_mask`` is ignored (it is ``packed_mask_placeholder`` or None).
    """
    bounds = kwargs.pop(BOUNDS_KWARG, None)
    cu_seqlens = kwargs.pop(CU_SEQLENS_KWARG, None)
    if bounds is None:
        # An unpadded batch: plain causal attention; a vision tower's call (is_causal=False) stays bidirectional.
        if attention_mask is None and query.shape[2] > 1 and is_causal is not False:
            is_causal = True
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if exact_on():  # rollout.exact: the rollout's order for every row (dropout is off in RL training)
        if isinstance(bounds, torch.Tensor):
            bounds = bounds.tolist()
        return packed_exact_attention(query, key, value, bounds, scaling), None
    dropout_p = dropout if module.training else 0.0
    if cu_seqlens is not None and dropout_p == 0.0 and flash_supported(query):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (S, H|KVH, D), views
        return varlen_attention(q, k, v, cu_seqlens, bounds, scaling)[None], None  # (1, S, H, D)
    if isinstance(bounds, torch.Tensor):
        bounds = bounds.tolist()  # a host tensor: no device sync
    return per_sequence_attention(query, key, value, bounds, scaling, dropout_p), None


# The fallback (CPU, float32, dropout) stays outside any compiled region: the bounds differ in every batch, and a compiled layer that saw them as
# Python integers would recompile for each new set. Around this call the layer's norms, projections, RoPE
# and MLP still compile (the bounds reach the layer as a host tensor, whose values dynamo does not guard).
@torch.compiler.disable
def per_sequence_attention(
    query: torch.Tensor,  # (1, H, S, D)
    key: torch.Tensor,  # (1, KVH, S, D)
    value: torch.Tensor,  # (1, KVH, S, D)
    bounds: list[int],
    scaling: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """One causal SDPA call per packed sequence; returns (1, S, H, D)."""
    parts = []
    for start, end in itertools.pairwise(bounds):
        parts.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                is_causal=True,
                scale=scaling,
                dropout_p=dropout_p,
                enable_gqa=True,
            )
        )  # (1, H, s, D)
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # (1, H, S, D)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Switch a Hugging Face model to the packed attention (it still serves padded calls unchanged)."""
    model.set_attn_implementation(PACKED_ATTENTION)
