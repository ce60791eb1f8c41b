"""Statistics of the prompt groups of a batch (the samples sharing a uid), for the step's metrics."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algos.advantage_base import _group_ids


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
