"""Advantage estimators with verl's ``core_algos`` names, arguments and conventions.

Every estimator takes ``token_level_rewards`` and ``response_mask`` shaped (B, T) (B samples, T response
tokens) and returns ``(advantages, returns)``, both (B, T) and exactly zero wherever ``response_mask`` is 0.
Group-based estimators take ``index``, one uid per sample (the batch's ``uid`` numpy array): the samples of
one prompt share a uid and form a group. Group statistics are vectorised (uid -> int, then ``index_add_``).

Outcome scores are the masked sum of ``token_level_rewards`` per row (verl sums the whole row; the two agree
because rewards are zero outside the mask). A fully masked row (no valid response token) is treated as
absent: it gets zero advantages and is left out of every group and batch statistic, so it cannot move
anyone else's baseline. On batches without such rows the results equal verl's.

``config`` is any attribute object or Mapping (verl passes its AlgoConfig); explicit keyword arguments win,
``config`` fills in arguments left at None, and a built-in default covers the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hybridflow.algos.group_stats import (
    _broadcast,
    _check_shapes,
    _group_ids,
    _group_stats,
    _masked,
    _outcome_scores,
    _work_dtype,
)
from hybridflow.algos.registry import (  # noqa: F401 (re-exported for verl-style imports)
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    AdvantageFn,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.utils.torch_functional import masked_whiten

logger = logging.getLogger(__name__)


def _config_value(config: Any, key: str, default: Any) -> Any:
    """Read ``key`` from an attribute object or a Mapping; ``default`` when absent or None."""
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def _resolve(explicit: Any, config: Any, key: str, default: Any) -> Any:
    return explicit if explicit is not None else _config_value(config, key, default)


def _grpo_scalar(
    scores: torch.Tensor,
    valid: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    epsilon: float,
    norm: bool,
) -> torch.Tensor:
    """GRPO per-row advantage ``(B,)``; a group of one has mean 0 and std 1 (verl), so a = s."""
    count, mean, std = _group_stats(scores, valid, group, num_groups)
    lone = count < 2
    mean = torch.where(lone, 0.0, mean)
    std = torch.where(lone, 1.0, std)
    adv = scores - mean[group]
    if norm:
        adv = adv / (std[group] + epsilon)  # all-equal rewards: 0 / (0 + eps) = 0, never NaN
    return adv


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor | None = None,
    lam: float | torch.Tensor | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; masked positions are skipped, returns = advantages + values, advantages whitened over the batch."""
    _check_shapes(token_level_rewards, response_mask, values=values)
    gamma = _resolve(gamma, config, "gamma", 1.0)
    lam = _resolve(lam, config, "lam", 1.0)
    dtype = torch.promote_types(_work_dtype(token_level_rewards), values.dtype)
    rewards, values, valid = token_level_rewards.to(dtype), values.to(dtype), response_mask.bool()
    next_value = rewards.new_zeros(rewards.shape[0])  # (B,)
    last_gae = rewards.new_zeros(rewards.shape[0])  # (B,)
    reversed_adv = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # A masked position (padding, or an observation hole in a multi-turn response) is skipped: the next
        # valid token's value and advantage are carried across it. torch.where, not a 0/1 blend, so a NaN
        # under the mask cannot leak into valid tokens.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        last_gae = torch.where(valid[:, t], gae_t, last_gae)
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)  # (B, T)
    returns = advantages + values
    advantages = masked_whiten(advantages, response_mask)
    return _masked(advantages, response_mask), _masked(returns, response_mask)


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (s - group mean) / (group std + epsilon); Dr.GRPO (s - mean) when norm_adv_by_std_in_grpo=False."""
    norm = bool(_resolve(norm_adv_by_std_in_grpo, config, "norm_adv_by_std_in_grpo", True))
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    adv = _broadcast(_grpo_scalar(scores, valid, group, num_groups, epsilon, norm), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO; identical to ``compute_grpo_outcome_advantage`` (which is vectorised here)."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config
    )


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k: only each group's best sample gets r_max - r_second_max (divided by the group std if asked)."""
    norm = bool(_resolve(norm_adv_by_std_in_grpo, config, "norm_adv_by_std_in_grpo", True))
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, _, std = _group_stats(scores, valid, group, num_groups)
    if bool((count == 1).any()):
        raise ValueError(
            "grpo_passk needs at least 2 samples per uid (it compares the best with the second best); "
            "set rollout.n >= 2"
        )
    ranked = torch.where(valid, scores, -torch.inf)  # (B,) masked rows never rank
    top = ranked.new_full((num_groups,), -torch.inf).scatter_reduce(0, group, ranked, "amax")
    is_top = valid & (scores == top[group])
    n_top = scores.new_zeros(num_groups).index_add_(0, group, is_top.to(scores.dtype))
    second = ranked.new_full((num_groups,), -torch.inf).scatter_reduce(
        0, group, torch.where(is_top, -torch.inf, ranked), "amax"
    )
    # A tie at the top leaves nothing to gain (r_max - r_second_max = 0) whichever sample verl would pick.
    second = torch.where(n_top > 1, top, second)
    gap = torch.where(count >= 2, top - second, 0.0)  # (G,) groups with no valid row would give inf - inf
    if norm:
        gap = gap / (std + epsilon)
    adv = _broadcast(torch.where(is_top, gap[group], 0.0), response_mask)
    return adv, adv


