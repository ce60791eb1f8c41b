"""The prompt groups of a batch (the samples sharing a uid) and their statistics.

Each sample's outcome score (``_outcome_scores``), its group's id (``_group_ids``), each group's count, mean and
unbiased std (``_group_stats``), for the advantage estimators, and the fraction of groups whose scores all tie
(``group_zero_std_fraction``) for the step's metrics; with the shape checks and the (B,) -> (B, T) spreading the
estimators share.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.utils.torch_functional import masked_sum


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    # Statistics in at least float32: bf16 means and stds over a group are too coarse.
    return torch.promote_types(t.dtype, torch.float32)


def _check_shapes(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **others: Any) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (batch, response_length), got {tuple(token_level_rewards.shape)}"
        )
    for name, t in {"response_mask": response_mask, **others}.items():
        if t is not None and tuple(t.shape) != tuple(token_level_rewards.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but token_level_rewards has {tuple(token_level_rewards.shape)}"
            )


def _outcome_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per-row outcome score ``(B,)`` and the ``(B,)`` bool of rows with at least one valid token."""
    _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards.to(_work_dtype(token_level_rewards)), response_mask, axis=-1)
    return scores, response_mask.sum(dim=-1) > 0


def _group_ids(index: Any, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map the per-sample uids to group ids ``(B,)`` in ``[0, G)``; returns the ids and G."""
    if index is None:
        raise ValueError(
            "this advantage estimator groups samples by prompt: pass index=<numpy array of one uid per sample> "
            "(the batch's non-tensor 'uid' field)"
        )
    uids = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    uids = uids.reshape(-1)
    if uids.shape[0] != batch_size:
        raise ValueError(f"index has {uids.shape[0]} uids but the batch has {batch_size} samples")
    try:
        _, inverse = np.unique(uids, return_inverse=True)
    except TypeError:  # uids of mixed, unorderable types: number them by first appearance instead
        first_seen: dict[Any, int] = {}
        inverse = np.array([first_seen.setdefault(u, len(first_seen)) for u in uids.tolist()], dtype=np.int64)
    group = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return group, (int(group.max()) + 1 if batch_size else 0)


def _group_stats(
    scores: torch.Tensor, valid: torch.Tensor, group: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group count, mean and unbiased (N-1) std over the valid rows, each ``(G,)``."""
    weight = valid.to(scores.dtype)  # (B,)
    count = scores.new_zeros(num_groups).index_add_(0, group, weight)
    # Average the offsets from the group's smallest score rather than the raw scores: a group of equal
    # scores then gets a mean equal to that score bit for bit, so its deviations and std are exactly 0
    # (summing 0.1 + 0.1 + 0.1 and dividing by 3 does not give 0.1 back, and the ~1e-8 residue divided by
    # std + 1e-6 would be a spurious advantage).
    lowest = torch.where(valid, scores, torch.inf)
    ref = scores.new_full((num_groups,), torch.inf).scatter_reduce(0, group, lowest, "amin")
    ref = torch.where(count > 0, ref, 0.0)  # (G,)
    offsets = (scores - ref[group]) * weight
    mean = ref + scores.new_zeros(num_groups).index_add_(0, group, offsets) / count.clamp(min=1)
    # Two-pass variance (sum of squared deviations), not E[x^2] - E[x]^2, which cancels badly.
    sq_dev = (scores - mean[group]).square() * weight
    var = scores.new_zeros(num_groups).index_add_(0, group, sq_dev) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread a ``(B,)`` scalar over the valid tokens of each row: ``(B, T)``, zero outside the mask."""
    return torch.where(response_mask.bool(), per_row.unsqueeze(-1), 0.0)


def _masked(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), values, 0.0)


@torch.no_grad()
def group_zero_std_fraction(scores: torch.Tensor, index: Any) -> float | None:
    """The fraction of groups whose samples' scores all tie (zero spread), among groups of two or more.

    ``scores`` (B,) are the samples' outcome scores, ``index`` one uid per sample (the batch's ``uid``). A
    group-relative estimator (GRPO, RLOO, ...) gives such a group zero advantage: it teaches nothing. Logged
    as ``critic/score/zero_std_frac`` (TRL's ``frac_reward_zero_std``). None when no group has two samples.
    Ties are exact: a group's scores are equal when its largest equals its smallest.
    """
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    if num_groups == 0:
        return None
    values = scores.reshape(-1).to(torch.float64)  # exact: a float64 score is not rounded into a tie
    count = values.new_zeros(num_groups).index_add_(0, group, torch.ones_like(values))
    high = values.new_full((num_groups,), -torch.inf).scatter_reduce(0, group, values, "amax")
    low = values.new_full((num_groups,), torch.inf).scatter_reduce(0, group, values, "amin")
    several = count >= 2
    if not bool(several.any()):
        return None
    return float((high == low)[several].float().mean())
