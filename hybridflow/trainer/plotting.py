"""curves.png: the panels a person checks first in an RL run, drawn with matplotlib (Agg) from metrics lines.

A run's ``metrics.jsonl`` holds one JSON object per step (``step`` plus verl-named metrics, ``null`` for a
non-finite value). ``plot_runs`` draws one run, or several in the same panels (one colour per run), as a
grid: reward (training, with validation accuracy marked), response length, entropy, the KL to the reference
that the run optimises (KL loss or KL in the reward), the rollout/trainer log-prob mismatch, grad norm, step
time split into stages, and the loss. Raw points are drawn faint with a moving average over them; a missing
or null value is a gap. matplotlib is imported only when a figure is drawn (``import hybridflow`` stays
light), through its object API (no pyplot state, no display needed).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.utils.storage import staged_file

logger = logging.getLogger(__name__)

Record = Mapping[str, Any]  # one metrics.jsonl line: "step" plus metric name -> float or None

_VAL_KEY = re.compile(r"^val-core/(?P<source>.+)/(?P<var>acc|reward)/mean@(?P<n>\d+)$")
# timing_s/* keys that are parts of a stage (or waits for one), not stages of their own
_SUB_STAGES = {"gen_prefill", "gen_decode", "reshard", "wait_for_rollout", "weight_sync"}
_NO_KL = "no KL to the reference in this run\n(actor.use_kl_loss, algorithm.use_kl_in_reward)"


@dataclass(frozen=True)
class Panel:
    """One chart: a title, a y-axis label, its series as (legend label, metric key), and a note if empty."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    empty: str = "not logged in this run"


PANELS: tuple[Panel, ...] = (
    Panel("reward", "mean score", (("train (sampled)", "critic/score/mean"),)),
    Panel("response length", "tokens", (("mean", "response_length/mean"),)),
    Panel("entropy", "nats per token", (("actor", "actor/entropy"),)),
    Panel(
        "KL to the reference",
        "KL",
        (("KL loss", "actor/kl_loss"), ("KL in reward", "actor/reward_kl_penalty")),
        empty=_NO_KL,
    ),
    Panel(
        "rollout / trainer mismatch",
        "per token",
        (("KL (k1)", "rollout_corr/kl"), ("|log ppl diff|", "rollout_corr/log_ppl_abs_diff")),
    ),
    Panel("grad norm", "L2 norm", (("actor", "actor/grad_norm"), ("critic", "critic/grad_norm"))),
    Panel("step time by stage", "seconds", ()),  # the stages come from the timing_s/* keys
    Panel(
        "loss",
        "loss",
        (
            ("policy", "actor/pg_loss"),
            ("value", "critic/vf_loss"),
            ("SFT", "sft/loss"),
            ("preference", "loss"),
        ),
    ),
)
STEP_TIME = "step time by stage"
_SFT_ALIASES = {"actor/grad_norm": "sft/grad_norm"}  # an SFT run's grad norm stands in for the actor's


@dataclass
class MetricsFile:
    """A metrics.jsonl as read: its metrics lines and every line that is not one, by line number.

    ``damaged``: lines that are not JSON (binary bytes, garbled text): the file was corrupted. ``malformed``:
    JSON lines that are not metrics lines (no integer ``step``, not an object). ``unfinished``: the number
    of the last line when it is the start of a JSON object with no newline after it, which is what a run
    stopped while writing leaves (``Tracker`` writes a line and its newline together); it is not damage.
    """

    path: Path
    records: list[dict[str, Any]]
    damaged: list[tuple[int, str]]
    malformed: list[tuple[int, str]]
    unfinished: int | None = None

    def problems(self) -> list[str]:
        """One sentence per kind of line left out (empty when every line is a metrics line)."""
        out = []
        if self.damaged:
            n = len(self.damaged)
            what = "1 line is" if n == 1 else f"{n} lines are"
            out.append(f"{self.path}: {what} damaged (not JSON): {_named(self.damaged)}")
        if self.malformed:
            n = len(self.malformed)
            what = "1 line is not a metrics line" if n == 1 else f"{n} lines are not metrics lines"
            out.append(f"{self.path}: {what}, left out: {_named(self.malformed)}")
        if self.unfinished is not None:
            out.append(
                f"{self.path}: line {self.unfinished} is unfinished (the run was stopped while writing it), "
                "left out"
            )
        return out


