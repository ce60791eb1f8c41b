"""Logging set-up: library modules log, only rank 0 talks to the console."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """Return the package logger for ``name`` (a module's ``__name__``)."""
    return logging.getLogger(name)


def rank() -> int:
    """Return this process's global rank from the environment (0 when not distributed)."""
    return int(os.environ.get("RANK", "0"))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (so redirection and test capture keep working)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_console_logging(level: str | int = "INFO") -> None:
    """Send hybridflow's log records to stderr on rank 0; other ranks only show warnings and errors."""
    root = logging.getLogger("hybridflow")
    root.setLevel(level if rank() == 0 else logging.WARNING)
    if any(isinstance(h, _StderrHandler) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)


def quiet_library_bars(env: MutableMapping[str, str], tty: bool) -> bool:
    """Turn off the progress bars of transformers and huggingface_hub ("Loading weights") when stderr is no
    terminal: in a log file each redraw is a carriage return on one endless line. A value the user set in
    ``HF_HUB_DISABLE_PROGRESS_BARS`` is kept. Returns whether the bars are off.

    transformers reads the variable when it is first imported: call this before (the command line does, first
    thing); processes started later (ranks, workers) inherit it.
    """
    if not tty and "HF_HUB_DISABLE_PROGRESS_BARS" not in env:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on")
