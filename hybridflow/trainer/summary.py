"""The run summary written at the end of every run: a short console table and ``summary.md``.

It reads the run directory's ``metrics.jsonl`` (so a resumed run is summarised whole) and gives the first and
last values of the main metrics, the best validation score and its step, the time per stage, the peak
memory, and where the checkpoint, the final model and the plot are.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.checkpoint import find_latest
from hybridflow.trainer.plotting import read_metrics, stage_keys, validation_series, value_of
from hybridflow.utils.progress import counted
from hybridflow.utils.storage import write_text_atomically

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.md"
# (label, metric key) of the rows of the table, in order; a metric the run did not log is left out.
MAIN_METRICS: tuple[tuple[str, str], ...] = (
    ("reward (train, sampled)", "critic/score/mean"),
    ("response length", "response_length/mean"),
    ("entropy", "actor/entropy"),
    ("KL loss (to the reference)", "actor/kl_loss"),
    ("KL in the reward", "actor/reward_kl_penalty"),
    ("rollout/trainer KL", "rollout_corr/kl"),
    ("grad norm (actor)", "actor/grad_norm"),
    ("policy loss", "actor/pg_loss"),
    ("value loss", "critic/vf_loss"),
    ("preference loss", "loss"),
    ("step time (s)", "perf/time_per_step"),
)


@dataclass
class RunSummary:
    """What ``summarize_run`` found: the rows of the tables, the stages, the memory and the paths."""

    run_dir: Path
    steps: int  # training steps in the metrics (the last step's number)
    metrics: list[tuple[str, int, float, int, float]] = field(default_factory=list)  # label, step, first, ...
    best_val: dict[str, tuple[float, int]] = field(default_factory=dict)  # source -> (score, step)
    val_first_last: dict[str, tuple[float, float]] = field(default_factory=dict)
    stages: list[tuple[str, float, float]] = field(default_factory=list)  # name, mean s per step, total s
    peak_memory: list[str] = field(default_factory=list)
    paths: dict[str, Path | None] = field(default_factory=dict)


def _first_last(records: Sequence[Mapping[str, Any]], key: str) -> tuple[int, float, int, float] | None:
    """(step, value) of the first and of the last finite value of ``key``; None if it has none."""
    points = [(int(r["step"]), value_of(r, key)) for r in records]
    points = [(s, v) for s, v in points if not math.isnan(v)]
    return (*points[0], *points[-1]) if points else None


def host_peak_rss_gib() -> float:
    """The peak resident memory of this process or of its largest finished child (GiB)."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    peaks = [resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return max(peaks) * scale / 2**30


