"""``hybridflow train`` with no arguments: a tiny model learns arithmetic by SFT, then improves by GRPO.

1. Build a tiny Qwen2-architecture model and a character tokenizer (no download).
2. Warm it up with a short SFT on the built-in arithmetic task's reference answers.
3. Measure greedy accuracy on held-out problems.
4. Run GRPO with the exact-match reward.
5. Measure greedy accuracy again and print both.
Everything lands in the run directory (configs, models, metrics.jsonl, curves.png).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow.config import load_config
from hybridflow.data import load_split_rows
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.jobs import load_components_from, rl_job, sft_job
from hybridflow.trainer.validation import validate
from hybridflow.utils.seed import set_seed

logger = logging.getLogger(__name__)

TINY_MODEL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# The embedded default config of the RL phase (any key can be overridden on the command line).
DEMO_OVERRIDES = [
    "trainer.experiment_name=demo",
    "data.task=arithmetic",
    # Sums of three one-digit numbers ('3+5+2=' -> '#### 10'): 1000 problems, 150 of them held out. A model of
    # 0.8M parameters learns them within a few hundred SFT steps, so a short warm-up leaves room for RL.
    "data.task_kwargs.digits=1",
    "data.task_kwargs.ops=+",
    "data.task_kwargs.terms=3",
    "data.task_kwargs.style=short",
    "data.task_train_size=780",
    "data.task_val_size=150",
    "data.max_prompt_length=48",
    "data.max_response_length=10",
    "data.train_batch_size=32",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "model.use_remove_padding=true",
    "actor.ppo_mini_batch_size=32",
    "actor.ppo_micro_batch_size_per_gpu=256",
    "actor.optim.lr=5e-5",
    "actor.optim.weight_decay=0.0",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=40",
    "trainer.test_freq=10",
    "trainer.val_before_train=false",
    # The demo starts over each time (its SFT warm-up is not checkpointed); pass trainer.resume=auto to continue.
    "trainer.resume=disable",
]
# The SFT warm-up differs only in these keys.
SFT_OVERRIDES = [
    "actor.optim.lr=3e-3",
    "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.lr_warmup_steps=10",
    "actor.optim.min_lr_ratio=0.3",
    "data.train_batch_size=64",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "trainer.total_training_steps=180",
]


def accuracy(metrics: dict[str, float]) -> float:
    """The held-out greedy accuracy among validation metrics."""
    return next(v for k, v in metrics.items() if k.endswith("/acc/mean@1"))


def run_demo(overrides: list[str] | None = None, sft_overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the built-in demo; returns accuracies before/after GRPO, the run directory and the history."""
    cfg = load_config(None, DEMO_OVERRIDES + list(overrides or []))
    # The command line's overrides configure the RL phase; the warm-up keeps its own SFT settings.
    sft_cfg = load_config(
        None, DEMO_OVERRIDES + list(overrides or []) + SFT_OVERRIDES + list(sft_overrides or [])
    )
    run_dir = Path(cfg.trainer.run_dir())
    set_seed(cfg.trainer.seed)
    model, tokenizer = build_tiny_model_and_tokenizer(
        run_dir / "base_model", seed=cfg.trainer.seed, **TINY_MODEL
    )
    logger.info("demo: SFT warm-up for %d steps", sft_cfg.trainer.total_training_steps)
    rows = load_split_rows(sft_cfg.data, "train", sft_cfg.trainer.seed)
    sft_job(sft_cfg, run_dir / "sft_model", model, tokenizer, rows)
    cfg.model.path = str(run_dir / "sft_model")
    components = load_components_from(run_dir / "sft_model", cfg)
    before = accuracy(validate(cfg, components))
    logger.info(
        "demo: held-out accuracy after SFT %.1f%%; GRPO for %d steps", 100 * before, components.total_steps
    )
    history = rl_job(cfg, components)
    after = accuracy(validate(cfg, components))
    return {
        "before": before,
        "after": after,
        "run_dir": run_dir,
        "history": history,
        "num_val": len(components.val),
    }


def format_table(result: dict[str, Any]) -> str:
    """The before/after table printed at the end of the demo."""
    n = result["num_val"]
    return "\n".join(
        [
            f"held-out greedy accuracy ({n} problems)",
            "  stage          accuracy",
            f"  after SFT      {100 * result['before']:6.1f}%",
            f"  after GRPO     {100 * result['after']:6.1f}%",
            f"  change         {100 * (result['after'] - result['before']):+6.1f} points",
            f"run directory: {result['run_dir']}",
        ]
    )
