"""``hybridflow plot RUN_DIR [RUN_DIR ...] [--out FILE]``: redraw curves.png from a run's metrics.jsonl.

Several run directories are drawn in the same panels, one colour per run (a run and its control, say).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.utils.errors import UserError

NAME = "plot"
HELP = "Draw the curves of one run (or several, in the same panels) from their metrics.jsonl."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One or more run directories and the output file."""
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="Run directories holding metrics.jsonl.")
    parser.add_argument(
        "--out",
        default=None,
        help="PNG to write (default: RUN_DIR/curves.png for one run, curves_compare.png here for several).",
    )


def load_run(run_dir: Path) -> list[dict]:
    """The metrics lines of ``run_dir``; a ``UserError`` naming the path and line when none can be plotted.

    A line that is not JSON is damage (the file is refused, naming the line); a JSON line that is not a
    metrics line, and an unfinished last line (a run stopped while writing it), are left out with a
    ``warning:`` line each.
    """
    from hybridflow.trainer.plotting import scan_metrics
    from hybridflow.trainer.tracking import METRICS_FILE

    if not run_dir.exists():
        raise UserError(f"run directory {run_dir} does not exist; give the directory of a run")
    if not run_dir.is_dir():
        raise UserError(
            f"{run_dir} is not a directory; give the directory of a run (it holds {METRICS_FILE})"
        )
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} holds no {METRICS_FILE}; is it the directory of a run?")
    found = scan_metrics(path)
    if found.damaged:
        n, why = found.damaged[0]
        count = "" if len(found.damaged) == 1 else f" ({len(found.damaged)} damaged lines in all)"
        raise UserError(
            f"{path}: line {n} is not JSON ({why}){count}: the file is damaged, not merely cut short by a "
            "stopped run; repair or delete the damaged lines (the others are intact JSON lines), or plot "
            "another run"
        )
    for problem in found.problems():
        print(f"warning: {problem}", file=sys.stderr)
    if not found.records:
        left_out = " (no line of it is a metrics line)" if found.malformed or found.unfinished else ""
        raise UserError(f"{path} holds no metrics yet{left_out}: nothing to plot")
    return found.records


def run(args: argparse.Namespace) -> int:
    """Draw the runs and say where the picture went."""
    from hybridflow.trainer.plotting import plot_runs, run_label
    from hybridflow.utils.progress import counted

    dirs = [Path(p).expanduser() for p in args.runs]
    runs = {name: load_run(d) for name, d in zip(run_label(dirs), dirs)}
    if len(runs) < len(dirs):
        raise UserError("the same run directory is given twice; give each run once")
    default = dirs[0] / "curves.png" if len(dirs) == 1 else Path("curves_compare.png")
    out = Path(args.out).expanduser() if args.out else default
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out / 'curves.png'}")
    steps = max(int(r["step"]) for records in runs.values() for r in records)
    title = " vs ".join(runs) + f"  ({counted(steps, 'step')})"
    plot_runs(runs, out, title=title)
    print(f"wrote {out}")
    return 0
