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
