"""How the command line reports failures: user errors in one line (exit 2), bugs with a traceback (exit 1)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from hybridflow.cli import config_cmd
from hybridflow.cli.main import main
from hybridflow.utils.errors import UserError


def _raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def run(args: object) -> int:
        raise exc

    monkeypatch.setattr(config_cmd, "run", run)


def test_a_user_error_is_one_line_with_exit_2(monkeypatch, capsys) -> None:
    _raising(monkeypatch, UserError("data.x: bad; fix: set it"))
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err == "error: data.x: bad; fix: set it\n"


@pytest.mark.parametrize("exc", [ValueError("oops"), KeyError("k"), AssertionError("a bug")])
def test_anything_else_is_an_internal_error_with_its_traceback(monkeypatch, capsys, exc) -> None:
    _raising(monkeypatch, exc)
    assert main(["config", "show"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert f"internal error: {type(exc).__name__}" in err and "This is a bug in hybridflow" in err


def test_an_os_error_of_a_path_names_the_path_and_the_fix(monkeypatch, capsys, tmp_path: Path) -> None:
    _raising(monkeypatch, PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x")))
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot use {tmp_path / 'x'}: Permission denied; fix its permissions")
    _raising(monkeypatch, OSError(errno.ENOSPC, "No space left on device", str(tmp_path)))
    assert main(["config", "show"]) == 2
    assert "error: the disk is full" in capsys.readouterr().err