def _named(found: Sequence[tuple[int, str]], most: int = 3) -> str:
    """'line 3 (why), line 7 (why) and 4 more'."""
    text = ", ".join(f"line {n} ({why})" for n, why in found[:most])
    return text + (f" and {len(found) - most} more" if len(found) > most else "")


def _step_of(row: Any) -> str | int:
    """The row's step as an int, or why the row is not a metrics line."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    if "step" not in row:
        return "no 'step'"
    step = row["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer():
        return f"'step' is {step!r}, not a whole number"
    return int(step)


def _text_of(raw: bytes) -> str | None:
    """A line's text; None for binary bytes (not UTF-8, or NULs: what a crash leaves in unwritten blocks)."""
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_metrics(path: str | Path) -> MetricsFile:
    """Read a metrics.jsonl line by line, keeping its metrics lines and naming every other line."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    out = MetricsFile(path, [], [], [])
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        last = n == len(lines)  # no newline after it: the file ends inside this line
        text = _text_of(raw)
        if text is None:
            out.damaged.append((n, "binary bytes"))
            continue
        try:
            row = json.loads(text)
        except ValueError:
            if last and text.lstrip().startswith("{"):
                out.unfinished = n
            else:
                out.damaged.append((n, f"starts {text[:24]!r}"))
            continue
        step = _step_of(row)
        if isinstance(step, str):
            out.malformed.append((n, step))
            continue
        row["step"] = step
        out.records.append(row)
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The metrics lines of a metrics.jsonl file (int ``step``); every other line is named in a warning."""
    found = scan_metrics(path)
    for problem in found.problems():
        logger.warning("%s", problem)
    return found.records


def value_of(record: Record, key: str) -> float:
    """``record[key]`` as a float; NaN when it is missing, null, non-numeric or non-finite."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value) if math.isfinite(value) else math.nan


def validation_series(records: Sequence[Record]) -> dict[str, list[tuple[int, float]]]:
    """Held-out score per data source over the steps: ``acc`` over ``reward``, the smallest ``mean@N``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        best: dict[str, tuple[tuple[bool, int], float]] = {}
        for key in record:
            m = _VAL_KEY.match(key)
            v = value_of(record, key)
            if m is None or math.isnan(v):
                continue
            rank = (m["var"] != "acc", int(m["n"]))
            if m["source"] not in best or rank < best[m["source"]][0]:
                best[m["source"]] = (rank, v)
        for source, (_, v) in best.items():
            out.setdefault(source, []).append((int(record["step"]), v))
    return out


def stage_keys(records: Sequence[Record]) -> list[str]:
    """The ``timing_s/<stage>`` keys of the run's stages, in first-seen order (parts and waits left out)."""
    keys: dict[str, None] = {}
    for record in records:
        for key in record:
            if not key.startswith("timing_s/"):
                continue
            name = key.removeprefix("timing_s/")
            if name not in _SUB_STAGES and not name.endswith("_wait"):
                keys[key] = None
    return list(keys)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average over the finite values around each point (NaN where a window has none)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        near = [v for v in values[max(0, i - half) : i + half + 1] if not math.isnan(v)]
        out.append(sum(near) / len(near) if near else math.nan)
    return out


def smoothing_window(n: int) -> int:
    """The moving average's width for ``n`` points: about a tenth of them, odd, between 1 and 25."""
    w = max(1, min(25, round(n / 10)))
    return w if w % 2 else w + 1


