"""verl 0.9.1's further policy losses: DPPO (TV and KL), SAPO, geometric-mean (GMPO), DRO and bypass mode.

Same signature, registry (``POLICY_LOSS_REGISTRY``) and metric keys as ``policy_loss``; the knobs they read
(``clip_ratio*``, ``clip_ratio_c``, ``tau_pos``, ``tau_neg``, ``dro_beta``, ``rollout_correction``) come
from ``config`` through ``get_config_value``, with verl's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.algos.aggregation import agg_loss
from hybridflow.algos.policy_loss import (
    _apply_is_weights,
    _clamped_log_ratio,
    _clip_range,
    _global_batch_info,
    _metrics,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_config_value,
    register_policy_loss,
)
from hybridflow.algos.rollout_correction import compute_rollout_correction_and_rejection_mask
from hybridflow.utils.torch_functional import masked_mean, masked_sum


def _dppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
    divergence: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary (arXiv 2602.04879): drop the gradient of tokens whose probability moved too far."""
    # clip_ratio_low/high are divergence thresholds here, not ratio offsets.
    div_low, div_high = _clip_range(config)
    clip_ratio_c = get_config_value(config, "clip_ratio_c")
    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)
    # Truncated IS (instead of a dual clip) with a stop-gradient: the gradient is -A * w * grad(log_prob).
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        if divergence == "tv":
            keep_pos = (prob - old_prob) <= div_high
            keep_neg = (prob - old_prob) >= -div_low
        else:  # KL between the Bernoulli distributions (token sampled or not) of the two policies
            binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            keep_pos = (binary_kl <= div_high) | (prob <= old_prob)
            keep_neg = (binary_kl <= div_low) | (prob >= old_prob)
        valid = torch.where(advantages > 0, keep_pos, keep_neg).to(log_prob.dtype)  # (B, T)
    pg_losses = _apply_is_weights(-advantages * truncated * log_prob * valid, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    pg_clipfrac = masked_mean(1.0 - valid, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(valid.dtype) * valid, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: ``-A * sg(min(r, c)) * log_prob`` on tokens with ``p - p_old`` inside ``[-low, high]``.

    For A > 0 a token is dropped when its probability rose by more than ``clip_ratio_high``, for A <= 0
    when it fell by more than ``clip_ratio_low`` (absolute probabilities); ``c`` = ``clip_ratio_c``.
    ``actor/pg_clipfrac`` is the dropped fraction, ``actor/pg_clipfrac_lower`` the kept-but-truncated one.
    """
    return _dppo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, "tv"
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: as ``dppo_tv`` with the binary KL ``KL(Bern(p_old) || Bern(p))`` as the divergence.

    A token moving the wrong way for its advantage's sign (p up for A > 0 beyond ``clip_ratio_high`` of
    binary KL, p down for A <= 0 beyond ``clip_ratio_low``) loses its gradient.
    """
    return _dppo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, "kl"
    )


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): ``-A * (4 / tau) * sigmoid(tau * (r - 1))``, tau_pos for A > 0, else tau_neg.

    A soft gate instead of a hard clip. As in verl 0.9.x the loss is always aggregated seq-mean-token-mean
    (``loss_agg_mode`` is ignored); no clipping, so both clip fractions are 0.
    """
    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    ratio = torch.exp(neg_kl)
    dtype, device = advantages.dtype, advantages.device
    tau_pos = torch.as_tensor(get_config_value(config, "tau_pos"), dtype=dtype, device=device)
    tau_neg = torch.as_tensor(get_config_value(config, "tau_neg"), dtype=dtype, device=device)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # (B, T)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # slope 1 at r = 1, like the plain ratio
    pg_losses = _apply_is_weights(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_global_batch_info(config))
    return pg_loss, _metrics(None, masked_mean(-neg_kl, response_mask), None)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673): ``-mean_t(A) * exp(mean_t(clipped log r))``, one term per sequence.

    Each token's log-ratio is clipped to ``[-clip_ratio_low, clip_ratio_high]`` on the side its advantage
    pushes (sign-aware, as PPO's min); the sequence ratio is the geometric mean of the token ratios and
    the advantage is the row's mean. IS weights enter as their per-row geometric mean. ``loss_agg_mode`` is
    ignored (as in verl): the loss is the mean over sequences, here over those with a valid token and with
    ``global_batch_size`` when given (verl takes ``torch.mean`` over the micro-batch's rows).
    """
    clip_low, clip_high = _clip_range(config)
    neg_kl = log_prob - old_log_prob  # (B, T); verl leaves this one unclamped
    ppo_kl = masked_mean(-neg_kl, response_mask)
    sign = torch.sign(advantages)
    clamped = torch.clamp(neg_kl, -clip_low, clip_high)
    clipped_log = sign * torch.minimum(sign * neg_kl, sign * clamped)  # (B, T)
    lengths = response_mask.sum(dim=-1) + 1e-8  # (B,)
    seq_ratio = torch.exp(masked_sum(clipped_log, response_mask, axis=-1) / lengths)  # (B,)
    seq_adv = masked_sum(advantages, response_mask, axis=-1) / lengths  # (B,)
    pg_losses = -seq_adv * seq_ratio  # (B,)
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, response_mask, axis=-1) / lengths)
    seq_valid = (response_mask.sum(dim=-1) > 0).to(pg_losses.dtype).unsqueeze(-1)  # (B, 1)
    pg_loss = agg_loss(pg_losses.unsqueeze(-1), seq_valid, "seq-mean-token-sum", **_global_batch_info(config))
    clipped = neg_kl != clamped
    pg_clipfrac = masked_mean((clipped & (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped & (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: ``-(A * log_prob - beta / 2 * (log_prob - old_log_prob)^2)`` with ``beta = dro_beta > 0``."""
    beta = get_config_value(config, "dro_beta")
    if beta is None or isinstance(beta, bool) or not beta > 0:
        raise ValueError(
            f"policy_loss.dro_beta must be a positive number when loss_mode is 'dro', got {beta!r} "
            "(e.g. dro_beta=0.1)"
        )
    log_ratio = log_prob - old_log_prob  # (B, T)
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    return pg_loss, _metrics(None, masked_mean(-log_ratio, response_mask), None)


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
