"""``hybridflow sft CONFIG.yaml [key=value ...] --out DIR``: supervised fine-tuning to a model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.cli.output import add_overwrite_flag, check_output_dir

NAME = "sft"
HELP = "Supervised fine-tuning on prompt/response rows (loss on the response only), on one rank or several."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A YAML config, overrides, and the output directory."""
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="YAML config and overrides (model.path, data.train_files, actor.optim.lr, ...).",
    )
    parser.add_argument("--out", default=None, help="Output model directory (default: {run_dir}/sft_model).")
    add_overwrite_flag(parser, "a non-empty --out directory, whole, once the new model is complete")


def run(args: argparse.Namespace) -> int:
    """Train and save a Hugging Face model directory."""
    from hybridflow.cli.config_cmd import split_file_and_overrides
    from hybridflow.config import load_config
    from hybridflow.trainer.jobs import sft_job
    from hybridflow.utils.logging import rank as env_rank

    path, overrides = split_file_and_overrides(args.args)
    cfg = load_config(path, overrides)
    out = Path(args.out or Path(cfg.trainer.run_dir()) / "sft_model").expanduser()
    check_output_dir(out, args.overwrite)  # before training, so a refusal costs nothing
    metrics = sft_job(cfg, out)
    if env_rank() == 0:  # under torchrun every rank runs the job; one line is enough
        loss = metrics.get("sft/loss")
        said = f"loss {loss:.4f}" if loss is not None else "nothing left to train"
        print(f"SFT done: {said}; model saved to {out}")
    return 0
