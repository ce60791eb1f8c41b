"""Put one outcome score per response on its last valid token (verl's ``token_level_scores``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def place_on_last_token(scores: torch.Tensor | Sequence[float], response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, R)`` tensor holding ``scores[b]`` at the last position where ``response_mask[b]`` is set.

    Every other position is 0, and a row with no valid token gets nothing. The output is float32 unless
    ``scores`` is a floating tensor of another dtype; it lives on ``response_mask``'s device.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (B, R), got shape {tuple(response_mask.shape)}")
    if not (isinstance(scores, torch.Tensor) and scores.is_floating_point()):
        scores = torch.as_tensor(scores, dtype=torch.float32)
    scores = scores.to(response_mask.device)  # (B,)
    batch, length = response_mask.shape
    if scores.shape != (batch,):
        raise ValueError(f"scores must be ({batch},) to match response_mask {tuple(response_mask.shape)}")
    out = torch.zeros(batch, length, dtype=scores.dtype, device=response_mask.device)  # (B, R)
    if length == 0:
        return out
    positions = torch.arange(length, device=response_mask.device).expand(batch, length)  # (B, R)
    # The last set position, -1 for an empty row; the mask may have holes (e.g. masked tool outputs).
    last = torch.where(response_mask.bool(), positions, -1).amax(dim=-1)  # (B,)
    # scatter rather than indexing the non-empty rows: no host sync on GPU. An empty row writes a 0 at 0.
    values = torch.where(last >= 0, scores, torch.zeros_like(scores))  # (B,)
    return out.scatter_(1, last.clamp(min=0).unsqueeze(-1), values.unsqueeze(-1))
