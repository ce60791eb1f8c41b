"""load_reward_function: from a file, file:fn, module:fn, and the error messages; token detection."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.rewards import is_token_reward_function, load_reward_function
from hybridflow.rewards.loader import file_source

SOURCE = textwrap.dedent(
    """
    LIMIT = 3

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    def by_length(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str) <= LIMIT)
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SOURCE)
    return path


def test_load_from_a_file(reward_file):
    fn = load_reward_function(str(reward_file))
    assert fn("d", "a", "a") == 1.0 and fn("d", "a", "b") == 0.0
    assert file_source(fn) == (str(reward_file), "compute_score")
    other = load_reward_function(str(reward_file), name="by_length")
    assert other("d", "abcd", None) == 0.0 and other("d", "abc", None) == 1.0
    # "file.py:name" overrides the name argument.
    assert load_reward_function(f"{reward_file}:by_length", name="compute_score")("d", "abcd", None) == 0.0


def test_load_module_function():
    fn = load_reward_function("hybridflow.rewards.scorer:default_compute_score")
    assert fn("arithmetic", "#### 3", 3) == 1.0
    assert file_source(fn) is None  # importable: picklable by reference
    assert load_reward_function("json", name="dumps")([1]) == "[1]"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ValueError, match="not found") as info:
        load_reward_function(str(missing))
    assert str(missing) in str(info.value)


def test_missing_function_lists_what_is_there(reward_file):
    with pytest.raises(ValueError) as info:
        load_reward_function(str(reward_file), name="score_it")
    message = str(info.value)
    assert "'score_it'" in message and str(reward_file) in message
    assert "by_length" in message and "compute_score" in message
    assert "reward.custom_function.name" in message


def test_not_callable(reward_file):
    with pytest.raises(TypeError, match=r"'LIMIT'.*int, not a function"):
        load_reward_function(str(reward_file), name="LIMIT")


def test_bad_module_and_broken_file(tmp_path):
    with pytest.raises(ValueError, match="cannot import reward module 'no_such_module_xyz'"):
        load_reward_function("no_such_module_xyz:fn")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match="boom at import"):
        load_reward_function(str(broken))
    with pytest.raises(ValueError, match="non-empty"):
        load_reward_function("  ")


def test_token_functions_are_recognised_by_parameter_names():
    def token_fn(prompt_ids, response_ids, tokenizer):
        return 0.0

    def text_fn(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    assert is_token_reward_function(token_fn)
    assert not is_token_reward_function(text_fn)
    assert not is_token_reward_function(len)  # builtin without named parameters
