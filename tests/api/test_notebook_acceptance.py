"""Issue 30's acceptance on the CPU: the write-ups' notebook call, hybrid and baseline, and the step-wise loop.

One tiny model for the module. The step-wise loop must give the dataflow's metrics exactly for the same
batch (same seed, same prompts in the same order): 8 prompts of different lengths per step, with and
without a critic, the step-wise Trainer choosing its stages from the batch it is given (issue 38).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.chat_rows import trl_conversational_rows

import hybridflow
from hybridflow.api.stepwise import Rewards
from hybridflow.engine.parallel.fsdp import local_bytes, optimizer_state_bytes
from hybridflow.models import build_tiny_model_and_tokenizer

ROWS = [
    {"prompt": [{"role": "user", "content": f"say {i}"}], "reward_model": {"ground_truth": str(i)}}
    for i in range(4)
]
COMMON = ["data.max_response_length=6", "data.shuffle=false"]
# The rollout's KV cache is sized by data.max_prompt_length + data.max_response_length, and the cache's length
# moves the rollout's log-probs in their last bits (1e-8): the comparisons give both APIs the same limit
# (the notebook API sizes it from the dataset, the step-wise one from the model's positions).
SAME_LIMIT = "data.max_prompt_length=400"
EIGHT = [row["prompt"] for row in trl_conversational_rows(8)]  # chat prompts of 30-300 characters


def varied(x):
    """A reward that differs between responses, so that the advantages (and the updates) are not zero."""
    return float(len(x) % 3) / 2


def reward(x):
    """The write-ups' reward: the response text alone."""
    return 1.0 if "Transformer" in x else 0.5


def keywords(max_steps: int = 2) -> dict:
    """The snippet's keywords (8 samples per optimizer step: one prompt of num_generations=8 per step)."""
    return dict(
        max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-6
    )


def _comparable(metrics: dict) -> dict:
    skip = ("timing_s/", "perf/", "memory/")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("notebook") / "m"
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


@pytest.fixture(scope="module")
def dataflow_run(model_dir: Path) -> tuple[list[dict], Path]:
    run = model_dir.parent / "run_hybrid"
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=reward,
        use_3d_hybrid=True,
        overrides=[*COMMON, f"trainer.default_local_dir={run}"],
        **keywords(),
    )
    assert trainer.layout is not None and "without a GPU" in trainer.layout.line()
    return trainer.train(ROWS), run


def test_the_snippet_runs_with_the_hybrid_engine(dataflow_run) -> None:
    history, run = dataflow_run
    assert len(history) == 2 and all(math.isfinite(v) for h in history for v in h.values())
    assert history[0]["critic/score/mean"] == 0.5 and "actor/pg_loss" in history[0]
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    assert (run / "final_model" / "model.safetensors").exists()


def test_the_snippet_runs_the_baseline(model_dir: Path) -> None:
    run = model_dir.parent / "run_baseline"
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=reward,
        use_3d_hybrid=False,
        overrides=[*COMMON, f"trainer.default_local_dir={run}"],
        **keywords(max_steps=1),
    )
    assert trainer.cfg.actor.hybrid_engine is False and trainer.layout is None
    history = trainer.train(ROWS)
    assert len(history) == 1 and math.isfinite(history[0]["actor/pg_loss"])


@pytest.mark.parametrize("critic", [False, True], ids=["grpo", "gae_critic"])
def test_the_step_wise_loop_gives_the_dataflows_metrics(
    model_dir: Path, tmp_path: Path, critic: bool
) -> None:
    # Two prompts of 2 samples per optimizer step: 8 prompts a step make 4 mini-batches, so the update needs
    # the old log-probs (the step-wise Trainer's config has data.train_batch_size=2: it chooses for the batch).
    batch = dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2)
    micro = ["critic.ppo_micro_batch_size_per_gpu=4"] if critic else []  # the critic's mini-batch: 4 samples
    expected = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=varied,
        algorithm="gae" if critic else None,
        overrides=[
            *COMMON,
            SAME_LIMIT,
            *micro,
            *(["critic.enable=true"] if critic else []),
            "data.train_batch_size=8",
            f"trainer.default_local_dir={tmp_path / 'a'}",
        ],
        **batch,
    ).train(EIGHT)
    trainer = hybridflow.Trainer(
        actor_model=str(model_dir),
        critic_model=critic or None,
        reward_fn=varied,
        overrides=[*COMMON, SAME_LIMIT, *micro, f"trainer.default_local_dir={tmp_path / 'b'}"],
        **batch,
    )
    try:
        assert trainer.cfg.data.train_batch_size == 2
        for step in range(2):
            responses = trainer.generate(EIGHT)
            assert len(responses) == 16 and all(isinstance(t, str) for t in responses.texts)
            rewards = trainer.critic_score(responses)
            assert (rewards.values is not None) == critic
            metrics = trainer.update_actor(responses, rewards)
            assert "timing_s/old_log_prob" in metrics
            assert metrics["actor/pg_loss"] != 0.0
            assert _comparable(metrics) == _comparable(expected[step])
    finally:
        trainer.close()


