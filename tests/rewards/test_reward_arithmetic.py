"""Scorer of the built-in arithmetic task: strict ``#### <int>``, 1.0 or 0.0."""

from __future__ import annotations

import pytest

from hybridflow.rewards.arithmetic import compute_score, extract_answer


def test_right_and_wrong_answers():
    assert compute_score("12 + 30 = 42\n#### 42", 42) == 1.0
    assert compute_score("#### 42", "42") == 1.0
    assert compute_score("#### 41", 42) == 0.0
    assert compute_score("#### -7", -7) == 1.0
    assert compute_score("#### 42.", 42) == 1.0  # full stop after the number


def test_malformed_answers_score_zero():
    assert compute_score("42", 42) == 0.0  # no marker: strict
    assert compute_score("the answer is forty-two", 42) == 0.0
    assert compute_score("#### 4.2", 4) == 0.0  # not an integer
    assert compute_score("#### 4,200", 4) == 0.0
    assert extract_answer("#### abc") is None


def test_last_marker_counts():
    assert extract_answer("#### 1 ... no, #### 42") == 42
    assert compute_score("#### 42 ... no, #### 1", 42) == 0.0


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="arithmetic ground_truth"):
        compute_score("#### 1", "one")
    with pytest.raises(ValueError, match="arithmetic ground_truth"):
        compute_score("#### 1", True)
