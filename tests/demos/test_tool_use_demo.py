"""The built-in multiply task with the calc tool through the trainer: a short multi-turn SFT warm-up on the
task's demonstrations, then GRPO whose episodes really call the tool. The tool's tokens are masked out of the
batch (the trainer's own dump of what it trains on holds no tool turn), episodes have several turns, and the
rollout's log-probs equal the trainer's recomputation on every sampled token (float32, 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.data.tasks import TOOL_TASKS
from hybridflow.demos.text import format_table
from hybridflow.demos.tool_use import run_tool_demo

SMALL = [
    "data.task_train_size=256",
    "data.task_val_size=8",
    "data.train_batch_size=4",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=16",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "data.task_kwargs.digits=2",
    "data.task_kwargs.call_fraction=1.0",
    "trainer.save_freq=0",
]
# 40 steps teach the call format well enough that most episodes call calc (the numbers are not copied yet).
WARM_UP = [
    "trainer.total_training_steps=40",
    "data.train_batch_size=32",
    "actor.ppo_micro_batch_size_per_gpu=32",
]


@pytest.mark.slow
def test_grpo_episodes_call_the_calculator_with_masked_tool_tokens(tmp_path: Path) -> None:
    dump = tmp_path / "rollouts"
    overrides = [
        "data.task=multiply",
        f"trainer.default_local_dir={tmp_path}",
        f"trainer.rollout_data_dir={dump}",
        *SMALL,
    ]
    result = run_tool_demo(overrides, WARM_UP)
    steps = result["history"]
    assert len(steps) == 2
    for m in steps:
        assert m["tool_call_counts/mean"] > 0 and m["num_turns/max"] > 1
        assert 0 < m["response_length/tool_fraction"] < 1
        assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5
    assert steps[0]["actor/ppo_kl"] == 0.0
    records = [json.loads(line) for f in sorted(dump.glob("*.jsonl")) for line in f.read_text().splitlines()]
    called = [r["response"] for r in records if "[[calc:" in r["response"]]
    assert called  # the policy's own calls
    # The batch's response_mask leaves out every tool turn: what the trainer trains on holds the calls and the
    # answers, never the tool's output or the chat template's headers around it.
    assert not any("tool\n" in r["response"] or "assistant\n" in r["response"] for r in records)
    assert result["calls_before"] is not None and result["calls_after"] is not None
    assert "tool calls per episode" in format_table(result)


def test_the_task_refuses_single_turn_rollouts_naming_the_keys() -> None:
    assert TOOL_TASKS == {"multiply": "calc"}  # the config layer's copy agrees
    from hybridflow.config.validate_async import TOOL_TASKS as CONFIG_COPY

    assert CONFIG_COPY == TOOL_TASKS
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.task=multiply"])
    assert "rollout.multi_turn.enable=true rollout.multi_turn.tools=[calc]" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(
            None, ["data.task=multiply", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calc]"]
        )
    assert "rollout.multi_turn.format=plain" in str(info.value)  # the demonstrations' format
    cfg = load_config(
        None,
        ["data.task=multiply", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calc]",
         "rollout.multi_turn.format=hermes", "data.task_kwargs.call_format=hermes"],
    )  # fmt: skip
    assert cfg.data.task == "multiply"
