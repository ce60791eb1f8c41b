"""Progress people can read: a bar on a terminal, plain lines with the rate and the time left otherwise.

Only rank 0 reports. ``Progress`` counts one phase (a rollout, a validation, a save): on a terminal a tqdm bar;
without one (a log file, CI, ``nohup``) a line every ``every_s`` seconds or ``every_n`` units while it runs,
e.g. ``rollout: 512/1024 samples · 21 samples/s · about 25 s left``, and one at the end when it took more than
``quiet_s`` (``rollout: done, 1024 samples in 48.2 s (21.2 samples/s)``), so that short phases do not flood the log
of a long run. The training loop's step line carries the same pace (``trainer.tracking``), from
``format_pace``. Units are given in the singular ("sample", "step") and counted in words ("1 step", "2 steps").
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from hybridflow.utils.logging import rank

logger = logging.getLogger("hybridflow.progress")

SEP = " · "
INVARIANT_UNITS = ("it",)  # units that take no plural "s"


def plural(unit: str, n: float = 2) -> str:
    """``unit`` for a count of ``n``: "step" for 1, "steps" otherwise ("it" stays "it")."""
    return unit if n == 1 or unit in INVARIANT_UNITS or unit.endswith("s") else f"{unit}s"


def counted(n: int, unit: str) -> str:
    """``n`` and its unit in words: "1 step", "165 steps"."""
    return f"{n} {plural(unit, n)}"


def short_duration(seconds: float) -> str:
    """A duration as a person says it: "8 s", "40 s", "3 min", "1 h 5 min"."""
    seconds = max(0.0, seconds)
    if seconds < 59.5:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min" if minutes % 60 else f"{minutes // 60} h"


def format_rate(done: float, elapsed: float, unit: str) -> str:
    """Units per second ("2.1 steps/s"), or seconds per unit when slower than one a second ("3.9 s/step")."""
    if done <= 0 or elapsed <= 0:
        return ""
    rate = done / elapsed
    return f"{rate:.3g} {plural(unit)}/s" if rate >= 1 else f"{elapsed / done:.3g} s/{unit}"


def format_pace(done: float, total: float | None, elapsed: float, unit: str) -> str:
    """The rate and, with a total, the time left at that rate: "2.1 steps/s · about 1 min left" ("" with
    nothing done yet)."""
    rate = format_rate(done, elapsed, unit)
    if not rate or total is None or done >= total:
        return rate
    left = (total - done) * elapsed / done
    return f"{rate}{SEP}about {short_duration(left)} left"


def nice_every(total: int, lines: int = 10) -> int:
    """A round interval (1, 2, 5, 10, 20, 50, ...) that says a run of ``total`` units in about ``lines`` lines
    (165 steps: every 20)."""
    want = total / max(1, lines)
    every = 1
    while every < want:
        for step in (2, 5 / 2, 2):  # 1 -> 2 -> 5 -> 10 -> 20 -> 50 -> ...
            every = round(every * step)
            if every >= want:
                break
    return every


class Progress:
    """Counts work done in one phase (``update(n)``); use as a context manager or call ``close()``."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "it",
        use_bar: bool | None = None,
        every_s: float = 30.0,
        quiet_s: float = 10.0,
        every_n: int | None = None,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.every_s, self.quiet_s, self.every_n = every_s, quiet_s, every_n
        self.done = 0
        self._said_at = 0  # ``done`` at the last line
        self.active = rank() == 0
        self.start = self._last_line = time.monotonic()
        self._bar = None
        self.elapsed: float | None = None  # set by close()
        if self.active and (sys.stderr.isatty() if use_bar is None else use_bar):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)

    def _count(self) -> str:
        if self.total is None:
            return counted(self.done, self.unit)
        return f"{self.done}/{self.total} {plural(self.unit, self.total)}"

    def line(self, now: float) -> str:
        """The line for the work done so far, e.g. ``rollout: 512/1024 samples · 21 samples/s · about 25 s left``."""
        pace = format_pace(self.done, self.total, now - self.start, self.unit)
        return f"{self.desc}: {self._count()}" + (f"{SEP}{pace}" if pace else "")

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units of work."""
        self.done += n
        if not self.active:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        due_n = self.every_n is not None and self.done - self._said_at >= self.every_n
        if due_n or now - self._last_line >= self.every_s:
            self._last_line, self._said_at = now, self.done
            logger.info("%s", self.line(now))

    def close(self) -> float:
        """End the phase (again: no effect); returns its duration in seconds."""
        if self.elapsed is not None:
            return self.elapsed
        elapsed = self.elapsed = time.monotonic() - self.start
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.active and elapsed >= self.quiet_s:
            if not self.done and self.total is None:  # a phase that counts nothing (a save)
                logger.info("%s: done in %.1f s", self.desc, elapsed)
            else:
                rate = format_rate(self.done, elapsed, self.unit)
                pace = f" ({rate})" if rate else ""
                logger.info("%s: done, %s in %.1f s%s", self.desc, self._count(), elapsed, pace)
        return elapsed

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
