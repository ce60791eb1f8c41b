"""Wall-clock timers for the per-stage ``timing_s/<stage>`` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    """Accumulates named wall-clock durations in seconds."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the enclosed block and add it to ``durations[name]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, prefix: str = "timing_s/") -> dict[str, float]:
        """Return the durations as metrics named ``<prefix><name>``."""
        return {f"{prefix}{k}": v for k, v in self.durations.items()}


@contextmanager
def timed(name: str, sink: dict[str, float]) -> Iterator[None]:
    """Time the enclosed block and store the seconds in ``sink['timing_s/' + name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        sink[f"timing_s/{name}"] = time.perf_counter() - start
