"""The modules FSDP2 wraps: a causal LM that scores response tokens, and a value model that scores states.

Wrapping the Hugging Face model in our own root module means FSDP2's root hooks gather the embedding, the
final norm and the LM head before our forward runs, so we can call the decoder and the head separately and
never materialise logits for prompt tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.engine.ops.lm_head import score_hidden_states
from hybridflow.engine.ops.modules import decoder_of
from hybridflow.engine.ops.packed_attention import (
    BOUNDS_KWARG,
    CU_SEQLENS_KWARG,
    PACKED_IMPLEMENTATIONS,
    packed_mask_placeholder,
)
from hybridflow.engine.ops.packing import ScoringInputs
from hybridflow.models.moe import num_experts, set_replay
from hybridflow.models.value_model import value_head
from hybridflow.models.vision_tower import vision_spec


def _hidden_rows(body: nn.Module, inputs: ScoringInputs) -> torch.Tensor:
    if num_experts(body.config):  # router replay: the batch's experts, or each block's own choice (None)
        set_replay(body, inputs.routed_experts)  # kept set through backward's recomputes
    extra, mask = {}, inputs.attention_mask
    if inputs.seq_bounds is not None:
        extra = {BOUNDS_KWARG: torch.tensor(inputs.seq_bounds)}  # a host tensor: see packed_attention
        if inputs.cu_seqlens is not None:
            extra[CU_SEQLENS_KWARG] = inputs.cu_seqlens
        if getattr(body.config, "_attn_implementation", None) in PACKED_IMPLEMENTATIONS:
            mask = packed_mask_placeholder(inputs.input_ids.device)  # (else HF builds the block mask itself)
    if vision_spec(body.config) is not None:  # the image features in place of the image tokens' embeddings
        embeds = {"inputs_embeds": _embeds_with_images(body, inputs)}  # (b, t, H)
        body = body.language_model  # the text decoder (the packed bounds must not reach the vision tower)
    else:
        embeds = {"input_ids": inputs.input_ids}
    out = body(**embeds, attention_mask=mask, position_ids=inputs.position_ids, use_cache=False, **extra)
    hidden = out.last_hidden_state  # (b, t, H)
    # index_select: its backward is an index_add (the rows are distinct), cheaper than advanced indexing's.
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.gather_index)  # (M, H)


def _embeds_with_images(body: nn.Module, inputs: ScoringInputs) -> torch.Tensor:
    """A VLM's input embeddings (b, t, H): the image tokens' replaced by the vision tower's merged features.

    A micro-batch without images runs the tower on a dummy image whose features enter with weight 0 (exact:
    x + 0 is x): every data-parallel rank then runs the tower's FSDP2 units in step, whatever its rows hold,
    and a trained tower gets its (zero) gradient on every rank.
    """
    spec = vision_spec(body.config)
    embeds = body.language_model.embed_tokens(inputs.input_ids)  # (b, t, H)
    pixels, grids = inputs.pixel_values, inputs.image_grid_thw
    dummy = pixels is None
    if dummy:
        t, h, w = spec.dummy_grid
        pixels = embeds.new_zeros(t * h * w, spec.patch_dim)  # (P, D)
        grids = torch.tensor([spec.dummy_grid], dtype=torch.long, device=embeds.device)  # (1, 3)
    out = body.visual(pixels.to(embeds.dtype), grid_thw=grids)
    features = getattr(out, "pooler_output", out).to(embeds.dtype)  # (N, H) merged: one per image token
    if dummy:
        return embeds + 0.0 * features.sum()
    # The prompts' image tokens (a response's sampled image pad is text); all of them when not told.
    image = inputs.image_mask if inputs.image_mask is not None else inputs.input_ids == spec.image_token_id
    image = image.unsqueeze(-1)  # (b, t, 1)
    return embeds.masked_scatter(image, features)


class PolicyScorer(nn.Module):
    """Causal LM wrapper: log-probs (and entropy) of the chosen response tokens at ``logits / temperature``."""

    def __init__(self, lm: nn.Module, fused_head: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.fused_head = fused_head  # False: the activation-checkpointed head (the reference path)

    def forward(
        self,
        inputs: ScoringInputs,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(log_probs (M,), entropy (M,) or None)`` in float32 for ``inputs.labels``."""
        rows = _hidden_rows(decoder_of(self.lm), inputs)  # (M, H)
        head = self.lm.get_output_embeddings()  # its weight is the gathered one only now, inside forward
        return score_hidden_states(
            rows,
            head,
            inputs.labels,
            temperature,
            with_entropy,
            entropy_grad=entropy_grad,
            fused=self.fused_head,
        )


class ValueScorer(nn.Module):
    """Value model wrapper (backbone + scalar head): one value per scored position."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: ScoringInputs) -> torch.Tensor:
        """Return the values (M,) in float32 at ``inputs.gather_index``."""
        rows = _hidden_rows(decoder_of(self.model), inputs)  # (M, H)
        head = value_head(self.model)  # ``score`` (GPT-2: ``classifier``); TypeError without one
        # A fresh tensor, not a view: FSDP2 hooks backward on the root's output and warns about views.
        return head(rows).float().squeeze(-1).clone()  # (M,)
