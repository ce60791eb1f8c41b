"""The ``hybridflow`` command: argparse with one subcommand per module.

A subcommand is a module listed in COMMANDS that defines ``NAME``, ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int``. Modules import their heavy dependencies (torch, transformers) inside ``run``
so that ``hybridflow --help`` and ``--version`` stay instant, and ``preflight.check_inputs`` judges the
command's config, files and directories before ``run``, so that a mistake there is refused in about a second.

Exit statuses: 0 done; 2 a user error (``UserError``: a bad config, file, row, model, checkpoint or output
directory, a full disk; also an ``OSError`` of a path and a YAML error), printed as one ``error: ...`` line
naming the file, field or row and the fix, never a traceback; 1 a failed rank (``WorkerError``, its remote
traceback in the message; under torchrun, a collective broken by a peer rank that died, one line naming it)
or an internal error: anything else is a bug in hybridflow, printed with its traceback and a line asking to
report it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

import yaml

import hybridflow
from hybridflow.utils.errors import UserError, path_error
from hybridflow.utils.logging import quiet_library_bars
from hybridflow.utils.threads import passive_wait_env

logger = logging.getLogger(__name__)

# Subcommand modules, in the order `hybridflow --help` lists them. Add a module here to add a command.
COMMANDS: tuple[str, ...] = (
    "hybridflow.cli.train_cmd",
    "hybridflow.cli.sft_cmd",
    "hybridflow.cli.dpo_cmd",
    "hybridflow.cli.kto_cmd",
    "hybridflow.cli.generate_cmd",
    "hybridflow.cli.serve_cmd",
    "hybridflow.cli.eval_cmd",
    "hybridflow.cli.export_cmd",
    "hybridflow.cli.plot_cmd",
    "hybridflow.cli.config_cmd",
    "hybridflow.cli.plan_cmd",
)

EXIT_USER_ERROR = 2
EXIT_WORKER_ERROR = 1
EXIT_INTERNAL_ERROR = 1


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="RL post-training for LLMs on the HybridFlow design.",
    )
    parser.add_argument("--version", action="version", version=f"hybridflow {hybridflow.__version__}")
    add_log_level(parser, "INFO")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(name)
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
        for leaf in _leaves(
            sub
        ):  # `hybridflow train run.yaml --log-level DEBUG` as well as before the command
            add_log_level(leaf, argparse.SUPPRESS)
    return parser


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level``; a command's own copy defaults to SUPPRESS, leaving the top-level value unless given."""
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Console log level (default INFO).",
    )


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that read a command's arguments: ``parser``, or its actions' (``config show``)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return [parser]
    return [leaf for a in actions for sub in dict.fromkeys(a.choices.values()) for leaf in _leaves(sub)]


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may come before, between and after a command's options.

    argparse fills a ``nargs="*"`` positional from one run of arguments only, so ``plan a=1 --gpus 8 b=2``
    would leave ``b=2`` unrecognised: such leftovers join the command's ``args`` (its config file and
    overrides), in the order given. Anything else left over (an unknown option) stays argparse's error.
    """
    args, extra = parser.parse_known_args(argv)
    positional = getattr(args, "args", None)
    if extra and isinstance(positional, list) and not any(a.startswith("-") for a in extra):
        args.args = [*positional, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hybridflow`` command line; returns the exit status."""
    # First, before anything imports torch: OpenMP reads its wait policy once, when torch loads it, and every
    # process this one starts (ranks, reward workers) inherits the environment (utils/threads.py).
    passive_wait_env(os.environ)
    quiet_library_bars(os.environ, sys.stderr.isatty())
    parser = build_parser()
    args = parse_args(parser, argv)  # --help and --version exit here, before anything heavy is imported
    from hybridflow.utils.logging import setup_console_logging

    setup_console_logging(args.log_level)
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    try:
        # The cheap checks (config, files, directories, model directories) come before the command imports
        # torch or loads a model, so a mistake costs a second, not the imports and the load.
        from hybridflow.cli.preflight import check_inputs

        check_inputs(args)
        return int(args.run(args) or 0)
    except (UserError, yaml.YAMLError) as exc:
        # The message already names the field or file and the fix; a traceback would bury it.
        return report_user_error(exc)
    except OSError as exc:
        if exc.filename is None:
            return report_internal_error(exc)
        return report_user_error(path_error(exc))  # a path the user gave or chose: unreadable, full, ...
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint raises a BaseException of its own
        if is_worker_error(exc):  # a rank failed: the message carries the group, role, rank and traceback
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_WORKER_ERROR
        return report_internal_error(exc)


def is_worker_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed rank's ``WorkerError`` (only possible once the worker groups were imported,
    so a command that never got that far does not pay for importing them)."""
    group = sys.modules.get("hybridflow.workers.group")
    return group is not None and isinstance(exc, group.WorkerError)


def report_internal_error(exc: BaseException) -> int:
    """The traceback and one line saying it is a bug to report; returns exit status 1.

    A collective broken by a peer rank that died (torchrun) is no bug of this rank: one line says so.
    """
    from hybridflow.utils.peers import peer_failure

    peer = peer_failure(exc)
    if peer is not None:
        logger.debug("a peer rank failed", exc_info=exc)
        print(f"error: {peer}", file=sys.stderr)
        return EXIT_WORKER_ERROR
    return report_bug(exc)


def report_user_error(exc: BaseException) -> int:
    """One ``error:`` line on stderr (the traceback only at --log-level DEBUG); returns exit status 2."""
    logger.debug("user error", exc_info=exc)
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_USER_ERROR


def report_bug(exc: BaseException) -> int:
    """The traceback and one line saying it is a bug in hybridflow to report; returns exit status 1."""
    traceback.print_exception(exc, file=sys.stderr)
    print(
        f"internal error: {type(exc).__name__}: {exc}\nThis is a bug in hybridflow {hybridflow.__version__}, "
        "not in your input; please report it to the maintainers with the command and the traceback above",
        file=sys.stderr,
    )
    return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
