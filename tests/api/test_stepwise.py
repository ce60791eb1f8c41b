"""The step-wise Trainer as a first-class API (issue 38): any number of prompts per call, with or without a
reward function, the old log-probs whenever the update needs them, an honest step line, and refusals for
responses trained on twice or sampled by an older policy and for scores that are not numbers."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from support.chat_rows import trl_conversational_rows, verl_rows

import hybridflow
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.errors import UserError

# The write-ups' batch keywords: 2 x 4 = 8 samples per optimizer step.
SNIPPET = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-6)
SHORT = "data.max_response_length=6"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stepwise") / "m"
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_any_number_of_prompts_with_a_critic_and_no_reward_function(
    model_dir: Path, tmp_path: Path, caplog
) -> None:
    run = tmp_path / "run"
    rows = verl_rows(6)  # gsm8k rows: chat prompts of different lengths, a ground truth each
    with hybridflow.Trainer(
        actor_model=str(model_dir),
        critic_model=str(model_dir),
        ref_model=True,
        num_generations=2,  # 2 samples per optimizer step: one prompt per mini-batch
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        overrides=[SHORT, "critic.ppo_micro_batch_size_per_gpu=2", f"trainer.default_local_dir={run}"],
    ) as trainer:
        # one prompt; two (an update of two mini-batches: its old log-probs are computed); three strings
        responses = trainer.generate(rows[:1])
        assert len(responses) == 2 and responses.prompt_index == [0, 0]
        rewards = trainer.critic_score(responses)  # no reward_fn: gsm8k rows get the built-in scorer
        assert rewards.values is not None and len(rewards.scores) == 2
        metrics = trainer.update_actor(responses, rewards)
        assert {"critic/vf_loss", "actor/pg_loss"} <= metrics.keys()

        responses = trainer.generate(rows[1:3])
        assert responses.prompt_index == [0, 0, 1, 1]
        scores = [1.0, 0.0, 0.0, 1.0]
        metrics = trainer.update_actor(responses, scores)  # the caller's own scores
        assert "timing_s/old_log_prob" in metrics and math.isfinite(metrics["actor/pg_loss"])
        assert metrics["critic/score/mean"] == pytest.approx(0.5)

        prompts = [row["prompt"][0]["content"] for row in rows[3:6]]  # plain strings
        responses = trainer.generate(prompts)
        metrics = trainer.update_actor(responses, lambda text: float(len(text) % 2))  # a reward function
        assert len(responses) == 6 and math.isfinite(metrics["critic/vf_loss"])
        assert trainer.global_step == 3
    assert _steps(run) == [1, 2, 3]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step ")]
    assert lines[-1].startswith("Step 3 |"), lines  # no max_steps: no made-up total


def test_refusals_of_the_step_wise_loop(model_dir: Path, tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    prompts = [row["prompt"] for row in trl_conversational_rows(6)]  # chat messages, system turns on some

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return float(str(ground_truth) in solution_str)

    with hybridflow.Trainer(
        actor_model=str(model_dir),
        max_steps=3,
        overrides=[SHORT, "rollout.n=2", f"trainer.default_local_dir={run}"],
        **SNIPPET,
    ) as trainer:
        first = trainer.generate(prompts[:2])
        assert len(first) == 4
        bad = [
            ([1.0, math.nan, 0.0, 1.0], r"rewards\[1\] is nan: a score must be finite"),
            (["1", 0.0, 0.0, 1.0], r"rewards\[0\] is '1' \(str\), not a number"),
            ([0.0, None, 0.0, 1.0], r"rewards\[1\] is None \(NoneType\), not a number"),
            ([1.0], r"rewards has 1 entries for 4 responses"),
            ("1010", r"rewards is a str"),
        ]
        for scores, message in bad:
            with pytest.raises(UserError, match=message):
                trainer.update_actor(first, scores)
        with pytest.raises(UserError, match="critic_score needs a reward"):
            trainer.critic_score(first)  # no reward anywhere, and no built-in scorer for these rows
        with pytest.raises(UserError, match="reads each prompt's ground truth, but prompt 0"):
            trainer.critic_score(first, verl)
        assert trainer.global_step == 0 and not (run / "metrics.jsonl").read_text()

        second = trainer.generate(prompts[2:4])
        trainer.update_actor(second, [1.0, 0.0, 0.0, 1.0])
        with pytest.raises(UserError, match=r"trained the actor already \(step 1\).*call generate\(\)"):
            trainer.update_actor(second, [1.0, 0.0, 0.0, 1.0])
        with pytest.raises(UserError, match=r"sampled at step 1, but the actor has been updated 1 time\(s\)"):
            trainer.update_actor(first, [1.0, 0.0, 0.0, 1.0])
        metrics = trainer.update_actor(first, [1.0, 0.0, 0.0, 1.0], allow_stale=True)  # off-policy, opted in
        assert metrics["training/global_step"] == 2.0

        third = trainer.generate(prompts[4:])
        trainer.update_actor(third, [0.0, 1.0, 1.0, 0.0])
        with pytest.raises(UserError, match=r"max_steps=3 reached"):
            trainer.update_actor(trainer.generate(prompts[:1]), [0.0, 1.0])
        assert trainer.save().name == "global_step_3"
    assert _steps(run) == [1, 2, 3]  # each step once
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step ")]
    assert lines[-1].startswith("Step 3/3 |"), lines
    # The same directory again: the run resumes from its checkpoint and goes on to step 4.
    with hybridflow.Trainer(
        actor_model=str(model_dir),
        max_steps=4,
        overrides=[SHORT, "rollout.n=2", f"trainer.default_local_dir={run}"],
    ) as trainer:
        assert trainer.global_step == 3
        trainer.update_actor(trainer.generate(prompts[:1]), [0.0, 1.0])
    assert _steps(run) == [1, 2, 3, 4]


def test_how_rows_become_prompts_is_said_once_per_trainer(model_dir: Path, tmp_path: Path, caplog) -> None:
    from support.chat_rows import ultrachat_rows

    rows = ultrachat_rows(8)
    with (
        caplog.at_level(logging.INFO, logger="hybridflow.data"),
        hybridflow.Trainer(
            actor_model=str(model_dir),
            num_generations=2,
            overrides=[SHORT, "data.max_prompt_length=300", f"trainer.default_local_dir={tmp_path / 'run'}"],
        ) as trainer,
    ):
        for calls in ([rows[0], rows[7]], [rows[3], rows[6]]):  # short, multi-turn and the Chinese row
            trainer.update_actor(trainer.generate(calls), lambda t: len(t) % 2)
        trainer.generate(["What is the capital of France?", "Name three rivers."])  # text: a new notice
    said = [r.getMessage() for r in caplog.records if r.name.startswith("hybridflow.data")]
    assert sum("have both a 'prompt' string and 'messages'" in m for m in said) == 1, said
    assert sum("prompts are text" in m for m in said) == 1, said


def test_the_step_time_is_the_whole_step_not_the_callers_pauses(
    model_dir: Path, tmp_path: Path, caplog
) -> None:
    import time

    caplog.set_level(logging.INFO, logger="hybridflow.trainer.tracking")
    prompts = ["1+1=", "what is 2+3?", "count to four, then stop"]
    with hybridflow.Trainer(
        actor_model=str(model_dir),
        reward_fn=lambda text: float(len(text) % 3),
        max_steps=2,
        num_generations=2,
        overrides=["data.max_response_length=24", f"trainer.default_local_dir={tmp_path / 'run'}"],
    ) as trainer:
        for _ in range(2):
            responses = trainer.generate(prompts)
            time.sleep(0.6)  # the caller's own work between the calls is not the trainer's step
            rewards = trainer.critic_score(responses)
            metrics = trainer.update_actor(responses, rewards)
            stages = sum(v for k, v in metrics.items() if k.startswith("timing_s/") and "gen_" not in k)
            # generate, score and update, as RLTrainer's step counts them (its stages and the bookkeeping around)
            assert metrics["timing_s/gen"] > 0 and metrics["perf/time_per_step"] >= stages
            assert metrics["perf/time_per_step"] < stages + 0.5
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step ")]
    assert (
        lines[-1].startswith("Step 2/2 | Loss: ")
        and f"Time: {metrics['perf/time_per_step']:.2f}s" in lines[-1]
    )


def test_groups_that_tie_in_every_early_step_are_said_once(model_dir: Path, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hybridflow.trainer.metrics")
    with hybridflow.Trainer(
        actor_model=str(model_dir),
        num_generations=2,
        overrides=[SHORT, f"trainer.default_local_dir={tmp_path / 'run'}"],
    ) as trainer:
        for step in range(4):
            responses = trainer.generate(["1+1=", "name a colour"])
            # each prompt's two samples tie; the prompts differ: no sample is better than its group's other
            metrics = trainer.update_actor(
                responses, [1.0, 1.0, 0.0, 0.0] if step < 3 else [1.0, 0.0, 0.0, 0.0]
            )
            assert metrics["critic/score/zero_std_frac"] == (1.0 if step < 3 else 0.5)
    said = [r.getMessage() for r in caplog.records if "zero_std_frac" in r.getMessage()]
    assert len(said) == 1 and "every prompt's 2 samples got the same reward" in said[0]
    assert "check the scores given to update_actor" in said[0]
