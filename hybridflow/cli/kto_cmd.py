"""``hybridflow kto CONFIG.yaml [key=value ...]``: offline preference training with KTO."""

from __future__ import annotations

import argparse

from hybridflow.cli.dpo_cmd import add_arguments, run_preference

NAME = "kto"
HELP = "Offline preference training with KTO on prompt/completion/label rows."

__all__ = ["HELP", "NAME", "add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """KTO as configured."""
    return run_preference(args, NAME)
