"""``hybridflow train data.task=multiply``: the demo of a task where a tool pays, on the CPU in minutes.

1. Build the tiny model and the character tokenizer (as the arithmetic demo does).
2. Warm it up with a multi-turn SFT on the task's demonstrations (``messages``): on a ``call_fraction`` of
   them the assistant calls ``[[calc: 87*69]]``, reads the tool turn and answers ``#### 6003``; on the
   others it answers at once (a product a tiny model cannot compute). Tool turns are masked out of the loss.
3. GRPO with multi-turn rollouts (``rollout.multi_turn``, the ``calc`` tool, the plain call format): the
   episodes that call the tool are the ones that score, so the policy learns to call it.
4. Held-out greedy accuracy and tool calls per episode at step 0 and at the last step.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridflow.demos.text import grpo_from_warm_up, warm_up

logger = logging.getLogger(__name__)

CALLS_KEY = "val-aux/tool_call_counts/mean"

# The task and rollout settings of both phases (they replace the arithmetic demo's DEMO_OVERRIDES).
TOOL_DEMO_OVERRIDES = [
    "trainer.experiment_name=tool_demo",
    "data.task=multiply",
    # Products of two 2-digit numbers with 4-digit results ('87*69=' -> '#### 6003'), which the 0.8M-parameter
    # model cannot compute (after the warm-up its direct answers are right about 1% of the time). Half of the
    # warm-up's demonstrations call the tool, half answer at once: the warm model does either when sampling,
    # and its greedy answers are direct (so wrong) on nearly every held-out problem.
    "data.task_kwargs.digits=2",
    "data.task_kwargs.call_fraction=0.5",
    "data.task_train_size=2000",
    "data.task_val_size=100",
    "data.max_prompt_length=32",
    "data.max_response_length=64",
    "data.train_batch_size=16",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.tools=[calc]",
    "rollout.multi_turn.format=plain",
    "rollout.multi_turn.max_assistant_turns=3",
    "model.use_remove_padding=true",
    "actor.ppo_mini_batch_size=16",
    "actor.ppo_micro_batch_size_per_gpu=128",
    "actor.optim.lr=5e-5",
    "actor.optim.weight_decay=0.0",
    "algorithm.adv_estimator=grpo",
    # The held-out accuracy has reached its top by step 10 in the measured run; 30 steps show it stays there.
    "trainer.total_training_steps=30",
    "trainer.test_freq=10",
    "trainer.val_before_train=true",
    "trainer.resume=disable",
]
# The GRPO phase sets these on top.
TOOL_GRPO_OVERRIDES = [
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "actor.optim.lr=1e-4",
    "actor.use_kl_loss=true",
]
# The warm-up's own settings (after the arithmetic demo's SFT_OVERRIDES).
TOOL_SFT_OVERRIDES = [
    # Copying the prompt's numbers into the call and the tool's result into the answer takes the model about
    # 250 steps to learn (the loss falls from ~0.75 to ~0.2 between steps 150 and 250).
    "trainer.total_training_steps=450",
    "data.train_batch_size=64",
]


def last_value(records: list[dict[str, Any]], step: int, key: str) -> float | None:
    """``key`` of the metrics line of ``step`` (None when that step did not log it)."""
    for record in records:
        if record["step"] == step and record.get(key) is not None:
            return float(record[key])
    return None


def run_tool_demo(
    overrides: list[str] | None = None, sft_overrides: list[str] | None = None
) -> dict[str, Any]:
    """SFT warm-up on the demonstrations, then GRPO with the calc tool; accuracies and tool calls before/after."""
    sft = TOOL_SFT_OVERRIDES + list(sft_overrides or [])
    cfg, run_dir = warm_up(overrides or [], sft, [], TOOL_GRPO_OVERRIDES, base=TOOL_DEMO_OVERRIDES)
    result, records = grpo_from_warm_up(cfg, run_dir, "tool demo (the calc tool)")
    last = result["last_step"]
    result["calls_before"] = last_value(records, 0, CALLS_KEY)
    result["calls_after"] = last_value(records, last, CALLS_KEY)
    return result
