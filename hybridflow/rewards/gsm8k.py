"""GSM8K scorer: the ``#### <number>`` answer format with strict or flexible extraction (verl's rules).

Differences from verl's ``gsm8k.compute_score``, both in the model's favour only when the number is right: a
trailing full stop (``#### 18.``) is not part of the number, and an answer equal in value to the ground
truth (``72.0`` for ``72``, ``1,000`` for ``1000``) counts as correct (verl compares the strings).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only the tail of a response is searched: the final answer sits at the end, and regex scans of very long
# responses are slow. 300 characters is verl's window (roughly 300 tokens of digits and punctuation).
CLIP_CHARS = 300

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"\-?[0-9\.\,]+")
_METHODS = ("strict", "flexible")


def normalize_number(text: str) -> str | None:
    """Drop commas, dollar signs and a trailing full stop; None when no digit is left."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    return text if any(c.isdigit() for c in text) else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in the last ``CLIP_CHARS`` characters: after ``#### `` (strict) or the last number."""
    if method not in _METHODS:
        raise ValueError(f"gsm8k extraction method must be one of {_METHODS}, got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        # The last "#### " answer; the format itself is part of what strict scoring checks.
        found = _STRICT.findall(tail)
        return normalize_number(found[-1]) if found else None
    for candidate in reversed(_ANY_NUMBER.findall(tail)):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def _same_number(answer: str, ground_truth: str) -> bool:
    """Equal as strings, or equal as exact decimals (so ``72.0`` matches ``72``)."""
    if answer == ground_truth:
        return True
    try:
        return Decimal(answer) == Decimal(ground_truth)
    except InvalidOperation:
        return False


def compute_score(
    solution_str: str,
    ground_truth: str | int | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong but extracted one, 0 without an answer."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = normalize_number(str(ground_truth))
    if truth is None:
        raise ValueError(f"gsm8k ground_truth must be a number, got {ground_truth!r}")
    return float(score) if _same_number(answer, truth) else float(format_score)
