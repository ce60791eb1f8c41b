"""Correction for the training/inference mismatch between the rollout engine and the trainer.

The rollout engine samples from ``pi_rollout`` (its own kernels and precision); the trainer recomputes
``old_log_prob`` under ``pi_train``. The per-token log-ratio ``log(pi_train / pi_rollout) = old_log_prob -
rollout_log_prob`` drives two independent tools, with verl's names (``rollout_corr_helper``):

- truncated importance sampling (TIS): weights ``min(ratio, threshold)`` per token, or one weight per
  sequence (the product of its token ratios), multiplied into the per-token policy loss;
- rejection: tokens, or whole sequences, whose ratio falls outside ``[lower, upper]`` are removed from
  the response mask.

All functions are pure and run without gradient. Metric values are detached 0-dim tensors (convert with
``float()`` when logging); the combined function prefixes them with ``rollout_corr/``.
"""

from __future__ import annotations

import math

import torch

from hybridflow.utils.torch_functional import masked_mean, masked_sum

# exp(+-20) spans 2e-9 .. 4.9e8: a wider log-ratio is already an outlier, and exp() of it could overflow.
SAFETY_BOUND = 20.0

ROLLOUT_IS_MODES: list[str] = ["token", "sequence"]
ROLLOUT_RS_MODES: list[str] = ["token", "sequence", "geometric"]


def _check_threshold(name: str, value: float | None) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a positive number (e.g. 2.0), got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (a bound on pi_train / pi_rollout, e.g. 2.0), got {value}")
    return float(value)


def _unit_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log-ratio per unit: per token (B, T), summed per sequence (B,) or averaged per sequence (B,)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_sum(log_ratio, response_mask, axis=-1)
    return masked_mean(log_ratio, response_mask, axis=-1)  # geometric mean of the token ratios