def summarize_run(run_dir: str | Path, records: Sequence[Mapping[str, Any]] | None = None) -> RunSummary:
    """The summary of the run in ``run_dir`` (its metrics.jsonl unless ``records`` are given)."""
    run_dir = Path(run_dir)
    if records is None:
        path = run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
    steps = max((int(r["step"]) for r in records), default=0)
    out = RunSummary(run_dir=run_dir, steps=steps)
    for label, key in MAIN_METRICS:
        found = _first_last(records, key)
        if found is not None:
            out.metrics.append((label, *found))
    for source, points in validation_series(records).items():
        best = max(points, key=lambda p: (p[1], -p[0]))  # the earliest step of the best score
        out.best_val[source] = (best[1], best[0])
        out.val_first_last[source] = (points[0][1], points[-1][1])
    for key in stage_keys(records):
        values = [v for v in (value_of(r, key) for r in records) if not math.isnan(v)]
        if values:
            out.stages.append((key.removeprefix("timing_s/"), sum(values) / max(steps, 1), sum(values)))
    device = [v for v in (value_of(r, "perf/max_memory_allocated_gb") for r in records) if not math.isnan(v)]
    if device:
        out.peak_memory.append(f"{max(device):.2f} GiB on the device (rank 0)")
    out.peak_memory.append(f"{host_peak_rss_gib():.2f} GiB host memory (the driver's process)")
    latest = find_latest(run_dir) if run_dir.is_dir() else None
    out.paths = {
        "checkpoint": latest,
        "final model": run_dir / "final_model" if (run_dir / "final_model").is_dir() else None,
        "plot": run_dir / "curves.png" if (run_dir / "curves.png").is_file() else None,
        "metrics": run_dir / "metrics.jsonl" if (run_dir / "metrics.jsonl").is_file() else None,
    }
    return out


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def format_summary(s: RunSummary) -> str:
    """The console table: first and last values, best validation, time per stage, memory and paths."""
    width = max([len(label) for label, *_ in s.metrics] + [len("held-out score (x)") + 8])
    lines = [
        f"run summary: {s.run_dir} ({counted(s.steps, 'step')})",
        f"  {'metric':<{width}}  {'first':>9}  {'last':>9}",
    ]
    for source, (first, last) in s.val_first_last.items():
        score, step = s.best_val[source]
        label = f"held-out score ({source})"
        lines.append(
            f"  {label:<{width}}  {_fmt(first):>9}  {_fmt(last):>9}  best {_fmt(score)} at step {step}"
        )
    for label, _, first, _, last in s.metrics:
        lines.append(f"  {label:<{width}}  {_fmt(first):>9}  {_fmt(last):>9}")
    if s.stages:
        total = sum(mean for _, mean, _ in s.stages) or 1.0
        parts = [f"{name} {mean:.3g}s ({100 * mean / total:.0f}%)" for name, mean, _ in s.stages]
        lines.append("  time per step by stage: " + ", ".join(parts))
    lines.append("  peak memory: " + "; ".join(s.peak_memory))
    lines += [f"  {name}: {path}" for name, path in s.paths.items() if path is not None]
    return "\n".join(lines)


def summary_markdown(s: RunSummary) -> str:
    """``summary.md``: the same content as the console table, as Markdown tables."""
    out = [
        f"# Run summary: {s.run_dir.name}",
        "",
        f"Run directory `{s.run_dir}`, {counted(s.steps, 'step')}.",
        "",
    ]
    out += ["| metric | first (step) | last (step) |", "|---|---|---|"]
    out += [f"| {label} | {_fmt(a)} ({i}) | {_fmt(b)} ({j}) |" for label, i, a, j, b in s.metrics]
    if s.best_val:
        out += ["", "| held-out score | first | last | best | best at step |", "|---|---|---|---|---|"]
        for source, (score, step) in s.best_val.items():
            first, last = s.val_first_last[source]
            out.append(f"| {source} | {_fmt(first)} | {_fmt(last)} | {_fmt(score)} | {step} |")
    if s.stages:
        total = sum(mean for _, mean, _ in s.stages) or 1.0
        out += ["", "| stage | mean s per step | share | total s |", "|---|---|---|---|"]
        for name, mean, seconds in s.stages:
            out.append(f"| {name} | {mean:.3g} | {100 * mean / total:.0f}% | {seconds:.1f} |")
    out += ["", "Peak memory: " + "; ".join(s.peak_memory) + ".", ""]
    out += [f"- {name}: `{path}`" for name, path in s.paths.items() if path is not None]
    return "\n".join(out) + "\n"


def write_summary(run_dir: str | Path, log: bool = True) -> RunSummary:
    """Summarise the run in ``run_dir``: ``summary.md`` there and (``log``) the table in the log; returns the
    summary. A caller that prints its own results first (the demos' accuracy table) logs it afterwards with
    ``log_summary``."""
    summary = summarize_run(run_dir)
    summary.paths["summary"] = Path(run_dir) / SUMMARY_FILE
    try:
        write_text_atomically(summary.paths["summary"], summary_markdown(summary))
    except OSError as e:  # the run is done; a full disk must not turn it into a failure
        logger.warning("could not write %s: %s", summary.paths["summary"], e)
        summary.paths["summary"] = None
    if log:
        logger.info("%s", format_summary(summary))
    return summary


def log_summary(run_dir: str | Path) -> RunSummary:
    """The table of a run summarised already (``write_summary(..., log=False)``), in the log."""
    summary = summarize_run(run_dir)
    written = Path(run_dir) / SUMMARY_FILE
    summary.paths["summary"] = written if written.is_file() else None
    logger.info("%s", format_summary(summary))
    return summary
