"""Scorer of the squares task (hybridflow/rewards/squares.py) and the data_source routes of the image datasets."""

from __future__ import annotations

import pytest

from hybridflow.rewards import default_compute_score, known_data_sources
from hybridflow.rewards.squares import compute_score


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("#### 2", "2", 1.0),
        ("There are two red squares.\n#### 2.", 2, 1.0),
        ("#### 3 ... no, #### 1", "1", 1.0),  # the last answer counts
        ("#### 1", "2", 0.0),
        ("2", "2", 1.0),  # the short style's bare count
        (" 3 red squares", 3, 1.0),
        ("2 squares, #### 1", "1", 1.0),  # a '####' answer wins over the leading number
        ("There are 2", "2", 0.0),  # a number further in is not an answer
        ("2.5", "2", 0.0),
        ("", "0", 0.0),
        ("#### 0", "0", 1.0),
        ("#### 12", "1", 0.0),
    ],
)
def test_squares_scorer(response: str, truth: str | int, score: float) -> None:
    """Right counts score 1, wrong or missing ones 0."""
    assert compute_score(response, truth) == score


def test_routes_of_the_image_datasets() -> None:
    """'squares' and verl's geo3k data_source have built-in scorers; geo3k compares boxed LaTeX answers."""
    assert {"squares", "hiyouga/geometry3k"} <= set(known_data_sources())
    assert default_compute_score("squares", "#### 3", "3") == 1.0
    geo = "hiyouga/geometry3k"
    assert default_compute_score(geo, "<think>so</think> \\boxed{3\\sqrt{3}}", "3 \\sqrt { 3 }") == 1.0
    assert default_compute_score(geo, "the answer is \\boxed{\\frac{20}{3}}", "\\frac{20}{3}") == 1.0
    assert default_compute_score(geo, "\\boxed{65}", "65") == 1.0
    assert default_compute_score(geo, "\\boxed{64}", "65") == 0.0
    assert default_compute_score(geo, "65", "65") == 0.0  # verl's geo3k answers are boxed
