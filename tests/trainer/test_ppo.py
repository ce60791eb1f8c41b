"""End to end on CPU: every advantage estimator and both KL placements run a few real steps."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer

BASE = [
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "data.max_response_length=8",
    "data.task_train_size=40",
    "data.task_val_size=8",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "model.use_remove_padding=true",
]
ESTIMATORS = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
]


def run(overrides: list[str]) -> list[dict[str, float]]:
    cfg = load_config(None, BASE + overrides)
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    return PPOTrainer(cfg, build_components(cfg, model, tokenizer)).fit()


def check(history: list[dict[str, float]], expect: tuple[str, ...]) -> None:
    assert len(history) == 2
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert set(expect) <= set(metrics), set(expect) - set(metrics)
    assert "val-core/arithmetic/acc/mean@1" in history[-1]  # test_freq=2: validated after the last step
    assert history[0]["actor/ppo_kl"] == 0.0  # on-policy first step: exactly zero
    assert history[0]["rollout_corr/log_prob_abs_diff_max"] < 1e-4  # rollout engine vs trainer, float32
    for metrics in history:  # every sample's first token comes from prefill, the rest from decode steps
        assert metrics["rollout/decode_tokens"] >= metrics["response_length/mean"] * 8 - 8
        assert metrics["perf/rollout_decode_tokens_per_s"] > 0


COMMON = (
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/grad_norm",
    "critic/score/mean",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "perf/throughput",
    "perf/lifecycle_freed_bytes",
    "perf/rollout_decode_tokens_per_s",
    "rollout/kv_slots",
)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_runs(estimator: str) -> None:
    expect = COMMON + (("critic/vf_loss", "timing_s/values") if estimator == "gae" else ())
    expect += ("timing_s/gen_max",) if estimator == "remax" else ()
    check(run([f"algorithm.adv_estimator={estimator}"]), expect)


@pytest.mark.parametrize(
    "kl", [["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"], ["actor.use_kl_loss=true"]]
)
def test_kl_in_reward_and_as_a_loss(kl: list[str]) -> None:
    history = run(kl)
    expect = (
        ("actor/reward_kl_penalty", "timing_s/ref")
        if "reward" in kl[0]
        else ("actor/kl_loss", "timing_s/ref")
    )
    check(history, COMMON + expect)


def test_reward_in_a_thread_beside_the_log_prob_passes_changes_no_result() -> None:
    kl = [
        "actor.use_kl_loss=true",
        "algorithm.rollout_correction.rollout_is=token",
    ]  # ref and old-log-prob passes run
    inline, threaded = run(kl), run([*kl, "reward.launch_async=true"])
    check(threaded, (*COMMON, "timing_s/reward_wait", "timing_s/old_log_prob", "timing_s/ref"))
    assert "timing_s/reward_wait" not in inline[0]
    for a, b in zip(inline, threaded):
        same = (
            "critic/score/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "response_length/mean",
        )
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "1+1"}],
    "reward_model": {"ground_truth": "2"},
}


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1"}]}, "ground_truth"),
        ({**GOOD, "prompt": ""}, "empty"),
        ({**GOOD, "reward_model": {"ground_truth": None}}, "ground_truth"),
        ({**GOOD, "data_source": "my/task"}, "my/task"),
        ({"messages": [{"role": "bot", "content": "1+1"}]}, "messages[0] has role 'bot'"),
    ],
)
def test_bad_training_data_is_named_by_file_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture, bad: dict, message: str
) -> None:
    model_dir = tmp_path / "model"
    build_tiny_model_and_tokenizer(out_dir=model_dir, hidden_size=32, num_hidden_layers=1)
    data = write_jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, bad])
    code = main(
        [
            "train",
            str(write_jsonl(tmp_path / "cfg.yaml", [])),
            f"model.path={model_dir}",
            f"data.train_files=[{data}]",
            f"data.val_files=[{data}]",
            f"trainer.default_local_dir={tmp_path}/run",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "train.jsonl" in err and message in err and "Traceback" not in err
    assert "row 2" in err or "line 3" in err


def parity_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that varies within most groups: the parity of the response length."""
    return float(len(solution_str) % 2)


