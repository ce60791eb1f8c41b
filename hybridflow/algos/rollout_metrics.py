"""Diagnostics of the rollout correction: IS-weight, rejection and off-policy metrics, with verl's keys.

Every function is pure and runs without gradient; values are detached 0-dim tensors (convert with
``float()`` when logging). Keys carry no prefix here: ``compute_rollout_correction_and_rejection_mask``
adds ``rollout_corr/``.

Unlike verl, fully masked rows (no valid response token) are left out of every per-sequence statistic
(``*_seq_*``, sequence-level max/min and fractions, perplexities, ``chi2_seq``), and a batch without any
valid token gives zeros instead of raising.
"""

from __future__ import annotations

import math

import torch

from hybridflow.utils.torch_functional import masked_mean, masked_sum

# exp(+-20) spans 2e-9 .. 4.9e8: a wider log-ratio is already an outlier, and exp() of it could overflow.
SAFETY_BOUND = 20.0

Metrics = dict[str, torch.Tensor]


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _extreme(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of ``values`` over ``valid``; 0 when nothing is valid."""
    if values.numel() == 0:
        return _zero(values)
    filled = values.masked_fill(~valid, float("-inf") if largest else float("inf"))
    extreme = filled.max() if largest else filled.min()
    return torch.where(valid.any(), extreme, _zero(extreme))


def _mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the ``valid`` entries (0 when none)."""
    return masked_mean(values, valid.to(values.dtype))


def _unbiased_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unbiased (N-1) std of ``values`` over ``valid``; 0 for fewer than two entries."""
    count = valid.sum()
    mean = _mean(values, valid)
    sq = masked_sum((values - mean).square(), valid.to(values.dtype))
    return torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), _zero(sq))


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Population std over the masked tokens of ``values`` clamped to [low, high]; 0 for one token or none."""
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    var = (masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0.0)
    return torch.where(mask.sum() > 1, var.sqrt(), _zero(var))


@torch.no_grad()
def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> Metrics:
    """Statistics of the applied IS weights (B, T) and of the raw ones before truncation/IcePop.

    ``log_ratio_for_metrics`` is the unclamped log-ratio per token (B, T), or per sequence (B, 1) for
    ``rollout_is="sequence"``. ``rollout_is_threshold_lower`` defaults to ``1 / rollout_is_threshold``.
    """
    upper = float(rollout_is_threshold)
    lower = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    mask = response_mask.to(rollout_is_weights.dtype)
    token_valid = response_mask.bool()
    seq_valid = token_valid.any(dim=-1)  # (B,)
    m: Metrics = {"rollout_is_mean": masked_mean(rollout_is_weights, mask)}
    if rollout_is == "sequence":
        seq_log = log_ratio_for_metrics.reshape(-1)  # (B,)
        m["rollout_is_max"] = torch.exp(_extreme(seq_log, seq_valid, largest=True).clamp(max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(_extreme(seq_log, seq_valid, largest=False))
        m["rollout_is_ratio_fraction_high"] = _mean((seq_log > math.log(upper)).float(), seq_valid)
        m["rollout_is_ratio_fraction_low"] = _mean((seq_log < math.log(lower)).float(), seq_valid)
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw_rollout_is_weights > upper).float(), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw_rollout_is_weights < lower).float(), mask)
        m["rollout_is_max"] = _extreme(rollout_is_weights, token_valid, largest=True)
        m["rollout_is_min"] = _extreme(rollout_is_weights, token_valid, largest=False)
    m["rollout_is_std"] = _clamped_std(rollout_is_weights, mask, 0.0, upper)
    # Effective sample size of the weights normalised to mean 1: 1 / E[w^2] (in (0, 1]).
    for_ess = rollout_is_weights.clamp(min=0.0, max=upper)
    normalized = for_ess / (masked_mean(for_ess, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), mask).clamp(min=1e-8)

    seq_weight = masked_mean(rollout_is_weights, mask, axis=-1)  # (B,) mean applied weight per row
    raw_seq_weight = masked_mean(raw_rollout_is_weights, mask, axis=-1)  # (B,)
    m["rollout_is_seq_mean"] = _mean(seq_weight, seq_valid)
    m["rollout_is_seq_std"] = _unbiased_std(seq_weight, seq_valid)
    m["rollout_is_seq_max"] = _extreme(seq_weight, seq_valid, largest=True)
    m["rollout_is_seq_min"] = _extreme(seq_weight, seq_valid, largest=False)
    m["rollout_is_seq_max_deviation"] = _extreme((seq_weight - 1.0).abs(), seq_valid, largest=True)
    # The raw per-row mean: a mean of truncated weights can never exceed the threshold.
    m["rollout_is_seq_fraction_high"] = _mean((raw_seq_weight > upper).float(), seq_valid)
    m["rollout_is_seq_fraction_low"] = _mean((raw_seq_weight < lower).float(), seq_valid)
    return {key: value.detach() for key, value in m.items()}


