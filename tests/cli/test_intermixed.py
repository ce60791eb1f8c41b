"""Every command that takes ``key=value`` overrides takes them before, between and after its options
(``--log-level`` included, which every command also accepts after its name), and a bad override after an
option is still one ``error:`` line naming it (exit status 2, no traceback; bad-input sweep)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import cli_cases

from hybridflow.cli.main import build_parser, main, parse_args

# command words, its options (each a list of strings), and the first argument the command needs first
# (a config file: ``eval`` reads one; "" for none)
COMMANDS = {
    "train": (["train"], [["--log-level", "warning"]], ""),
    "sft": (["sft"], [["--out", "OUT"], ["--overwrite"], ["--log-level", "warning"]], ""),
    "dpo": (["dpo"], [["--log-level", "info"]], ""),
    "kto": (["kto"], [["--log-level", "error"]], ""),
    "eval": (["eval"], [["--out", "OUT"], ["--overwrite"]], "run.yaml"),
    "config": (["config", "show"], [["--log-level", "error"]], ""),
    "plan": (["plan"], [["--gpus", "2"], ["--gpu-memory-gb", "80"], ["--model-shape", "qwen2.5-0.5b"]], ""),
}
OVERRIDES = ["rollout.n=4", "actor_rollout_ref.actor.optim.lr=2e-6", "data.train_batch_size=8"]


pytestmark = pytest.mark.usefixtures("restore_cli_logging")


def _placements(options: list[list[str]]) -> dict[str, list[str]]:
    """The overrides before all options, after all of them, and one between each option and the next."""
    flat = [word for option in options for word in option]
    between: list[str] = []
    for i, option in enumerate(options):
        between += [*OVERRIDES[i : i + 1], *option]
    between += OVERRIDES[len(options) :]
    return {"before": [*OVERRIDES, *flat], "after": [*flat, *OVERRIDES], "between": between}


@pytest.mark.parametrize("placement", ["before", "after", "between"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_takes_overrides_before_and_after_its_options(command: str, placement: str) -> None:
    words, options, first = COMMANDS[command]
    argv = [*words, *([first] if first else []), *_placements(options)[placement]]
    args = parse_args(build_parser(), argv)
    assert args.args == [*([first] if first else []), *OVERRIDES]  # in the order given
    given = dict(zip((o[0] for o in options), (o[1] if len(o) > 1 else True for o in options)))
    for flag, value in given.items():
        attribute = getattr(args, flag.lstrip("-").replace("-", "_"))
        assert attribute == (value.upper() if flag == "--log-level" else value)


def test_the_log_level_before_the_command_still_counts_and_after_it_wins() -> None:
    parser = build_parser()
    assert parse_args(parser, ["train", "rollout.n=2"]).log_level == "INFO"
    assert parse_args(parser, ["--log-level", "debug", "train", "rollout.n=2"]).log_level == "DEBUG"
    assert parse_args(parser, ["--log-level", "debug", "plan", "--log-level", "error"]).log_level == "ERROR"


def _bad_after_an_option(env: cli_cases.Env, command: str) -> tuple[list[str], str]:
    """``hybridflow COMMAND [FIRST] rollout.n=4 OPTIONS no_such.key=1``: the key the error line must name."""
    words, options, first = COMMANDS[command]
    lead = []
    if first:  # eval reads its config file first: a real one
        (env.tmp / first).write_text("rollout:\n  n: 2\n")
        lead = [str(env.tmp / first)]
    flat = [str(env.tmp / "out") if w == "OUT" else w for option in options for w in option]
    named = [f"model.path={env.model}"] if command in ("dpo", "kto") else []  # not the built-in demo
    return [*words, *lead, *named, "rollout.n=4", *flat, "no_such.key=1"], "no_such.key"


@cli_cases.sweep(_bad_after_an_option)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_override_after_an_option_is_one_error_line_naming_it(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = cli_cases.Env(tmp_path / "model", lambda: tmp_path, tmp_path)
    argv, named = _bad_after_an_option(env, command)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    (line,) = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert named in line and "unknown config key" in line


def test_an_unknown_option_after_overrides_is_still_argparses_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "rollout.n=4", "--log-level", "debug", "--verbose", "rollout.n=2"])
    assert info.value.code == 2
    assert "unrecognized arguments: --verbose" in capsys.readouterr().err
