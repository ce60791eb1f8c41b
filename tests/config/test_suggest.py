"""'Did you mean' for an unknown key: our keys, verl's and short spellings, and the notebook API's keywords."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.suggest import KEYWORD_KEYS, unknown_key


@pytest.mark.parametrize(
    ("written", "fix"),
    [
        ("learning_rat", "did you mean 'actor.optim.lr' (the notebook API's learning_rate=)?"),
        ("learning_rate", "did you mean 'actor.optim.lr' (the notebook API's learning_rate=)?"),
        ("num_generation", "did you mean 'rollout.n' (the notebook API's num_generations=)?"),
        ("max_step", "did you mean 'trainer.total_training_steps' (the notebook API's max_steps=)?"),
        ("algorithm.gama", "did you mean 'algorithm.gamma' or 'algorithm.lam' or 'algorithm.adv_estimator'?"),
        ("rollout.temprature", "did you mean 'rollout.temperature'"),
        ("zzzz", "see docs/config.md for all keys"),
    ],
)
def test_an_unknown_key_names_the_closest_key(written: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{written}=1"])
    (problem,) = info.value.problems
    assert (problem.path, problem.message) == (written, "unknown config key")
    assert problem.fix.startswith(fix)
    assert unknown_key(written).fix == problem.fix


def test_the_keywords_are_the_notebook_apis_and_name_real_keys() -> None:
    from hybridflow.api.keywords import DIRECT
    from hybridflow.config.schema import schema_index

    assert DIRECT == KEYWORD_KEYS  # one table: the trainer's keywords are the ones suggested
    assert set(KEYWORD_KEYS.values()) <= set(schema_index()[0])
