"""``rollout.kv_cache_dtype``: auto (the default, the rollout's dtype) or fp8 (the paged engine's e4m3 cache);
verl's key maps onto it (tests/support/spelling_cases.py), other values and HF generate are refused with the fix."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.config.errors import ConfigError


def test_auto_is_the_default_and_fp8_spellings_are_taken() -> None:
    assert load_config(None, []).rollout.kv_cache_dtype == "auto"
    assert load_config(None, ["rollout.kv_cache_dtype=fp8"]).rollout.kv_cache_dtype == "fp8"
    assert load_config(None, ["rollout.kv_cache_dtype=FP8_E4M3"]).rollout.kv_cache_dtype == "fp8"  # vLLM's


@pytest.mark.parametrize("value", ["bfloat16", "fp8_e5m2", "int8"])
def test_other_values_are_refused_naming_the_allowed_ones(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"rollout.kv_cache_dtype={value}"])
    (problem,) = info.value.problems
    assert problem.path == "rollout.kv_cache_dtype" and "auto or fp8" in problem.fix


def test_hf_generate_with_an_fp8_cache_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.kv_cache_dtype=fp8", "rollout.engine=hf"])
    (problem,) = info.value.problems
    assert problem.path == "rollout.engine" and "rollout.kv_cache_dtype=auto" in problem.fix