def _rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, lone_keeps_score: bool
) -> torch.Tensor:
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_stats(scores, valid, group, num_groups)
    n = count[group]  # (B,)
    # s * n/(n-1) - mean * n/(n-1) is s minus the mean of the other n-1 samples of the group.
    loo = (scores - mean[group]) * n / (n - 1).clamp(min=1)
    lone = scores if lone_keeps_score else torch.zeros_like(scores)
    return _broadcast(torch.where(n > 1, loo, lone), response_mask)


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: a_i = s_i * n/(n-1) - mean * n/(n-1); a group of one keeps a = s."""
    adv = _rloo(token_level_rewards, response_mask, index, lone_keeps_score=True)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: as ``rloo`` except that a group of one gets a = 0 (verl's behaviour)."""
    adv = _rloo(token_level_rewards, response_mask, index, lone_keeps_score=False)
    return adv, adv


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: s minus the length-weighted group mean sum(len * s) / sum(len); a group of one has baseline 0."""
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, _, _ = _group_stats(scores, valid, group, num_groups)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)  # (B,) zero for masked rows, so they weigh nothing
    weighted = scores.new_zeros(num_groups).index_add_(0, group, lengths * scores)
    total_len = scores.new_zeros(num_groups).index_add_(0, group, lengths)
    baseline = torch.where(count > 1, weighted / total_len.clamp(min=1), 0.0)  # (G,)
    adv = _broadcast(scores - baseline[group], response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha * (s - group mean) / f_norm with alpha = B / #(non-zero scores), recomputed as verl does."""
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_stats(scores, valid, group, num_groups)
    mean = torch.where(count < 2, 0.0, mean)
    # The passed ``alpha`` is ignored, as in verl: the correction B / M rescales the batch-mean gradient to
    # the samples that carry signal (M = samples with a non-zero reward).
    n_signal = (valid & (scores != 0)).sum().clamp(min=1)
    alpha = valid.sum() / n_signal
    adv = _broadcast(alpha * (scores - mean[group]) / f_norm, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: s - group mean on every valid token, then ``masked_whiten`` over the batch."""
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_stats(scores, valid, group, num_groups)
    mean = torch.where(count < 2, 0.0, mean)
    centered = _broadcast(scores - mean[group], response_mask)  # (B, T)
    adv = _masked(masked_whiten(centered, response_mask), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go carried across masked tokens, then ``masked_whiten`` over the batch.

    As in verl 0.9.1, a masked span inside a response (a multi-turn observation) passes the running return
    through unchanged: rewards after it reach the tokens before it, discounted only over valid tokens.
    verl before 0.9 (and hybridflow before issue 32) reset the return at every masked token instead; with
    masked positions only as trailing padding both give the same result.
    """
    _check_shapes(token_level_rewards, response_mask)
    gamma = _resolve(gamma, config, "gamma", 1.0)
    rewards = token_level_rewards.to(_work_dtype(token_level_rewards))
    valid = response_mask.bool()
    returns = torch.zeros_like(rewards)  # (B, T)
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        # A masked position neither adds its reward nor discounts: the running return skips it.
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    advantages = _masked(masked_whiten(returns, response_mask), response_mask)
    return advantages, _masked(returns, response_mask)


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted return-to-go minus the greedy sample's reward ``reward_baselines`` (B,); no whitening."""
    _check_shapes(token_level_rewards, response_mask)
    if reward_baselines is None or tuple(reward_baselines.shape) != (token_level_rewards.shape[0],):
        raise ValueError(
            "remax needs reward_baselines: the reward of each prompt's greedy sample, one value per row "
            f"(shape ({token_level_rewards.shape[0]},)), got "
            f"{None if reward_baselines is None else tuple(reward_baselines.shape)}"
        )
    rewards = _masked(token_level_rewards.to(_work_dtype(token_level_rewards)), response_mask)
    returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])  # (B, T) reward-to-go
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1)
    return _masked(advantages, response_mask), _masked(returns, response_mask)


@register_adv_est(AdvantageEstimator.GDPO)
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    non_tensor_batch: Mapping[str, Any] | None = None,
    batch: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: GRPO-normalise each reward component per group, weight and sum them, then whiten over the batch.

    The components are ``non_tensor_batch[key]`` (one score per sample) for the keys in the config's
    ``gdpo_reward_keys``, weighted by ``gdpo_reward_weights`` (default 1); without keys the single
    component is the outcome score of ``token_level_rewards``. ``batch`` is accepted for verl compatibility.
    """
    norm = bool(_resolve(norm_adv_by_std_in_grpo, config, "norm_adv_by_std_in_grpo", True))
    scores, valid = _outcome_scores(token_level_rewards, response_mask)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    keys = list(_config_value(config, "gdpo_reward_keys", []))
    components = [scores]
    if keys:
        if non_tensor_batch is None or any(k not in non_tensor_batch for k in keys):
            have = [] if non_tensor_batch is None else sorted(non_tensor_batch)
            raise ValueError(
                f"gdpo_reward_keys {keys} must all be in non_tensor_batch (has {have}); "
                "return these components from the reward function"
            )
        components = [
            torch.as_tensor(np.asarray(non_tensor_batch[k], dtype=np.float64), device=scores.device).to(
                scores.dtype
            )
            for k in keys
        ]
    weights = list(_config_value(config, "gdpo_reward_weights", [1.0] * len(components)))
    if len(weights) != len(components):
        raise ValueError(f"gdpo_reward_weights has {len(weights)} entries for {len(components)} reward keys")
    total = torch.zeros_like(scores)
    for weight, component in zip(weights, components):
        component = torch.where(valid, component, 0.0)
        total = total + float(weight) * _grpo_scalar(component, valid, group, num_groups, epsilon, norm)
    adv = _masked(masked_whiten(_broadcast(total, response_mask), response_mask), response_mask)
    return adv, adv
