"""``hybridflow train data.task=squares``: a tiny vision-language model learns to count coloured squares.

1. Build a tiny Qwen2.5-VL (random weights, a 2-block vision tower, frozen as by default) with the char
   tokenizer and a PIL image processor (no download).
2. Warm it up with a short SFT on image prompts that ask for the *green and blue* squares ("blue squares:" ->
   "2"): it learns the answer's form and to read the board, but has never been asked about red, and its
   held-out accuracy on red is at or below chance (about 1 in 4: the answers are drawn evenly from 0-3).
3. GRPO on image prompts that ask for the *red* squares, with the exact-count reward and DAPO's overlong
   penalty (an answer is the count and its end token; a longer response loses reward): the rise in held-out
   red accuracy is what RL taught. (A warm-up on the questions without their images left the model deaf to
   the image: its answers stopped depending on the board and GRPO stayed at chance.)
4. Held-out greedy accuracy (red questions) at step 0 and at the last step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow.data import load_split_rows
from hybridflow.demos.text import demo_configs, grpo_from_warm_up
from hybridflow.models.vision import build_tiny_vl_model_and_processor
from hybridflow.trainer.jobs import sft_job
from hybridflow.utils.seed import set_seed

logger = logging.getLogger(__name__)

VISION_TASKS = ("squares",)  # the built-in tasks whose prompts hold images

# The task and rollout settings of both phases (they replace the arithmetic demo's DEMO_OVERRIDES).
VISION_DEMO_OVERRIDES = [
    "trainer.experiment_name=vision_demo",
    "data.task=squares",
    # 84 x 84 boards of 3 x 3 cells (one image token a cell), 1-4 squares, asked for the red count in 0-3
    # and answered by the bare digit ('red squares:' -> '2').
    "data.task_kwargs.style=short",
    "data.task_kwargs.ask=red",
    "data.task_train_size=800",
    "data.task_val_size=100",
    "data.max_prompt_length=48",
    "data.max_response_length=4",
    "data.train_batch_size=16",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "model.use_remove_padding=true",
    "actor.ppo_mini_batch_size=16",
    "actor.ppo_micro_batch_size_per_gpu=128",
    "actor.optim.lr=5e-4",
    "actor.optim.weight_decay=0.0",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=200",
    "trainer.test_freq=40",
    "trainer.val_before_train=true",
    "trainer.resume=disable",
]
# The GRPO phase sets these on top. The scorer reads the count a response starts with, so nothing told the policy
# to stop after it: the end token's probability drifted away (by the last steps 73-96% of the samples ran into the
# 4-token cap and the entropy rose from 1.0 to 3-4 nats, with the run's own clipping warning). DAPO's overlong penalty (0 up to the answer and its end token,
# -0.5 for a third token, -1 for a fourth) keeps the answers at two tokens; the held-out accuracy rises as before.
VISION_GRPO_OVERRIDES = [
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.len=2",
    "reward.overlong_buffer.penalty_factor=1.0",
]
# The warm-up's own settings (after the arithmetic demo's SFT_OVERRIDES): the answer's form and the board, on
# the other colours' questions.
VISION_SFT_OVERRIDES = [
    "trainer.total_training_steps=60",
    "data.train_batch_size=32",
    "data.task_kwargs.ask=green,blue",
]


def warm_up_vision(overrides: list[str], sft_overrides: list[str] | None) -> tuple[Any, Path]:
    """Build the tiny VLM and SFT it on the green and blue questions; returns (config, run directory)."""
    sft = VISION_SFT_OVERRIDES + list(sft_overrides or [])
    cfg, sft_cfg = demo_configs(overrides, sft, [], VISION_GRPO_OVERRIDES, base=VISION_DEMO_OVERRIDES)
    run_dir = Path(cfg.trainer.run_dir())
    set_seed(cfg.trainer.seed, cfg.trainer.deterministic)
    model, processor = build_tiny_vl_model_and_processor(run_dir / "base_model", seed=cfg.trainer.seed)
    logger.info(
        "vision demo: SFT warm-up on the green and blue questions (with their images), %d steps",
        sft_cfg.trainer.total_training_steps,
    )
    rows = load_split_rows(sft_cfg.data, "train", sft_cfg.trainer.seed)
    sft_job(sft_cfg, run_dir / "sft_model", model, processor.tokenizer, rows, processor=processor)
    cfg.model.path = str(run_dir / "sft_model")
    return cfg, run_dir


def run_vision_demo(
    overrides: list[str] | None = None, sft_overrides: list[str] | None = None
) -> dict[str, Any]:
    """SFT warm-up on the other colours, then GRPO on the red questions; held-out accuracy before and after."""
    cfg, run_dir = warm_up_vision(list(overrides or []), sft_overrides)
    return grpo_from_warm_up(cfg, run_dir, "vision demo (image prompts)")[0]
