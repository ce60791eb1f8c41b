"""curves.png with matplotlib: drawn from metrics lines with gaps, nulls and torn lines; one run or several."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
from matplotlib.image import imread

from hybridflow.trainer.plotting import (
    PANELS,
    moving_average,
    plot_runs,
    read_metrics,
    run_label,
    smoothing_window,
    stage_keys,
    validation_series,
)


def write_metrics(path, steps=30, skip=(7, 8), nan_at=(12,)):
    """A metrics.jsonl like a run's: missing steps, null values, a validation line at step 0, a torn tail."""
    lines = [json.dumps({"step": 0, "val-core/arith/acc/mean@1": 0.3})]
    for step in range(1, steps + 1):
        if step in skip:
            continue
        row = {
            "step": step,
            "critic/score/mean": None if step in nan_at else 0.3 + step / 60,
            "response_length/mean": 9.0 - step / 10,
            "actor/entropy": 0.5 - step / 100,
            "actor/kl_loss": step * 1e-3,
            "rollout_corr/kl": 1e-7,
            "actor/grad_norm": None if step == 5 else 1.0,
            "actor/pg_loss": 0.01 * (-1) ** step,
            "timing_s/gen": 0.5,
            "timing_s/gen_decode": 0.4,  # a part of gen, not a stage of its own
            "timing_s/update_actor": 1.0,
            "timing_s/reward_wait": 0.0,
        }
        if step % 10 == 0:
            row["val-core/arith/acc/mean@1"] = 0.3 + step / 50
            row["val-core/arith/reward/mean@1"] = 0.9  # acc wins over reward
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + '\n{"step": 31, "critic/sc')  # a line torn by a kill
    return path


def test_a_plot_is_written_from_metrics_with_gaps_and_nans(tmp_path):
    records = read_metrics(write_metrics(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records][:8] == [0, 1, 2, 3, 4, 5, 6, 9]  # the torn line is skipped
    out = plot_runs({"run": records}, tmp_path / "curves.png", title="run (step 30 of 30)")
    img = imread(out)
    assert img.shape[0] >= 600 and img.shape[1] >= 1200  # a grid of readable panels
    assert img[..., :3].std() > 0.05  # something is drawn, not a blank page
    assert not list(tmp_path.glob(".curves.png*"))  # written beside and renamed in


def test_a_run_with_no_rl_metrics_still_gets_its_panels(tmp_path):
    out = plot_runs(
        {"sft": [{"step": 1, "sft/loss": 2.0}, {"step": 2, "sft/loss": float("nan")}]}, tmp_path / "c.png"
    )
    assert imread(out).ndim == 3
    assert plot_runs({"empty": []}, tmp_path / "e.png").is_file()


def test_two_runs_in_the_same_panels(tmp_path):
    a = read_metrics(write_metrics(tmp_path / "a.jsonl"))
    b = read_metrics(write_metrics(tmp_path / "b.jsonl", steps=20, skip=(), nan_at=()))
    assert imread(plot_runs({"run": a, "control": b}, tmp_path / "both.png")).shape[1] >= 1200


def test_the_panels_a_person_checks_first():
    titles = [p.title for p in PANELS]
    for title in (
        "reward",
        "response length",
        "entropy",
        "KL to the reference",
        "rollout / trainer mismatch",
    ):
        assert title in titles
    assert "grad norm" in titles and "step time by stage" in titles
    keys = {key for p in PANELS for _, key in p.series}
    assert "actor/kl_loss" in keys and "actor/reward_kl_penalty" in keys
    assert "actor/ppo_kl" not in keys  # 0 by construction on-policy: not the KL a run optimises


def test_series_helpers(tmp_path):
    records = read_metrics(write_metrics(tmp_path / "metrics.jsonl"))
    assert stage_keys(records) == ["timing_s/gen", "timing_s/update_actor"]
    ((source, points),) = validation_series(records).items()
    assert source == "arith" and [s for s, _ in points] == [0, 10, 20, 30]
    assert [v for _, v in points] == pytest.approx([0.3, 0.5, 0.7, 0.9])  # acc, not reward (0.9 each)
    assert moving_average([1.0, math.nan, 3.0, 5.0], 3) == [1.0, 2.0, 4.0, 4.0]
    assert all(math.isnan(v) for v in moving_average([math.nan, math.nan], 3))
    assert smoothing_window(3) == 1 and smoothing_window(40) == 5 and smoothing_window(10_000) == 25
    assert np.isfinite(moving_average([0.5] * 5, 5)).all()


def test_run_labels_are_short_and_distinct(tmp_path):
    assert run_label([tmp_path / "a" / "demo", tmp_path / "b" / "lr0"]) == ["demo", "lr0"]
    assert run_label([tmp_path / "a" / "demo", tmp_path / "b" / "demo"]) == ["a/demo", "b/demo"]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("not json", "1 line is damaged (not JSON): line 1 (starts 'not json')"),
        ('{"no_step": 1}', "1 line is not a metrics line, left out: line 1 (no 'step')"),
        ('{"step": "x"}', "line 1 ('step' is 'x', not a whole number)"),
        ("", None),
    ],
)
def test_foreign_lines_are_skipped_and_named(tmp_path, caplog, line, said):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{line}\n{{"step": 2, "a": 1.0}}\n')
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.plotting"):
        assert read_metrics(path) == [{"step": 2, "a": 1.0}]
    assert (said in caplog.text) if said else not caplog.records
