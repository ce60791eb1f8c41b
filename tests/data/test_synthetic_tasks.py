"""Built-in tasks: deterministic by seed, disjoint splits, correct ground truths and reference answers."""

from __future__ import annotations

import re

import pytest

from hybridflow.data import make_arithmetic, make_countdown, make_task

_ARITH = re.compile(r"^What is (-?\d+) ([-+*/]) (-?\d+)\?")
_COUNTDOWN = re.compile(r"^Use ([\d, ]+) once each with .* to make (\d+)\.")


def _content(row: dict) -> str:
    assert isinstance(row["prompt"], list) and len(row["prompt"]) == 1
    assert row["prompt"][0]["role"] == "user"
    return row["prompt"][0]["content"]


def _arith_key(row: dict) -> tuple[int, str, int]:
    a, op, b = _ARITH.match(_content(row)).groups()
    return int(a), op, int(b)


def _countdown_key(row: dict) -> tuple[tuple[int, ...], int]:
    gt = row["reward_model"]["ground_truth"]
    return tuple(sorted(gt["numbers"])), gt["target"]


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_deterministic_by_seed(name: str) -> None:
    a = make_task(name, "train", 50, seed=3)
    assert a == make_task(name, "train", 50, seed=3)
    assert a != make_task(name, "train", 50, seed=4)


@pytest.mark.parametrize(("name", "key"), [("arithmetic", _arith_key), ("countdown", _countdown_key)])
def test_splits_disjoint_and_unique(name: str, key) -> None:
    train = {key(r) for r in make_task(name, "train", 1500, seed=0)}
    test_same_seed = [key(r) for r in make_task(name, "test", 300, seed=0)]
    test_other_seed = [key(r) for r in make_task(name, "test", 300, seed=7)]
    assert len(train) == 1500  # unique within a split
    assert len(set(test_same_seed)) == 300
    assert not train & set(test_same_seed)
    assert not train & set(test_other_seed)


def test_row_schema() -> None:
    for row in make_task("arithmetic", "test", 5, seed=1) + make_task("countdown", "test", 5, seed=1):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"]["split"] == "test"
        assert len(_content(row)) < 100  # short: the demo model reads one token per char
    rows = make_task("arithmetic", "train", 4, seed=1)
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3]
    assert {r["data_source"] for r in rows} == {"arithmetic"}


@pytest.mark.parametrize(
    ("digits", "ops", "allow_negative", "size"),
    [(2, "+-", False, 200), (3, "+-*/", False, 200), (1, "-", True, 60)],
)
def test_arithmetic_answers(digits: int, ops: str, allow_negative: bool, size: int) -> None:
    rows = make_arithmetic(size, seed=5, split="train", digits=digits, ops=ops, allow_negative=allow_negative)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    negatives = 0
    for row in rows:
        a, op, b = _arith_key(row)
        assert op in ops
        gt = row["reward_model"]["ground_truth"]
        assert isinstance(gt, str)
        if op == "+":
            expected = a + b
        elif op == "-":
            expected = a - b
        elif op == "*":
            expected = a * b
        else:
            assert a % b == 0, "divisions are exact"
            expected = a // b
        assert int(gt) == expected
        assert row["extra_info"]["answer"] == f"#### {expected}"
        assert lo <= b <= hi
        assert lo <= (expected if op == "/" else a) <= hi
        negatives += expected < 0
    assert (negatives > 0) == allow_negative


def test_countdown_reference_answers() -> None:
    rows = make_countdown(200, seed=2, split="test", num_count=4, max_number=12, ops="+-*/", max_target=50)
    for row in rows:
        gt = row["reward_model"]["ground_truth"]
        nums, target = _COUNTDOWN.match(_content(row)).groups()
        assert [int(x) for x in nums.split(", ")] == gt["numbers"]
        assert int(target) == gt["target"]
        assert 1 <= gt["target"] <= 50 and len(gt["numbers"]) == 4
        assert all(1 <= n <= 12 for n in gt["numbers"])
        match = re.fullmatch(r"<answer>(.*)</answer>", row["extra_info"]["answer"])
        expr = match.group(1)
        assert set(expr) <= set("0123456789+-*/() ")
        assert sorted(int(n) for n in re.findall(r"\d+", expr)) == sorted(gt["numbers"])
        assert eval(expr) == gt["target"]  # only digits, operators and brackets (checked above)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="distinct"):
        make_arithmetic(200, seed=0, digits=1, ops="+")  # only 100 such problems exist in all
    with pytest.raises(ValueError, match="unknown built-in task"):
        make_task("sudoku", "train", 1, 0)
    with pytest.raises(ValueError, match="split"):
        make_task("arithmetic", "val", 1, 0)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic(1, seed=0, ops="+^")
    with pytest.raises(ValueError, match="digits"):
        make_arithmetic(1, seed=0, digits=0)