def series_points(records: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have it (null values kept as NaN: a gap)."""
    steps = [int(r["step"]) for r in records if key in r]
    return steps, [value_of(r, key) for r in records if key in r]


def _train_records(records: Sequence[Record]) -> list[Record]:
    """The training steps' lines (a validation-only line, such as step 0 before training, left out)."""
    return [r for r in records if any(not k.startswith(("val-", "step")) for k in r)]


def _draw_series(ax: Any, steps: list[int], values: list[float], label: str, style: dict[str, Any]) -> None:
    """Raw points faint, the moving average over them solid (just the line when there are few points)."""
    window = smoothing_window(len(values))
    if window <= 1:
        ax.plot(steps, values, marker=".", label=label, **style)
        return
    ax.plot(steps, values, alpha=0.25, linewidth=1.0, marker=".", markersize=3, **style)
    ax.plot(steps, moving_average(values, window), linewidth=2.0, label=f"{label} (avg of {window})", **style)


def _draw_lines(ax: Any, panel: Panel, runs: Mapping[str, Sequence[Record]]) -> bool:
    """The panel's series for every run; returns whether anything was drawn."""
    drawn = False
    multi = len(runs) > 1
    for r, (name, records) in enumerate(runs.items()):
        train = _train_records(records)
        for s, (label, key) in enumerate(panel.series):
            if not any(key in rec for rec in train) and key in _SFT_ALIASES:
                key = _SFT_ALIASES[key]
            steps, values = series_points(train, key)
            if not any(not math.isnan(v) for v in values):
                continue
            colour = f"C{r if multi else s}"
            style = {"color": colour, "linestyle": ("-", "--", ":", "-.")[s % 4] if multi else "-"}
            _draw_series(ax, steps, values, f"{name}: {label}" if multi else label, style)
            drawn = True
        if panel.title == "reward":
            drawn = _draw_validation(ax, name if multi else None, records, r if multi else None) or drawn
    return drawn


def _draw_validation(ax: Any, run: str | None, records: Sequence[Record], colour: int | None) -> bool:
    """Validation scores as marked points joined by a dashed line, one set per data source."""
    series = validation_series(records)
    for i, (source, points) in enumerate(series.items()):
        label = f"validation ({source})" if len(series) > 1 else "validation (held-out)"
        steps, values = zip(*points)
        c = f"C{colour}" if colour is not None else f"C{3 + i}"
        ax.plot(
            steps,
            values,
            color=c,
            linestyle="--",
            marker="o",
            markersize=6,
            markeredgecolor="black",
            label=f"{run}: {label}" if run else label,
        )
    return bool(series)


def _draw_stages(ax: Any, runs: Mapping[str, Sequence[Record]]) -> bool:
    """One run: its stages' seconds stacked over the steps. Several: each stage's mean seconds, per run."""
    keys = stage_keys([r for records in runs.values() for r in records])
    if not keys:
        return False
    names = [k.removeprefix("timing_s/") for k in keys]
    if len(runs) == 1:
        records = _train_records(next(iter(runs.values())))
        steps = [int(r["step"]) for r in records]
        layers = [[0.0 if math.isnan(v) else v for v in (value_of(r, k) for r in records)] for k in keys]
        ax.stackplot(steps, layers, labels=names, alpha=0.85, colors=[f"C{i % 10}" for i in range(len(keys))])
        top = max((sum(col) for col in zip(*layers)), default=1.0)
        ax.set_ylim(0, 1.45 * top or 1.0)  # room above the stack for the legend
        return True
    width = 0.8 / len(runs)
    for r, (name, records) in enumerate(runs.items()):
        means = []
        for k in keys:
            vals = [v for v in (value_of(rec, k) for rec in records) if not math.isnan(v)]
            means.append(sum(vals) / len(vals) if vals else 0.0)
        ax.barh([i + r * width for i in range(len(keys))], means, height=width, color=f"C{r}", label=name)
    ax.set_yticks([i + width * (len(runs) - 1) / 2 for i in range(len(keys))], names)
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per step")
    return True


def _draw_panel(ax: Any, panel: Panel, runs: Mapping[str, Sequence[Record]]) -> None:
    """Title, axes, the series (or the panel's note when the run logged none of them), legend, grid."""
    ax.set_title(panel.title, fontsize=12, fontweight="bold")
    drawn = _draw_stages(ax, runs) if panel.title == STEP_TIME else _draw_lines(ax, panel, runs)
    if not drawn:
        ax.text(0.5, 0.5, panel.empty, ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if panel.title != STEP_TIME or len(runs) == 1:
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=9)
    if panel.title == STEP_TIME and len(runs) == 1:
        ax.legend(fontsize=7, loc="upper center", ncol=4, framealpha=0.8)
    else:
        ax.legend(fontsize=8, loc="best", framealpha=0.8)


def plot_runs(
    runs: Mapping[str, Sequence[Record]], out: str | Path, title: str | None = None, columns: int = 4
) -> Path:
    """Draw ``runs`` (name -> metrics records) into the PNG ``out`` (written beside and renamed in)."""
    from matplotlib.figure import Figure  # no pyplot: no global state and no display (Agg)

    rows = math.ceil(len(PANELS) / columns)
    fig = Figure(figsize=(4.6 * columns, 3.9 * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, panel in zip(axes, PANELS):
        _draw_panel(ax, panel, runs)
    for ax in axes[len(PANELS) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=14)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(out) as tmp:  # a viewer never sees a half-written picture
        fig.savefig(tmp, format="png")
    return out


def run_label(paths: Sequence[Path]) -> list[str]:
    """Short distinct names for run directories: the last path part, more parts where two would clash."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