def test_dapo_dynamic_sampling_keeps_varied_groups_and_overlong_penalty() -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "rollout.n=4",
            "actor.ppo_micro_batch_size_per_gpu=16",
            "algorithm.filter_groups.enable=true",
            "actor.clip_ratio_high=0.28",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=4",
            "reward.overlong_buffer.log=true",
        ],
    )
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    history = PPOTrainer(cfg, build_components(cfg, model, tokenizer, reward_fn=parity_reward)).fit()
    check(
        history,
        (*COMMON, "train/num_gen_batches", "train/kept_group_ratio", "reward_extra/overlong_penalty/mean"),
    )
    assert all(h["train/kept_group_ratio"] <= 1.0 for h in history)


def test_dynamic_sampling_gives_up_with_a_clear_message() -> None:
    cfg = load_config(
        None, [*BASE, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"]
    )
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer, reward_fn=lambda *a, **k: 1.0))
    with pytest.raises(ValueError, match=r"in 2 rounds; raise algorithm\.filter_groups\.max_num_gen_batches"):
        trainer.fit()


def test_dynamic_sampling_draws_gen_batch_size_prompts_a_round() -> None:
    calls: list[str] = []

    def constant(data_source, solution_str, ground_truth, extra_info=None) -> float:
        calls.append(solution_str)
        return 1.0  # no group ever varies: every round is spent

    overrides = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"]
    cfg = load_config(None, [*BASE, *overrides, "data.gen_batch_size=8", "trainer.val_before_train=false"])
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer, reward_fn=constant))
    with pytest.raises(ValueError, match="in 2 rounds"):
        trainer.fit()
    assert len(calls) == 2 * 8 * 2  # 2 rounds x gen_batch_size 8 prompts x rollout.n 2


def test_val_only_validates_and_trains_nothing(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(None, [*BASE, "trainer.val_only=true", "trainer.log_val_generations=3"])
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer))
    with caplog.at_level(logging.INFO, logger="hybridflow.trainer.loop"):
        history = trainer.fit()
    assert len(history) == 1 and trainer.global_step == 0
    assert any(k.startswith("val-core/") for k in history[0])
    assert not any(k.startswith("actor/") for k in history[0])  # no update ran
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    assert all(v.equal(before[k]) for k, v in after.items())
    samples = [r.getMessage() for r in caplog.records if "validation sample" in r.getMessage()]
    assert len(samples) == 3 and samples[0].startswith("validation sample 0 at step 0 (score ")


def test_val_only_without_a_validation_set_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model_dir = tmp_path / "model"
    build_tiny_model_and_tokenizer(out_dir=model_dir, hidden_size=32, num_hidden_layers=1)
    data = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 4)  # training files and no validation files
    args = [
        f"model.path={model_dir}",
        f"data.train_files=[{data}]",
        f"trainer.default_local_dir={tmp_path}/run",
    ]
    args += ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.val_only=true"]
    assert main(["train", str(write_jsonl(tmp_path / "cfg.yaml", [])), *args]) == 2
    err = capsys.readouterr().err
    assert "trainer.val_only=true but there is no validation set; set data.val_files" in err
    assert "Traceback" not in err


def test_rollout_correction_weights_and_rejection() -> None:
    history = run(
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=token",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        ]
    )
    check(history, COMMON)
    assert any(k.startswith("rollout_corr/rollout_is") for k in history[0])
    assert any(k.startswith("rollout_corr/rollout_rs") for k in history[0])


def test_validation_with_n_samples_reports_pass_at_k_and_majority() -> None:
    history = run(
        ["rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0"]
    )
    last = history[-1]
    for key in (
        "reward/mean@4",
        "reward/best@4",
        "reward/worst@4",
        "reward/maj@4",
        "acc/pass@1",
        "acc/pass@4",
    ):
        assert f"val-core/arithmetic/{key}" in last, key
    assert last["val-core/arithmetic/reward/worst@4"] <= last["val-core/arithmetic/reward/best@4"]
