"""Names registered with @register_adv_est / @register_policy_loss are valid config values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import hybridflow.trainer  # noqa: F401  (connects the algos registries to config validation)
from hybridflow import algos as core_algos
from hybridflow.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator
from hybridflow.config import CHOICES, ConfigError, load_config


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    saved = dict(ADV_ESTIMATOR_REGISTRY), dict(POLICY_LOSS_REGISTRY)
    yield
    for registry, before in zip((ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY), saved):
        registry.clear()
        registry.update(before)


def _estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: object) -> tuple:
    return response_mask.float(), response_mask.float()


def test_every_builtin_name_is_a_builtin_choice() -> None:
    """config's own lists (valid without the trainer) hold every estimator and loss algos ships."""
    builtin_losses = {
        n
        for n, f in POLICY_LOSS_REGISTRY.items()
        if f.__module__ in {"hybridflow.algos.policy_loss", "hybridflow.algos.trust_region_losses"}
    }
    assert {e.value for e in AdvantageEstimator} <= set(CHOICES["algorithm.adv_estimator"])
    assert builtin_losses <= set(CHOICES["actor.policy_loss.loss_mode"])


@pytest.mark.parametrize("name", ["gdpo", "grpo_vectorized", "rloo_vectorized"])
def test_registered_builtin_estimators_are_selectable(name: str) -> None:
    assert load_config(None, [f"algorithm.adv_estimator={name}"]).algorithm.adv_estimator == name


def test_names_registered_from_python_validate() -> None:
    with pytest.raises(ConfigError, match="unknown value 'my_estimator'"):
        load_config(None, ["algorithm.adv_estimator=my_estimator"])
    core_algos.register_adv_est("my_estimator")(_estimator)
    core_algos.register_policy_loss("my_loss")(core_algos.compute_policy_loss_vanilla)
    cfg = load_config(None, ["algorithm.adv_estimator=my_estimator", "actor.policy_loss.loss_mode=my_loss"])
    assert (cfg.algorithm.adv_estimator, cfg.actor.policy_loss.loss_mode) == ("my_estimator", "my_loss")
    assert core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator) is _estimator


def test_the_unknown_value_error_lists_the_registered_names() -> None:
    core_algos.register_adv_est("listed_estimator")(_estimator)
    core_algos.register_policy_loss("listed_loss")(core_algos.compute_policy_loss_vanilla)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.adv_estimator=nope", "actor.policy_loss.loss_mode=nope"])
    by_path = {p.path: p for p in info.value.problems}
    adv, loss = by_path["algorithm.adv_estimator"], by_path["actor.policy_loss.loss_mode"]
    assert len(info.value.problems) == 2
    assert "gdpo" in adv.fix and "listed_estimator" in adv.fix and "@register_adv_est(name)" in adv.fix
    assert "cispo" in loss.fix and "listed_loss" in loss.fix and "@register_policy_loss(name)" in loss.fix
    assert "listed_loss" not in adv.fix


def test_the_same_definition_run_again_replaces_its_registration() -> None:
    """A module executed again (its first import failed after registering) re-registers without error."""
    namespace: dict[str, object] = {"__name__": "user_module"}
    source = "def est(token_level_rewards, response_mask, **kw):\n    return response_mask, response_mask\n"
    exec(source, namespace)
    first = core_algos.register_adv_est("rerun_estimator")(namespace["est"])
    exec(source, namespace)
    second = core_algos.register_adv_est("rerun_estimator")(namespace["est"])
    assert first is not second and core_algos.get_adv_estimator_fn("rerun_estimator") is second
    with pytest.raises(ValueError, match="already registered"):
        core_algos.register_adv_est("rerun_estimator")(_estimator)  # another definition is still refused


def test_the_registries_are_the_dicts_the_lookups_read() -> None:
    """As in verl: inspecting or patching hybridflow.algos.*_REGISTRY changes what the lookups return."""
    from hybridflow.algos import advantage, policy_loss, registry, token_baseline, trust_region_losses

    assert core_algos.ADV_ESTIMATOR_REGISTRY is registry.ADV_ESTIMATOR_REGISTRY
    assert advantage.ADV_ESTIMATOR_REGISTRY is core_algos.ADV_ESTIMATOR_REGISTRY
    assert (
        core_algos.POLICY_LOSS_REGISTRY is registry.POLICY_LOSS_REGISTRY is policy_loss.POLICY_LOSS_REGISTRY
    )
    assert (
        token_baseline.compute_optimal_token_baseline_advantage
        is ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"]
    )
    assert trust_region_losses.compute_policy_loss_dro is POLICY_LOSS_REGISTRY["dro"]
    ADV_ESTIMATOR_REGISTRY["patched_estimator"] = _estimator
    POLICY_LOSS_REGISTRY["patched_loss"] = core_algos.compute_policy_loss_gpg
    assert core_algos.get_adv_estimator_fn("patched_estimator") is _estimator
    assert core_algos.get_policy_loss_fn("patched_loss") is core_algos.compute_policy_loss_gpg
    cfg = load_config(
        None, ["algorithm.adv_estimator=patched_estimator", "actor.policy_loss.loss_mode=patched_loss"]
    )
    assert cfg.algorithm.adv_estimator == "patched_estimator"
    ADV_ESTIMATOR_REGISTRY["grpo"] = _estimator  # replacing a built-in is seen too
    assert core_algos.get_adv_estimator_fn(AdvantageEstimator.GRPO) is _estimator
