"""Module-level tool functions for the tools tests (isolated tools and specs import them by path)."""

from __future__ import annotations

import time


def echo(text: str) -> str:
    """Return the text."""
    return f"echo: {text}"


def sleepy(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "woke up"


def broken(text: str) -> str:
    """Always raise."""
    raise RuntimeError(f"cannot handle {text}")


def add(a: int, b: int) -> int:
    """A non-string return value."""
    return a + b


NOT_CALLABLE = 3
