"""Policy-gradient losses with verl's names, signatures and metrics: PPO's clipped surrogate (``vanilla``), the
plain policy gradients without a ratio (``gpg``, ``reinforce``), verl's bypass mode, and the entropy bonus; the
knobs every policy loss reads (``PolicyLossConfig``) and the pieces they share. The losses that replace or
refine PPO's clip are in ``trust_region_losses``; the registry they all join is ``registry``.

Every loss has verl's signature ``(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode="token-mean", config=None, rollout_is_weights=None)`` with ``(B, T)`` tensors and returns
``(pg_loss, pg_metrics)``: the scalar loss and a dict with ``actor/pg_clipfrac``, ``actor/ppo_kl`` and
``actor/pg_clipfrac_lower``. Metric values are detached 0-dim tensors, not floats: converting them costs
a device-to-host sync, which the trainer does once per step rather than once per micro-batch (``float(v)``
or ``v.item()``).

``config`` may be a ``PolicyLossConfig``, verl's ``ActorConfig`` (``policy_loss`` and
``global_batch_info`` sub-objects), any object with attributes, a Mapping, or None; missing or None
knobs fall back to the ``PolicyLossConfig`` defaults, which are verl's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.algos.aggregation import LOSS_AGG_MODES, agg_loss
from hybridflow.algos.registry import (  # noqa: F401 (POLICY_LOSS_REGISTRY, get_policy_loss_fn: re-exported)
    POLICY_LOSS_REGISTRY,
    get_policy_loss_fn,
    register_policy_loss,
)
from hybridflow.algos.rollout_correction import compute_rollout_correction_and_rejection_mask
from hybridflow.utils.torch_functional import entropy_from_logits, masked_mean

# exp() of a log-ratio beyond +-20 overflows float16/bfloat16 ranges and is meaningless as a ratio anyway.
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Every knob the policy losses read, with verl's defaults.

    ``clip_ratio_low``/``clip_ratio_high`` of None mean ``clip_ratio``. ``dro_beta`` (DRO's penalty, required
    by ``dro``), ``tau_pos``/``tau_neg`` (SAPO's gate temperatures) and ``rollout_correction`` (the settings
    ``bypass_mode`` reads: ``loss_type``, ``rollout_is``, ``rollout_rs`` and their thresholds, as an object
    or a Mapping) are verl 0.9.1's. The last four fields are the
    global-batch counts of ``agg_loss``: build one config per mini-batch with ``dataclasses.replace``.
    ``loss_agg_mode`` is for the caller: the losses use their ``loss_agg_mode`` argument, as in verl.
    """

    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_correction: Any = None
    dp_size: int = 1
    batch_num_tokens: int | float | torch.Tensor | None = None
    global_batch_size: int | float | torch.Tensor | None = None
    loss_scale_factor: int | float | None = None

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"clip_ratio_c (dual-clip bound) must be > 1.0, got {self.clip_ratio_c}; the default is 3.0"
            )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"Invalid loss_agg_mode {self.loss_agg_mode!r}; valid modes are {LOSS_AGG_MODES}"
            )
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (a fraction of tokens), got {getattr(self, name)}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(PolicyLossConfig)}
_MISSING = object()


def _lookup(source: Any, name: str) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, _MISSING)
    return getattr(source, name, _MISSING)


def get_config_value(config: Any, name: str) -> Any:
    """Read knob ``name`` from ``config``, then its ``policy_loss`` and ``global_batch_info`` parts, else the default."""
    if name not in _DEFAULTS:
        raise KeyError(f"unknown policy-loss knob {name!r}; known knobs are {sorted(_DEFAULTS)}")
    if config is not None:
        for source in (config, _lookup(config, "policy_loss"), _lookup(config, "global_batch_info")):
            if source is _MISSING or source is None:
                continue
            value = _lookup(source, name)
            if value is not _MISSING and value is not None:
                return value
    return _DEFAULTS[name]


def _global_batch_info(config: Any) -> dict[str, Any]:
    keys = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
    return {key: get_config_value(config, key) for key in keys}


