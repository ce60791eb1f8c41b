"""The built-in multiply task: products of several-digit numbers whose rows carry a demonstration that calls the
calc tool (plain or Hermes format) on a call_fraction of them; disjoint splits; its scorer reads the episode's
final answer."""

from __future__ import annotations

import math

import pytest

from hybridflow.data import make_task
from hybridflow.rewards import default_compute_score
from hybridflow.tools import ToolSet, calculator_tool
from hybridflow.utils.errors import UserError


def _factors(row: dict) -> tuple[int, ...]:
    return tuple(int(x) for x in row["prompt"][0]["content"].rstrip("=").split("*"))


def test_splits_are_disjoint_and_the_ground_truth_is_the_product() -> None:
    train = make_task("multiply", "train", 1000, seed=0)
    test = make_task("multiply", "test", 200, seed=0) + make_task("multiply", "test", 200, seed=5)
    assert len({_factors(r) for r in train}) == 1000
    assert not {_factors(r) for r in train} & {_factors(r) for r in test}
    for row in train[:50]:
        nums = _factors(row)
        assert len(nums) == 2 and all(100 <= n <= 999 for n in nums)
        assert row["reward_model"]["ground_truth"] == str(math.prod(nums))
        assert row["extra_info"]["answer"] == f"#### {math.prod(nums)}"
    assert make_task("multiply", "train", 20, seed=3) == make_task("multiply", "train", 20, seed=3)


@pytest.mark.parametrize("fmt", ["plain", "hermes"])
def test_the_demonstrations_call_calc_and_answer_with_its_result(fmt: str) -> None:
    rows = make_task(
        "multiply", "train", 400, seed=1, digits=2, factors=3, call_fraction=0.3, call_format=fmt
    )
    tools = ToolSet([calculator_tool()])
    calls = [r for r in rows if len(r["messages"]) == 4]
    assert 0.2 < len(calls) / len(rows) < 0.4  # about call_fraction of them, by a stable hash
    for row in rows:
        user, *middle, answer = row["messages"]
        assert user == row["prompt"][0] and answer == {
            "role": "assistant",
            "content": row["extra_info"]["answer"],
        }
        if middle:
            call, result = middle
            (parsed,) = tools.parse(call["content"], fmt).calls
            assert tools.run(parsed, 5.0).text == result["content"] == row["reward_model"]["ground_truth"]
    assert {len(r["messages"]) for r in make_task("multiply", "train", 50, seed=1, call_fraction=1.0)} == {4}
    assert {len(r["messages"]) for r in make_task("multiply", "train", 50, seed=1, call_fraction=0)} == {2}


@pytest.mark.parametrize(
    "kwargs",
    [{"digits": 0}, {"factors": 1}, {"call_fraction": 1.5}, {"call_format": "json"}, {"style": "long"}],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(UserError):
        make_task("multiply", "train", 4, seed=0, **kwargs)


def test_the_score_reads_the_final_answer_of_the_episode() -> None:
    truth = "201607"
    # what the trainer decodes: the policy's turns only (tool outputs are masked out)
    assert default_compute_score("multiply", "[[calc: 347*581]]#### 201607", truth) == 1.0
    assert default_compute_score("multiply", "#### 1 [[calc: 347*581]]#### 201607", truth) == 1.0
    assert default_compute_score("multiply", "#### 201607 [[calc: 1*2]]#### 2", truth) == 0.0  # the last one
    assert default_compute_score("multiply", "[[calc: 347*581]]", truth) == 0.0  # called, never answered
    assert default_compute_score("multiply", "#### 201607", 201607) == 1.0  # without the tool counts too
