"""Enumerated config fields: the built-in names, and names a higher layer supplies through a choice source."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from hybridflow.config import ConfigError, Problem, choices, load_config, register_choice_source


@pytest.fixture(autouse=True)
def _own_sources(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sources registered here go away after the test (the trainer's stay)."""
    monkeypatch.setattr(choices, "_SOURCES", {k: list(v) for k, v in choices._SOURCES.items()})
    yield


def test_a_source_makes_its_names_valid_and_is_asked_only_for_unknown_values() -> None:
    seen = []

    def source(cfg: object) -> list[str]:
        seen.append(cfg)
        return ["judge"]

    register_choice_source("reward.manager", source)
    assert load_config(None, ["reward.manager=judge"]).reward.manager == "judge"
    assert len(seen) == 1 and seen[0].reward.manager == "judge"  # called with the config being validated
    load_config(None, ["reward.manager=dapo"])
    assert len(seen) == 1  # a built-in name needs no source
    assert choices.choices_for("reward.manager", seen[0]) == ["naive", "batch", "dapo", "prime", "judge"]


def test_the_unknown_value_error_lists_the_sources_names() -> None:
    register_choice_source("reward.manager", lambda cfg: ["judge", "naive"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.manager=jduge"])
    (problem,) = info.value.problems
    assert problem.path == "reward.manager" and problem.message == "unknown value 'jduge'"
    assert problem.fix == "use one of: naive, batch, dapo, prime, judge"


def test_a_source_that_cannot_answer_reports_its_problems() -> None:
    def broken(cfg: object) -> list[str]:
        raise ConfigError([Problem("reward.custom_function.path", "cannot be imported", "fix the file")])

    register_choice_source("reward.manager", broken)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.manager=judge", "reward.on_error=never"])
    paths = [p.path for p in info.value.problems]
    assert paths == ["reward.custom_function.path", "reward.on_error"]  # all problems of the stage at once


def test_sources_only_for_enumerated_fields() -> None:
    with pytest.raises(ValueError, match=r"'rollout\.n' is not an enumerated config field"):
        register_choice_source("rollout.n", lambda cfg: [])
    with pytest.raises(ValueError, match=r"'rollout\.n' is not an enumerated config field"):
        choices.add_choice("rollout.n", "x")


def test_registering_the_same_source_twice_counts_once() -> None:
    def source(cfg: object) -> list[str]:
        return ["judge"]

    register_choice_source("reward.manager", source)
    register_choice_source("reward.manager", source)
    assert choices._SOURCES["reward.manager"].count(source) == 1


def test_the_algos_registries_are_sources_once_the_trainer_package_is_imported() -> None:
    """hybridflow.trainer connects them, and importing it stays light: no torch until a source is asked."""
    code = (
        "import sys, hybridflow.trainer; from hybridflow.config import choices; "
        "print(sorted(choices._SOURCES), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['actor.policy_loss.loss_mode', 'algorithm.adv_estimator'] False"


def test_without_the_trainer_the_error_says_what_makes_registered_names_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(choices, "_SOURCES", {})  # as in a process that never imported hybridflow.trainer
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.adv_estimator=my_estimator"])
    (problem,) = info.value.problems
    assert problem.fix.startswith("use one of: gae, grpo, ")
    assert problem.fix.endswith(
        "or register your own with @register_adv_est(name) from hybridflow.algos, before the config is built "
        "or in the module reward.custom_function.path names (registered names count once hybridflow.trainer "
        "is imported)"
    )


def test_the_rejection_options_the_config_accepts_are_the_ones_the_algorithms_run() -> None:
    """config (L1) may not import algos (L2), so the option names stand in both: they must not drift."""
    from hybridflow.algos import rollout_correction

    assert choices.ROLLOUT_RS_OPTIONS == rollout_correction.ROLLOUT_RS_OPTIONS
    assert set(choices.ROLLOUT_RS_ALIASES.items()) <= set(rollout_correction.ROLLOUT_RS_ALIASES.items())
