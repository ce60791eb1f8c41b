"""default_compute_score: dispatch by data_source, keyword options, the unknown-source error."""

from __future__ import annotations

import pytest

from hybridflow.rewards import default_compute_score, known_data_sources


@pytest.mark.parametrize(
    ("data_source", "right", "wrong", "truth"),
    [
        ("openai/gsm8k", "so #### 7", "so #### 8", "7"),
        ("lighteval/MATH", r"\boxed{\frac12}", r"\boxed{2}", r"\frac{1}{2}"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{3}", r"\boxed{4}", "3"),
        ("HuggingFaceH4/MATH-500", r"\boxed{3}", r"\boxed{4}", "3"),
        ("arithmetic", "#### 12", "#### 13", 12),
        ("countdown", "<answer>1+2</answer>", "<answer>1-2</answer>", {"target": 3, "numbers": [1, 2]}),
    ],
)
def test_each_data_source_is_scored(data_source, right, wrong, truth):
    right_score = default_compute_score(data_source, right, truth)
    assert right_score == 1.0 and type(right_score) is float
    expected_wrong = 0.1 if data_source == "countdown" else 0.0
    assert default_compute_score(data_source, wrong, truth, extra_info={"index": 0}) == expected_wrong


def test_scorer_options_are_passed_and_others_ignored():
    assert default_compute_score("openai/gsm8k", "#### 8", "7", format_score=0.2) == 0.2
    assert default_compute_score("openai/gsm8k", "it is 7", "7", method="flexible") == 1.0
    # math takes no options: a mixed batch can share one set of kwargs.
    assert default_compute_score("lighteval/MATH", r"\boxed{7}", "7", method="flexible") == 1.0


def test_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(ValueError) as info:
        default_compute_score("my/dataset", "x", "y")
    message = str(info.value)
    assert "my/dataset" in message
    assert "openai/gsm8k" in message and "countdown" in message
    assert "reward.custom_function.path" in message
    assert "arithmetic" in known_data_sources()
