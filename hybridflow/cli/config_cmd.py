"""``hybridflow config show [FILE] [key=value ...]``: print the resolved config as YAML."""

from __future__ import annotations

import argparse
import sys

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


def names_a_model(overrides: list[str]) -> bool:
    """Whether ``key=value`` overrides alone set ``model.path`` (verl's way to run without a config file).

    Without a config file the training commands run their built-in demo, unless the overrides name a model
    to train: then they are a run of their own, from the defaults.
    """
    from hybridflow.config import load_config
    from hybridflow.config.errors import ConfigError

    try:
        return load_config(None, overrides).model.path is not None
    except ConfigError:
        return False  # the demo, which takes the same overrides, reports the problem


def run(args: argparse.Namespace) -> int:
    """Resolve and print the config."""
    path, overrides = split_file_and_overrides(args.args)
    cfg = load_config(path, overrides)
    sys.stdout.write(to_yaml(cfg))
    return 0
