"""``hybridflow eval CONFIG|CHECKPOINT [key=value ...] --out FILE.jsonl``: validation only."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.cli.output import add_overwrite_flag, check_output_file
from hybridflow.utils.errors import MissingFileError, UserError

NAME = "eval"
HELP = "Validate a model or checkpoint on the held-out prompts and write the generations to JSONL."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A config or checkpoint, overrides, and the output file."""
    parser.add_argument(
        "args",
        nargs="+",
        metavar="CONFIG|CHECKPOINT [key=value ...]",
        help="A YAML config (its model.path is evaluated), or a global_step_N folder / run directory "
        "(its actor, with the run's config.yaml), then overrides such as rollout.val_kwargs.n=4.",
    )
    parser.add_argument("--out", default=None, help="Generations JSONL (default: {run_dir}/eval.jsonl).")
    add_overwrite_flag(parser, "an existing --out file")


def _resolve(target: str) -> tuple[Path | None, Path | None]:
    """(config file, checkpoint folder) for the first argument."""
    from hybridflow.checkpoint import find_latest
    from hybridflow.checkpoint.rundir import is_complete

    path = Path(target).expanduser()
    if path.is_file():
        return path, None
    if not path.exists():
        raise MissingFileError(f"{path} does not exist: pass a YAML config or a checkpoint folder")
    ckpt = path if is_complete(path) else find_latest(path)
    if ckpt is None:
        raise UserError(
            f"{path} is neither a complete global_step_N checkpoint nor a run directory holding one"
        )
    config = ckpt.parent / "config.yaml"
    return (config if config.is_file() else None), ckpt


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the metrics."""
    from hybridflow.config import load_config
    from hybridflow.trainer.jobs import eval_job

    first, overrides = args.args[0], args.args[1:]
    if "=" in first and not Path(first).exists():
        raise UserError("the first argument of eval is a config file or a checkpoint folder, not an override")
    config, ckpt = _resolve(first)
    cfg = load_config(str(config) if config else None, overrides)
    out = Path(args.out or Path(cfg.trainer.run_dir()) / "eval.jsonl").expanduser()
    check_output_file(out, args.overwrite)
    metrics = eval_job(cfg, out, ckpt)
    for line in metric_lines(metrics, cfg.rollout.val_kwargs.n):
        print(line)
    print(f"generations written to {out}")
    return 0


# At one sample per prompt the best, the worst and the majority vote are that sample: the mean says it all.
_SAME_AT_ONE = ("reward/best@1", "reward/worst@1", "reward/maj@1")


def metric_lines(metrics: dict[str, float], n: int) -> list[str]:
    """One line per metric, sorted; at n = 1 the statistics equal to the mean by definition are left out, and a
    reward mean equal to the accuracy (a 0/1 reward) is said on the accuracy's line."""
    shown = dict(metrics)
    notes: dict[str, str] = {}
    if n == 1:
        shown = {k: v for k, v in shown.items() if not k.endswith(_SAME_AT_ONE)}
        for key in [k for k in shown if k.endswith("/reward/mean@1")]:
            acc = key.removesuffix("reward/mean@1") + "acc/mean@1"
            if acc in shown and shown[acc] == shown[key]:
                del shown[key]
                notes[acc] = " (reward/mean@1 the same)"
    return [f"{key}: {shown[key]:.4f}{notes.get(key, '')}" for key in sorted(shown)]
