"""Phase progress: plain lines only for long phases when there is no terminal."""

from __future__ import annotations

import pytest

from hybridflow.utils import progress as progress_mod
from hybridflow.utils.progress import Progress, counted, format_pace, format_rate, nice_every, short_duration


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
    assert lines == ["save: 1/2 it · 35 s/it · about 35 s left", "save: done, 1/2 it in 40.0 s (40 s/it)"]


def test_lines_give_the_rate_and_the_time_left(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    clock = FakeClock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    with caplog.at_level("INFO", logger="hybridflow.progress"):
        with Progress("rollout", total=1024, unit="sample", use_bar=False, every_s=30) as p:
            for _ in range(8):
                clock.now += 6.0
                p.update(64)  # 64 samples every 6 s
        with Progress("validation", total=12, unit="sample", use_bar=False, every_n=5, quiet_s=60) as p:
            for _ in range(12):
                clock.now += 2.0
                p.update(1)
        with Progress("update actor", unit="step", use_bar=False, quiet_s=1) as p:
            clock.now += 12.0
            p.update()
        with Progress("save global_step_40", use_bar=False, quiet_s=1):
            clock.now += 3.0
    assert [r.getMessage() for r in caplog.records] == [
        "rollout: 320/1024 samples · 10.7 samples/s · about 1 min left",
        "rollout: done, 512/1024 samples in 48.0 s (10.7 samples/s)",  # closed early: what was done
        "validation: 5/12 samples · 2 s/sample · about 14 s left",
        "validation: 10/12 samples · 2 s/sample · about 4 s left",
        "update actor: done, 1 step in 12.0 s (12 s/step)",  # one step, not "1 steps"
        "save global_step_40: done in 3.0 s",
    ]


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.2, "1 s"),
        (8.4, "8 s"),
        (59.4, "59 s"),
        (59.6, "1 min"),
        (150, "2 min"),
        (3599, "1 h"),
        (3900, "1 h 5 min"),
    ],
)
def test_durations_read_as_people_say_them(seconds: float, said: str) -> None:
    assert short_duration(seconds) == said


def test_counts_and_rates_in_words() -> None:
    assert counted(1, "step") == "1 step" and counted(0, "step") == "0 steps" and counted(2, "it") == "2 it"
    assert format_rate(40, 20.0, "step") == "2 steps/s" and format_rate(1, 3.9, "step") == "3.9 s/step"
    assert format_rate(0, 5.0, "step") == "" and format_pace(0, 10, 0.0, "step") == ""
    assert format_pace(40, 165, 19.0, "step") == "2.11 steps/s · about 59 s left"
    assert format_pace(165, 165, 80.0, "step") == "2.06 steps/s"  # done: nothing left to estimate
    assert format_pace(3, None, 1.0, "step") == "3 steps/s"  # no total: the rate alone


@pytest.mark.parametrize(("total", "every"), [(3, 1), (10, 1), (60, 10), (165, 20), (450, 50), (1000, 100)])
def test_about_ten_lines_a_run_at_round_intervals(total: int, every: int) -> None:
    assert nice_every(total) == every


def test_bar_on_a_terminal_and_silence_off_rank_zero(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with Progress("validation", total=3, use_bar=True) as p:
        p.update(3)
    assert "validation" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    with Progress("validation", total=3, use_bar=True) as p:
        p.update(3)
    assert capsys.readouterr().err == ""
    assert p.done == 3
