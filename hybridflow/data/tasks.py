"""Built-in synthetic tasks in verl's row schema: no download, seeded, disjoint train/test splits.

Every problem belongs to exactly one split, decided by a stable hash of the problem itself (CRC32 of its
canonical key), not by the seed or the sizes: about one problem in five is a test problem. So
``make_task(name, "train", ...)`` and ``make_task(name, "test", ...)`` never share a problem, whatever
seeds and sizes are used; the seed only picks which problems of the split are drawn, and in what order.
Problems are unique within one split.

Prompts are short single user turns because the demo model is character-level (one token per char).
Each row also carries the reference SFT response in ``extra_info["answer"]``; the rows of a task that is
answered with a tool (``multiply``, see ``TOOL_TASKS``) also carry a demonstration in ``messages`` (the user
turn, the assistant's call, the tool's result, the answer) for the multi-turn SFT warm-up. ``squares``
(``data.squares``) is a visual task: its rows carry a generated image and need a vision-language model.
The split and drawing helpers all tasks share live in ``data.task_rows``.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from hybridflow.data.squares import make_squares
from hybridflow.data.task_rows import SPLITS, TEST_BUCKETS, in_test_split  # noqa: F401 (the task API)
from hybridflow.data.task_rows import check_task_args as _check_args
from hybridflow.data.task_rows import draw_unique as _draw_unique
from hybridflow.data.task_rows import task_row as _row
from hybridflow.utils.errors import UserError

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def make_arithmetic(
    size: int,
    seed: int,
    split: str = "train",
    digits: int = 2,
    ops: str = "+-",
    allow_negative: bool = False,
    terms: int = 2,
    style: str = "question",
) -> list[dict[str, Any]]:
    """Problems 'a op b [op c ...]' with ``digits``-digit operands, answered as '#### <int>'.

    ``terms`` operands are combined left to right. ``-`` keeps every result >= 0 unless ``allow_negative``
    (with two terms by ordering the operands, with more by redrawing); ``/`` only makes exact divisions (two
    terms). ``style`` is "question" ('What is 37 + 58? Answer as #### <number>.') or "short" ('37+58=').
    Ground truth: the result as a str.
    """
    _check_args(size, split, ops)
    if not isinstance(digits, int) or digits < 1:
        raise UserError(f"digits must be an int >= 1, got {digits!r}")
    if not isinstance(terms, int) or terms < 2 or (terms > 2 and "/" in ops):
        raise UserError(f"terms must be an int >= 2 (and 2 when ops has '/'), got {terms!r}")
    if style not in ("question", "short"):
        raise UserError(f"style must be 'question' or 'short', got {style!r}")
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1

    def draw(rng: random.Random) -> tuple[str, tuple[list[int], list[str], int]] | None:
        nums = [rng.randint(lo, hi) for _ in range(terms)]
        signs = [rng.choice(ops) for _ in range(terms - 1)]
        if terms == 2 and signs[0] == "-" and nums[0] < nums[1] and not allow_negative:
            nums.reverse()
        if terms == 2 and signs[0] == "/":
            if nums[1] == 0:
                return None
            nums[0] *= nums[1]  # a / b is exact by construction
        result = Fraction(nums[0])
        for op, n in zip(signs, nums[1:]):
            result = _apply(op, result, Fraction(n))
            if result is None or (result < 0 and not allow_negative):
                return None
        text = "".join(f"{n}{op}" for n, op in zip(nums, signs)) + str(nums[-1])
        return text, (nums, signs, int(result))

    rows = []
    for i, (nums, signs, result) in enumerate(_draw_unique("arithmetic", size, seed, split, draw)):
        expr = "".join(f"{n} {op} " for n, op in zip(nums, signs)) + str(nums[-1])
        content = (
            f"What is {expr}? Answer as #### <number>."
            if style == "question"
            else expr.replace(" ", "") + "="
        )
        rows.append(_row("arithmetic", split, i, content, str(result), f"#### {result}"))
    return rows


def _apply(op: str, x: Fraction, y: Fraction) -> Fraction | None:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    return None if y == 0 else x / y


def _countdown_expression(rng: random.Random, numbers: list[int], ops: str) -> tuple[str, int] | None:
    """A random left-to-right expression using every number once; None unless all steps stay integral."""
    order = numbers[:]
    rng.shuffle(order)
    text, value, top = str(order[0]), Fraction(order[0]), 3  # top: precedence of the outermost operator
    for n in order[1:]:
        op = rng.choice(ops)
        value = _apply(op, value, Fraction(n))
        if value is None or value.denominator != 1:
            return None  # keep every intermediate integral so the reference answer evaluates exactly
        left = f"({text})" if top < _PRECEDENCE[op] else text
        text, top = f"{left} {op} {n}", _PRECEDENCE[op]
    return text, int(value)


def make_countdown(
    size: int,
    seed: int,
    split: str = "train",
    num_count: int = 3,
    max_number: int = 20,
    ops: str = "+-*",
    max_target: int = 100,
) -> list[dict[str, Any]]:
    """Countdown: combine ``num_count`` numbers in [1, max_number] once each with ``ops`` to hit the target.

    The target is the value (in [1, max_target]) of a random expression over all the numbers, which is
    also the reference answer '<answer>expr</answer>'. Ground truth: {"target": int, "numbers": [int]}.
    """
    _check_args(size, split, ops)
    if num_count < 2 or max_number < 1 or max_target < 1:
        raise UserError(
            f"need num_count >= 2, max_number >= 1 and max_target >= 1; got {num_count}, {max_number}, "
            f"{max_target}"
        )

    def draw(rng: random.Random) -> tuple[str, tuple[list[int], int, str]] | None:
        numbers = [rng.randint(1, max_number) for _ in range(num_count)]
        made = _countdown_expression(rng, numbers, ops)
        if made is None or not 1 <= made[1] <= max_target:
            return None
        expr, target = made
        return f"{sorted(numbers)}={target}", (numbers, target, expr)

    rows = []
    op_list = " ".join(ops)
    for i, (numbers, target, expr) in enumerate(_draw_unique("countdown", size, seed, split, draw)):
        nums = ", ".join(map(str, numbers))
        content = f"Use {nums} once each with {op_list} to make {target}. Answer as <answer>...</answer>."
        ground_truth = {"target": target, "numbers": numbers}
        rows.append(_row("countdown", split, i, content, ground_truth, f"<answer>{expr}</answer>"))
    return rows


CALL_FORMATS = ("plain", "hermes")


def tool_call_text(expression: str, call_format: str) -> str:
    """An assistant turn that calls the ``calc`` tool on ``expression``, in ``call_format``."""
    if call_format == "plain":
        return f"[[calc: {expression}]]"
    body = {"name": "calc", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def make_multiply(
    size: int,
    seed: int,
    split: str = "train",
    digits: int = 3,
    factors: int = 2,
    call_fraction: float = 1.0,
    call_format: str = "plain",
    style: str = "short",
    full_width: bool = True,
) -> list[dict[str, Any]]:
    """Products of ``factors`` numbers of ``digits`` digits, answered as '#### <int>': a task where a tool pays.

    A tiny model cannot multiply 347 by 581 in its head, but it can copy the expression into a ``calc`` call
    and copy the result into its answer. ``messages`` holds the demonstration for the SFT warm-up: for a
    ``call_fraction`` of the rows (a stable hash of the problem decides which) the assistant calls ``calc``
    (``call_format`` "plain": ``[[calc: 347*581]]``, or "hermes"), reads the tool turn and answers; the other
    rows answer at once (with the right number, which a tiny model cannot learn: RL finds that the tool pays).
    ``style`` is "short" ('347*581=') or "question". ``full_width`` keeps only products of exactly
    ``digits * factors`` digits: every answer has the same width, so a tiny model copies it by position.
    Ground truth: the product as a str.
    """
    _check_args(size, split, "*")
    if not isinstance(digits, int) or digits < 1 or not isinstance(factors, int) or factors < 2:
        raise UserError(
            f"need digits >= 1 and factors >= 2 (ints), got digits={digits!r} factors={factors!r}"
        )
    if not isinstance(call_fraction, (int, float)) or not 0 <= call_fraction <= 1:
        raise UserError(f"call_fraction must be a number in [0, 1], got {call_fraction!r}")
    if call_format not in CALL_FORMATS or style not in ("question", "short"):
        raise UserError(
            f"call_format must be one of {CALL_FORMATS} (as rollout.multi_turn.format) and style 'question' or "
            f"'short'; got {call_format!r}, {style!r}"
        )
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1

    def draw(rng: random.Random) -> tuple[str, list[int]] | None:
        nums = [rng.randint(lo, hi) for _ in range(factors)]
        if full_width and len(str(math.prod(nums))) < digits * factors:
            return None
        return "*".join(map(str, nums)), nums

    rows = []
    for i, nums in enumerate(_draw_unique("multiply", size, seed, split, draw)):
        expr = "*".join(map(str, nums))
        product = str(math.prod(nums))
        content = (
            f"{expr}="
            if style == "short"
            else f"What is {' * '.join(map(str, nums))}? Answer as #### <number>."
        )
        row = _row("multiply", split, i, content, product, f"#### {product}")
        calls = zlib.crc32(f"multiply-call:{expr}".encode()) % 1000 < round(1000 * call_fraction)
        call = [
            {"role": "assistant", "content": tool_call_text(expr, call_format)},
            {"role": "tool", "content": product},
        ]
        answer = {"role": "assistant", "content": f"#### {product}"}
        row["messages"] = [*row["prompt"], *(call if calls else []), answer]
        rows.append(row)
    return rows


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": make_arithmetic,
    "countdown": make_countdown,
    "multiply": make_multiply,
    "squares": make_squares,  # a visual task: needs a vision-language model
}
# Built-in tasks answered with a tool: task -> the built-in tool they need (rollout.multi_turn.tools). The
# config layer keeps its own copy (config.validate_async.TOOL_TASKS); a test checks that they agree.
TOOL_TASKS: dict[str, str] = {"multiply": "calc"}


def make_task(name: str, split: str, size: int, seed: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Rows of a built-in task's ``split``; ``kwargs`` set its difficulty (see make_arithmetic/make_countdown)."""
    if name not in TASKS:
        raise UserError(f"unknown built-in task {name!r}; use one of {sorted(TASKS)}")
    return TASKS[name](size=size, seed=seed, split=split, **kwargs)
