"""``hybridflow eval``'s printed metrics: at one sample per prompt, one line where five said the same."""

from __future__ import annotations

from hybridflow.cli.eval_cmd import metric_lines
from hybridflow.trainer.val_metrics import validation_metrics


def test_one_sample_per_prompt_prints_the_mean_once() -> None:
    # two sources; arithmetic scored 0/1 (reward = accuracy), gsm8k with a format bonus (they differ)
    sources = ["arithmetic"] * 3 + ["gsm8k"] * 2
    metrics = validation_metrics(
        sources,
        [1.0, 0.0, 1.0, 0.1, 1.0],
        ["4", "7", "9", "x", "12"],
        [True, False, True, False, True],
        1,
        "val",
    )
    assert len([k for k in metrics if k.startswith("val/arithmetic/")]) == 5  # what was printed before
    assert metric_lines(metrics, 1) == [
        "val/arithmetic/acc/mean@1: 0.6667 (reward/mean@1 the same)",
        "val/gsm8k/acc/mean@1: 0.5000",
        "val/gsm8k/reward/mean@1: 0.5500",
    ]


def test_several_samples_print_every_statistic() -> None:
    answers = ["4", "4", "5", "4", "9", "9"]
    metrics = validation_metrics(["a"] * 6, [1, 1, 0, 1, 0, 0], answers, [1, 1, 0, 1, 0, 0], 3, "val")
    lines = metric_lines(metrics, 3)
    assert [line.split(":")[0] for line in lines] == sorted(metrics)
    assert "val/a/reward/best@3: 1.0000" in lines and "val/a/reward/worst@3: 0.0000" in lines
