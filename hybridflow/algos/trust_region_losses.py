"""Policy losses that change how PPO keeps the update near the old policy (its trust region), verl's names.

PPO's own clipped surrogate is ``policy_loss.compute_policy_loss_vanilla``; these replace or refine its clip:
GSPO clips the sequence's length-normalised ratio; Clip-Cov drops the gradient of a few tokens whose advantage
and log-prob covary most, KL-Cov penalises their log-ratio instead; CISPO clips the ratio as a stop-gradient
weight, so clipped tokens keep their gradient; DPPO (TV and KL) drops the tokens whose probability moved too
far by a divergence; SAPO replaces the clip by a soft gate; GMPO (``geo_mean``) clips the geometric mean of
the token ratios; DRO penalises the squared log-ratio. Same signature, registry (``POLICY_LOSS_REGISTRY``) and
metric keys as ``policy_loss``; the knobs they read (``clip_ratio*``, ``clip_ratio_c``, ``clip_cov_*``,
``kl_cov_ratio``, ``ppo_kl_coef``, ``tau_pos``, ``tau_neg``, ``dro_beta``) come from ``config`` through
``get_config_value``, with verl's defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algos.aggregation import agg_loss
from hybridflow.algos.policy_loss import (
    _apply_is_weights,
    _clamped_log_ratio,
    _clip_range,
    _global_batch_info,
    _metrics,
    get_config_value,
)
from hybridflow.algos.registry import register_policy_loss
from hybridflow.utils.torch_functional import masked_mean, masked_sum


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv 2507.18071): PPO clip on the per-sequence length-normalised ratio, aggregated by ``loss_agg_mode``.

    ``loss_agg_mode`` is honoured, as issue 32 states for verl 0.9.1 (the trainer passes the actor's mode,
    token-mean by default); verl up to 0.9.0 always used seq-mean-token-mean, the paper's sequence
    average: pass ``loss_agg_mode="seq-mean-token-mean"`` for those numbers.
    """
    clip_low, clip_high = _clip_range(config)
    neg_kl = log_prob - old_log_prob  # (B, T)
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)  # (B,)
    neg_kl_seq = masked_sum(neg_kl, response_mask, axis=-1) / seq_lengths  # (B,) log s_i

    # s_i,t = sg[s_i] * pi_t / sg[pi_t]: the value of the sequence ratio, the gradient of each token's ratio.
    log_seq_ratio = log_prob - log_prob.detach() + neg_kl_seq.detach().unsqueeze(-1)  # (B, T)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = _apply_is_weights(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))

    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-neg_kl, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, None)


def _clip_cov_mask(
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    clipped: torch.Tensor,
    config: Any,
) -> torch.Tensor:
    """(B, T) float mask, 0 on the randomly chosen high-covariance tokens whose gradient Clip-Cov drops."""
    clip_cov_ratio = get_config_value(config, "clip_cov_ratio")
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0 (fraction of tokens to detach), got {clip_cov_ratio}")
    lb, ub = get_config_value(config, "clip_cov_lb"), get_config_value(config, "clip_cov_ub")
    with torch.no_grad():
        valid = response_mask.bool()
        lp = log_prob.detach()
        cov = (advantages - masked_mean(advantages, response_mask)) * (lp - masked_mean(lp, response_mask))
        candidates = valid & ~clipped & (cov > lb) & (cov < ub)  # (B, T)
        idx = candidates.reshape(-1).nonzero(as_tuple=True)[0]
        clip_num = max(int(clip_cov_ratio * int(valid.sum())), 1)
        if idx.numel() > clip_num:  # pick at random among candidates (torch's global RNG, as in verl)
            idx = idx[torch.randperm(idx.numel(), device=idx.device)[:clip_num]]
        corr = torch.ones(advantages.numel(), dtype=log_prob.dtype, device=log_prob.device)
        corr[idx] = 0.0
    return corr.reshape(advantages.shape)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (arXiv 2505.22617): PPO clip, plus zero gradient on a few tokens with cov(A, logp) in (lb, ub)."""
    clip_low, clip_high = _clip_range(config)
    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = (pg_losses2 > pg_losses1) & response_mask.bool()
    corr = _clip_cov_mask(advantages, log_prob, response_mask, clipped, config)  # (B, T)
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)

    pg_losses = _apply_is_weights(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, None)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (arXiv 2505.22617): unclipped ``-A * ratio``, plus ``ppo_kl_coef * |log ratio|`` on top-cov tokens.

    As in verl, ``actor/ppo_kl`` here is the mean ABSOLUTE log-ratio.
    """
    kl_cov_ratio = get_config_value(config, "kl_cov_ratio")
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0 (fraction of tokens to penalise), got {kl_cov_ratio}")
    ppo_kl_coef = get_config_value(config, "ppo_kl_coef")

    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    abs_kl = neg_kl.abs()
    ratio = torch.exp(neg_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = pg_losses1 + ppo_kl_coef * abs_kl

    with torch.no_grad():
        valid = response_mask.bool()
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        valid_idx = valid.reshape(-1).nonzero(as_tuple=True)[0]
        if valid_idx.numel() > 0:
            adv_v = advantages.reshape(-1)[valid_idx].float()
            lp_v = log_prob.detach().reshape(-1)[valid_idx].float()
            cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())  # plain means over the valid tokens
            k = max(1, int(valid_idx.numel() * kl_cov_ratio))
            selected[valid_idx[torch.topk(cov, k).indices]] = True
        selected = selected.reshape(valid.shape)

    pg_losses = _apply_is_weights(torch.where(selected, pg_losses_kl, pg_losses1), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    return pg_loss, _metrics(None, masked_mean(abs_kl, response_mask), None)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (arXiv 2506.13585): ``-sg(clip(ratio)) * A * log_prob``; clipped tokens keep their gradient."""
    clip_low, clip_high = _clip_range(config)
    neg_kl = _clamped_log_ratio(old_log_prob, log_prob)  # (B, T)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    # Stop-gradient on the weight: the gradient flows only through log_prob, scaled by the clipped ratio.
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)

    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global_batch_info(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, None)


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
