"""KL penalties between the policy and the reference, KL controllers, and KL-in-reward shaping.

Names follow verl's ``core_algos``: ``kl_penalty(logprob, ref_logprob, kl_penalty)``, ``kl_penalty_forward``,
``FixedKLController``, ``AdaptiveKLController``, ``get_kl_controller`` and ``compute_rewards``. The estimators
are J. Schulman's (http://joschu.net/blog/kl-approx.html), per token, for samples drawn from the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.utils.torch_functional import masked_mean

logger = logging.getLogger(__name__)

_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
VALID_KL_PENALTIES = _KL_NAMES + tuple(f"{name}+" for name in _KL_NAMES)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)`` for one of kl/k1, abs, mse/k2, low_var_kl/k3 (no ``+`` suffix)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        # k3 = exp(d) - d - 1 with d = log(ref / pi): unbiased and always >= 0. d is clamped so exp cannot
        # overflow where the two policies disagree wildly, and the result is clamped so a single token
        # cannot dominate the loss (verl's bounds).
        d = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    if kl_penalty == "full":
        raise ValueError(
            "kl_penalty='full' (exact KL over the vocabulary) is not supported; use 'low_var_kl'"
        )
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(VALID_KL_PENALTIES)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)``; a ``+`` suffix (``k3+``) keeps the value but takes the gradient of k2.

    k1 and k3 are unbiased for the KL's value but their gradients are not unbiased for the KL's gradient;
    k2's gradient is, so the straight-through variants use k2 for backward and the named estimator forward.
    """
    if kl_penalty not in (*VALID_KL_PENALTIES, "full", "full+"):
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(VALID_KL_PENALTIES)}")
    straight_through = kl_penalty.endswith("+")
    forward = kl_penalty_forward(logprob, ref_logprob, kl_penalty.removesuffix("+"))
    if not straight_through:
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    # value == forward, d/dlogprob == d(k2)/dlogprob
    return backward - backward.detach() + forward.detach()


_kl_penalty = kl_penalty  # ``compute_kl_in_reward``'s argument of the same name shadows the function


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """Token rewards with a k1 KL penalty: ``scores - kl_ratio * (old_log_prob - ref_log_prob)`` (verl)."""
    return token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)


def compute_kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL-in-reward: ``(token_level_rewards (B, T), mean per-sequence KL)`` as verl's ``apply_kl_penalty``.

    The second value is the ``actor/reward_kl_penalty`` metric and the ``current_kl`` to pass to the KL
    controller's ``update``: the masked token mean of each row, averaged over the rows.
    """
    kld = _kl_penalty(old_log_prob, ref_log_prob, kl_penalty)  # (B, T)
    kld = torch.where(response_mask.bool(), kld, 0.0)
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()  # (B,) -> scalar
    return token_level_rewards, float(current_kl)


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        """Return the controller state for a checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore the state written by ``state_dict``."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    After each update the coefficient moves by ``e * n_steps / horizon`` with the proportional error
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``: up when the KL is above target, down when below.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs horizon > 0, got {horizon}; set kl_ctrl.horizon (e.g. 10000)"
            )
        if target_kl <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0, got {target_kl}; set kl_ctrl.target_kl"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Scale ``value`` by ``1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Return the controller state for a checkpoint."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore the state written by ``state_dict``."""
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def _field(kl_ctrl: Any, key: str, default: Any = None) -> Any:
    value = kl_ctrl.get(key, default) if isinstance(kl_ctrl, Mapping) else getattr(kl_ctrl, key, default)
    return default if value is None else value


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller from an attribute object or Mapping with type, kl_coef, target_kl, horizon."""
    kind = _field(kl_ctrl, "type", "fixed")
    kl_coef = _field(kl_ctrl, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kind == "adaptive":
        horizon = _field(kl_ctrl, "horizon", 10000)
        target_kl = _field(kl_ctrl, "target_kl", 0.1)
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")
