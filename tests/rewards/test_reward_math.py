r"""MATH scorer: the last \boxed{} (nested braces), normalisation and exact plain-number comparison."""

from __future__ import annotations

import pytest

from hybridflow.rewards.math_reward import as_fraction, compute_score, extract_boxed_answer, strip_string


def test_extract_last_boxed_with_nested_braces():
    assert extract_boxed_answer(r"so \boxed{\frac{\sqrt{3}}{2}}.") == r"\frac{\sqrt{3}}{2}"
    assert extract_boxed_answer(r"\boxed{1} then \boxed{2}") == "2"
    assert extract_boxed_answer(r"\boxed 5$ done") == "5"
    assert extract_boxed_answer(r"\fbox{3}") == "3"
    assert extract_boxed_answer(r"answer \boxed{\frac{1}{2}") is None  # cut off inside the box
    assert extract_boxed_answer("no box at all") is None
    assert extract_boxed_answer(r"\boxed") is None


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\tfrac12}", r"\frac{1}{2}"),
        (r"\boxed{0.5}", r"\frac12"),
        (r"\boxed{.5}", r"\frac{1}{2}"),
        (r"\boxed{3/4}", r"\frac{3}{4}"),
        (r"\boxed{0.75}", "3/4"),
        (r"\boxed{\frac1{72}}", r"\frac{1}{72}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{90^{\circ}}", "90"),
        (r"\boxed{5\text{ cm}}", "5"),
        (r"\boxed{5\text{cm}}", "5"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{10\%}", "10"),
        (r"\boxed{\$18.90}", "18.90"),
        (r"\boxed{1,\!000}", "1000"),
        (r"\boxed{\sqrt2}", r"\sqrt{2}"),
        (r"\boxed{7.}", "7"),
        (r"\boxed{007}", "7"),
        (r"\boxed{\text{(B)}}", r"\text{(B)}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"The answer is \boxed{4}.", r"\boxed{4}"),  # a ground truth that keeps its box
    ],
)
def test_equivalent_answers_score_one(response, truth):
    assert compute_score(response, truth) == 1.0


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{\frac{1}{3}}", "0.33"),  # exact comparison: 0.33 is not 1/3
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),  # no symbolic algebra
        ("the answer is 4", "4"),  # no box
        (r"\boxed{\frac{4}{1}", "4"),  # unclosed box
        (r"\boxed{(1,2)}", "(1,3)"),
    ],
)
def test_wrong_or_missing_answers_score_zero(response, truth):
    assert compute_score(response, truth) == 0.0


def test_strip_string_pieces():
    assert strip_string(r"\left( 1, 2 \right)") == "(1,2)"
    assert strip_string(r"k = \frac12") == r"\frac{1}{2}"
    assert strip_string("1,234,567") == "1234567"
    assert strip_string("(1,234)") == "(1,234)"  # not a thousands separator inside a tuple


def test_as_fraction_only_for_plain_numbers():
    assert as_fraction("-0.25") == as_fraction(r"-\frac{1}{4}")
    assert as_fraction(r"\frac{1}{4}") * 4 == 1
    assert as_fraction(r"\frac{1}{0}") is None
    assert as_fraction(r"\sqrt{2}") is None
    assert compute_score(r"\boxed{1}", 1) == 1.0  # numeric ground truth
