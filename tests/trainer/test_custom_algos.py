"""verl-style custom algorithms: an estimator and a policy loss registered from Python, or by the reward
module the config names, validate as config values and are the ones training calls."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.dist_util import run_world

from hybridflow import algos as core_algos
from hybridflow.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from hybridflow.api.notebook import RLTrainer
from hybridflow.config import Config, ConfigError, load_config
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.rewards.loader import import_reward_module
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.scoring import build_reward_manager

TINY = [
    "data.train_batch_size=2",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_response_length=4",
    "data.task_train_size=8",
    "data.task_val_size=2",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
]
# A reward module as verl users write one: the reward function, plus an estimator and a loss it registers.
MODULE = textwrap.dedent(
    """
    import torch
    from hybridflow import algos as core_algos

    CALLS = {"estimator": 0, "loss": 0, "score": 0}

    @core_algos.register_adv_est("module_estimator")
    def module_estimator(token_level_rewards, response_mask, config=None, **kwargs):
        CALLS["estimator"] += 1
        advantages = 0.625 * response_mask.to(torch.float32)
        return advantages, advantages

    @core_algos.register_policy_loss("module_loss")
    def module_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                    config=None, rollout_is_weights=None):
        CALLS["loss"] += 1
        return core_algos.compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        CALLS["score"] += 1
        return 1.0
    """
)
CUSTOM = ["algorithm.adv_estimator=module_estimator", "actor.policy_loss.loss_mode=module_loss"]


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    saved = dict(ADV_ESTIMATOR_REGISTRY), dict(POLICY_LOSS_REGISTRY)
    yield
    for registry, before in zip((ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY), saved):
        registry.clear()
        registry.update(before)


@pytest.fixture
def reward_module(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(MODULE)
    return path


def train_one_step(cfg: Config) -> dict[str, float]:
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=1)
    components = build_components(cfg, model, tokenizer)
    (metrics,) = PPOTrainer(cfg, components).fit()
    components.close()
    return metrics


def test_an_estimator_and_a_loss_registered_from_python_train(tmp_path: Path) -> None:
    calls = {"estimator": 0, "loss": 0}

    @core_algos.register_adv_est("python_estimator")
    def python_estimator(token_level_rewards, response_mask, config=None, **kwargs):
        calls["estimator"] += 1
        advantages = -0.375 * response_mask.to(torch.float32)
        return advantages, advantages

    @core_algos.register_policy_loss("python_loss")
    def python_loss(old_log_prob, log_prob, advantages, response_mask, *args):
        calls["loss"] += 1
        return core_algos.compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, response_mask, *args
        )

    cfg = load_config(
        None, [*TINY, "algorithm.adv_estimator=python_estimator", "actor.policy_loss.loss_mode=python_loss"]
    )
    metrics = train_one_step(cfg)
    assert metrics["critic/advantages/max"] == metrics["critic/advantages/min"] == -0.375
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "model")  # RLTrainer reads the model's config
    trainer = RLTrainer(str(tmp_path / "model"), algorithm="python_estimator")
    assert trainer.cfg.algorithm.adv_estimator == "python_estimator"
    assert calls["estimator"] == 1 and calls["loss"] >= 1


def test_names_registered_by_the_reward_module_validate_and_train(reward_module: Path) -> None:
    with pytest.raises(ConfigError, match="unknown value 'module_estimator'"):
        load_config(None, [*TINY, *CUSTOM])  # without the module nothing registers the names
    cfg = load_config(None, [*TINY, *CUSTOM, f"reward.custom_function.path={reward_module}"])
    module = import_reward_module(str(reward_module))
    assert ADV_ESTIMATOR_REGISTRY["module_estimator"] is module.module_estimator
    # The reward manager's function comes from the same module object: imported once, state shared.
    assert build_reward_manager(cfg).compute_score is module.compute_score
    metrics = train_one_step(cfg)
    assert metrics["critic/advantages/max"] == metrics["critic/advantages/min"] == 0.625
    assert module.CALLS["estimator"] == 1 and module.CALLS["loss"] >= 1 and module.CALLS["score"] == 4


def test_a_reward_module_that_does_not_import_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    with pytest.raises(ConfigError) as info:
        load_config(None, [*CUSTOM, f"reward.custom_function.path={missing}"])
    (problem,) = info.value.problems  # one problem, although both fields needed the module
    assert problem.path == "reward.custom_function.path" and str(missing) in problem.message
    assert "algorithm.adv_estimator" in problem.fix


def test_a_reward_module_that_fails_after_registering_is_one_problem(tmp_path: Path) -> None:
    """Both fields ask for the module: the second import runs its decorators again, which must not fail."""
    broken = tmp_path / "broken.py"
    broken.write_text(MODULE + "\nundefined_name\n")
    with pytest.raises(ConfigError) as info:
        load_config(None, [*CUSTOM, f"reward.custom_function.path={broken}"])
    (problem,) = info.value.problems
    assert "NameError: name 'undefined_name' is not defined" in problem.message


def rank_registry(rank: int, cfg: Config) -> tuple[bool, bool, str]:
    """In a fresh process, as a Ray rank: build the rank's worker from the config alone."""
    from hybridflow.algos import POLICY_LOSS_REGISTRY as losses
    from hybridflow.workers.build import build_rank_worker

    before = "module_loss" in losses
    build_rank_worker(cfg, 1, ("actor",), "actor")
    return before, "module_loss" in losses, losses["module_loss"].__module__


def test_a_rank_process_registers_the_reward_modules_loss(reward_module: Path, tmp_path: Path) -> None:
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "model", hidden_size=32, num_hidden_layers=1)
    cfg = load_config(None, [*TINY, *CUSTOM, f"reward.custom_function.path={reward_module}"])
    cfg.model.path = str(tmp_path / "model")
    ((before, after, module),) = run_world(1, rank_registry, cfg)
    assert not before and after  # the policy loss runs on the ranks: they import the module themselves
    assert module == import_reward_module(str(reward_module)).__name__
