"""``hybridflow sft`` runs of the multi-rank, Ray and resume tests, and the comparison of two of them.

``sft_argv`` trains the tiny model on a JSONL of rows (``realistic.sft_rows``: lengths that differ, masked tool
conversations) for two steps of four rows; ``assert_same_sft`` checks that two runs took the same steps: the
losses, gradient norms and learning rates of every step and the trained weights, to 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SFT = (
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "actor.optim.lr=1e-2",
    "trainer.total_training_steps=2",
    "trainer.device=cpu",
    "trainer.logger=[console]",
)
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "model.target_modules=all-linear")
STEP_KEYS = ("sft/loss", "sft/grad_norm", "sft/lr")


def sft_argv(model: Path, data: Path, run_dir: Path, world: int = 1, *extra: str) -> list[str]:
    """``hybridflow sft`` of ``model`` on ``data`` on ``world`` ranks into ``run_dir`` (the model: its
    ``sft_model``)."""
    args = [
        "sft",
        f"model.path={model}",
        f"data.train_files=[{data}]",
        f"trainer.default_local_dir={run_dir}",
    ]
    return [*args, f"trainer.n_gpus_per_node={world}", *SFT, *extra]


def step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every step's line of a run's metrics.jsonl, by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row.pop("step"): row for row in rows}


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a run's ``sft_model``."""
    return load_file(run_dir / "sft_model" / "model.safetensors")


def assert_same_sft(want_dir: Path, got_dir: Path, tol: float = 1e-5) -> None:
    """Two SFT runs took the same steps: each step's loss, gradient norm and learning rate, and the weights."""
    want, got = step_metrics(want_dir), step_metrics(got_dir)
    assert sorted(got) == sorted(want) and want, (sorted(want), sorted(got))
    for step in want:
        for key in STEP_KEYS:
            assert got[step][key] == pytest.approx(want[step][key], rel=tol, abs=tol), (got_dir, step, key)
    weights, trained = trained_weights(want_dir), trained_weights(got_dir)
    assert trained.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.allclose(trained[key], value, rtol=tol, atol=tol), (got_dir, key)
