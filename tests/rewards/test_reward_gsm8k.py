"""GSM8K scorer: strict/flexible extraction, the 300-character window, format score, normalisation."""

from __future__ import annotations

import pytest

from hybridflow.rewards.gsm8k import CLIP_CHARS, compute_score, extract_solution


def test_strict_correct_wrong_and_missing():
    assert compute_score("3 + 4 = 7 apples.\n#### 7", "7") == 1.0
    assert compute_score("3 + 4 = 8 apples.\n#### 8", "7") == 0.0
    assert compute_score("3 + 4 = 8 apples.\n#### 8", "7", format_score=0.1) == 0.1
    # No "#### " marker: strict gives nothing, not even the format score.
    assert compute_score("The answer is 7", "7", format_score=0.1) == 0.0
    assert compute_score("####7", "7") == 0.0  # the marker needs its space


def test_flexible_takes_the_last_number():
    assert compute_score("I first got 12 but the answer is 7", "7", method="flexible") == 1.0
    assert extract_solution("first 12, then 7 .", method="flexible") == "7"  # a lone "." is not a number
    assert extract_solution("no digits here.", method="flexible") is None
    assert compute_score("no digits here", "7", method="flexible", format_score=0.5) == 0.0


def test_last_marker_commas_dollars_and_full_stop():
    assert extract_solution("#### 5 was wrong, so #### 7") == "7"
    assert compute_score("#### 1,234", "1234") == 1.0
    assert compute_score("#### 7.", "7") == 1.0  # sentence-ending full stop
    assert compute_score("#### -3", "-3") == 1.0
    assert compute_score("It costs $1,250 in total", "1250", method="flexible") == 1.0
    assert compute_score("#### 7.0", "7") == 1.0  # same value (verl compares strings here)
    assert compute_score("#### 7.5", "7") == 0.0
    assert compute_score("#### 7", 7) == 1.0  # integer ground truth


def test_only_the_last_300_characters_are_read():
    assert CLIP_CHARS == 300
    inside = "#### 7" + " " * 294  # 300 characters: the marker is the first thing in the window
    outside = "#### 7" + " " * 295  # 301 characters: the first "#" falls out, "### 7" is left
    assert compute_score(inside, "7") == 1.0
    assert compute_score(outside, "7") == 0.0
    assert compute_score("#### 9 " + "x" * 400 + " #### 7", "7") == 1.0


def test_bad_method_and_bad_ground_truth():
    with pytest.raises(ValueError, match="strict"):
        extract_solution("#### 7", method="loose")
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("#### 7", "seven")
