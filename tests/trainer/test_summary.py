"""The run summary: first and last values, best validation and its step, stages, memory and paths."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hybridflow.trainer.summary import SUMMARY_FILE, format_summary, log_summary, summarize_run, write_summary


def make_run(run_dir: Path) -> Path:
    rows = [{"step": 0, "val-core/arith/acc/mean@1": 0.4}]
    for step in range(1, 11):
        rows.append(
            {
                "step": step,
                "critic/score/mean": None if step == 1 else 0.4 + step / 50,
                "actor/kl_loss": step / 1000,
                "timing_s/gen": 1.0,
                "timing_s/update_actor": 3.0,
                "perf/time_per_step": 4.0,
            }
        )
    rows[5]["val-core/arith/acc/mean@1"] = 0.9
    rows[10]["val-core/arith/acc/mean@1"] = 0.8
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "final_model").mkdir()
    return run_dir


def test_the_summary_holds_first_last_best_stages_and_paths(tmp_path: Path) -> None:
    s = summarize_run(make_run(tmp_path / "run"))
    assert s.steps == 10
    rows = {label: (i, a, j, b) for label, i, a, j, b in s.metrics}
    assert rows["reward (train, sampled)"] == pytest.approx((2, 0.44, 10, 0.6))  # first finite: step 2
    assert s.best_val == {"arith": (0.9, 5)} and s.val_first_last == {"arith": (0.4, 0.8)}
    assert [(name, mean) for name, mean, _ in s.stages] == [("gen", 1.0), ("update_actor", 3.0)]
    assert s.paths["final model"] == tmp_path / "run" / "final_model" and s.paths["checkpoint"] is None
    table = format_summary(s)
    assert "best 0.9 at step 5" in table and "gen 1s (25%)" in table and "peak memory:" in table


def test_summary_md_is_written_and_logged(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="hybridflow.trainer.summary")
    run = make_run(tmp_path / "run")
    write_summary(run)
    text = (run / SUMMARY_FILE).read_text()
    assert "| reward (train, sampled) | 0.44 (2) | 0.6 (10) |" in text
    assert "| arith | 0.4 | 0.8 | 0.9 | 5 |" in text and "| update_actor | 3 | 75% | 30.0 |" in text
    assert "final model" in text and "run summary:" in caplog.text


def test_a_run_without_metrics_still_gets_a_summary(tmp_path: Path) -> None:
    tmp_path.joinpath("empty").mkdir()
    assert "0 steps" in format_summary(write_summary(tmp_path / "empty"))


def test_a_one_step_run_says_1_step(tmp_path: Path) -> None:
    run = tmp_path / "one"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    summary = write_summary(run)
    assert f"run summary: {run} (1 step)" in format_summary(summary)
    assert "1 step." in (run / SUMMARY_FILE).read_text()


def test_a_summary_written_quietly_is_logged_later_whole(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="hybridflow.trainer.summary")
    run = make_run(tmp_path / "run")
    write_summary(run, log=False)  # a demo: its accuracy table comes first
    assert "run summary:" not in caplog.text
    log_summary(run)
    assert "run summary:" in caplog.text and f"summary: {run / SUMMARY_FILE}" in caplog.text
