"""``hybridflow train [CONFIG.yaml] [key=value ...]``: an RL run; with neither a config nor ``model.path``, the demo."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.config import Config

NAME = "train"
HELP = "Train with PPO/GRPO and friends (no config and no model.path=...: the built-in CPU demo)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """An optional YAML config followed by key=value overrides."""
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="YAML config (omit it for the demo), then overrides such as rollout.n=8.",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo or the configured job, printing the before/after table for the demo."""
    from hybridflow.cli.config_cmd import names_a_model, split_file_and_overrides

    path, overrides = split_file_and_overrides(args.args)
    if path is None and not names_a_model(overrides):
        from hybridflow.data.tasks import TOOL_TASKS
        from hybridflow.demos.text import demo_task, format_table, run_demo
        from hybridflow.demos.tool_use import run_tool_demo
        from hybridflow.demos.vision import VISION_TASKS, run_vision_demo
        from hybridflow.trainer.summary import log_summary

        # A task answered with a tool (data.task=multiply) has its own demo: multi-turn SFT, GRPO with the tool;
        # a visual task (data.task=squares) too: a tiny vision-language model, GRPO on image prompts.
        task = demo_task(overrides)
        demo = run_tool_demo if task in TOOL_TASKS else run_vision_demo if task in VISION_TASKS else run_demo
        result = demo(overrides)
        print(format_table(result), flush=True)  # the accuracy before and after, then the run summary
        log_summary(result["run_dir"])
        return 0
    from hybridflow.trainer.jobs import rl_job
    from hybridflow.utils.progress import counted

    cfg = planned_config(path, overrides)
    history = rl_job(cfg)
    print(f"done: {counted(len(history), 'step')}; metrics in {cfg.trainer.run_dir()}/metrics.jsonl")
    return 0


def planned_config(path: str | None, overrides: list[str], gpu_bytes: int | None = -1) -> Config:
    """The run's config with the automatic layout in the keys the file and overrides leave unset, logged.

    ``gpu_bytes``: one GPU's memory to plan for (default -1: this machine's; the notebook API plans the same way).
    """
    from hybridflow.config import load_config
    from hybridflow.config.loader import _read_yaml
    from hybridflow.config.user_keys import user_keys
    from hybridflow.plan.auto_layout import log_plan, plan_chooses, plan_run

    given = user_keys(_read_yaml(path) if path is not None else {}, overrides)
    cfg = load_config(path, overrides, defer=plan_chooses(given))  # checked by plan_run once chosen
    cfg, layout = plan_run(cfg, given, gpu_bytes)
    log_plan(cfg, layout)
    return cfg
