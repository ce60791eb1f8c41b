"""The notebook API trains on a list of dicts with a Python reward function."""

from __future__ import annotations

import math
from pathlib import Path

import hybridflow
from hybridflow.models import build_tiny_model_and_tokenizer


def reward(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response contains the ground truth."""
    return float(str(ground_truth) in solution_str)


def test_rltrainer_trains_on_a_list_of_dicts(tmp_path: Path) -> None:
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "m", hidden_size=32, num_hidden_layers=1)
    rows = [
        {
            "data_source": "mine",
            "prompt": [{"role": "user", "content": f"say {i}"}],
            "reward_model": {"ground_truth": str(i)},
        }
        for i in range(8)
    ]
    trainer = hybridflow.RLTrainer(
        model_name=str(tmp_path / "m"),
        reward_fn=reward,
        algorithm="rloo",
        max_steps=2,
        overrides=[
            "data.train_batch_size=4",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "data.max_response_length=6",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    history = trainer.train(rows)
    assert len(history) == 2 and all(math.isfinite(v) for h in history for v in h.values())
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "curves.png").exists()
    assert (tmp_path / "run" / "final_model" / "model.safetensors").exists()
