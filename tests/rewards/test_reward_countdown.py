"""Countdown scorer: exact multiset of numbers, safe evaluation with ast, verl's 1.0 / 0.1 / 0 values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from hybridflow.rewards.countdown import compute_score, evaluate_equation, extract_equation

GT = {"target": 24, "numbers": [2, 3, 4]}


def test_right_equation_scores_one():
    assert compute_score("<think>2*3 is 6, times 4</think> <answer>2*3*4</answer>", GT) == 1.0
    assert compute_score("<answer> (4 * 3) * 2 </answer>", GT) == 1.0
    # Exact arithmetic: (1/3)*3 is exactly 1.
    assert compute_score("<answer>(1/3)*3</answer>", {"target": 1, "numbers": [1, 3, 3]}) == 1.0
    assert compute_score("<answer>-5+3</answer>", {"target": -2, "numbers": [5, 3]}) == 1.0


def test_wrong_value_gets_the_format_score():
    assert compute_score("<answer>4+2*3</answer>", GT) == 0.1  # = 10
    assert compute_score("<answer>4+2*3</answer>", GT, format_score=0.0) == 0.0


def test_numbers_must_be_used_exactly_once():
    assert compute_score("<answer>4*3*2+2-2</answer>", GT) == 0.1  # 2 used three times
    assert compute_score("<answer>4*3*2*1</answer>", GT) == 0.1  # 1 was not given
    assert compute_score("<answer>2*3*4</answer>", {"target": 24, "numbers": [2, 3, 4, 1]}) == 0.1  # 1 unused


def test_disallowed_syntax_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    response = f"<answer>open({str(marker)!r}, 'w')</answer>"
    assert compute_score(response, GT) == 0.1
    assert not marker.exists()
    assert compute_score("<answer>2**3*3</answer>", {"target": 24, "numbers": [2, 3, 3]}) == 0.1  # no power
    assert compute_score("<answer>2.0*3*4</answer>", GT) == 0.1  # no float literals
    assert compute_score("<answer>0x10+8</answer>", {"target": 24, "numbers": [16, 8]}) == 0.1  # hex
    assert compute_score("<answer>16+8</answer>", {"target": 24, "numbers": [16, 8]}) == 1.0
    assert compute_score("<answer>2*3*4 = 24</answer>", GT) == 0.1  # not an expression
    assert compute_score("<answer>" + "(" * 300 + "2" + ")" * 300 + "</answer>", GT) == 0.1


def test_division_by_zero_gets_the_format_score():
    assert compute_score("<answer>4/(2-2)</answer>", {"target": 4, "numbers": [4, 2, 2]}) == 0.1


def test_missing_answer_scores_zero_and_the_last_block_counts():
    assert compute_score("2*3*4 = 24", GT) == 0.0
    assert compute_score("<answer>2*3*4", GT) == 0.0
    assert compute_score("<answer>1+1</answer> no, <answer>2*3*4</answer>", GT) == 1.0
    assert extract_equation("<answer>\n2*3*4\n</answer>") == "2*3*4"


def test_evaluate_equation_returns_value_and_literals():
    assert evaluate_equation("(1+2)*3") == (Fraction(9), [1, 2, 3])
    with pytest.raises(ZeroDivisionError):
        evaluate_equation("1/0")
    with pytest.raises(ValueError, match="Call"):
        evaluate_equation("abs(3)")


def test_ground_truth_forms():
    assert (
        compute_score("<answer>2*3*4</answer>", {"target": np.int64(24), "numbers": np.array([4, 3, 2])})
        == 1.0
    )
    with pytest.raises(ValueError, match="target"):
        compute_score("<answer>2</answer>", {"numbers": [2]})
    with pytest.raises(ValueError, match="countdown ground_truth"):
        compute_score("<answer>2</answer>", "24")
    with pytest.raises(ValueError, match="integer"):
        compute_score("<answer>2</answer>", {"target": "x", "numbers": [2]})
