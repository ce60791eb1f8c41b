"""The command line: `hybridflow config show` and `--version`, and user errors as one line with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import cli_cases

import hybridflow
from hybridflow.cli.config_cmd import split_file_and_overrides
from hybridflow.cli.main import main
from hybridflow.config import Config

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("restore_cli_logging")


@pytest.fixture
def run_yaml(tmp_path: Path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n: 4\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 2e-6\n")
    return str(path)


def test_show_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == Config().to_dict()


def test_show_file_and_overrides(run_yaml: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["config", "show", run_yaml, "rollout.temperature=0.7", "trainer.logger=[console,jsonl]"]) == 0
    )
    captured = capsys.readouterr()
    shown = yaml.safe_load(captured.out)
    assert shown["rollout"]["n"] == 4 and shown["rollout"]["temperature"] == 0.7
    assert shown["actor"]["optim"]["lr"] == 2e-6
    assert shown["trainer"]["logger"] == ["console", "jsonl"]


def test_show_overrides_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "rollout.n=2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 2


def test_split_file_and_overrides() -> None:
    assert split_file_and_overrides(["a.yaml", "x=1"]) == ("a.yaml", ["x=1"])
    assert split_file_and_overrides(["x=1", "y=2"]) == (None, ["x=1", "y=2"])
    assert split_file_and_overrides([]) == (None, [])


@cli_cases.sweep(cli_cases.config_show)  # the reliability sweep runs these cases too
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout.n=abc"], "error: rollout.n: expected an integer, got 'abc' (str); fix: e.g. rollout.n=8"),
        (
            ["rollout.temprature=1"],
            "error: rollout.temprature: unknown config key; fix: did you mean 'rollout.temperature'",
        ),
        (
            ["rollout.n=0", "actor.optim.lr=-1"],
            "error: 2 problems in the config:\n  - rollout.n: must be at least 1",
        ),
        (["missing.yaml"], "error: config file 'missing.yaml' not found"),
        (
            ["rollout.n=2", "rollout.top_k"],
            "error: rollout.top_k: override 'rollout.top_k' is not of the form key=value",
        ),
    ],
)
def test_user_errors_exit_2_without_traceback(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message)
    assert "Traceback" not in captured.err


def test_invalid_yaml_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1,\n")
    assert main(["config", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: is not valid YAML (line 2")
    assert "Traceback" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hybridflow {hybridflow.__version__}"


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "config" in capsys.readouterr().err


def test_real_process(tmp_path: Path, run_yaml: str) -> None:
    """A fresh interpreter: the YAML on stdout, or a bad value as one line and exit 2."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "config", "show", run_yaml]
    ok = subprocess.run([*cmd, "rollout.top_k=5"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["rollout"]["top_k"] == 5
    assert "'actor_rollout_ref.actor.optim.lr' -> 'actor.optim.lr'" in ok.stderr  # the alias notice
    bad = subprocess.run(
        [*cmd, "actor_rollout_ref.rollout.n=abc"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert (
        "error: rollout.n (given as 'actor_rollout_ref.rollout.n'): expected an integer, got 'abc'"
        in bad.stderr
    )
    assert "Traceback" not in bad.stderr


def test_config_show_lists_the_names_a_reward_module_registers(tmp_path: Path) -> None:
    """A fresh `hybridflow config show`: the module reward.custom_function.path names is imported before
    algorithm.adv_estimator is checked, and the unknown-value error lists what it registered (in-process,
    tests/trainer/test_custom_algos.py trains with such names)."""
    module = tmp_path / "my_reward.py"
    module.write_text(
        "from hybridflow import algos as core_algos\n\n\n"
        "@core_algos.register_adv_est('file_estimator')\n"
        "def file_estimator(token_level_rewards, response_mask, **kwargs):\n"
        "    return response_mask, response_mask\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli.main",
        "config",
        "show",
        f"reward.custom_function.path={module}",
    ]
    bad = subprocess.run(
        [*cmd, "algorithm.adv_estimator=file_estimatr"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "error: algorithm.adv_estimator: unknown value 'file_estimatr'" in bad.stderr
    assert (
        "tir_optimal_token_baseline, file_estimator; or register your own with @register_adv_est(name)"
        in bad.stderr
    )


def test_config_show_accepts_registered_builtins_and_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "algorithm.adv_estimator=gdpo"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["algorithm"]["adv_estimator"] == "gdpo"
    assert main(["config", "show", "actor.policy_loss.loss_mode=vanila"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: actor.policy_loss.loss_mode: unknown value 'vanila'; fix: use one of: vanilla,"
    )
    assert "@register_policy_loss(name)" in err


def test_the_readmes_quoted_errors_are_what_the_commands_print(capsys: pytest.CaptureFixture[str]) -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    quoted = [
        (line.removeprefix("$ hybridflow ").split(), lines[i + 1])
        for i, line in enumerate(lines)
        if line.startswith("$ hybridflow ") and lines[i + 1].startswith("error: ")
    ]
    assert len(quoted) >= 2
    for argv, error in quoted:
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines()[-1] == error, argv
