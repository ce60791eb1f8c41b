"""Scorer of the built-in visual ``squares`` task: the count after the last ``####``, else a leading count.

The task's "question" style asks for ``#### <count>``; its "short" style is answered by the bare count
(``2``), the form a model trained by RL alone can find. A response with a ``####`` answer is judged by its
last one; one without is judged by the integer it starts with (``2 red squares``), never by a number further
in, so a response that merely mentions numbers earns nothing.
"""

from __future__ import annotations

import re

from hybridflow.rewards.arithmetic import extract_answer, ground_truth_int

_LEADING = re.compile(r"\s*(\d{1,9})(?![0-9]|[.,][0-9])")


def extract_count(solution_str: str) -> int | None:
    """The ``#### <integer>`` answer (the last one), else the integer the response starts with, else None."""
    marked = extract_answer(solution_str)
    if marked is not None:
        return marked
    leading = _LEADING.match(solution_str)
    return int(leading.group(1)) if leading else None


def compute_score(solution_str: str, ground_truth: int | str) -> float:
    """1.0 when the answered count equals the number of squares of the asked colour, else 0.0."""
    return 1.0 if extract_count(solution_str) == ground_truth_int(ground_truth) else 0.0
