"""Countdown scorer (TinyZero / verl): an equation in ``<answer>...</answer>`` that reaches the target.

Rules and values follow verl's countdown scorer: every given number is used exactly once (the multiset of
integer literals equals ``numbers``); 1.0 for a right equation, 0.1 (``format_score``) for an answer that is
present but wrong, invalid or not computable, 0 without an answer. Unlike verl, the equation is never passed
to ``eval``: it is parsed with ``ast`` and only integer literals, ``+ - * /``, unary minus and parentheses
are accepted; arithmetic is exact (``fractions.Fraction``), so ``(1/3)*3`` is exactly 1. verl requires an
``Assistant:`` header because it scores prompt + response; here the text is the response alone, and the last
``<answer>`` block anywhere in it counts.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from fractions import Fraction

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DIGITS = re.compile(r"[0-9]+")
# Equations longer than this are not parsed: no real answer needs it, and it bounds the parser's work.
MAX_EQUATION_CHARS = 1000

_BINARY_OPS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def extract_equation(solution_str: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` block, stripped; None when there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def _evaluate(node: ast.AST, source: str, literals: list[int]) -> Fraction:
    """Exact value of an allowed expression node, appending each integer literal to ``literals``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        # Only plain decimal digits: "0x5" or "1_0" are ints to Python but not numbers of the puzzle.
        if not _DIGITS.fullmatch(ast.get_source_segment(source, node) or ""):
            raise ValueError("only plain decimal integers are allowed")
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left = _evaluate(node.left, source, literals)
        right = _evaluate(node.right, source, literals)
        return _BINARY_OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, source, literals)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"{type(node).__name__} is not allowed in a countdown equation")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """Exact value and integer literals of ``equation``; ValueError if not allowed, ZeroDivisionError."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise ValueError(f"equation longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(equation, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an arithmetic expression: {exc}") from exc
    literals: list[int] = []
    return _evaluate(tree.body, equation, literals), literals


def _as_int(value: object, what: str) -> int:
    """An int from an int-like value (numpy ints included, integral floats allowed); bools refused."""
    if isinstance(value, bool):
        raise ValueError(f"countdown ground_truth {what} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"countdown ground_truth {what} must be an integer, got {value!r}") from None


def parse_ground_truth(ground_truth: object) -> tuple[int, list[int]]:
    """``(target, numbers)`` from ``{"target": int, "numbers": [int, ...]}`` (lists may be numpy arrays)."""
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(
            f"countdown ground_truth must be a dict {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}"
        )
    numbers = ground_truth["numbers"]
    if isinstance(numbers, (str, bytes)) or not hasattr(numbers, "__iter__"):
        raise ValueError(f"countdown ground_truth numbers must be a list of integers, got {numbers!r}")
    return _as_int(ground_truth["target"], "target"), [_as_int(n, "numbers") for n in numbers]


def compute_score(
    solution_str: str, ground_truth: Mapping, format_score: float = 0.1, score: float = 1.0
) -> float:
    """``score`` for an equation using each number once that equals the target, else ``format_score``/0."""
    target, numbers = parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    try:
        value, literals = evaluate_equation(equation)
    except (ValueError, ZeroDivisionError):
        return float(format_score)
    if sorted(literals) != sorted(numbers) or value != target:
        return float(format_score)
    return float(score)
