"""Model inputs for scoring responses: padded, or packed with padding removed (sequence packing).

Batches use verl's layout: ``input_ids`` (B, T) is a left-padded prompt followed by a right-padded response of
R tokens, ``attention_mask`` marks real tokens and ``position_ids`` count real tokens from 0. The logit that
scores response token j sits at position T - R - 1 + j. Both layouts here produce the flat rows of the
model's hidden states to score, so the chunked LM head only ever sees response positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoringInputs:
    """What the model consumes and where its hidden states are read."""

    input_ids: torch.Tensor  # (B, T) padded, or (1, S) packed
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: torch.Tensor | None  # (B, T) padded; None when packed (boundaries come from position_ids)
    gather_index: torch.Tensor  # (M,) rows of the flattened hidden states that score a response token
    labels: torch.Tensor  # (M,) the response tokens being scored
    scatter_index: torch.Tensor  # (M,) flat positions in (B * R) where each score belongs
    seq_bounds: list[int] | None = None  # packed: start of each sequence in (1, S), then S


def check_scoring_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> None:
    """Raise a clear error when shapes or dtypes cannot be a (prompt + response) batch."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (batch, seq_len); got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be an integer tensor (token ids), got {input_ids.dtype}")
    if not 0 < response_length < input_ids.shape[1]:
        raise ValueError(
            f"response length {response_length} must be positive and shorter than the sequence "
            f"({input_ids.shape[1]} tokens), leaving at least one prompt token"
        )


def build_scoring_inputs(
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor,  # (B, T)
    position_ids: torch.Tensor,  # (B, T)
    response_length: int,
    remove_padding: bool,
) -> ScoringInputs:
    """Pick the rows to score: every valid response token, in padded or packed (remove-padding) layout."""
    check_scoring_batch(input_ids, attention_mask, response_length)
    T = input_ids.shape[1]
    R = response_length
    mask = attention_mask.bool()  # (B, T)
    response_mask = mask[:, -R:]  # (B, R)
    b_idx, j_idx = response_mask.nonzero(as_tuple=True)  # (M,), (M,)
    padded_rows = b_idx * T + (T - R - 1) + j_idx  # (M,) the position before each response token
    labels = input_ids[b_idx, T - R + j_idx]  # (M,)
    scatter_index = b_idx * R + j_idx  # (M,)
    if not remove_padding:
        return ScoringInputs(input_ids, position_ids, attention_mask, padded_rows, labels, scatter_index)
    flat_mask = mask.reshape(-1)  # (B*T,)
    packed_pos = torch.cumsum(flat_mask.long(), 0) - 1  # (B*T,) packed row of each kept token
    keep = flat_mask.nonzero(as_tuple=True)[0]  # (S,)
    lengths = mask.sum(-1).tolist()  # one host sync per micro-batch: the bounds every layer needs
    bounds = [0]
    for n in lengths:
        if n:
            bounds.append(bounds[-1] + n)
    return ScoringInputs(
        input_ids=input_ids.reshape(-1)[keep][None],  # (1, S)
        position_ids=position_ids.reshape(-1)[keep][None],  # (1, S)
        attention_mask=None,
        gather_index=packed_pos[padded_rows],  # (M,)
        labels=labels,
        scatter_index=scatter_index,
        seq_bounds=bounds,
    )


def scatter_to_responses(
    values: torch.Tensor, scatter_index: torch.Tensor, batch: int, response_length: int
) -> torch.Tensor:
    """Place per-token ``values`` (M,) into a zero (B, R) tensor; positions without a token stay 0."""
    out = values.new_zeros(batch * response_length)  # (B*R,)
    out = out.index_put((scatter_index,), values)  # out-of-place so autograd flows through values
    return out.view(batch, response_length)
