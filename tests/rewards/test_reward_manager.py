"""RewardManager in-process: naive, batch and token kinds, extras, and every error path."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hybridflow.rewards import ERRORS_KEY, RewardError, RewardManager


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def test_default_scorers_by_data_source():
    manager = RewardManager()
    scores, extras = manager.score(
        ["arithmetic", "arithmetic", "openai/gsm8k"], ["#### 5", "#### 6", "#### 7"], [5, 5, "7"]
    )
    assert scores == [1.0, 0.0, 1.0]
    assert extras == {}


def test_dict_returns_become_extras_filled_with_zero():
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "plain":
            return 1
        return {"score": 0.5, "acc": True, "len": len(solution_str), "pred": "not a number"}

    scores, extras = RewardManager(scorer).score(["d", "d"], ["abc", "plain"], [None, None])
    assert scores == [0.5, 1.0]
    assert extras == {"acc": [1.0, 0.0], "len": [3.0, 0.0]}  # the string entry is dropped


def test_reward_kwargs_and_extra_info_reach_the_function():
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        seen.append(extra_info)
        return bonus

    scores, _ = RewardManager(scorer, reward_kwargs={"bonus": 0.25}).score(
        ["d"], ["x"], ["y"], [{"index": 4}]
    )
    assert scores == [0.25] and seen == [{"index": 4}]


def test_a_raising_function_stops_at_the_sample_with_its_name():
    calls = []

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        if solution_str == "bad":
            raise KeyError("missing field")
        return 1.0

    with pytest.raises(RewardError) as info:
        RewardManager(flaky).score(["a", "b", "c"], ["ok", "bad", "ok"], [1, 2, 3])
    message = str(info.value)
    assert "sample 1" in message and "data_source='b'" in message
    assert "flaky" in message and "KeyError" in message and "missing field" in message
    assert "reward.on_error=zero" in message
    assert isinstance(info.value.__cause__, KeyError)
    assert calls == ["ok", "bad"]  # nothing scored after the failure
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (math.nan, "non-finite"),
        (-math.inf, "non-finite"),
        ("1.0", "type str"),
        (None, "type NoneType"),
        ({"acc": 1.0}, "without a 'score'"),
        ({"score": "high"}, "type str"),
        (torch.tensor(1.0), ".item()"),
    ],
)
def test_bad_return_values_raise(value, needle):
    with pytest.raises(RewardError, match="sample 0") as info:
        RewardManager(lambda **kw: value, fn_name="my_fn").score(["src"], ["x"], ["y"])
    assert needle in str(info.value) and "my_fn" in str(info.value) and "'src'" in str(info.value)


def test_on_error_zero_scores_zero_counts_and_warns(caplog):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "nan":
            return math.nan
        if solution_str == "boom":
            raise RuntimeError("boom")
        return {"score": 1.0, "acc": 1.0}

    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        scores, extras = RewardManager(scorer, on_error="zero").score(
            ["a", "b", "c", "d"], ["ok", "nan", "boom", "ok"], [0, 0, 0, 0]
        )
    assert scores == [1.0, 0.0, 0.0, 1.0]
    no_timeouts = {"reward/timeouts": [0.0] * 4, "reward/skipped": [0.0] * 4}
    assert extras == {"acc": [1.0, 0.0, 0.0, 1.0], ERRORS_KEY: [0.0, 1.0, 1.0, 0.0], **no_timeouts}
    assert "2 of 4 samples" in caplog.text and "sample 1" in caplog.text
    # No failure: the error column is still there, all zeros.
    _, extras = RewardManager(exact_match, on_error="zero").score(["a"], ["x"], ["x"])
    assert extras == {ERRORS_KEY: [0.0], "reward/timeouts": [0.0], "reward/skipped": [0.0]}


def test_batch_kind():
    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return [scale * (s == g) for s, g in zip(solution_strs, ground_truths)]

    manager = RewardManager(batch_fn, kind="batch", reward_kwargs={"scale": 2.0})
    assert manager.score(["a", "b"], ["x", "y"], ["x", "z"]) == ([2.0, 0.0], {})


def test_batch_kind_errors():
    def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    with pytest.raises(RewardError, match="returned 1 scores for 2 samples"):
        RewardManager(wrong_length, kind="batch").score(["a", "b"], ["x", "y"], [0, 0])

    def per_sample_nan(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0, math.nan]

    with pytest.raises(RewardError, match="sample 1"):
        RewardManager(per_sample_nan, kind="batch").score(["a", "b"], ["x", "y"], [0, 0])

    def raises(data_sources, solution_strs, ground_truths, extra_infos):
        raise RuntimeError("batch boom")

    scores, extras = RewardManager(raises, kind="batch", on_error="zero").score(
        ["a", "b"], ["x", "y"], [0, 0]
    )
    assert scores == [0.0, 0.0] and extras == {ERRORS_KEY: [1.0, 1.0]}
    with pytest.raises(RewardError, match="batch boom"):
        RewardManager(raises, kind="batch").score(["a", "b"], ["x", "y"], [0, 0])


class _Tokenizer:
    eos_token_id = 9


def test_token_kind_detected_by_parameter_names():
    def token_fn(prompt_ids, response_ids, tokenizer):
        # reward: response ends with EOS, minus 0.1 per prompt token
        return float(response_ids[-1] == tokenizer.eos_token_id) - 0.1 * len(prompt_ids)

    manager = RewardManager(token_fn)
    assert manager.kind == "token"
    scores, _ = manager.score(
        ["a", "b"],
        None,
        None,
        prompt_ids=[[1], [1, 2]],
        response_ids=[[4, 9], [4, 5]],
        tokenizer=_Tokenizer(),
    )
    assert scores == pytest.approx([0.9, -0.2])


def test_token_kind_explicit_and_missing_ids():
    manager = RewardManager(lambda a, b, c: float(len(b)), kind="token")
    assert manager.score(None, None, None, prompt_ids=[[1]], response_ids=[[1, 2, 3]])[0] == [3.0]
    with pytest.raises(ValueError, match="needs prompt_ids and response_ids"):
        manager.score(["a"], ["text"], [0])


def test_argument_checks():
    with pytest.raises(ValueError, match="kind"):
        RewardManager(kind="dapo")
    with pytest.raises(ValueError, match="on_error"):
        RewardManager(on_error="ignore")
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(timeout_s=0)
    with pytest.raises(TypeError, match="compute_score"):
        RewardManager(compute_score=42)
    with pytest.raises(ValueError, match="ground_truths has 1 entries but the batch has 2"):
        RewardManager().score(["a", "b"], ["x", "y"], [1])
    # A lambda cannot reach worker processes: refused up front with the fix.
    with pytest.raises(TypeError, match=r"\(path, name\)"):
        RewardManager(lambda **kw: 1.0, num_workers=2)
