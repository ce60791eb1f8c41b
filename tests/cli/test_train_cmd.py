"""Without a config file, ``model.path=...`` overrides make a run of their own (verl's style), not the demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli.config_cmd import names_a_model
from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer


def test_only_a_model_path_turns_overrides_into_a_run() -> None:
    assert names_a_model(["model.path=/m", "rollout.n=2"])
    assert names_a_model(["actor_rollout_ref.model.path=/m"])  # the verl key
    assert not names_a_model(["rollout.n=2"]) and not names_a_model([])
    assert not names_a_model(["model.path=/m", "rollout.n=-3"])  # the demo path reports the bad value


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
    assert "done: 1 steps" in capsys.readouterr().out  # the run's summary, not the demo's table
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # validation before training, then the step
    saved = json.loads((run_dir / "final_model" / "config.json").read_text())
    assert saved["hidden_size"] == 32  # the named model, not the demo's


def test_kto_without_a_config_or_model_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kto", "trainer.seed=3"]) == 2
    assert "needs a config file or model.path=DIR" in capsys.readouterr().err
