"""Correction for the training/inference mismatch between the rollout engine and the trainer (verl 0.9.1 API).

The rollout engine samples from ``pi_rollout`` (its own kernels and precision); the trainer recomputes
``old_log_prob`` under ``pi_train``. The per-token log-ratio ``log r = log(pi_train / pi_rollout) =
old_log_prob - rollout_log_prob`` drives two independent tools, with the names of verl's
``rollout_corr_helper``:

- importance weights (``rollout_is`` = ``token`` or ``sequence``): ``r`` per token, or ``prod r`` per
  sequence; a single-number threshold truncates them (TIS, ``min(w, upper)``), a ``"lower_upper"`` string
  zeroes the weights outside ``[lower, upper]`` (IcePop);
- rejection (``rollout_rs``): one or several comma-chained options of ``SUPPORTED_ROLLOUT_RS_OPTIONS``,
  each a divergence estimator per token — k1 = ``-log r``, k2 = ``0.5 (log r)^2``, k3 = ``r - 1 - log r`` —
  taken per token (``token_*``) or summed, averaged or maximised over the sequence (``seq_sum_*``,
  ``seq_mean_*``, ``seq_max_*``). A token, or a whole sequence, is kept when every option passes.

Thresholds of rejection (``rollout_rs_threshold``): one entry per option, comma separated (a single entry
applies to all). A k1 option takes ratio bounds ``"lower_upper"`` on ``exp(k1) = pi_rollout / pi_train``
(a single number ``u`` means ``1/u_u``); k2/k3 options take one positive upper bound. Our older modes are
aliases: ``token`` = ``token_k1``, ``sequence`` = ``seq_sum_k1``, ``geometric`` = ``seq_mean_k1`` (with
the symmetric bounds they were used with, identical results).

Everything runs without gradient; metric values are detached 0-dim tensors (``rollout_metrics``).
"""

from __future__ import annotations

import math

import torch

from hybridflow.algos.rollout_metrics import (
    SAFETY_BOUND,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rs_metrics,
)
from hybridflow.utils.torch_functional import masked_mean, masked_sum

ROLLOUT_IS_MODES: list[str] = ["token", "sequence"]
# Each option aggregates a KL estimator k1/k2/k3 per token or over a sequence (its sum, mean or max); k1 is
# signed, so its max says nothing and is not an option. config.choices lists the same names for validation
# (a test keeps the two equal).
ROLLOUT_RS_OPTIONS: list[str] = [
    *(f"token_k{k}" for k in (1, 2, 3)),
    *(f"seq_{agg}_k{k}" for agg in ("sum", "mean") for k in (1, 2, 3)),
    *(f"seq_max_k{k}" for k in (2, 3)),
]
SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = set(ROLLOUT_RS_OPTIONS)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}
# hybridflow's names before verl 0.9.1's options (verl 0.6/0.7 interface) -> the option they equal.
ROLLOUT_RS_ALIASES: dict[str, str] = {
    "token": "token_k1",
    "sequence": "seq_sum_k1",
    "geometric": "seq_mean_k1",
}
# Every name rollout_rs accepts (comma-chained): the options, then the aliases.
ROLLOUT_RS_MODES: list[str] = ROLLOUT_RS_OPTIONS + list(ROLLOUT_RS_ALIASES)

Threshold = float | str


