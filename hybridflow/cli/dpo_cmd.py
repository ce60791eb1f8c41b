"""``hybridflow dpo [CONFIG.yaml] [key=value ...]``: offline preference training with DPO (IPO, cDPO)."""

from __future__ import annotations

import argparse

from hybridflow.utils.errors import UserError

NAME = "dpo"
HELP = (
    "Offline preference training with DPO (IPO with preference.loss_type=ipo, cDPO with "
    "preference.label_smoothing); no config and no model.path=...: the built-in demo."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """An optional YAML config followed by key=value overrides."""
    parser.add_argument(
        "args", nargs="*", metavar="[CONFIG] [key=value ...]", help="YAML config, then overrides."
    )


def run_preference(args: argparse.Namespace, kind: str) -> int:
    """Train with ``kind`` (dpo or kto) and say where the results are; dpo without a config is the demo."""
    from hybridflow.cli.config_cmd import names_a_model, split_file_and_overrides
    from hybridflow.config import load_config
    from hybridflow.utils.progress import counted

    path, overrides = split_file_and_overrides(args.args)
    own_run = path is not None or names_a_model(overrides)
    if not own_run and kind == "dpo":
        from hybridflow.demos.text import format_table, run_dpo_demo
        from hybridflow.trainer.summary import log_summary

        result = run_dpo_demo(overrides)
        print(format_table(result, "DPO"), flush=True)  # the accuracy before and after, then the run summary
        log_summary(result["run_dir"])
        return 0
    if not own_run:
        raise UserError(
            f"hybridflow {kind} needs a config file or model.path=DIR (with data.train_files=[FILE], ...)"
        )
    cfg = load_config(path, overrides)
    from hybridflow.trainer.jobs import preference_job  # torch and transformers: after the checks

    history = preference_job(cfg, kind)
    print(f"done: {counted(len(history), 'step')}; metrics in {cfg.trainer.run_dir()}/metrics.jsonl")
    return 0


def run(args: argparse.Namespace) -> int:
    """DPO as configured, or the built-in demo."""
    return run_preference(args, NAME)
