"""``hybridflow config show [FILE] [key=value ...]``: print the resolved config as YAML."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from hybridflow.config import load_config, to_yaml

NAME = "config"
HELP = "Inspect configurations."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``config`` actions (currently ``show``)."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="Print the resolved config (defaults, then FILE, then overrides) as YAML.",
        description="Print the resolved config: the defaults, then FILE, then key=value overrides "
        "(verl keys such as actor_rollout_ref.rollout.n=8 are accepted).",
    )
    show.add_argument(
        "args", nargs="*", metavar="[FILE] [key=value ...]", help="Optional YAML file, then overrides."
    )


def split_file_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument is the config file unless it contains '='; the rest are overrides."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def _sets_model_path(key: str, value: Any) -> bool:
    """Whether one override (a mapping value counts key by key) sets ``model.path``, verl aliases included."""
    from hybridflow.config.aliases import resolve_alias

    if resolve_alias(key)[0] == "model.path":
        return True
    return isinstance(value, Mapping) and any(_sets_model_path(f"{key}.{k}", v) for k, v in value.items())


def names_a_model(overrides: list[str]) -> bool:
    """Whether ``key=value`` overrides alone set ``model.path`` (verl's way to run without a config file).

    Without a config file the training commands run their built-in demo, unless the overrides name a model
    to train: then they are a run of their own, from the defaults, whatever else the overrides say (a bad
    value is that run's error, never a reason to run the demo). Only the keys are read; an override not of
    the form key=value raises ConfigError.
    """
    from hybridflow.config import parse_overrides

    return any(_sets_model_path(key, value) for key, value in parse_overrides(overrides))


def run(args: argparse.Namespace) -> int:
    """Resolve and print the config."""
    import hybridflow.trainer  # noqa: F401  (validates names registered by a reward module, as training does)

    path, overrides = split_file_and_overrides(args.args)
    cfg = load_config(path, overrides)
    sys.stdout.write(to_yaml(cfg))
    return 0
