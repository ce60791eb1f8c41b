"""Issue 38: verl's ``VERL_*`` environment variables are honoured where they mean something (the tensor
lifecycle, always on) and otherwise named at start in one line, never silently ignored."""

from __future__ import annotations

import logging

import pytest

from hybridflow.config import load_config, startup
from hybridflow.config.startup import verl_environment_lines


@pytest.fixture
def start_lines(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The lines a job's start logs for an environment (a fresh once-per-process memory each time)."""
    monkeypatch.setattr(logging.getLogger("hybridflow"), "propagate", True)

    def lines(environ: dict[str, str]) -> list[tuple[int, str]]:
        monkeypatch.setattr(startup, "_reported", set())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hybridflow.config.startup"):
            startup.check_start(load_config(), environ, on_gpu=False)
        return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "hybridflow.config.startup"]

    return lines


def test_the_tensor_lifecycle_variable_is_answered_once(start_lines) -> None:
    (line,) = start_lines({"VERL_TENSOR_LIFECYCLE_ENABLE": "1", "PATH": "/usr/bin"})
    assert line[0] == logging.INFO
    assert line[1].startswith(
        "VERL_TENSOR_LIFECYCLE_ENABLE=1: the tensor lifecycle is always on in hybridflow"
    )
    assert "perf/lifecycle_freed_bytes" in line[1]


def test_turning_the_lifecycle_off_is_reported_as_ignored(start_lines) -> None:
    ((level, message),) = start_lines({"VERL_TENSOR_LIFECYCLE_ENABLE": "0"})
    assert level == logging.WARNING
    assert message.startswith("VERL_TENSOR_LIFECYCLE_ENABLE=0 is ignored: the tensor lifecycle is always on")


def test_every_other_verl_variable_is_named_in_one_line(start_lines) -> None:
    environ = {
        "VERL_TENSOR_LIFECYCLE_ENABLE": "1",
        "VERL_TLM_GC_INTERVAL": "5",
        "VERL_LOGGING_LEVEL": "DEBUG",
        "VERL_SGLANG_FOO": "1",
        "VERL_MADE_UP": "x",
        "HOME": "/root",
    }
    lines = start_lines(environ)
    assert [level for level, _ in lines] == [logging.INFO, logging.WARNING]
    warning = lines[1][1]
    assert warning.startswith("environment variables hybridflow does not read: ")
    assert "VERL_TLM_GC_INTERVAL=5 (batch keys are freed as soon as their last reader has run" in warning
    assert "VERL_LOGGING_LEVEL=DEBUG (pass --log-level" in warning
    assert "VERL_SGLANG_FOO=1 (the built-in rollout engine runs in place of vLLM and SGLang)" in warning
    assert "VERL_MADE_UP=x (unknown to hybridflow)" in warning
    assert "HOME" not in warning and "\n" not in warning


def test_nothing_is_said_without_verl_variables(start_lines) -> None:
    assert start_lines({"PATH": "/usr/bin", "RANK": "0"}) == []
    assert verl_environment_lines({}) == []


def test_only_rank_0_reports_and_each_line_once(start_lines, monkeypatch: pytest.MonkeyPatch) -> None:
    assert start_lines({"VERL_TLM_GC_INTERVAL": "5", "RANK": "1"}) == []
    environ = {"VERL_TLM_GC_INTERVAL": "5"}
    assert len(start_lines(environ)) == 1
    startup.check_start(load_config(), environ, on_gpu=False)  # a second job in the same process: silent
    assert len(startup._reported) == 1


def test_a_job_start_reports_them(monkeypatch: pytest.MonkeyPatch, start_lines, caplog) -> None:
    # the one call in trainer.jobs.start_job, with the process's own environment
    from hybridflow.trainer.jobs import start_job

    monkeypatch.setenv("VERL_TLM_GC_INTERVAL", "7")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(startup, "_reported", set())
    with caplog.at_level(logging.INFO, logger="hybridflow.config.startup"):
        start_job(load_config(overrides=["trainer.device=cpu"]))
    assert any("VERL_TLM_GC_INTERVAL=7" in r.getMessage() for r in caplog.records)
