"""RewardManager with a real process pool (2 spawned workers): results, timeouts, killed workers."""

from __future__ import annotations

import signal
import textwrap
import time

import pytest

from hybridflow.rewards import ERRORS_KEY, RewardError, RewardManager, pool

SOURCE = textwrap.dedent(
    """
    import os
    import signal
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            time.sleep(30)
        if solution_str == "stuck":
            # Like a call stuck in C code: the in-worker timer never gets through.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(30)
        if solution_str == "boom":
            raise RuntimeError("boom in worker")
        return {"score": float(solution_str == ground_truth), "pid": os.getpid()}

    def token_score(prompt_ids, response_ids, tokenizer):
        return float(sum(response_ids) + tokenizer["offset"])
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "pool_reward.py"
    path.write_text(SOURCE)
    return str(path)


def test_pool_scores_in_two_workers_and_times_out(reward_file):
    start = time.monotonic()
    with RewardManager(
        (reward_file, "compute_score"), num_workers=2, timeout_s=0.5, on_error="zero"
    ) as manager:
        scores, extras = manager.score(["a"] * 5, ["x", "slow", "y", "boom", "x"], ["x", "x", "y", "x", "z"])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert extras[ERRORS_KEY] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert extras["pid"][1] == 0.0 and extras["pid"][0] > 0  # failed samples have no extras: filled with 0
    # The slow call sleeps 30 s; it was cut at 0.5 s (the rest is starting two interpreters).
    assert time.monotonic() - start < 15


def test_pool_timeout_raises_with_sample_and_source(reward_file):
    with (
        RewardManager((reward_file, "compute_score"), num_workers=2, timeout_s=0.3) as manager,
        pytest.raises(RewardError) as info,
    ):
        manager.score(["a", "b", "c"], ["x", "slow", "x"], ["x", "x", "x"])
    message = str(info.value)
    assert "sample 1" in message and "data_source='b'" in message
    assert "timed out" in message and "pool_reward.py" in message


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks")
def test_stuck_worker_is_killed_and_the_pool_restarts(reward_file, monkeypatch):
    monkeypatch.setattr(pool, "HARD_TIMEOUT_GRACE_S", 1.0)
    with RewardManager(
        (reward_file, "compute_score"), num_workers=2, timeout_s=0.2, on_error="zero"
    ) as manager:
        manager.score(["a", "a"], ["x", "x"], ["x", "x"])  # start both workers before timing anything
        scores, extras = manager.score(["a", "b"], ["stuck", "x"], ["x", "x"])
        assert scores == [0.0, 1.0] and extras[ERRORS_KEY] == [1.0, 0.0]
        # The workers were killed; the next call gets a fresh pool.
        assert manager.score(["a"], ["x"], ["x"])[0] == [1.0]


def test_pool_with_token_function_and_default_scorer(reward_file):
    with RewardManager((reward_file, "token_score"), num_workers=2) as manager:
        assert manager.kind == "token"
        scores, _ = manager.score(
            None, None, None, prompt_ids=[[1], [2]], response_ids=[[1, 2], [5]], tokenizer={"offset": 10}
        )
    assert scores == [13.0, 15.0]
    with RewardManager(num_workers=2) as manager:  # default_compute_score is importable by reference
        assert manager.score(["arithmetic"] * 2, ["#### 4", "#### 5"], [4, 4])[0] == [1.0, 0.0]


def test_on_error_raise_stops_at_the_first_timeout(reward_file):
    # Two workers, eight slow samples: waiting out each would take four rounds of the timeout.
    with (
        RewardManager((reward_file, "compute_score"), num_workers=2, timeout_s=1.0) as manager,
        pytest.raises(RewardError, match=r"sample [01] .*timed out") as info,  # the first round: either one
    ):
        start = time.monotonic()
        manager.score(["a"] * 8, ["slow"] * 8, ["x"] * 8)
    assert time.monotonic() - start < 1.0 + 8  # one round (plus starting the workers), not four
    assert "reward.timeout_s" in str(info.value)


def test_on_error_zero_stops_waiting_for_a_function_that_times_out_on_everything(reward_file, caplog):
    with RewardManager(
        (reward_file, "compute_score"), num_workers=2, timeout_s=1.0, on_error="zero"
    ) as manager:
        start = time.monotonic()
        scores, extras = manager.score(["a"] * 8, ["slow"] * 8, ["x"] * 8)
    assert time.monotonic() - start < 1.0 + 8
    assert scores == [0.0] * 8
    assert extras["reward/timeouts"] == [1.0, 1.0] + [0.0] * 6  # the first two timed out
    assert extras["reward/skipped"] == [0.0, 0.0] + [1.0] * 6  # the rest were not waited for
    assert "timed out on each of its first 2 samples" in caplog.text
