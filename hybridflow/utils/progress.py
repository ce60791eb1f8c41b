"""Progress of a long phase: a bar on a terminal, plain log lines otherwise (files, CI, ``nohup``).

Only rank 0 reports. Without a terminal a phase stays silent unless it is long: a line every ``every_s``
seconds while it runs, and one at the end when it took more than ``quiet_s``, so short steps do not flood
the log of a long run.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from hybridflow.utils.logging import rank

logger = logging.getLogger("hybridflow.progress")


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
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.every_s, self.quiet_s = every_s, quiet_s
        self.done = 0
        self.active = rank() == 0
        self.start = self._last_line = time.monotonic()
        self._bar = None
        self.elapsed: float | None = None  # set by close()
        if self.active and (sys.stderr.isatty() if use_bar is None else use_bar):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)

    def _count(self) -> str:
        return (
            f"{self.done}/{self.total} {self.unit}" if self.total is not None else f"{self.done} {self.unit}"
        )

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units of work."""
        self.done += n
        if not self.active:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            logger.info("%s: %s (%.0f s)", self.desc, self._count(), now - self.start)

    def close(self) -> float:
        """End the phase (again: no effect); returns its duration in seconds."""
        if self.elapsed is not None:
            return self.elapsed
        elapsed = self.elapsed = time.monotonic() - self.start
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.active and elapsed >= self.quiet_s:
            logger.info("%s: done, %s in %.1f s", self.desc, self._count(), elapsed)
        return elapsed

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
