"""Without a config file, ``model.path=...`` overrides make a run of their own (verl's style), not the demo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridflow.cli.config_cmd import names_a_model
from hybridflow.cli.main import main
from hybridflow.config import ConfigError
from hybridflow.demos import text as demo
from hybridflow.models import build_tiny_model_and_tokenizer


def test_only_a_model_path_turns_overrides_into_a_run() -> None:
    assert names_a_model(["model.path=/m", "rollout.n=2"])
    assert names_a_model(["actor_rollout_ref.model.path=/m"])  # the verl key
    assert not names_a_model(["rollout.n=2"]) and not names_a_model([])


def test_train_with_overrides_alone_trains_the_named_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "model", hidden_size=32, num_hidden_layers=1)
    run_dir = tmp_path / "run"
    args = [
        f"model.path={tmp_path / 'model'}",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={run_dir}",
    ]
    assert main(["train", *args]) == 0
    assert "done: 1 step;" in capsys.readouterr().out  # the run's summary, not the demo's table
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # validation before training, then the step
    saved = json.loads((run_dir / "final_model" / "config.json").read_text())
    assert saved["hidden_size"] == 32  # the named model, not the demo's


def test_kto_without_a_config_or_model_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kto", "trainer.seed=3"]) == 2
    assert "needs a config file or model.path=DIR" in capsys.readouterr().err


def test_a_model_is_named_by_the_keys_whatever_the_values() -> None:
    assert names_a_model(["model.path=/m", "rollout.n=-3"])  # the run reports the bad value, not the demo
    assert names_a_model(["actor.ppo_mini_batch_size=32", "++actor_rollout_ref.model.path=/m"])
    assert names_a_model(["actor_rollout_ref.model={path: /m}"])  # a mapping under the verl key
    assert not names_a_model(["rollout.n=-3", "reward.model.path=/rm"])  # a reward model is not the policy
    with pytest.raises(ConfigError, match="not of the form key=value"):
        names_a_model(["model.path=/m", "rollout.top_k"])


def _forbid_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_demo(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "run_demo", no_demo)
    monkeypatch.setattr(demo, "run_dpo_demo", no_demo)
    monkeypatch.setattr(demo, "warm_up", no_demo)


@pytest.mark.parametrize("command", ["train", "dpo", "kto"])
@pytest.mark.parametrize("model_key", ["model.path", "actor_rollout_ref.model.path"])
@pytest.mark.parametrize(
    ("bad", "quoted"),
    [
        ("actor.ppo_mini_batch_size=32", "32 prompts is larger than the batch (data.train_batch_size=16)"),
        ("actor.ppo_micro_batch_size_per_gpu=3", "3 does not divide the per-GPU mini-batch of 128 samples"),
    ],
)
def test_a_named_model_with_a_bad_override_is_reported_not_replaced_by_the_demo(
    command: str,
    model_key: str,
    bad: str,
    quoted: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _forbid_the_demo(monkeypatch)
    run_dir = tmp_path / "run"
    args = [f"{model_key}={tmp_path / 'model'}", bad, f"trainer.default_local_dir={run_dir}"]
    assert main([command, *args]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and quoted in errors[0], captured.err
    assert "256" not in errors[0] and "model.path" not in errors[0]  # neither the demo's values nor its fix
    assert "SFT" not in captured.err and captured.out == ""
    assert not run_dir.exists()


def test_kto_with_a_missing_model_names_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _forbid_the_demo(monkeypatch)
    rows = tmp_path / "kto.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": True}) + "\n")
    missing = tmp_path / "no_such_model"
    args = [
        f"model.path={missing}",
        f"data.train_files=[{rows}]",
        f"trainer.default_local_dir={tmp_path / 'r'}",
    ]
    assert main(["kto", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: model.path '{missing}': no such directory" in err
    assert "needs a config file" not in err


def test_the_demo_says_which_values_of_an_error_are_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "rollout.n=3", f"trainer.default_local_dir={run_dir}"]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "rollout.n=3" in error  # the user's value
    assert (
        "[the demo sets actor.ppo_micro_batch_size_per_gpu=64, actor.ppo_mini_batch_size=8; you set rollout.n=3]"
        in error
    )
    assert not run_dir.exists()


def test_the_demo_quotes_the_users_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 4 prompts cannot hold the demo's mini-batch of 8 (12 would run: a last, smaller mini-batch is fine)
    assert main(["train", "data.train_batch_size=4", f"trainer.default_local_dir={tmp_path}"]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "(data.train_batch_size=4)" in error and "the demo sets actor.ppo_mini_batch_size=8" in error


def test_the_warm_up_config_accepts_what_the_rl_phase_accepts() -> None:
    """The SFT warm-up replaces the user's micro-batch with its own: its check must not fail on theirs."""
    cfg, sft_cfg = demo.demo_configs(["rollout.n=5", "actor.ppo_micro_batch_size_per_gpu=80"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 80 and cfg.rollout.n == 5
    assert sft_cfg.actor.ppo_micro_batch_size_per_gpu == 64 and sft_cfg.data.train_batch_size == 64
    with pytest.raises(ConfigError, match=r"rollout\.n: must be at least 1, got -3"):
        demo.demo_configs(["rollout.n=-3"])


def test_a_tensor_parallel_rollout_that_cannot_split_the_model_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_tiny_model_and_tokenizer(
        out_dir=tmp_path / "model",
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    args = [
        f"model.path={tmp_path / 'model'}",
        "trainer.n_gpus_per_node=4",
        "rollout.tensor_model_parallel_size=4",
    ]
    assert main(["train", *args, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "rollout.tensor_model_parallel_size=4 does not split this model: num_attention_heads=6" in err
    assert "Traceback" not in err


def test_the_demo_prints_its_accuracy_then_the_summary_and_its_warm_up_in_a_few_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_cli_logging: None
) -> None:
    import io
    import sys

    # The demo with a shrunken budget (its warm-up keeps its own settings on the command line: shrink them here).
    sft = [
        "trainer.total_training_steps=12",
        "data.train_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=8",
    ]
    full = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda overrides: full(overrides, sft_overrides=sft))
    both = io.StringIO()  # stdout (the table) and stderr (the log) as one terminal shows them, in order
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    args = [
        f"trainer.default_local_dir={tmp_path}",
        "data.task_train_size=64",
        "data.task_val_size=8",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "rollout.n=2",
        "trainer.total_training_steps=1",
        "model.tiny_arch=llama",
    ]
    assert main(["train", *args]) == 0
    out = both.getvalue()
    assert out.index("held-out greedy accuracy") < out.index("run summary:")  # as the README says
    assert out.count("run summary:") == 1
    warm_up = [line.split(": ", 1)[1] for line in out.splitlines() if "/12 | Loss" in line]
    # A line every 2 steps of the 12, each with the pace, not one per step.
    assert [line.split(" |")[0] for line in warm_up] == [f"Step {s}/12" for s in (2, 4, 6, 8, 10, 12)]
    assert all("steps/s" in line or "s/step" in line for line in warm_up)
    assert "about" in warm_up[0] and "left" in warm_up[0]
    assert "(1 step)" in out and not re.search(r"(?<![\d.])1 steps\b", out)  # (not a rate: "9.31 steps/s")
