"""The optimal token baseline (OTB) family of advantage estimators, under verl 0.9.1's names.

For each prompt group and each step ``t`` the baseline is ``B_t = sum_i G_it W_it / (sum_i W_it + eps)``:
``G_it`` the reward-to-go and ``W_it = sum_{j<=t} w_ij`` a cumulative path-variance proxy, with
``w = 1 - 2 pi(a_t) + sum_v pi_v^2`` (``||e_a - pi||^2``; ``pi(a_t) = exp(old_log_probs)``) scaled by the
squared rollout IS weight when one is given. ``A_t = G_t - B_t``. ``optimal_token_baseline`` aligns the
rows by response position; ``tir_optimal_token_baseline`` (multi-turn, tool-integrated) aligns them by
the index of the valid token, so observation spans do not shift the turns against each other.

As everywhere in ``hybridflow.algos``, fully masked rows are left out of the group (verl counts them in a
group's size and in its second-longest length), and ``returns`` is zero outside ``response_mask`` (verl
returns the raw reward-to-go there).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.algos.group_stats import _check_shapes, _group_ids, _masked, _work_dtype
from hybridflow.algos.registry import AdvantageEstimator, register_adv_est


def _path_weights(
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per-token ``w = 1 - 2 pi + sum pi^2`` (B, T), times the squared IS weight; zero on masked tokens."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(
            "the optimal token baseline needs old_log_probs and sum_pi_squared (sum over the vocabulary of "
            "pi^2 per response token, from the actor's forward); both (batch, response_length)"
        )
    _check_shapes(
        old_log_probs, response_mask, sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights
    )
    w = 1.0 - 2.0 * torch.exp(old_log_probs.to(dtype)) + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype).square()
    return torch.where(response_mask.bool(), w, 0.0)


def _group_baseline(
    returns: torch.Tensor,
    path: torch.Tensor,
    valid: torch.Tensor,
    index: Any,
    epsilon: float,
    handle_zero_tail: bool,
) -> torch.Tensor:
    """Baselines (B, L) over aligned columns: ``returns``, cumulative ``path`` weights, ``valid`` (B, L) bool."""
    weight = torch.where(valid, path, 0.0)  # (B, L)
    row_valid = valid.any(dim=-1)  # (B,) rows with a valid token take part
    group, num_groups = _group_ids(index, returns.shape[0], returns.device)
    member = row_valid.to(returns.dtype)  # (B,)
    count = returns.new_zeros(num_groups).index_add_(0, group, member)  # (G,)
    num = returns.new_zeros((num_groups, returns.shape[1])).index_add_(0, group, returns * weight)
    den = returns.new_zeros((num_groups, returns.shape[1])).index_add_(0, group, weight)
    baseline = (num / (den + epsilon))[group]  # (B, L)
    baseline = torch.where((count[group] > 1).unsqueeze(-1), baseline, 0.0)  # a group of one: A = G
    if handle_zero_tail:
        # The single longest row of a group has no peer past the second-longest length: baseline 0 there.
        length = valid.sum(dim=-1).to(returns.dtype)  # (B,)
        ranked = torch.where(row_valid, length, -1.0)
        top = ranked.new_full((num_groups,), -1.0).scatter_reduce(0, group, ranked, "amax")  # (G,)
        is_top = row_valid & (length == top[group])
        n_top = returns.new_zeros(num_groups).index_add_(0, group, is_top.to(returns.dtype))
        others = torch.where(is_top, -1.0, ranked)
        second = ranked.new_full((num_groups,), -1.0).scatter_reduce(0, group, others, "amax")  # (G,)
        lone_top = is_top & (n_top[group] == 1) & (count[group] > 1)  # (B,)
        positions = torch.arange(returns.shape[1], device=returns.device, dtype=returns.dtype)
        tail = lone_top.unsqueeze(-1) & (positions.unsqueeze(0) >= second[group].unsqueeze(-1))
        baseline = torch.where(tail, 0.0, baseline)
    return baseline


@register_adv_est(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB: ``A_t = G_t - sum_i G_it W_it / sum_i W_it`` per group, rows aligned by response position."""
    _check_shapes(token_level_rewards, response_mask)
    dtype = _work_dtype(token_level_rewards)
    valid = response_mask.bool()
    rewards = _masked(token_level_rewards.to(dtype), response_mask)
    returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])  # (B, T) reward-to-go
    path = _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights, dtype).cumsum(
        dim=-1
    )
    baseline = _group_baseline(returns, path, valid, index, epsilon, handle_zero_tail)
    return _masked(returns - baseline, response_mask), _masked(returns, response_mask)


@register_adv_est(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE)
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn OTB: as ``optimal_token_baseline`` with rows aligned by the k-th valid token, not position."""
    _check_shapes(token_level_rewards, response_mask)
    dtype = _work_dtype(token_level_rewards)
    valid = response_mask.bool()
    batch, width = valid.shape
    rewards = _masked(token_level_rewards.to(dtype), response_mask)
    returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])  # (B, T)
    path = _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights, dtype).cumsum(
        dim=-1
    )
    # Column k of the packed matrices holds each row's k-th valid token; the spare last column takes the rest.
    slot = torch.where(valid, valid.long().cumsum(dim=-1) - 1, width)  # (B, T)
    packed_returns = returns.new_zeros((batch, width + 1)).scatter_(1, slot, returns)[:, :width]
    packed_path = path.new_zeros((batch, width + 1)).scatter_(1, slot, path)[:, :width]
    lengths = valid.sum(dim=-1, keepdim=True)  # (B, 1)
    packed_valid = torch.arange(width, device=valid.device).unsqueeze(0) < lengths  # (B, T)
    baseline = _group_baseline(packed_returns, packed_path, packed_valid, index, epsilon, handle_zero_tail)
    packed_adv = packed_returns - baseline  # (B, T) by valid-token index
    advantages = packed_adv.gather(1, slot.clamp(max=width - 1)) if width else packed_adv
    return _masked(advantages, response_mask), _masked(returns, response_mask)
