"""The one error type of the config system: every problem names its dotted field path and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.utils.errors import UserError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (dotted path), what, and how to fix it."""

    path: str
    message: str
    fix: str = ""
    given_as: str | None = None  # the key the user typed when it differs from path (a verl alias)

    def __str__(self) -> str:
        where = self.path if self.given_as is None else f"{self.path} (given as '{self.given_as}')"
        text = f"{where}: {self.message}"
        return f"{text}; fix: {self.fix}" if self.fix else text


class ConfigError(UserError):
    """A config that cannot be used; ``problems`` lists every problem found, each with its fix."""

    def __init__(self, problems: Sequence[Problem] | str) -> None:
        if isinstance(problems, str):
            problems = [Problem("config", problems)]
        self.problems: list[Problem] = list(problems)
        super().__init__(format_problems(self.problems))


def format_problems(problems: Sequence[Problem]) -> str:
    """One line for one problem; a counted list for several."""
    if len(problems) == 1:
        return str(problems[0])
    lines = [f"{len(problems)} problems in the config:"] + [f"  - {p}" for p in problems]
    return "\n".join(lines)
