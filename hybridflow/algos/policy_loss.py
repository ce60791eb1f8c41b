"""Policy-gradient losses with verl's names, signatures and metrics, plus their registry.

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
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridflow.algos.advantage_base import same_definition
from hybridflow.algos.aggregation import LOSS_AGG_MODES, agg_loss
from hybridflow.utils.torch_functional import entropy_from_logits, masked_mean, masked_sum

logger = logging.getLogger(__name__)

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


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``, a valid loss_mode (a later one replaces it)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        previous = POLICY_LOSS_REGISTRY.get(name)
        if previous is not None and not same_definition(previous, fn):  # the same one run again: no news
            logger.warning("policy loss %r re-registered: %s replaces %s", name, fn, previous)
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Return the policy loss registered under ``name``."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"Unsupported policy loss mode {name!r}. Registered modes are {sorted(POLICY_LOSS_REGISTRY)}; "
            "add your own with @register_policy_loss(name)."
        )
    return POLICY_LOSS_REGISTRY[name]


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