def _clip_range(config: Any) -> tuple[float, float]:
    clip_ratio = get_config_value(config, "clip_ratio")
    low = get_config_value(config, "clip_ratio_low")
    high = get_config_value(config, "clip_ratio_high")
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def _apply_is_weights(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Multiply per-token losses by rollout importance weights (expected detached, see rollout_correction)."""
    if rollout_is_weights is None:
        return pg_losses
    if rollout_is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"rollout_is_weights {tuple(rollout_is_weights.shape)} must match the per-token loss "
            f"{tuple(pg_losses.shape)}, i.e. (batch, response_length)"
        )
    return pg_losses * rollout_is_weights


def _metrics(
    pg_clipfrac: torch.Tensor | None, ppo_kl: torch.Tensor, pg_clipfrac_lower: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """verl's three actor metrics as detached 0-dim tensors; a loss without clipping reports 0."""
    zero = torch.zeros((), dtype=ppo_kl.dtype, device=ppo_kl.device)
    return {
        "actor/pg_clipfrac": (zero if pg_clipfrac is None else pg_clipfrac).detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": (zero if pg_clipfrac_lower is None else pg_clipfrac_lower).detach(),
    }


def _clamped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)  # (B, T)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip (``clip_ratio_c``) for A < 0."""
    clip_low, clip_high = _clip_range(config)
    clip_ratio_c = get_config_value(config, "clip_ratio_c")
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}; the default is 3.0"
        )

    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)

    # Dual clip: for A < 0 a huge ratio would give an unbounded loss; cap it at -A * c (no gradient there).
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    lower_clipped = (clip_pg_losses1 > pg_losses3) & (advantages < 0)
    pg_clipfrac_lower = masked_mean(lower_clipped.float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (arXiv 2504.02546): plain policy gradient ``-A * log_prob``, no ratio and no clipping."""
    pg_losses = _apply_is_weights(-advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    ppo_kl = masked_mean(-_clamped_log_ratio(old_log_prob, log_prob), response_mask)
    return pg_loss, _metrics(None, ppo_kl, None)


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE ``-w * A * log_prob`` with optional (truncated) IS weights ``w``; no ratio, no clipping.

    verl names the first argument ``rollout_log_prob`` (its bypass mode); here it is ``old_log_prob`` like
    every registered loss, and is used only for ``actor/ppo_kl``. verl's default aggregation is kept.
    """
    pg_losses = _apply_is_weights(-advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    ppo_kl = masked_mean(-_clamped_log_ratio(old_log_prob, log_prob), response_mask)
    return pg_loss, _metrics(None, ppo_kl, None)


def _setting(source: Any, name: str, default: Any) -> Any:
    return source.get(name, default) if isinstance(source, Mapping) else getattr(source, name, default)


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's bypass mode: ``old_log_prob`` IS the rollout's; IS weights and rejection computed here.

    Reads ``config``'s ``rollout_correction`` (``loss_type`` "ppo_clip" or "reinforce", ``rollout_is``,
    ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``).
    The weights and the rejection mask compare the current ``log_prob`` (detached) with the rollout's.
    ``ppo_clip``: vanilla PPO on the rejection mask without IS weights (the ratio already is pi / pi_rollout);
    ``reinforce``: ``-w * A * log_prob`` with the computed weights. The passed ``rollout_is_weights`` are
    ignored; the ``rollout_corr/`` metrics join the loss metrics.
    """
    rc = get_config_value(config, "rollout_correction")
    if rc is None:
        raise ValueError(
            "loss_mode 'bypass_mode' needs the rollout-correction settings: pass a config whose "
            "rollout_correction (or policy_loss.rollout_correction) holds loss_type, rollout_is, rollout_rs, ..."
        )
    loss_type = _setting(rc, "loss_type", "ppo_clip") or "ppo_clip"
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            f"Invalid rollout_correction.loss_type {loss_type!r}; accepted: 'ppo_clip', 'reinforce'"
        )
    with torch.no_grad():
        weights, effective_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
            log_prob.detach(),
            old_log_prob,
            response_mask,
            rollout_is=_setting(rc, "rollout_is", None),
            rollout_is_threshold=_setting(rc, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(_setting(rc, "rollout_is_batch_normalize", False)),
            rollout_rs=_setting(rc, "rollout_rs", None),
            rollout_rs_threshold=_setting(rc, "rollout_rs_threshold", None),
        )
    if loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, weights
        )
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, None
        )
    metrics.update(rc_metrics)
    return pg_loss, metrics


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregated entropy of ``logits`` ``(B, T, V)`` over ``response_mask`` ``(B, T)`` (pass the global counts)."""
    token_entropy = entropy_from_logits(logits)  # (B, T) float32, chunked over rows
    return agg_loss(
        token_entropy,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