def _unit_valid(response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Which units count: valid tokens (B, T), or sequences with at least one valid token (B,)."""
    return response_mask.bool() if level == "token" else response_mask.sum(dim=-1) > 0


def _to_tokens(unit_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence values (B,) to (B, T); per-token values pass through."""
    return unit_values if unit_values.dim() == like.dim() else unit_values.unsqueeze(-1).expand_as(like)


def _fraction(flags: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Fraction of valid units where ``flags`` holds (0 when nothing is valid)."""
    return masked_mean(flags.float(), valid)


def _masked_extreme(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) over the valid units, 0 when there is none."""
    if values.numel() == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    fill = float("-inf") if largest else float("inf")
    filled = values.masked_fill(~valid, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(valid.any(), extreme, torch.zeros_like(extreme))


@torch.no_grad()
def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS weights ``min(exp(log_ratio), threshold)`` (B, T), zero on padding, and their metrics.

    ``rollout_is="token"`` gives one weight per token; ``"sequence"`` gives each sequence
    ``exp(sum of its valid log-ratios)``, broadcast over its tokens. With ``rollout_is_batch_normalize``
    the weights are divided by their mean over the valid tokens/sequences of THIS batch (no all-reduce).
    Metrics (before normalisation): ``rollout_is_mean`` (mean truncated weight), ``rollout_is_max/min``
    (raw ratio), ``rollout_is_ratio_fraction_high`` (fraction truncated), ``rollout_is_ratio_fraction_low``
    (ratio below 1/threshold), ``rollout_is_eff_sample_size``.
    """
    if rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(
            f"Invalid rollout_is {rollout_is!r}; valid modes are {ROLLOUT_IS_MODES} (None disables IS)"
        )
    threshold = _check_threshold("rollout_is_threshold", rollout_is_threshold)
    if log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(response_mask.shape)} differ"
        )

    unit_log = _unit_log_ratio(log_ratio, response_mask, rollout_is)  # (B, T) or (B,)
    valid = _unit_valid(response_mask, rollout_is)
    raw = torch.exp(torch.clamp(unit_log, -SAFETY_BOUND, SAFETY_BOUND))
    truncated = raw.clamp(max=threshold)

    mean_weight = masked_mean(truncated, valid)
    normalized = truncated / (mean_weight + 1e-8)
    log_threshold = math.log(threshold)
    metrics = {
        "rollout_is_mean": mean_weight,
        "rollout_is_max": _masked_extreme(raw, valid, largest=True),
        "rollout_is_min": _masked_extreme(raw, valid, largest=False),
        # Compared in log space: exact even where exp() saturated at the safety bound.
        "rollout_is_ratio_fraction_high": _fraction(unit_log > log_threshold, valid),
        "rollout_is_ratio_fraction_low": _fraction(unit_log < -log_threshold, valid),
        "rollout_is_eff_sample_size": 1.0 / masked_mean(normalized.square(), valid).clamp(min=1e-8),
    }
    if rollout_is_batch_normalize:
        factor = torch.where(mean_weight > 1e-8, mean_weight, torch.ones_like(mean_weight))
        truncated = truncated / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    weights = _to_tokens(truncated, log_ratio) * response_mask  # (B, T)
    return weights.detach(), {key: value.detach() for key, value in metrics.items()}


@torch.no_grad()
def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token",
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mask out tokens/sequences whose ratio is outside ``[lower, upper]``; returns (mask (B, T), metrics).

    The ratio is per token (``"token"``), the product over the sequence (``"sequence"``) or the geometric
    mean over the sequence (``"geometric"``); a rejected sequence loses all its tokens. ``lower`` defaults
    to ``1 / upper``; the bounds themselves are kept. The mask keeps ``response_mask``'s dtype. Metrics:
    ``rollout_rs_masked_fraction`` (valid tokens rejected), ``rollout_rs_seq_masked_fraction`` (valid
    sequences with a rejected token), ``rollout_rs_ratio_fraction_high/low``.
    """
    if rollout_rs not in ROLLOUT_RS_MODES:
        raise ValueError(
            f"Invalid rollout_rs {rollout_rs!r}; valid modes are {ROLLOUT_RS_MODES} (None disables it)"
        )
    upper = _check_threshold("rollout_rs_threshold", rollout_rs_threshold)
    lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
    lower = _check_threshold("rollout_rs_threshold_lower", lower)
    if lower > upper:
        raise ValueError(f"rollout_rs_threshold_lower ({lower}) must be <= rollout_rs_threshold ({upper})")
    if log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(response_mask.shape)} differ"
        )

    unit_log = _unit_log_ratio(log_ratio, response_mask, rollout_rs)  # (B, T) or (B,)
    valid = _unit_valid(response_mask, rollout_rs)
    too_high = unit_log > math.log(upper)
    too_low = unit_log < math.log(lower)
    keep = _to_tokens(~(too_high | too_low), log_ratio)  # (B, T) bool

    token_valid = response_mask.bool()
    rejected = token_valid & ~keep
    seq_valid = token_valid.any(dim=-1)  # (B,)
    metrics = {
        "rollout_rs_masked_fraction": _fraction(rejected, token_valid),
        "rollout_rs_seq_masked_fraction": _fraction(rejected.any(dim=-1), seq_valid),
        "rollout_rs_ratio_fraction_high": _fraction(too_high, valid),
        "rollout_rs_ratio_fraction_low": _fraction(too_low, valid),
    }
    modified_mask = response_mask * keep.to(response_mask.dtype)
    return modified_mask, {key: value.detach() for key, value in metrics.items()}


@torch.no_grad()
def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mismatch diagnostics between trainer and rollout log-probs (B, T), averaged over valid tokens.

    ``kl``: k1 estimate of KL(pi_rollout || pi_train) = mean(rollout - old); ``k3_kl``: mean(r - 1 - log r)
    with r = pi_train / pi_rollout; ``chi2_token``: mean(r^2) - 1; ``training_ppl``/``rollout_ppl``: mean
    over valid sequences of exp(-mean token log-prob); ``log_prob_abs_diff_mean/max``: |old - rollout|.
    """
    log_ratio = old_log_prob - rollout_log_prob  # (B, T) log r
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    token_valid = response_mask.bool()
    seq_valid = token_valid.any(dim=-1)  # (B,)
    abs_diff = log_ratio.abs()
    training_ppl = torch.exp(-masked_mean(old_log_prob, response_mask, axis=-1))  # (B,)
    rollout_ppl = torch.exp(-masked_mean(rollout_log_prob, response_mask, axis=-1))  # (B,)
    metrics = {
        "kl": masked_mean(-log_ratio, response_mask),
        "k3_kl": masked_mean(torch.exp(safe) - 1.0 - safe, response_mask),
        "chi2_token": masked_mean(torch.exp(2.0 * safe), response_mask) - 1.0,
        "training_ppl": masked_mean(training_ppl, seq_valid),
        "rollout_ppl": masked_mean(rollout_ppl, seq_valid),
        "log_prob_abs_diff_mean": masked_mean(abs_diff, response_mask),
        "log_prob_abs_diff_max": _masked_extreme(abs_diff, token_valid, largest=True),
    }
    return {key: value.detach() for key, value in metrics.items()}


@torch.no_grad()
def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """IS weights (or None), the response mask after rejection, and ``rollout_corr/``-prefixed metrics.

    ``rollout_is=None`` skips the weights and ``rollout_rs=None`` the rejection; the mismatch metrics of
    ``compute_offpolicy_metrics`` are always computed. Unlike verl, the weights are returned as a plain
    (B, T) tensor (verl wraps them in a DataProto under ``rollout_is_weights``).
    """
    if not (old_log_prob.shape == rollout_log_prob.shape == response_mask.shape):
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must share the shape (batch, response_length), got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise ValueError(
            "rollout_rs is set but rollout_rs_threshold is None; set it, e.g. rollout_rs_threshold=2.0"
        )
    log_ratio = old_log_prob - rollout_log_prob  # (B, T)
    metrics: dict[str, torch.Tensor] = {}

    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)

    modified_mask = response_mask.clone()
    if rollout_rs is not None:
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower
        )
        metrics.update(rs_metrics)

    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, modified_mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}