def normalize_rollout_rs(rollout_rs: str) -> list[str]:
    """Split a comma-chained ``rollout_rs`` into its options: aliases mapped, duplicates dropped, order kept."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError(
            f"rollout_rs must be a non-empty string of comma-separated options, got {rollout_rs!r}; "
            f"accepted: {', '.join(ROLLOUT_RS_MODES)}"
        )
    options: list[str] = []
    for part in (p.strip() for p in rollout_rs.split(",")):
        if not part:
            continue
        option = ROLLOUT_RS_ALIASES.get(part, part)
        if option not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option {part!r}; accepted: {', '.join(ROLLOUT_RS_MODES)} "
                f"(aliases: {', '.join(f'{k}={v}' for k, v in ROLLOUT_RS_ALIASES.items())})"
            )
        if option not in options:
            options.append(option)
    return options


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {text!r} is not a number") from exc


def parse_rollout_is_threshold(spec: Threshold) -> tuple[float, float | None]:
    """``(upper, lower)`` of an IS threshold: a number (TIS, lower None) or ``"lower_upper"`` (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            low_text, up_text = text.split("_", 1)
            lower = _number(low_text, "rollout_is_threshold lower bound")
            upper = _number(up_text, "rollout_is_threshold upper bound")
        else:
            upper = _number(text, "rollout_is_threshold")
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold upper bound must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold lower bound must be in (0, upper={upper}], got {lower}")
    return upper, lower


def parse_rollout_rs_thresholds(
    options: list[str], spec: Threshold | None
) -> dict[str, tuple[float | None, float]]:
    """Per option ``(lower, upper)`` ratio bounds (k1; lower None elsewhere) from a threshold spec."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set, e.g. 2.0 or '0.5_2.0'")
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    entries = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(entries) == 1:
        entries = entries * len(options)
    if not entries or len(entries) != len(options):
        raise ValueError(
            f"rollout_rs_threshold {spec!r} must hold one threshold for all options or one per option "
            f"({len(options)}: {', '.join(options)})"
        )
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, entry in zip(options, entries):
        what = f"rollout_rs_threshold of {option}"
        if option.endswith("k1"):
            if "_" in entry:
                low_text, up_text = entry.split("_", 1)
                lower, upper = _number(low_text, what), _number(up_text, what)
            else:
                upper = _number(entry, what)
                lower = 1.0 / upper if upper > 0 else upper
            if not (lower > 0 and upper > 0):
                raise ValueError(f"{what} must be positive ratio bounds, got {entry!r}")
            if lower > upper:
                raise ValueError(f"{what} must have lower <= upper, got {entry!r}")
            bounds[option] = (lower, upper)
        else:
            if "_" in entry:
                raise ValueError(
                    f"{what} takes a single upper bound (k2/k3 have no lower bound), got {entry!r}"
                )
            upper = _number(entry, what)
            if not upper > 0:
                raise ValueError(f"{what} must be > 0, got {entry!r}")
            bounds[option] = (None, upper)
    return bounds


def _check_shapes(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> None:
    if log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(response_mask.shape)} must have the "
            "same shape (batch, response_length)"
        )


@torch.no_grad()
def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: Threshold = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IS weights (B, T), zero on padding, and their metrics (``compute_is_metrics``).

    ``"token"``: ``r`` per token; ``"sequence"``: ``exp(sum of the row's valid log-ratios)`` on each token.
    A number truncates (TIS); ``"lower_upper"`` zeroes weights outside the bounds (IcePop, plus the metric
    ``rollout_is_oob_ratio``). ``rollout_is_batch_normalize`` divides by the mean weight of THIS batch (per
    token, or per valid sequence), reported as ``rollout_is_batch_norm_factor``; unlike verl there is no
    all-reduce over data-parallel ranks (the trainer calls this once, on the whole batch).
    """
    if rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(
            f"Invalid rollout_is {rollout_is!r}; accepted: {ROLLOUT_IS_MODES} (None disables IS)"
        )
    _check_shapes(log_ratio, response_mask)
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        for_metrics = log_ratio  # (B, T)
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(torch.clamp(for_metrics, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = compute_is_metrics(weights, raw, for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_valid = (mask.sum(dim=-1) > 0).to(weights.dtype)  # (B,)
            mean = masked_sum(masked_mean(weights, mask, axis=-1), seq_valid) / seq_valid.sum().clamp(
                min=1e-8
            )
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor.detach()
    return weights.detach(), metrics


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row max over valid tokens (B,); 0 for a fully masked row."""
    filled = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)


@torch.no_grad()
def _apply_option(
    option: str,
    stat: torch.Tensor,  # (B, T): the option's statistic per token (a sequence's repeated over its tokens)
    seq_stat: torch.Tensor | None,  # (B,) for sequence-level options
    bound: tuple[float | None, float],
    response_mask: torch.Tensor,
    seq_valid: torch.Tensor,
    metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """What one rejection option keeps (B, T bool); its metrics go into ``metrics``."""
    lower, upper = bound
    is_k1 = lower is not None
    # k1 bounds are ratio bounds; compare in log space. k2/k3 bounds are on the statistic itself.
    low_stat = math.log(lower) if is_k1 else 0.0
    high_stat = math.log(upper) if is_k1 else upper
    keep = stat <= high_stat
    if is_k1:
        keep = keep & (stat >= low_stat)
    metrics.update(
        compute_rs_metrics(
            option,
            stat,
            response_mask,
            seq_valid,
            level="token" if seq_stat is None else "sequence",
            per_sequence_values=seq_stat,
            rollout_rs_threshold=high_stat,
            rollout_rs_threshold_lower=low_stat,
            apply_lower_threshold=is_k1,
        )
    )
    rejected = response_mask.bool() & ~keep
    metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(
        rejected.float(), response_mask.to(stat.dtype)
    )
    metrics[f"rollout_rs_{option}_seq_masked_fraction"] = masked_mean(rejected.any(dim=-1).float(), seq_valid)
    return keep


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Threshold | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Response mask (B, T) with the tokens or sequences that fail any ``rollout_rs`` option set to 0.

    k1 options keep ``log(lower) <= k1 <= log(upper)`` (k1 = ``-log r`` per token, or its per-sequence
    sum/mean), k2/k3 options keep ``statistic <= upper``. The mask keeps ``response_mask``'s dtype.
    Metrics: per option ``rollout_rs_<option>_*`` (``compute_rs_metrics``) plus ``_masked_fraction`` (valid
    tokens rejected) and ``_seq_masked_fraction`` (valid sequences with a rejected token); overall
    ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction`` (over valid sequences).
    """
    _check_shapes(log_ratio, response_mask)
    options = normalize_rollout_rs(rollout_rs)
    bounds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    mask = response_mask.to(log_ratio.dtype)
    token_valid = response_mask.bool()
    seq_valid = token_valid.any(dim=-1)  # (B,)
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}  # (B, T) each
    reduce = {
        "seq_sum": lambda v: masked_sum(v, mask, axis=-1),
        "seq_mean": lambda v: masked_mean(v, mask, axis=-1),
        "seq_max": lambda v: _seq_max(v, mask),
    }
    keep_all = torch.ones_like(token_valid)
    metrics: dict[str, torch.Tensor] = {}
    for option in options:
        level_name, estimator = option.rsplit("_", 1)
        if level_name == "token":
            stat, seq_stat = per_token[estimator], None
        else:
            seq_stat = reduce[level_name](per_token[estimator])  # (B,)
            stat = seq_stat.unsqueeze(-1).expand_as(log_ratio)
        keep = _apply_option(option, stat, seq_stat, bounds[option], response_mask, seq_valid, metrics)
        keep_all = keep_all & keep
    rejected = token_valid & ~keep_all
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = masked_mean(rejected.any(dim=-1).float(), seq_valid)
    modified = response_mask * keep_all.to(response_mask.dtype)
    return modified, {key: value.detach() for key, value in metrics.items()}


@torch.no_grad()
def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: Threshold | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: Threshold | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """IS weights (or None), the response mask after rejection, and ``rollout_corr/``-prefixed metrics.

    ``rollout_is=None`` (or ``rollout_is_threshold=None``) skips the weights and ``rollout_rs=None`` the
    rejection; the off-policy metrics are always computed. Unlike verl, the weights are a plain (B, T)
    tensor (verl wraps them in a DataProto under ``rollout_is_weights``).
    """
    if not (old_log_prob.shape == rollout_log_prob.shape == response_mask.shape):
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must share the shape (batch, response_length), got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise ValueError("rollout_rs is set but rollout_rs_threshold is None; set it, e.g. 2.0 or '0.5_2.0'")
    log_ratio = old_log_prob - rollout_log_prob  # (B, T) log r
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    modified_mask = response_mask.clone()
    if rollout_rs is not None:
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, modified_mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}