@torch.no_grad()
def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> Metrics:
    """Metrics ``rollout_rs_<option>_*`` of one rejection option.

    ``rs_statistic`` is the per-token statistic (B, T) (a sequence statistic broadcast over its tokens);
    ``per_sequence_values`` the per-sequence one (B,) or None (then the per-row token mean). The thresholds
    are in the statistic's units (log-ratio bounds for k1 options); the lower one counts only when
    ``apply_lower_threshold``.
    """
    prefix = f"rollout_rs_{option_name}"
    mask = response_mask.to(rs_statistic.dtype)
    token_valid = response_mask.bool()
    seq_values = (
        masked_mean(rs_statistic, mask, axis=-1) if per_sequence_values is None else per_sequence_values
    )
    seq_values = seq_values.reshape(-1)  # (B,)
    upper, lower = float(rollout_rs_threshold), float(rollout_rs_threshold_lower)
    m: Metrics = {f"{prefix}_mean": masked_mean(rs_statistic, mask)}
    if level == "sequence":
        m[f"{prefix}_max"] = _extreme(seq_values, seq_valid_mask, largest=True)
        m[f"{prefix}_min"] = _extreme(seq_values, seq_valid_mask, largest=False)
        m[f"{prefix}_fraction_high"] = _mean((seq_values > upper).float(), seq_valid_mask)
        low = _mean((seq_values < lower).float(), seq_valid_mask)
    else:
        m[f"{prefix}_max"] = _extreme(rs_statistic, token_valid, largest=True)
        m[f"{prefix}_min"] = _extreme(rs_statistic, token_valid, largest=False)
        m[f"{prefix}_fraction_high"] = masked_mean((rs_statistic > upper).float(), mask)
        low = masked_mean((rs_statistic < lower).float(), mask)
    m[f"{prefix}_fraction_low"] = low if apply_lower_threshold else _zero(low)
    m[f"{prefix}_std"] = _clamped_std(rs_statistic, mask, lower if apply_lower_threshold else 0.0, upper)
    m[f"{prefix}_seq_mean"] = _mean(seq_values, seq_valid_mask)
    m[f"{prefix}_seq_std"] = _unbiased_std(seq_values, seq_valid_mask)
    m[f"{prefix}_seq_max"] = _extreme(seq_values, seq_valid_mask, largest=True)
    m[f"{prefix}_seq_min"] = _extreme(seq_values, seq_valid_mask, largest=False)
    m[f"{prefix}_seq_max_deviation"] = _extreme(seq_values.abs(), seq_valid_mask, largest=True)  # ideal is 0
    m[f"{prefix}_seq_fraction_high"] = _mean((seq_values > upper).float(), seq_valid_mask)
    if apply_lower_threshold:
        m[f"{prefix}_seq_fraction_low"] = _mean((seq_values < lower).float(), seq_valid_mask)
    return {key: value.detach() for key, value in m.items()}


@torch.no_grad()
def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> Metrics:
    """Mismatch diagnostics between the trainer's log-probs and the rollout's (B, T); rollout may be None.

    Always: ``training_ppl`` (mean over valid rows of exp(-mean token log-prob)) and ``training_log_ppl``.
    With ``rollout_log_prob`` (r = pi_train / pi_rollout per token): ``kl`` = mean(rollout - old) (k1 of
    KL(pi_rollout || pi_train)), ``k3_kl`` = mean(r - 1 - log r), ``rollout_ppl``, ``rollout_log_ppl``,
    ``log_ppl_diff`` (row mean of rollout minus trainer mean log-prob, its ``_abs``, ``_max``, ``_min``),
    ``ppl_ratio`` = mean exp(log_ppl_diff), ``chi2_token`` = mean(r^2) - 1, ``chi2_seq`` = mean over rows
    of (prod r)^2 - 1; hybridflow adds ``log_prob_abs_diff_mean``/``_max`` (|old - rollout| per token).
    """
    mask = response_mask.to(old_log_prob.dtype)
    token_valid = response_mask.bool()
    seq_valid = token_valid.any(dim=-1)  # (B,)
    train_mean_lp = masked_mean(old_log_prob, mask, axis=-1)  # (B,)
    m: Metrics = {
        "training_ppl": _mean(torch.exp(-train_mean_lp), seq_valid),
        "training_log_ppl": _mean(-train_mean_lp, seq_valid),
    }
    if rollout_log_prob is not None:
        if rollout_log_prob.shape != old_log_prob.shape:
            raise ValueError(
                f"rollout_log_prob {tuple(rollout_log_prob.shape)} and old_log_prob "
                f"{tuple(old_log_prob.shape)} must have the same shape (batch, response_length)"
            )
        log_ratio = old_log_prob - rollout_log_prob  # (B, T) log r
        safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
        rollout_mean_lp = masked_mean(rollout_log_prob, mask, axis=-1)  # (B,)
        log_ppl_diff = rollout_mean_lp - train_mean_lp  # (B,) log(training_ppl / rollout_ppl) per row
        seq_log_ratio = torch.clamp(masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
        abs_diff = log_ratio.abs()
        m.update(
            {
                "kl": masked_mean(-log_ratio, mask),
                "k3_kl": masked_mean(torch.exp(safe) - 1.0 - safe, mask),
                "rollout_ppl": _mean(torch.exp(-rollout_mean_lp), seq_valid),
                "rollout_log_ppl": _mean(-rollout_mean_lp, seq_valid),
                "log_ppl_diff": _mean(log_ppl_diff, seq_valid),
                "log_ppl_abs_diff": _mean(log_ppl_diff.abs(), seq_valid),
                "log_ppl_diff_max": _extreme(log_ppl_diff, seq_valid, largest=True),
                "log_ppl_diff_min": _extreme(log_ppl_diff, seq_valid, largest=False),
                "ppl_ratio": _mean(torch.exp(log_ppl_diff), seq_valid),
                "chi2_token": masked_mean(torch.exp(2.0 * safe), mask) - 1.0,
                "chi2_seq": _mean(torch.exp(2.0 * seq_log_ratio), seq_valid) - 1.0,
                "log_prob_abs_diff_mean": masked_mean(abs_diff, mask),
                "log_prob_abs_diff_max": _extreme(abs_diff, token_valid, largest=True),
            }
        )
    return {key: value.detach() for key, value in m.items()}


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> Metrics:
    """``compute_offpolicy_metrics`` of the current policy's log-probs, keys prefixed ``rollout_corr/``."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}
