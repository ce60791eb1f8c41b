"""The write-ups' and TRL's keywords map onto config keys; a keyword contradicting an override is refused."""

from __future__ import annotations

import pytest

from hybridflow.api.keywords import keyword_overrides
from hybridflow.config import load_config
from hybridflow.config.user_keys import file_values
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


def test_a_keyword_contradicting_the_config_file_or_dict_names_both() -> None:
    file = file_values({"actor": {"optim": {"lr": 1e-5}}, "rollout": {"n": 8}})
    with pytest.raises(
        UserError,
        match=r"learning_rate=1e-06 sets actor.optim.lr=1e-06, but the config \(config=\) sets actor.optim.lr=1e-05",
    ):
        keyword_overrides(SNIPPET, [], file)
    verl = file_values({"actor_rollout_ref": {"rollout": {"n": 4}}})  # verl's nesting: rollout.n
    with pytest.raises(UserError, match=r"num_generations=8 sets rollout.n=8, but the config .* rollout.n=4"):
        keyword_overrides(dict(SNIPPET, num_generations=8), [], verl)
    agreeing = keyword_overrides(SNIPPET, [], file_values({"actor": {"optim": {"lr": "1e-6"}}}))
    assert "actor.optim.lr=1e-06" in agreeing


def test_the_notebook_defaults_give_way_to_the_config() -> None:
    # algorithm and use_3d_hybrid have defaults of the API's own (grpo, true): a config that sets the key wins
    chosen = keyword_overrides(
        {"model_name": "/m"}, [], file_values({"algorithm": {"adv_estimator": "rloo"}})
    )
    assert "algorithm.adv_estimator=grpo" not in chosen and "actor.hybrid_engine=true" in chosen
    assert "algorithm.adv_estimator=grpo" in keyword_overrides({"model_name": "/m"}, [])


@pytest.mark.parametrize(
    ("cls", "keywords", "message"),
    [
        (
            "RLTrainer",
            {"learning_rat": 1e-6},
            r"RLTrainer got an unknown keyword learning_rat=; did you mean learning_rate=\?",
        ),
        ("RLTrainer", {"max_stepz": 2}, r"unknown keyword max_stepz=; did you mean max_steps=\?"),
        (
            "Trainer",
            {"learning_rat": 1e-6},
            r"Trainer got an unknown keyword learning_rat=; did you mean learning_rate=\?",
        ),
        ("Trainer", {"max_stepz": 2}, r"did you mean max_steps=\?"),
        ("Trainer", {"zzz": 1}, r"unknown keyword zzz=; the keywords are .*gradient_accumulation_steps"),
    ],
)
def test_misspelt_keywords_are_refused_naming_the_close_match(cls: str, keywords: dict, message: str) -> None:
    import hybridflow

    first = {"RLTrainer": "model_name", "Trainer": "actor_model"}[cls]
    with pytest.raises(UserError, match=message):
        getattr(hybridflow, cls)(**{first: "/nowhere/model"}, **keywords)  # refused before anything loads


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models import build_tiny_model_and_tokenizer

    out = tmp_path_factory.mktemp("keywords") / "m"
    build_tiny_model_and_tokenizer(
        out_dir=out, hidden_size=32, num_hidden_layers=1, max_position_embeddings=1024
    )
    return out


def test_rltrainer_takes_its_config_as_a_dict_or_a_file(model_dir, tmp_path) -> None:
    import hybridflow

    config = {"rollout": {"n": 4, "temperature": 0.7}, "actor_rollout_ref.actor.optim.lr": 3e-6}
    trainer = hybridflow.RLTrainer(model_name=str(model_dir), config=config)
    assert trainer.cfg.rollout.n == 4 and trainer.cfg.rollout.temperature == 0.7
    assert trainer.cfg.actor.optim.lr == 3e-6 and config["rollout"] == {"n": 4, "temperature": 0.7}
    assert trainer.cfg.data.max_response_length == 512  # verl's default for the Python API (1024 positions)
    with pytest.raises(
        UserError, match=r"num_generations=8 sets rollout.n=8, but the config \(config=\) sets rollout.n=4"
    ):
        hybridflow.RLTrainer(model_name=str(model_dir), num_generations=8, config=config)
    file = tmp_path / "run.yaml"
    file.write_text("actor:\n  optim:\n    lr: 1.0e-5\ndata:\n  max_response_length: 32\n")
    assert (
        hybridflow.RLTrainer(model_name=str(model_dir), config=str(file)).cfg.data.max_response_length == 32
    )
    with pytest.raises(UserError, match=r"learning_rate=1e-06 sets actor.optim.lr=1e-06, but the config"):
        hybridflow.RLTrainer(model_name=str(model_dir), learning_rate=1e-6, config=file)
    with pytest.raises(UserError, match=r"config=list: give the path of a YAML file or a dict"):
        hybridflow.RLTrainer(model_name=str(model_dir), config=[("rollout.n", 4)])
