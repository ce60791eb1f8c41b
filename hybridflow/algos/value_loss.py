"""Clipped value-function loss for the PPO critic (verl's ``compute_value_loss``)."""

from __future__ import annotations

import torch

from hybridflow.algos.aggregation import agg_loss
from hybridflow.utils.torch_functional import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2))``; returns ``(vf_loss, vf_clipfrac)``.

    ``vpreds`` are the critic's new predictions, ``values`` the predictions at rollout time and
    ``returns`` the targets, all ``(B, T)``. ``vf_clipfrac`` is the fraction of valid tokens where the
    clipped term is the larger one, as a detached 0-dim tensor. The keyword-only arguments are
    ``agg_loss``'s global-batch counts (see its docstring for how micro-batches are combined).
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 (e.g. 0.5), got {cliprange_value}")
    if not (vpreds.shape == returns.shape == values.shape == response_mask.shape):
        raise ValueError(
            "vpreds, returns, values and response_mask must share the shape (batch, response_length), got "
            f"{tuple(vpreds.shape)}, {tuple(returns.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # (B, T)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(
        clipped_vf_losses,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), response_mask).detach()
    return vf_loss, vf_clipfrac
