"""Shared pieces of the advantage estimators: the name enum, the registry, config lookup, group statistics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import numpy as np
import torch

from hybridflow.utils.torch_functional import masked_sum

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AdvantageEstimator(str, Enum):
    """Names of the built-in advantage estimators (the values of ``algorithm.adv_estimator``)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageFn] = {}


def _estimator_name(name_or_enum: str | Enum) -> str:
    if isinstance(name_or_enum, Enum):
        return str(name_or_enum.value)
    if isinstance(name_or_enum, str):
        return name_or_enum
    raise TypeError(f"an advantage estimator name must be a str or AdvantageEstimator, got {name_or_enum!r}")


def same_definition(a: Callable, b: Callable) -> bool:
    """Whether two functions are one source definition (same module and qualified name), or the same."""
    if a is b:
        return True
    key = (getattr(a, "__module__", None), getattr(a, "__qualname__", None))
    return key[1] is not None and key == (getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``name_or_enum`` (a valid algorithm.adv_estimator).

    Another function under a taken name is refused, unless it is the same definition run again (same
    module and qualified name: a module executed again after its import failed, a notebook cell run again),
    which replaces the earlier one.
    """
    name = _estimator_name(name_or_enum)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and not same_definition(existing, fn):
            raise ValueError(
                f"advantage estimator {name!r} is already registered to {existing.__module__}."
                f"{existing.__qualname__}; register {fn.__qualname__} under a different name"
            )
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> AdvantageFn:
    """Return the advantage estimator registered under ``name_or_enum``."""
    name = _estimator_name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {', '.join(sorted(ADV_ESTIMATOR_REGISTRY))} "
            "(add your own with @register_adv_est(name))"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


# ----------------------------------------------------------------------------------------------- helpers


def _config_value(config: Any, key: str, default: Any) -> Any:
    """Read ``key`` from an attribute object or a Mapping; ``default`` when absent or None."""
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def _resolve(explicit: Any, config: Any, key: str, default: Any) -> Any:
    return explicit if explicit is not None else _config_value(config, key, default)


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    # Statistics in at least float32: bf16 means and stds over a group are too coarse.
    return torch.promote_types(t.dtype, torch.float32)


def _check_shapes(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **others: Any) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (batch, response_length), got {tuple(token_level_rewards.shape)}"
        )
    for name, t in {"response_mask": response_mask, **others}.items():
        if t is not None and tuple(t.shape) != tuple(token_level_rewards.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but token_level_rewards has {tuple(token_level_rewards.shape)}"
            )


def _outcome_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per-row outcome score ``(B,)`` and the ``(B,)`` bool of rows with at least one valid token."""
    _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards.to(_work_dtype(token_level_rewards)), response_mask, axis=-1)
    return scores, response_mask.sum(dim=-1) > 0


def _group_ids(index: Any, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map the per-sample uids to group ids ``(B,)`` in ``[0, G)``; returns the ids and G."""
    if index is None:
        raise ValueError(
            "this advantage estimator groups samples by prompt: pass index=<numpy array of one uid per sample> "
            "(the batch's non-tensor 'uid' field)"
        )
    uids = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    uids = uids.reshape(-1)
    if uids.shape[0] != batch_size:
        raise ValueError(f"index has {uids.shape[0]} uids but the batch has {batch_size} samples")
    try:
        _, inverse = np.unique(uids, return_inverse=True)
    except TypeError:  # uids of mixed, unorderable types: number them by first appearance instead
        first_seen: dict[Any, int] = {}
        inverse = np.array([first_seen.setdefault(u, len(first_seen)) for u in uids.tolist()], dtype=np.int64)
    group = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return group, (int(group.max()) + 1 if batch_size else 0)


def _group_stats(
    scores: torch.Tensor, valid: torch.Tensor, group: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group count, mean and unbiased (N-1) std over the valid rows, each ``(G,)``."""
    weight = valid.to(scores.dtype)  # (B,)
    count = scores.new_zeros(num_groups).index_add_(0, group, weight)
    # Average the offsets from the group's smallest score rather than the raw scores: a group of equal
    # scores then gets a mean equal to that score bit for bit, so its deviations and std are exactly 0
    # (summing 0.1 + 0.1 + 0.1 and dividing by 3 does not give 0.1 back, and the ~1e-8 residue divided by
    # std + 1e-6 would be a spurious advantage).
    lowest = torch.where(valid, scores, torch.inf)
    ref = scores.new_full((num_groups,), torch.inf).scatter_reduce(0, group, lowest, "amin")
    ref = torch.where(count > 0, ref, 0.0)  # (G,)
    offsets = (scores - ref[group]) * weight
    mean = ref + scores.new_zeros(num_groups).index_add_(0, group, offsets) / count.clamp(min=1)
    # Two-pass variance (sum of squared deviations), not E[x^2] - E[x]^2, which cancels badly.
    sq_dev = (scores - mean[group]).square() * weight
    var = scores.new_zeros(num_groups).index_add_(0, group, sq_dev) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread a ``(B,)`` scalar over the valid tokens of each row: ``(B, T)``, zero outside the mask."""
    return torch.where(response_mask.bool(), per_row.unsqueeze(-1), 0.0)


def _masked(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), values, 0.0)


def _grpo_scalar(
    scores: torch.Tensor,
    valid: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    epsilon: float,
    norm: bool,
) -> torch.Tensor:
    """GRPO per-row advantage ``(B,)``; a group of one has mean 0 and std 1 (verl), so a = s."""
    count, mean, std = _group_stats(scores, valid, group, num_groups)
    lone = count < 2
    mean = torch.where(lone, 0.0, mean)
    std = torch.where(lone, 1.0, std)
    adv = scores - mean[group]
    if norm:
        adv = adv / (std[group] + epsilon)  # all-equal rewards: 0 / (0 + eps) = 0, never NaN
    return adv


# -------------------------------------------------------------------------------------------- estimators
