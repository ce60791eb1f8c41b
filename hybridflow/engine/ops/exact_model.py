"""An HF causal LM made to compute as the exact rollout does (``rollout.exact``): the trainer's side of
exact mode, applied before FSDP2 wraps the model."""

from __future__ import annotations

import torch

from hybridflow.engine.ops.invariant import rope_table
from hybridflow.engine.ops.packed_attention import use_packed_attention
from hybridflow.models.moe import loop_experts, moe_blocks


def use_rope_table(model: torch.nn.Module) -> int:
    """Have every rotary embedding of an HF model read ``rope_table`` (the rollout's table); modules patched."""
    length = text_length(model.config)
    patched = 0
    for module in model.modules():
        if not hasattr(module, "inv_freq") or not hasattr(module, "attention_scaling"):
            continue

        def forward(
            x: torch.Tensor, position_ids: torch.Tensor, _m=module
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rope_table(_m.inv_freq, _m.attention_scaling, length)  # (L, D) each
            return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)  # (b, t, D) each

        module.forward = forward
        patched += 1
    return patched


def text_length(config) -> int:
    """The positions a rope table covers: the text model's ``max_position_embeddings``."""
    text = getattr(config, "text_config", None) or config
    return int(text.max_position_embeddings)


def prepare_exact(model: torch.nn.Module) -> None:
    """Make an HF causal LM compute as the exact rollout does: the packed attention (whose exact branch reads
    each sequence in the rollout's order), the shared RoPE table, and each MoE block's experts through the
    loop over experts (each expert's rows through the exact matmul, summed per token in expert order)."""
    use_packed_attention(model)
    use_rope_table(model)
    for block in moe_blocks(model):
        block.experts_fn = loop_experts
