"""Model inputs for scoring responses: padded, or packed with padding removed (sequence packing).

Batches use verl's layout: ``input_ids`` (B, T) is a left-padded prompt followed by a right-padded response of
R tokens, ``attention_mask`` marks real tokens and ``position_ids`` count real tokens from 0. The logit that
scores response token j sits at position T - R - 1 + j. Both layouts here produce the flat rows of the
model's hidden states to score, so the chunked LM head only ever sees response positions.

The indices are meant to be built on the host from the CPU batch and moved to the device afterwards
(``ScoringInputs.to``): ``nonzero`` and the per-sequence lengths then cost no device sync, and the copies
are asynchronous, so the host keeps queueing kernels while the device works.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a tensor to ``device`` without making the host wait for the device.

    A blocking host-to-device copy synchronises the stream, i.e. waits for all queued kernels. Staging a
    CPU tensor in pinned memory makes the copy truly asynchronous; the pinned block is not reused before
    the copy has run (torch records an event on it).
    """
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class ScoringInputs:
    """What the model consumes and where its hidden states are read."""

    input_ids: torch.Tensor  # (B, T) padded, or (1, S) packed
    position_ids: torch.Tensor  # same shape as input_ids; a VLM's M-RoPE positions: (3, B, T) or (3, 1, S)
    attention_mask: torch.Tensor | None  # (B, T) padded; None when packed (boundaries come from position_ids)
    gather_index: torch.Tensor  # (M,) rows of the flattened hidden states that score a response token
    labels: torch.Tensor  # (M,) the response tokens being scored
    scatter_index: torch.Tensor  # (M,) flat positions in (B * R) where each score belongs
    seq_bounds: list[int] | None = None  # packed: start of each sequence in (1, S), then S
    cu_seqlens: torch.Tensor | None = None  # packed: seq_bounds as int32, moved to the device with the rest
    host_gather_index: torch.Tensor | None = None  # gather_index's host copy, kept by ``to`` (for Ulysses)
    # MoE router replay: each token row's experts per sparse layer, (B*T or S, L, k) uint8 (255: none)
    routed_experts: torch.Tensor | None = None
    token_index: torch.Tensor | None = None  # packed: (S,) each row's flat position in (B * T)
    # A vision-language model's images (``ops.vision_inputs``): the micro-batch's rows' patches, in row order
    pixel_values: torch.Tensor | None = None  # (P, D); None: no image (the tower then sees a dummy one)
    image_grid_thw: torch.Tensor | None = None  # (I, 3) each image's patch grid
    # Where the image features go (as input_ids): the prompts' image tokens only; one the policy sampled in a
    # response is text (a random or young policy can sample the image pad like any other token).
    image_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ScoringInputs:
        """The same inputs with every tensor on ``device`` (asynchronous copies from the host)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = to_device(value, device) if isinstance(value, torch.Tensor) else value
        if self.gather_index.device.type == "cpu" and self.host_gather_index is None:
            moved["host_gather_index"] = self.gather_index
        return ScoringInputs(**moved)


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
    routed_experts: torch.Tensor | None = None,  # (B, T, L, k) uint8
) -> ScoringInputs:
    """Pick the rows to score: every valid response token, in padded or packed (remove-padding) layout.

    Pass CPU tensors and move the result with ``ScoringInputs.to``: on device tensors the ``nonzero`` calls
    and the sequence lengths would each wait for the device. ``routed_experts`` (router replay) follows the
    token rows.
    """
    check_scoring_batch(input_ids, attention_mask, response_length)
    T = input_ids.shape[1]
    R = response_length
    mask = attention_mask.bool()  # (B, T)
    response_mask = mask[:, -R:]  # (B, R)
    b_idx, j_idx = response_mask.nonzero(as_tuple=True)  # (M,), (M,)
    padded_rows = b_idx * T + (T - R - 1) + j_idx  # (M,) the position before each response token
    labels = input_ids[b_idx, T - R + j_idx]  # (M,)
    scatter_index = b_idx * R + j_idx  # (M,)
    routed = None if routed_experts is None else routed_experts.reshape(-1, *routed_experts.shape[2:])
    if not remove_padding:  # (B*T, L, k) routed rows
        return ScoringInputs(
            input_ids, position_ids, attention_mask, padded_rows, labels, scatter_index, routed_experts=routed
        )
    flat_mask = mask.reshape(-1)  # (B*T,)
    packed_pos = torch.cumsum(flat_mask.long(), 0) - 1  # (B*T,) packed row of each kept token
    keep = flat_mask.nonzero(as_tuple=True)[0]  # (S,)
    lengths = mask.sum(-1).tolist()  # the bounds every layer needs (free on CPU tensors)
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
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        routed_experts=None if routed is None else routed[keep],  # (S, L, k)
        token_index=keep,
    )


def scatter_to_responses(
    values: torch.Tensor, scatter_index: torch.Tensor, batch: int, response_length: int
) -> torch.Tensor:
    """Place per-token ``values`` (M,) into a zero (B, R) tensor; positions without a token stay 0."""
    out = values.new_zeros(batch * response_length)  # (B*R,)
    out = out.index_put((scatter_index,), values)  # out-of-place so autograd flows through values
    return out.view(batch, response_length)
