"""Token-id prompts and responses into verl's training layout (left-padded prompt, right-padded response)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from hybridflow.models.moe import NO_EXPERT
from hybridflow.protocol import Batch

# Fields of the training layout laid out along the prompt + response row: the prompt is left-padded, so a
# batch whose prompts were padded to a shorter width widens on the left and its responses stay aligned.
ROW_FIELDS = ("input_ids", "attention_mask", "position_ids")
# Fields aligned with the response columns (right-padded to the response length), filled with 0 (masked).
RESPONSE_FIELDS = (
    "response_mask",
    "rollout_log_probs",
    "old_log_probs",
    "entropys",
    "ref_log_prob",
    "values",
    "advantages",
    "returns",
    "token_level_scores",
    "token_level_rewards",
    "rollout_is_weights",
)


def layout_padding(pad_token_id: int) -> dict[str, tuple[str, float]]:
    """How each field of the training layout widens (``Batch.concat``'s ``pad``): token ids fill with the pad
    token, masks, positions and per-token values with 0, rows on the left and response columns on the right.

    Ranks (and dynamic-sampling rounds) pad their prompts to their own longest one; with this, their shares
    join into one batch whose every row keeps its tokens, mask and positions.
    """
    pad = {key: ("left", 0) for key in ROW_FIELDS}
    pad["input_ids"] = ("left", pad_token_id)
    pad["responses"] = ("right", pad_token_id)
    pad.update({key: ("right", 0) for key in RESPONSE_FIELDS})
    pad["routed_experts"] = ("left", NO_EXPERT)  # MoE router replay: (B, P + R, L, k), 255 = not routed
    return pad


def pad_rows(
    rows: list[list], width: int, fill: float, dtype: torch.dtype, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one (B, width) tensor padded with ``fill`` (on the left or the right),
    and the (B, width) bool mask of the real entries.

    One flat copy and one masked scatter instead of a tensor per row: at 1,024 rows of 1,024 tokens the
    per-row version spends ~0.1 s of the host's time per tensor.
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # (B,)
    if (lengths > width).any():
        b = int(np.argmax(lengths > width))
        raise ValueError(f"row {b} has {lengths[b]} entries, more than the width {width}")
    columns = np.arange(width)  # (width,)
    mask = columns >= width - lengths[:, None] if left else columns < lengths[:, None]  # (B, width)
    out = np.full((len(rows), width), fill, dtype=torch.empty((), dtype=dtype).numpy().dtype)
    # Row-major order of the mask's True entries is the order of the rows' concatenation.
    out[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=out.dtype, count=int(lengths.sum()))
    return torch.from_numpy(out), torch.from_numpy(mask)


def pack_prompt_response(
    prompts: list[list[int]], responses: list[list[int]], response_length: int, pad_token_id: int
) -> Batch:
    """A Batch with ``input_ids`` (B, P + R), ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``.

    Prompts are left-padded to the longest prompt P, responses right-padded to ``response_length`` R (longer
    responses are refused: the rollout already caps them). Position ids count real tokens from 0.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    P = max((len(p) for p in prompts), default=0)
    R = response_length
    for b, r in enumerate(responses):
        if len(r) > R:
            raise ValueError(f"response {b} has {len(r)} tokens, more than the response length {R}")
    response_ids, response_mask = pad_rows(responses, R, pad_token_id, torch.long)  # (B, R)
    prompt_ids, prompt_mask = pad_rows(prompts, P, pad_token_id, torch.long, left=True)  # (B, P)
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + R)
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # (B, P + R)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P + R)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "responses": response_ids,
            "response_mask": response_mask.float(),
        }
    )


def pack_routing(
    prompt_lengths: list[int], routed: list[torch.Tensor], prompt_width: int, response_length: int
) -> torch.Tensor:
    """The rollout's routing records (each (p + r - 1, L, k) uint8: the prompt's tokens, then every response
    token but the last) laid out as ``pack_prompt_response`` lays out the tokens: (B, P + R, L, k), 255 where
    no token was routed (padding, the last response token)."""
    L, k = routed[0].shape[1:]
    out = torch.full((len(routed), prompt_width + response_length, L, k), NO_EXPERT, dtype=torch.uint8)
    for b, (p, rows) in enumerate(zip(prompt_lengths, routed)):
        start = prompt_width - p  # the prompt is left-padded
        out[b, start : start + rows.shape[0]] = rows
    return out
