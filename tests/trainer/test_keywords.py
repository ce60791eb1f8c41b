"""The write-ups' and TRL's keywords map onto config keys; a keyword contradicting an override is refused."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.keywords import keyword_overrides
from hybridflow.utils.errors import UserError

SNIPPET = dict(
    model_name="/models/m",
    max_steps=100,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=4,
    learning_rate=1e-6,
    use_3d_hybrid=True,
)


def _config(keywords, overrides=()):
    overrides = list(overrides)
    return load_config(None, keyword_overrides(keywords, overrides) + overrides)


def test_the_snippets_keywords_map_onto_micro_and_mini_batches() -> None:
    cfg = _config(SNIPPET)
    assert cfg.model.path == "/models/m" and cfg.trainer.total_training_steps == 100
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.hybrid_engine is True
    # 2 samples per GPU per pass x 4 passes x 1 GPU = 8 samples per optimizer step = 1 prompt of rollout.n=8
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 2
    assert cfg.actor.ppo_mini_batch_size == 1 and cfg.data.train_batch_size == 1


def test_num_generations_gpus_and_an_explicit_batch() -> None:
    keywords = dict(SNIPPET, num_generations=4, use_3d_hybrid=False)
    cfg = _config(keywords, ["trainer.n_gpus_per_node=2", "data.train_batch_size=8"])
    assert cfg.rollout.n == 4 and cfg.actor.hybrid_engine is False
    assert cfg.actor.ppo_mini_batch_size == 4 and cfg.data.train_batch_size == 8  # 2 x 4 x 2 / 4; batch kept


def test_agreeing_overrides_pass_and_contradicting_ones_name_both() -> None:
    assert _config(SNIPPET, ["actor.optim.lr=1e-6"]).actor.optim.lr == 1e-6
    with pytest.raises(
        UserError,
        match=r"learning_rate=1e-06 sets actor.optim.lr=1e-06, but overrides set actor.optim.lr=1e-05",
    ):
        _config(SNIPPET, ["actor.optim.lr=1e-5"])
    with pytest.raises(UserError, match=r"gradient_accumulation_steps=4.*actor.ppo_mini_batch_size=2"):
        _config(SNIPPET, ["actor.ppo_mini_batch_size=2"])
    with pytest.raises(UserError, match=r"num_generations=8 sets rollout.n=8, but overrides set rollout.n=4"):
        _config(dict(SNIPPET, num_generations=8), ["actor_rollout_ref.rollout.n=4"])  # verl's key too


def test_a_mini_batch_that_is_no_whole_number_of_prompts_is_refused() -> None:
    with pytest.raises(UserError, match="not a whole number of prompts of num_generations=8"):
        _config(dict(SNIPPET, gradient_accumulation_steps=3))
