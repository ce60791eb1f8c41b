"""The reward-model worker scores at each sample's last real token, and drives a PPO run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.reward_model_util import save_reward_model

from hybridflow.config import load_config
from hybridflow.engine.ops.sequences import pack_prompt_response
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.workers.reward_model import RewardModelWorker


@torch.no_grad()
def test_scores_match_a_direct_forward_of_each_sequence(tmp_path: Path) -> None:
    model = save_reward_model(tmp_path / "rm", 64)
    cfg = load_config(
        None,
        [
            "reward.model.enable=true",
            f"reward.model.path={tmp_path / 'rm'}",
            "reward.model.micro_batch_size_per_gpu=2",
        ],
    )
    worker = RewardModelWorker(cfg, policy_vocab_size=64)
    prompts, responses = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], []]
    batch = pack_prompt_response(prompts, responses, 4, pad_token_id=0)
    got = worker.compute_scores(batch)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        want = model(torch.tensor([p + r])).logits[0, 0]
        assert got[i] == pytest.approx(float(want), abs=1e-5)
    with pytest.raises(ValueError, match="must use the policy's tokenizer"):
        RewardModelWorker(cfg, policy_vocab_size=65)


def test_ppo_with_a_reward_model(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=1)
    save_reward_model(tmp_path / "rm", len(tokenizer))
    cfg = load_config(
        None,
        [
            "data.train_batch_size=4",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "data.max_response_length=6",
            "data.task_train_size=20",
            "data.task_val_size=4",
            "trainer.total_training_steps=2",
            "reward.model.enable=true",
            f"reward.model.path={tmp_path / 'rm'}",
        ],
    )
    history = PPOTrainer(cfg, build_components(cfg, model, tokenizer)).fit()
    assert all(math.isfinite(v) for h in history for v in h.values())
    assert history[0]["critic/score/mean"] != 0.0  # the reward model's scores, not the rule's zeros
