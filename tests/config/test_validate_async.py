"""Validation of the rollout-mode sections (validate_async.py): ``rollout.harness``."""

from __future__ import annotations

import pytest


def test_harness_keys_are_validated_naming_the_key() -> None:
    from hybridflow.config import ConfigError, load_config

    cfg = load_config(None, ["rollout.harness.module=h.py", "data.task=multiply"])  # a harness runs the tool
    assert cfg.rollout.harness.function == "episode" and cfg.rollout.harness.host == "127.0.0.1"
    cases = {
        "rollout.harness.on_error=ignore": "rollout.harness.on_error",
        "rollout.harness.max_concurrency=0": "rollout.harness.max_concurrency",
        "rollout.harness.timeout_s=0": "rollout.harness.timeout_s",
        "rollout.harness.function=not-a-name": "rollout.harness.function",
        "rollout.harness.port=70000": "rollout.harness.port",
        "rollout.multi_turn.enable=true": "rollout.multi_turn.enable",
        "trainer.async_mode=colocate": "trainer.async_mode",
        "reward.custom_function.path=r.py": "reward.custom_function.path",
    }
    for override, key in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, ["rollout.harness.module=h.py", override])
        assert key in str(info.value), (override, str(info.value))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.harness.module=h.py", "rollout.harness.verifiers_env=env"],
            "rollout.harness.verifiers_env: is set with rollout.harness.module",
        ),
        (
            ["rollout.harness.verifiers_config={agent: {}}"],
            "rollout.harness.verifiers_config: is set without",
        ),
        (
            ["rollout.harness.verifiers_env=env", "rollout.multi_turn.enable=true"],
            "rollout.multi_turn.enable: with rollout.harness.verifiers_env set",
        ),
        (
            ["rollout.harness.verifiers_env=env", "rollout.harness.function=play"],
            "rollout.harness.function: is 'play' with rollout.harness.verifiers_env set",
        ),
    ],
)
def test_verifiers_env_keys_are_validated_naming_the_key(overrides: list[str], message: str) -> None:
    from hybridflow.config import ConfigError, load_config

    # the environment's harness runs the tool: no rollout.multi_turn needed for data.task=multiply
    cfg = load_config(None, ["rollout.harness.verifiers_env=env", "data.task=multiply"])
    assert cfg.rollout.harness.enabled and cfg.rollout.harness.verifiers_config == {}
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value), str(info.value)
