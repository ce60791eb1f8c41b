"""Offline preference losses: DPO (sigmoid, with cDPO label smoothing), IPO and KTO, and their metrics.

Every loss takes per-sequence log-probs, one value per completion (``sequence_logps`` turns per-token
log-probs into them), and returns a per-example loss the caller reduces. Conventions follow the papers and
TRL's trainers:

- DPO (Rafailov et al. 2023): ``h = (pi_c - pi_r) - (ref_c - ref_r)``, loss ``-logsigmoid(beta h)``.
- cDPO (label smoothing eps, the chance a label is flipped):
  ``-(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)``.
- IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, where ``h`` is built from per-sequence *average*
  log-probs (``sequence_logps(..., average=True)``), as TRL does; the caller passes averaged log-probs.
- KTO (Ethayarajh et al. 2024): ``z0`` is the policy/reference KL estimated on mismatched
  (prompt_i, completion_j) pairs, clamped at 0 and detached; desirable examples pay
  ``w_d (1 - sigmoid(beta (r - z0)))``, undesirable ones ``w_u (1 - sigmoid(beta (z0 - r)))`` with
  ``r = pi - ref``.

Implicit rewards are ``beta * (pi - ref)``, detached: they are reported, never differentiated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.utils.torch_functional import masked_mean, masked_sum

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob ``(B,)``: the masked sum of token log-probs, or their masked mean (IPO)."""
    if token_logps.shape != mask.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and mask {tuple(mask.shape)} must match")
    if average:
        return masked_mean(token_logps, mask, axis=-1)  # (B,)
    return masked_sum(token_logps, mask, axis=-1)  # (B,)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected 1-D tensors of one shape (one value per example), got {shapes}")


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO / cDPO / IPO loss per pair ``(P,)`` and the detached implicit rewards of chosen and rejected.

    Inputs are per-sequence log-probs ``(P,)`` for P pairs: summed for ``sigmoid``, averaged over the
    completion's tokens for ``ipo`` (``sequence_logps(..., average=True)``).
    """
    _check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type != "sigmoid" and label_smoothing > 0:
        raise ValueError(
            f"label_smoothing (cDPO) applies to loss_type='sigmoid' only; set it to 0 for {loss_type!r}"
        )
    # The reference log-probs are constants of the objective even if the caller forgot to detach them.
    ref_chosen_logps, ref_rejected_logps = ref_chosen_logps.detach(), ref_rejected_logps.detach()
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # (P,)
    if loss_type == "sigmoid":
        # logsigmoid is the stable form of log(1 / (1 + exp(-x))): no overflow for large |beta h|.
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2  # (P,)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()  # (P,)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()  # (P,)
    return losses, chosen_rewards, rejected_rewards


def kto_kl_estimate(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: mean of (policy - ref) over mismatched pairs, clamped at 0, detached (scalar).

    With several data-parallel ranks, the paper's estimate is the mean over the global batch: all-reduce
    the sum and the count of ``policy_kl_logps - ref_kl_logps`` across ranks before dividing.
    """
    _check_same_shape(policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    if policy_kl_logps.numel() == 0:
        raise ValueError("kto_kl_estimate needs at least one mismatched (prompt, completion) pair")
    return (policy_kl_logps - ref_kl_logps).detach().mean().clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl_estimate: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO loss per example ``(M,)`` and the detached implicit rewards ``(M,)``; ``labels`` True = desirable."""
    _check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, labels=labels)
    _check_beta(beta)
    if labels.dtype != torch.bool:
        raise TypeError(f"labels must be a bool tensor (True = desirable), got {labels.dtype}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight}, "
            f"{undesirable_weight}"
        )
    z0 = torch.as_tensor(kl_estimate, dtype=policy_logps.dtype, device=policy_logps.device)
    # z0 is a baseline, not a path for gradients (the paper and TRL both detach it); clamp as the paper does.
    z0 = z0.detach().clamp(min=0)
    logratio = policy_logps - ref_logps.detach()  # (M,)
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0)))  # (M,)
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio)))  # (M,)
    losses = torch.where(labels, desirable, undesirable)  # (M,)
    return losses, beta * logratio.detach()


def preference_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, float]:
    """TRL's DPO metrics, means over pairs: rewards/{chosen,rejected,accuracies,margins}, logps/{...}."""
    _check_same_shape(
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
    )
    if chosen_rewards.numel() == 0:
        raise ValueError("preference_metrics needs at least one pair")
    chosen_rewards, rejected_rewards = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        # A tie is not a win: the chosen reward has to be strictly higher.
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": chosen_logps.detach().float().mean().item(),
        "logps/rejected": rejected_logps.detach().float().mean().item(),
    }


def kto_metrics(rewards: torch.Tensor, logps: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """KTO metrics: reward and log-prob means of desirable ('chosen') and undesirable ('rejected') examples.

    A side with no example in the batch reports 0.0; ``rewards/margins`` is chosen minus rejected.
    """
    _check_same_shape(rewards=rewards, logps=logps, labels=labels)
    if labels.dtype != torch.bool:
        raise TypeError(f"labels must be a bool tensor (True = desirable), got {labels.dtype}")
    rewards, logps = rewards.detach().float(), logps.detach().float()

    def side_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
        return values[mask].mean().item() if bool(mask.any()) else 0.0

    chosen, rejected = side_mean(rewards, labels), side_mean(rewards, ~labels)
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": side_mean(logps, labels),
        "logps/rejected": side_mean(logps, ~labels),
    }
