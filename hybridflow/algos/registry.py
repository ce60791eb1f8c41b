"""The registries of advantage estimators and policy losses, under verl's names, and their lookups.

``ADV_ESTIMATOR_REGISTRY`` and ``POLICY_LOSS_REGISTRY`` are the very dicts ``get_adv_estimator_fn`` and
``get_policy_loss_fn`` read; ``@register_adv_est(name)`` and ``@register_policy_loss(name)`` write to them (the
built-ins register where they are defined: ``advantage``, ``token_baseline``, ``policy_loss``,
``trust_region_losses``). A name taken by another estimator is refused; a policy loss registered again replaces
the earlier one with a warning. The same definition run again (a module executed again, a notebook cell run
again) replaces its earlier self quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

import torch

logger = logging.getLogger(__name__)

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
