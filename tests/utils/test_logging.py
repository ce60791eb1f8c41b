"""Library progress bars are turned off only where they would litter a log file."""

from __future__ import annotations

from hybridflow.utils.logging import quiet_library_bars


def test_library_bars_are_off_without_a_terminal_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert quiet_library_bars(env, tty=False) and env == {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    on_terminal: dict[str, str] = {}
    assert not quiet_library_bars(on_terminal, tty=True) and on_terminal == {}
    mine = {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    assert not quiet_library_bars(mine, tty=False) and mine == {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}
