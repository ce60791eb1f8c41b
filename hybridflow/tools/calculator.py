"""The ``calc`` tool: arithmetic on numbers, evaluated from the expression's syntax tree (never ``eval``).

Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Everything else
(names, calls, attributes, strings, comparisons) is refused. Sizes are bounded so that a model cannot stall
the trainer with ``9**9**9``: the exponent of ``**``, the bits of any integer result and the length of the
expression are capped. Results are integers printed exactly, or floats printed with ``repr``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from hybridflow.tools.registry import Tool

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_INT_BITS = 4096  # about 1233 decimal digits

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def _bits(value: float) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_size(op: type[ast.operator], left: float, right: float) -> None:
    """Refuse, before computing it, an operation whose integer result would exceed MAX_INT_BITS."""
    if op is ast.Pow:
        if abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and _bits(left) * right > MAX_INT_BITS
        ):
            raise CalcError(f"result of {left}**{right} would be too large (over {MAX_INT_BITS} bits)")
    elif op is ast.Mult and _bits(left) + _bits(right) > MAX_INT_BITS:
        raise CalcError(f"product would be too large (over {MAX_INT_BITS} bits)")


def _eval(node: ast.AST) -> float:
    """Value of an allowed node; CalcError for anything else."""
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _check_size(type(node.op), left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise CalcError("division by zero") from exc
        except OverflowError as exc:
            raise CalcError("result is too large for a float") from exc
        if isinstance(result, complex):  # (-8) ** 0.5
            raise CalcError("result is a complex number")
        if _bits(result) > MAX_INT_BITS:
            raise CalcError(f"result is too large (over {MAX_INT_BITS} bits)")
        return result
    raise CalcError(
        f"unsupported syntax: {type(node).__name__} (only numbers, + - * / // % ** and parentheses)"
    )


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalcError for anything but bounded arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(
            f"expression is too long ({len(expression)} characters, at most {MAX_EXPRESSION_CHARS})"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalcError(f"not a valid expression: {exc.msg}") from exc
    except (ValueError, MemoryError, RecursionError) as exc:  # null bytes, absurd nesting
        raise CalcError("not a valid expression") from exc
    try:
        return _eval(tree)
    except RecursionError as exc:
        raise CalcError("expression is nested too deeply") from exc


def calc(expression: str) -> str:
    """The ``calc`` tool's function: the expression's value as text (raises CalcError, a tool error)."""
    value = evaluate(expression)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError(f"result is not finite ({value!r})")
    return repr(value) if isinstance(value, float) else str(value)


def calculator_tool() -> Tool:
    """The ``calc`` Tool (one string parameter, ``expression``)."""
    return Tool(
        name="calc",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12+3)*4/5"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        function=calc,
    )
