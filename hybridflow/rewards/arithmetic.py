"""Scorer of the built-in arithmetic task: the response must state ``#### <integer>``."""

from __future__ import annotations

import re

# "#### 42" with an optional minus; a decimal ("#### 4.2") is not an integer answer and does not match, while
# a full stop ending the sentence ("#### 42.") does. At most 1000 digits: int() refuses more than 4300.
_ANSWER = re.compile(r"####\s*(-?\d{1,1000})(?![0-9]|[.,][0-9])")


def extract_answer(solution_str: str) -> int | None:
    """The integer after the last ``####`` marker, or None when the response has none."""
    found = _ANSWER.findall(solution_str)
    return int(found[-1]) if found else None


def ground_truth_int(ground_truth: object) -> int:
    """The ground truth as an int (the task stores it as an int or a string of digits)."""
    if isinstance(ground_truth, bool):
        raise ValueError(f"arithmetic ground_truth must be an integer, got {ground_truth!r}")
    if isinstance(ground_truth, float) and ground_truth.is_integer():
        return int(ground_truth)
    try:
        return int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"arithmetic ground_truth must be an integer, got {ground_truth!r}") from None


def compute_score(solution_str: str, ground_truth: int | str) -> float:
    """1.0 when the ``#### <integer>`` answer equals the ground truth, else 0.0 (no format credit)."""
    truth = ground_truth_int(ground_truth)
    answer = extract_answer(solution_str)
    return 1.0 if answer == truth else 0.0
