"""Experiment tracking: metrics.jsonl, the per-step console line, curves.png, and optional tensorboard/wandb.

The driver calls ``Tracker.log(step, metrics)`` once per step (and again for validation metrics). Only rank 0
tracks: on other ranks a ``Tracker`` accepts calls and does nothing, so the same driver code runs everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hybridflow.trainer.plotting import plot_runs
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import rank as env_rank
from hybridflow.utils.progress import format_pace
from hybridflow.utils.storage import write_text_atomically

logger = logging.getLogger(__name__)

SUPPORTED_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
_OPTIONAL = {"tensorboard": "tensorboard", "wandb": "wandb"}  # logger name -> module it needs
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"

# The console line: (label, metric key, format). Missing metrics are left out of the line.
CONSOLE_FIELDS = (
    ("Loss", "actor/pg_loss", "{:.4g}"),
    ("Loss", "loss", "{:.4g}"),  # DPO and KTO (the first loss present is shown)
    ("Loss", "sft/loss", "{:.4g}"),
    ("Reward", "critic/score/mean", "{:.4g}"),
    ("Time", "perf/time_per_step", "{:.2f}s"),
)
_VAL_KEY = re.compile(r"^val-core/(?P<source>.+)/(?P<var>acc|reward)/mean@(?P<n>\d+)$")


def check_loggers(names: Sequence[str]) -> list[str]:
    """Validate logger names and return them deduplicated, with "jsonl" (always on) included."""
    if isinstance(names, str):
        raise TypeError(f"loggers must be a list of names, e.g. [{names!r}], not a string")
    out = []
    for name in [*names, "jsonl"]:
        if name not in SUPPORTED_LOGGERS:
            raise UserError(f"unknown logger {name!r}; supported loggers: {', '.join(SUPPORTED_LOGGERS)}")
        module = _OPTIONAL.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise UserError(
                f"logger {name!r} needs the {module} package: pip install 'hybridflow[{name}]' "
                f"(or drop {name!r} from trainer.logger)"
            )
        if name not in out:
            out.append(name)
    return out


def validation_accuracy(metrics: Mapping[str, float]) -> dict[str, float]:
    """Validation accuracy per data source found in ``metrics`` ("val" for a plain ``val/accuracy``).

    verl logs ``val-core/{data_source}/{acc|reward}/mean@N``; per source an ``acc`` entry wins over
    ``reward`` (a reward may include format bonuses), and the smallest N wins (mean@1 is greedy accuracy).
    """
    best: dict[str, tuple[tuple[bool, int], float]] = {}
    if "val/accuracy" in metrics:
        best["val"] = ((False, 0), metrics["val/accuracy"])
    for key, value in metrics.items():
        m = _VAL_KEY.match(key)
        if m is None:
            continue
        rank_key = (m["var"] != "acc", int(m["n"]))
        source = m["source"]
        if source not in best or rank_key < best[source][0]:
            best[source] = (rank_key, value)
    return {source: float(v) for source, (_, v) in best.items()}


def format_step_line(step: int, total_steps: int | None, metrics: Mapping[str, float], pace: str = "") -> str:
    """The console line, e.g. ``Step 3/100 | Loss: 0.012 | Reward: 0.72 | Time: 0.58s | Val acc: 0.45``, then
    the run's ``pace`` when given (``| 0.4 steps/s · about 4 min left``, ``utils.progress.format_pace``).

    ``total_steps=None`` (a loop of the caller's with no step limit) shows the step alone: ``Step 3 | ...``.
    """
    parts = [f"Step {step}" if total_steps is None else f"Step {step}/{total_steps}"]
    for label, key, fmt in CONSOLE_FIELDS:
        if key in metrics and not any(p.startswith(f"{label}: ") for p in parts):
            parts.append(f"{label}: {fmt.format(metrics[key])}")
    accuracy = validation_accuracy(metrics)
    for source, value in accuracy.items():
        label = "Val acc" if len(accuracy) == 1 else f"Val acc ({source})"
        parts.append(f"{label}: {value:.4g}")
    if pace:
        parts.append(pace)
    return " | ".join(parts)


def _clean(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Metrics as plain floats (numpy/torch scalars included); NaN and inf become None (JSON null)."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        if key == "step":
            raise UserError("'step' is reserved in metrics.jsonl; pass the step as log(step, metrics)")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"metric {key!r} must be a number (float, int, numpy or one-element torch scalar), "
                f"got {type(value).__name__}"
            ) from None
        out[key] = v if math.isfinite(v) else None
    return out


class Tracker:
    """Writes every step's metrics to ``{run_dir}/metrics.jsonl`` and the chosen loggers; plots curves.png.

    ``loggers`` is drawn from console, jsonl (always on), tensorboard and wandb. ``plot_every`` refreshes
    ``curves.png`` every that many steps, at most once per ``plot_interval_s`` (0: only at ``close()``,
    which always draws it; ``trainer/plotting.py`` has the panels). ``resume_step=None`` starts a fresh
    metrics.jsonl; an int keeps the earlier lines with ``step <= resume_step`` (and plots them), so a resumed
    run's file matches an uninterrupted one; ``saved_records`` (``{step: metrics}`` saved in the resumed
    checkpoint) puts back a kept step whose line a kill lost. ``use_tqdm=None`` shows a progress bar when stderr is a terminal.

    The console line ends with the run's pace (steps per second and the time left, from the steps logged so far).
    ``console_every=N`` writes it every N steps (and at the last step, at a validation, and at least every
    ``console_every_s`` seconds) instead of every step: an SFT of hundreds of short steps says where it is in
    a few lines.
    """

    plot_interval_s = 20.0  # the shortest time between two drawings of curves.png during training
    console_every_s = 60.0  # with console_every > 1: the longest time between two console lines

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int | None,
        loggers: Sequence[str] = ("console", "jsonl"),
        plot_every: int = 1,
        *,
        resume_step: int | None = None,
        saved_records: Mapping[int, Mapping[str, Any]] | None = None,
        project_name: str = "hybridflow",
        experiment_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        use_tqdm: bool | None = None,
        rank: int | None = None,
        console_every: int = 1,
    ) -> None:
        self.loggers = check_loggers(loggers)
        if plot_every < 0:
            raise UserError(f"plot_every must be >= 0 (0 = plot only at close), got {plot_every}")
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.plot_every = plot_every
        self.title = experiment_name or self.run_dir.name
        self.active = (env_rank() if rank is None else rank) == 0
        self._records: list[dict[str, Any]] = []  # every step's metrics so far, for curves.png
        self._plotted_at: float | None = None
        self._last_step: int | None = None
        self.console_every = max(1, console_every)
        self._first_step = resume_step or 0  # the pace counts the steps of this process only
        self._started = self._line_at = time.monotonic()
        self._file = self._bar = self._tb = self._wandb = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self._open_metrics_file(resume_step, saved_records or {})
        console = "console" in self.loggers
        if console and (sys.stderr.isatty() if use_tqdm is None else use_tqdm):
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step or 0, desc="Training", file=sys.stderr)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.loggers:
            import wandb

            self._wandb = wandb.init(
                project=project_name, name=experiment_name, dir=str(self.run_dir), config=dict(config or {})
            )

    @property
    def metrics_path(self) -> Path:
        """Path of the JSON-lines metrics file."""
        return self.run_dir / METRICS_FILE

    @property
    def plot_path(self) -> Path:
        """Path of the curves PNG."""
        return self.run_dir / PLOT_FILE

    def _open_metrics_file(
        self, resume_step: int | None, saved_records: Mapping[int, Mapping[str, Any]]
    ) -> TextIO:
        """Open metrics.jsonl for appending, keeping only the lines a resumed run continues from."""
        kept: list[str] = []
        dropped = 0
        steps: set[int] = set()
        # A run resumed in its own directory has its file (made at its start, before any kill): only then
        # can a line be missing. A new directory resumed from another run's checkpoint starts a file of
        # its own, from the resumed step on.
        own_file = self.metrics_path.exists()
        if own_file:
            for line in self.metrics_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    keep = resume_step is not None and int(row["step"]) <= resume_step
                except (ValueError, KeyError, TypeError):
                    keep = False  # a torn last line from a killed run, or not ours
                if keep:
                    kept.append(line)
                    step = int(row.pop("step"))
                    steps.add(step)
                    self._record(
                        step, {k: v for k, v in row.items() if v is None or isinstance(v, (int, float))}
                    )
                else:
                    dropped += 1
        if dropped:
            logger.info(
                "%s: dropped %d line(s) of an earlier run (resume_step=%s)",
                self.metrics_path,
                dropped,
                resume_step,
            )
        for step, record in sorted(saved_records.items() if own_file else ()):
            if resume_step is not None and int(step) <= resume_step and int(step) not in steps:
                clean = _clean(record)  # the line a kill after the checkpoint's commit never wrote
                kept.append(json.dumps({"step": int(step), **clean}, allow_nan=False))
                self._record(int(step), clean)
                logger.info("%s: restored the line of step %s from its checkpoint", self.metrics_path, step)
        # atomic and fsynced: a crash here leaves the old file or the trimmed one
        write_text_atomically(self.metrics_path, "".join(line + "\n" for line in kept))
        return self.metrics_path.open("a", encoding="utf-8")

    def sync(self) -> None:
        """Make every line written so far durable (flush and fsync); the checkpoint commit calls it first."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _record(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Keep this step's metrics for the curves (None/NaN are kept as gaps)."""
        while self._records and self._records[-1]["step"] > step:  # a replayed step replaces the old tail
            self._records.pop()
        self._records.append({"step": step, **metrics})

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics: a metrics.jsonl line, the console line, the loggers, and maybe a plot."""
        clean = _clean(metrics)  # validates on every rank, so a bad metric fails the same way everywhere
        if not self.active:
            return
        step = int(step)
        assert self._file is not None, "log() after close()"
        self._file.write(json.dumps({"step": step, **clean}, allow_nan=False) + "\n")
        self._file.flush()
        self._record(step, clean)
        self._last_step = step
        if "console" in self.loggers:
            # non-finite values show as nan on the console rather than vanishing from the line
            self._console(step, {k: math.nan if v is None else v for k, v in clean.items()})
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=step)
        if self.plot_every and step % self.plot_every == 0 and self._plot_due():
            self.plot()

    def _plot_due(self) -> bool:
        """Whether ``plot_interval_s`` has passed since the last drawing (drawing takes about a second)."""
        return self._plotted_at is None or time.monotonic() - self._plotted_at >= self.plot_interval_s

    def _console(self, step: int, metrics: Mapping[str, float]) -> None:
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0))
        due = (
            self.console_every == 1
            or step % self.console_every == 0
            or step == self.total_steps
            or bool(validation_accuracy(metrics))
            or now - self._line_at >= self.console_every_s
        )
        if not due:
            return
        self._line_at = now
        total = None if self.total_steps is None else self.total_steps - self._first_step
        pace = format_pace(step - self._first_step, total, now - self._started, "step")
        line = format_step_line(step, self.total_steps, metrics, pace)
        if self._bar is None:
            logger.info("%s", line)
        else:
            self._bar.write(line, file=sys.stderr)

    def plot(self) -> Path | None:
        """Refresh ``{run_dir}/curves.png`` from the metrics logged so far; returns its path (None off rank 0)."""
        if not self.active:
            return None
        of = "" if self.total_steps is None else f" of {self.total_steps}"
        steps = "" if self._last_step is None else f"  (step {self._last_step}{of})"
        self._plotted_at = time.monotonic()
        try:
            return plot_runs({self.title: self._records}, self.plot_path, title=f"{self.title}{steps}")
        except Exception as e:  # a full disk (or a drawing failure) must not stop training over a picture
            logger.warning("could not write %s: %s: %s", self.plot_path, type(e).__name__, e)
            return None

    def close(self) -> None:
        """Write the final plot and close the metrics file and loggers (safe to call twice)."""
        if not self.active or self._file is None:
            return
        self.plot()
        self._file.close()
        self._file = None
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