def test_the_step_wise_plan_is_the_engines_state(model_dir: Path, tmp_path: Path) -> None:
    trainer = hybridflow.Trainer(
        actor_model=str(model_dir),
        reward_fn=reward,
        overrides=[*COMMON, f"trainer.default_local_dir={tmp_path / 'run'}"],
        **keywords(),
    )
    try:
        trainer.update_actor(trainer.generate([ROWS[0]]))  # the trainer's own reward scores them
        # The plan's training state is the engine's own: the float32 masters and AdamW's moments it holds
        # (the gradients, as large as the masters, live only through the update).
        engine = trainer.components.groups[0].worker.roles["actor"].engine.engine
        views = trainer.layout.views
        masters, moments = local_bytes(engine.module.parameters()), optimizer_state_bytes(engine.optimizer)
        assert views.state_bytes(grad=0) == pytest.approx(masters + moments, rel=0.15)
        assert views.held_elements * 4 == pytest.approx(masters, rel=0.15)
    finally:
        trainer.close()


def test_the_step_wise_loop_with_a_critic_and_scores_of_ones_own(model_dir: Path, tmp_path: Path) -> None:
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return float(ground_truth in solution_str)

    trainer = hybridflow.Trainer(
        actor_model=str(model_dir),
        critic_model=True,
        ref_model=str(model_dir),
        reward_fn=verl,
        overrides=[*COMMON, "actor.use_kl_loss=true", f"trainer.default_local_dir={tmp_path / 'run'}"],
        **keywords(),
    )
    try:
        assert trainer.cfg.algorithm.adv_estimator == "gae" and trainer.cfg.use_reference
        responses = trainer.generate(ROWS[:1])
        rewards = trainer.critic_score(responses)
        assert isinstance(rewards, Rewards) and rewards.values is not None and rewards.values.shape[0] == 8
        metrics = trainer.update_actor(responses, rewards)
        assert {"critic/vf_loss", "actor/pg_loss", "actor/kl_loss"} <= metrics.keys()
        responses = trainer.generate(ROWS[1:2])
        metrics = trainer.update_actor(responses, [1.0, 0.0] * 4)  # the caller's own scores
        assert metrics["critic/score/mean"] == 0.5 and trainer.global_step == 2
        path = trainer.save(hf_dir=tmp_path / "hf")
        assert path.name == "global_step_2" and (tmp_path / "hf" / "model.safetensors").exists()
    finally:
        trainer.close()


def test_the_snippets_reward_says_it_teaches_nothing(model_dir: Path, tmp_path: Path, caplog) -> None:
    # The write-ups' reward on a model that never writes "Transformer": 0.5 for every sample, every step.
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=lambda x: 1.0 if "Transformer" in x else 0.5,
        overrides=[*COMMON, f"trainer.default_local_dir={tmp_path / 'run'}"],
        **keywords(max_steps=3),
    )
    with caplog.at_level("WARNING", logger="hybridflow.trainer.metrics"):
        history = trainer.train(ROWS)
    assert [h["critic/score/zero_std_frac"] for h in history] == [1.0, 1.0, 1.0]
    said = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "reward was" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert said[0].startswith(
        "the reward was 0.5 for every sample of the first 3 steps (the reward function "
    )
    assert "<lambda>" in said[0] and "data_source" in said[0]
