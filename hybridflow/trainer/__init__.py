"""The single controller: the dataflow of stages, the RL/SFT/DPO loops, validation, metrics and loggers.

Importing this package connects the algos registries to config validation (``register_choice_source``):
a name registered with ``@register_adv_est`` or ``@register_policy_loss`` before a config is validated is
a valid ``algorithm.adv_estimator`` or ``actor.policy_loss.loss_mode``, and so is one that the module
``reward.custom_function.path`` names registers (verl users register in their reward module): that module
is imported, once, before such a name is looked up. The registries are read only for a name outside
config's built-in lists, so importing this package stays light (no torch).
"""

from __future__ import annotations

from hybridflow.config.choices import register_choice_source
from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.schema import Config


def import_custom_module(cfg: Config) -> None:
    """Import the module ``reward.custom_function.path`` names (once), so that what it registers exists."""
    path = cfg.reward.custom_function.path
    if not path:
        return
    from hybridflow.rewards.loader import import_reward_module

    try:
        import_reward_module(path)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            [
                Problem(
                    "reward.custom_function.path",
                    str(exc),
                    "make the module import: it is imported to find the names it registers for "
                    "algorithm.adv_estimator and actor.policy_loss.loss_mode",
                )
            ]
        ) from exc


def registered_adv_estimators(cfg: Config) -> list[str]:
    """Every name registered with ``@register_adv_est``, the config's reward module imported first."""
    import_custom_module(cfg)
    from hybridflow.algos import ADV_ESTIMATOR_REGISTRY

    return sorted(ADV_ESTIMATOR_REGISTRY)


def registered_policy_losses(cfg: Config) -> list[str]:
    """Every name registered with ``@register_policy_loss``, the config's reward module imported first."""
    import_custom_module(cfg)
    from hybridflow.algos import POLICY_LOSS_REGISTRY

    return sorted(POLICY_LOSS_REGISTRY)


register_choice_source("algorithm.adv_estimator", registered_adv_estimators)
register_choice_source("actor.policy_loss.loss_mode", registered_policy_losses)
