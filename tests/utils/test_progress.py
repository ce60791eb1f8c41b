"""Phase progress: plain lines only for long phases when there is no terminal."""

from __future__ import annotations

import pytest

from hybridflow.utils import progress as progress_mod
from hybridflow.utils.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_for_long_phases_only(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    clock = FakeClock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    with caplog.at_level("INFO", logger="hybridflow.progress"):
        with Progress("rollout", total=8, unit="samples", use_bar=False) as p:
            p.update(4)
            clock.now = 5.0
        assert caplog.text == ""  # 5 s: a short phase says nothing
        p = Progress("save", total=2, use_bar=False, every_s=30, quiet_s=10)
        clock.now = 40.0
        p.update(1)  # 35 s since the start: an intermediate line
        clock.now = 45.0
        assert p.close() == pytest.approx(40.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["save: 1/2 it (35 s)", "save: done, 1/2 it in 40.0 s"]


def test_bar_on_a_terminal_and_silence_off_rank_zero(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with Progress("validation", total=3, use_bar=True) as p:
        p.update(3)
    assert "validation" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    with Progress("validation", total=3, use_bar=True) as p:
        p.update(3)
    assert capsys.readouterr().err == ""
    assert p.done == 3
