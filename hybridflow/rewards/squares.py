"""Scorer of the built-in visual ``squares`` task: the response must state ``#### <count>``."""

from __future__ import annotations

from hybridflow.rewards.arithmetic import extract_answer, ground_truth_int


def compute_score(solution_str: str, ground_truth: int | str) -> float:
    """1.0 when the last ``#### <integer>`` equals the number of squares of the asked colour, else 0.0."""
    return 1.0 if extract_answer(solution_str) == ground_truth_int(ground_truth) else 0.0
