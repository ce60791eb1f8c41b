"""Tracker: metrics.jsonl lines, the console line, curves.png, logger validation and resume trimming."""

import importlib.machinery
import json
import logging
import math
import sys
import types

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from hybridflow.trainer import tracking
from hybridflow.trainer.tracking import Tracker, check_loggers, format_step_line, validation_accuracy

LOGGER = "hybridflow.trainer.tracking"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_with_plain_floats_and_null_for_nan(tmp_path):
    with Tracker(tmp_path, total_steps=10, loggers=["console"], plot_every=0, use_tqdm=False) as t:
        t.log(1, {"actor/pg_loss": np.float32(0.5), "critic/score/mean": torch.tensor(0.25), "n": 3})
        t.log(2, {"actor/pg_loss": float("nan"), "x": -math.inf, "y": 1.5})
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # jsonl is on although only console was asked for
    assert rows == [
        {"step": 1, "actor/pg_loss": 0.5, "critic/score/mean": 0.25, "n": 3.0},
        {"step": 2, "actor/pg_loss": None, "x": None, "y": 1.5},
    ]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()  # strict JSON, readable by any parser


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("Step")]


def test_console_line_format(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    monkeypatch.setattr(tracking.time, "monotonic", clock)
    t = Tracker(tmp_path, total_steps=100, plot_every=0, use_tqdm=False)
    clock.now += 6.0  # 3 steps in 6 s: 2 s a step, 97 steps left
    t.log(3, {"actor/pg_loss": 0.012, "critic/score/mean": 0.72, "perf/time_per_step": 0.58, "other": 9.0})
    clock.now += 0.5
    t.log(4, {"critic/score/mean": 0.5})
    clock.now += 0.5
    t.log(5, {"actor/pg_loss": float("nan")})
    t.close()
    assert step_lines(caplog) == [
        "Step 3/100 | Loss: 0.012 | Reward: 0.72 | Time: 0.58s | 2 s/step · about 3 min left",
        "Step 4/100 | Reward: 0.5 | 1.62 s/step · about 3 min left",
        "Step 5/100 | Loss: nan | 1.4 s/step · about 2 min left",
    ]


def test_a_line_every_n_steps_with_the_pace_for_long_runs_of_short_steps(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    monkeypatch.setattr(tracking.time, "monotonic", clock)
    t = Tracker(tmp_path, total_steps=165, plot_every=0, use_tqdm=False, console_every=20)
    for step in range(1, 166):
        clock.now += 0.25 if step < 100 else 1.5  # the steps slow down (the machine got busy)
        metrics = {"sft/loss": 1.0 / step}
        if step == 50:
            metrics["val/accuracy"] = 0.5  # a validation always gets its line
        t.log(step, metrics)
    t.close()
    lines = step_lines(caplog)
    assert [line.split(" |")[0] for line in lines] == [
        "Step 20/165", "Step 40/165", "Step 50/165", "Step 60/165", "Step 80/165",
        "Step 100/165", "Step 120/165", "Step 140/165", "Step 160/165", "Step 165/165",
    ]  # fmt: skip
    assert lines[0] == "Step 20/165 | Loss: 0.05 | 4 steps/s · about 36 s left"
    assert lines[-1].endswith("| 1.33 steps/s")  # the end: the rate over the run, no time left
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 165  # every step is in the metrics all the same


def test_slow_steps_get_a_line_at_least_every_minute(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    monkeypatch.setattr(tracking.time, "monotonic", clock)
    t = Tracker(tmp_path, total_steps=1000, plot_every=0, use_tqdm=False, console_every=100)
    for step in range(1, 8):
        clock.now += 25.0
        t.log(step, {"sft/loss": 0.5})
    assert [line.split(" |")[0] for line in step_lines(caplog)] == ["Step 3/1000", "Step 6/1000"]
    assert step_lines(caplog)[0].endswith("25 s/step · about 6 h 55 min left")


def test_a_resumed_run_counts_its_pace_from_where_it_resumed(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    monkeypatch.setattr(tracking.time, "monotonic", clock)
    t = Tracker(tmp_path, total_steps=20, plot_every=0, use_tqdm=False, resume_step=10)
    clock.now += 10.0
    t.log(11, {"critic/score/mean": 0.5})
    assert step_lines(caplog) == ["Step 11/20 | Reward: 0.5 | 10 s/step · about 2 min left"]


def test_console_line_shows_validation_accuracy():
    assert format_step_line(0, 20, {"val/accuracy": 0.25}) == "Step 0/20 | Val acc: 0.25"
    metrics = {"val-core/arith/reward/mean@1": 0.5, "val-core/openai/gsm8k/acc/mean@1": 0.125}
    assert format_step_line(7, 20, {"perf/time_per_step": 1.234, **metrics}) == (
        "Step 7/20 | Time: 1.23s | Val acc (arith): 0.5 | Val acc (openai/gsm8k): 0.125"
    )


def test_validation_accuracy_prefers_acc_then_smallest_n():
    metrics = {
        "val-core/a/reward/mean@1": 0.9,
        "val-core/a/acc/mean@4": 0.4,
        "val-core/a/acc/mean@1": 0.3,
        "val-core/b/reward/mean@8": 0.6,
        "val-core/b/reward/best@8/mean": 1.0,
        "val-aux/c/reward/mean@1": 0.2,
    }
    assert validation_accuracy(metrics) == {"a": 0.3, "b": 0.6}


def test_no_console_logger_means_no_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Tracker(tmp_path, total_steps=5, loggers=["jsonl"], plot_every=0) as t:
        t.log(1, {"critic/score/mean": 1.0})
    assert not [r for r in caplog.records if r.getMessage().startswith("Step")]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_plot_is_written_every_plot_every_steps_at_most_once_per_interval(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr("hybridflow.trainer.tracking.plot_runs", lambda runs, out, title: drawn.append(title))
    t = Tracker(tmp_path, total_steps=6, loggers=[], plot_every=2)
    t.log(1, {"critic/score/mean": 0.1})
    assert drawn == []  # plot_every=2: not yet
    t.log(2, {"critic/score/mean": 0.3})
    t.log(4, {"critic/score/mean": 0.3})  # within plot_interval_s of the last drawing
    assert len(drawn) == 1 and drawn[0].endswith("(step 2 of 6)")
    t.plot_interval_s = 0.0
    t.log(6, {"critic/score/mean": 0.3})
    t.close()  # close always draws
    assert len(drawn) == 3 and drawn[-1].endswith("(step 6 of 6)")


def test_plot_is_a_png_of_the_logged_series(tmp_path):
    t = Tracker(tmp_path, total_steps=4, loggers=[], plot_every=1)
    t.log(0, {"val-core/arith/acc/mean@1": 0.2})
    t.log(1, {"critic/score/mean": 0.1, "actor/kl_loss": 0.0, "timing_s/gen": 0.5})
    t.log(2, {"critic/score/mean": float("nan"), "actor/kl_loss": 0.01, "timing_s/gen": 0.4})
    t.log(3, {"critic/score/mean": 0.4, "val-core/arith/acc/mean@1": 0.4})
    t.close()
    img = imread(tmp_path / "curves.png")
    assert img.shape[0] > 600 and img.shape[1] > 1200 and img[..., :3].std() > 0.05


def test_plot_without_any_metric_still_writes_a_png(tmp_path):
    Tracker(tmp_path, total_steps=3, loggers=[]).close()
    assert imread(tmp_path / "curves.png").ndim == 3


def test_a_plot_that_fails_does_not_stop_training(tmp_path, monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridflow.trainer.tracking.plot_runs", fail)
    with Tracker(tmp_path, total_steps=1, loggers=[], plot_every=1) as t:
        t.log(1, {"critic/score/mean": 0.1})
        assert t.plot() is None
    assert "could not write" in caplog.text and "No space left" in caplog.text


def test_unknown_and_uninstalled_loggers(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="supported loggers: console, jsonl, tensorboard, wandb"):
        Tracker(tmp_path, total_steps=1, loggers=["console", "mlflow"])
    with pytest.raises(TypeError, match="list of names"):
        check_loggers("console")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"pip install 'hybridflow\[wandb\]'"):
        check_loggers(["wandb"])
    with pytest.raises(ValueError, match=r"pip install 'hybridflow\[tensorboard\]'"):
        check_loggers(["tensorboard"])
    assert check_loggers(["console", "console"]) == ["console", "jsonl"]
    assert not (tmp_path / "metrics.jsonl").exists()  # a bad logger fails before anything is written


def test_bad_metric_values_raise(tmp_path):
    with Tracker(tmp_path, total_steps=1, loggers=[], plot_every=0) as t:
        with pytest.raises(TypeError, match="'name' must be a number"):
            t.log(1, {"name": "grpo"})
        with pytest.raises(ValueError, match="reserved"):
            t.log(1, {"step": 1.0})
    with pytest.raises(ValueError, match="plot_every"):
        Tracker(tmp_path, total_steps=1, plot_every=-1)


def test_other_ranks_write_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Tracker(tmp_path / "run", total_steps=2, rank=1, use_tqdm=False) as t:
        t.log(1, {"critic/score/mean": 1.0})
        assert t.plot() is None
    assert not (tmp_path / "run").exists()
    assert not [r for r in caplog.records if r.getMessage().startswith("Step")]


def test_fresh_run_truncates_and_resume_keeps_earlier_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with Tracker(tmp_path, total_steps=6, loggers=[], plot_every=0) as t:
        for step in range(1, 6):
            t.log(step, {"critic/score/mean": step / 10})
    with path.open("a") as f:
        f.write('{"step": 6, "critic/sco')  # a line torn by a kill
    with Tracker(tmp_path, total_steps=6, loggers=[], plot_every=0, resume_step=3) as t:
        t.log(4, {"critic/score/mean": 0.0})
    assert [(r["step"], r["critic/score/mean"]) for r in read_jsonl(path)] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 0.0),
    ]
    with Tracker(tmp_path, total_steps=6, loggers=[], plot_every=0) as t:
        t.log(1, {"critic/score/mean": 0.7})
    assert read_jsonl(path) == [{"step": 1, "critic/score/mean": 0.7}]


def test_tqdm_mode_writes_the_line_above_a_bar(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Tracker(tmp_path, total_steps=10, plot_every=0, use_tqdm=True) as t:
        t.log(2, {"critic/score/mean": 0.5})
    err = capsys.readouterr().err
    assert "Step 2/10 | Reward: 0.5" in err
    assert "2/10" in err.replace("Step 2/10", "")  # the bar's own counter
    assert not [r for r in caplog.records if r.getMessage().startswith("Step")]  # not logged twice


class FakeWandb(types.ModuleType):
    """Stands in for the wandb service (not installed here): records what a run sends it."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))

    def finish(self) -> None:
        pass


def test_a_run_files_itself_under_the_configured_project(tmp_path, monkeypatch) -> None:
    from test_checkpointing import argv

    from hybridflow.cli.main import main
    from hybridflow.models import build_tiny_model_and_tokenizer

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    model = tmp_path / "model"
    build_tiny_model_and_tokenizer(out_dir=model, hidden_size=32, num_hidden_layers=1)
    (tmp_path / "job").mkdir()
    extra = [
        "trainer.total_training_steps=1",
        "trainer.logger=[console,wandb]",
        "trainer.project_name=myproj",
    ]
    assert main(argv(model, tmp_path / "job" / "run", *extra, "trainer.experiment_name=exp1")) == 0
    (init,) = fake.inits
    assert init["project"] == "myproj" and init["name"] == "exp1"
    assert init["config"]["trainer"]["project_name"] == "myproj"  # the whole config travels with the run
    assert [step for step, m in fake.logged if "actor/pg_loss" in m] == [1]


def test_a_saved_line_comes_back_only_in_its_own_run_directory(tmp_path):
    """A kill after a commit loses the step's line: it comes back from the checkpoint. A new directory
    resumed from another run's checkpoint starts its own file at the resumed step, with no line of it."""
    own, other = tmp_path / "own", tmp_path / "other"
    first = Tracker(own, 3, loggers=("jsonl",), plot_every=0)
    first.log(1, {"a": 1.0})
    first.close()  # then killed after step 2's commit, before its line
    saved = {2: {"a": 2.0}}
    for run_dir in (own, other):
        Tracker(run_dir, 3, loggers=("jsonl",), plot_every=0, resume_step=2, saved_records=saved).close()
    steps = [
        [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (own, other)
    ]
    assert steps == [[1, 2], []]
