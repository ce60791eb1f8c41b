"""reward.timeout_s holds in every mode: in-process and in the pool, for naive, token and batch functions."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hybridflow.rewards import ERRORS_KEY, RewardError, RewardManager, RewardTimeoutError

SOURCE = textwrap.dedent(
    """
    import time

    def slow_on_b(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "b":
            time.sleep(20)
        return 1.0

    def token_slow_on_9(prompt_ids, response_ids, tokenizer):
        if response_ids == [9]:
            time.sleep(20)
        return 1.0

    def always_slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(20)
        return 1.0

    def batch_slow(data_sources, solution_strs, ground_truths, extra_infos):
        time.sleep(20)
        return [1.0] * len(solution_strs)
    """
)
TIMEOUT_S = 0.3


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "slow_reward.py"
    path.write_text(SOURCE)
    return str(path)


def score(manager: RewardManager) -> tuple[list[float], dict[str, list[float]]]:
    """Score three samples whose second one (data_source 'b', response [9]) hangs."""
    if manager.kind == "token":
        return manager.score(["a", "b", "c"], None, None, prompt_ids=[[1]] * 3, response_ids=[[1], [9], [2]])
    return manager.score(["a", "b", "c"], ["x", "y", "z"], [0, 0, 0])


PER_SAMPLE = [
    pytest.param(name, workers, id=f"{name}-workers{workers}")
    for name in ("slow_on_b", "token_slow_on_9")
    for workers in (0, 2)
]


@pytest.mark.parametrize(("name", "workers"), PER_SAMPLE)
def test_a_hung_sample_raises_naming_function_sample_and_timeout(reward_file, name, workers):
    start = time.monotonic()
    with (
        RewardManager((reward_file, name), num_workers=workers, timeout_s=TIMEOUT_S) as manager,
        pytest.raises(RewardError) as info,
    ):
        score(manager)
    message = str(info.value)
    assert name in message and "sample 1" in message and "data_source='b'" in message
    assert f"timed out after {TIMEOUT_S} s" in message
    assert "reward.timeout_s" in message
    assert ("reward.num_workers" in message) == (workers == 0)  # the way to stuck calls that can be killed
    assert isinstance(info.value.__cause__, RewardTimeoutError)
    assert time.monotonic() - start < 15  # the call sleeps 20 s (the pool also starts two interpreters)


@pytest.mark.parametrize(("name", "workers"), PER_SAMPLE)
def test_a_hung_sample_scores_zero_with_a_warning(reward_file, name, workers, caplog):
    start = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"),
        RewardManager((reward_file, name), num_workers=workers, timeout_s=TIMEOUT_S, on_error="zero") as m,
    ):
        scores, extras = score(m)
    assert scores == [1.0, 0.0, 1.0] and extras[ERRORS_KEY] == [0.0, 1.0, 0.0]
    assert "sample 1" in caplog.text and "timed out" in caplog.text and name in caplog.text
    assert time.monotonic() - start < 15


@pytest.mark.parametrize("workers", [0, 2])  # batch functions run in the calling process either way
def test_a_hung_batch_function_times_out(reward_file, workers, caplog):
    start = time.monotonic()
    kw = dict(kind="batch", num_workers=workers, timeout_s=TIMEOUT_S)
    with pytest.raises(RewardError) as info:
        score(RewardManager((reward_file, "batch_slow"), **kw))
    message = str(info.value)
    assert "batch_slow" in message and "batch of 3 samples" in message and "a, b, c" in message
    assert f"timed out after {TIMEOUT_S} s" in message and "reward.timeout_s" in message
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        scores, extras = score(RewardManager((reward_file, "batch_slow"), on_error="zero", **kw))
    assert scores == [0.0] * 3 and extras[ERRORS_KEY] == [1.0] * 3
    assert "timed out" in caplog.text
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "background-thread"])
def test_in_process_on_error_zero_stops_calling_a_function_that_times_out_on_everything(
    reward_file, thread, caplog
):
    # Eight samples of a function that hangs on each: two timeouts, then the rest are skipped, not waited.
    result: dict = {}

    def target() -> None:
        manager = RewardManager((reward_file, "always_slow"), timeout_s=TIMEOUT_S, on_error="zero")
        result["out"] = manager.score(["a"] * 8, ["x"] * 8, [0] * 8)

    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        if thread:
            worker = threading.Thread(target=target)
            worker.start()
            worker.join(timeout=10)
        else:
            target()
    assert time.monotonic() - start < 4 * TIMEOUT_S + 1  # two waits, not eight
    scores, extras = result["out"]
    assert scores == [0.0] * 8 and extras[ERRORS_KEY] == [1.0] * 8
    assert extras["reward/timeouts"] == [1.0, 1.0] + [0.0] * 6  # reported in the step's metrics
    assert extras["reward/skipped"] == [0.0, 0.0] + [1.0] * 6
    assert "timed out on each of its first 2 samples" in caplog.text


def test_in_process_timeouts_are_counted_without_giving_up_on_a_function_that_scores(reward_file):
    with RewardManager((reward_file, "slow_on_b"), timeout_s=TIMEOUT_S, on_error="zero") as manager:
        scores, extras = manager.score(["b", "a", "b", "b"], ["x"] * 4, [0] * 4)
    assert scores == [0.0, 1.0, 0.0, 0.0]  # the second sample scored: every later sample is still called
    assert extras["reward/timeouts"] == [1.0, 0.0, 1.0, 1.0] and extras["reward/skipped"] == [0.0] * 4


def test_in_process_timeout_holds_on_a_background_thread(reward_file):
    # reward.launch_async scores on a background thread, where no signal can reach the call.
    result: dict = {}

    def target() -> None:
        manager = RewardManager((reward_file, "slow_on_b"), timeout_s=TIMEOUT_S, on_error="zero")
        result["scores"] = score(manager)[0]

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and result["scores"] == [1.0, 0.0, 1.0]


def test_a_pure_python_hang_is_stopped_not_left_running():
    spinning = threading.Event()

    def busy(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "b":
            spinning.set()
            while True:  # holds the GIL half the time while it runs: it must not outlive its timeout
                pass
        return 1.0

    before = threading.active_count()
    scores, _ = score(RewardManager(busy, timeout_s=TIMEOUT_S, on_error="zero"))
    assert spinning.is_set() and scores == [1.0, 0.0, 1.0]
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


def test_the_process_exits_without_waiting_for_a_stuck_call(reward_file):
    script = textwrap.dedent(
        f"""
        from hybridflow.rewards import RewardManager
        manager = RewardManager(({reward_file!r}, "slow_on_b"), timeout_s={TIMEOUT_S}, on_error="zero")
        print(manager.score(["a", "b"], ["x", "y"], [0, 0])[0])
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=15)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.0, 0.0]"
    assert time.monotonic() - start < 12  # not the 20 s the stuck call sleeps


def test_a_reward_that_sets_timers_of_its_own_runs_in_process_under_the_default_timeout():
    """Math graders (math_verify) time their parsing with signal.alarm, which only the main thread may do."""
    import signal

    def graded(data_source, solution_str, ground_truth, extra_info=None):
        def give_up(signum, frame):
            raise TimeoutError("parsing took too long")

        previous = signal.signal(signal.SIGALRM, give_up)  # ValueError off the main thread
        signal.alarm(5)
        try:
            return float(solution_str == ground_truth)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    scores, _ = RewardManager(graded).score(["a", "b"], ["1", "2"], ["1", "3"])
    assert scores == [1.0, 0.0]


def test_c_code_that_returns_past_its_limit_counts_as_a_timeout():
    """The timer's signal waits for C code to return; a call back before the watchdog's limit timed out."""
    start = time.perf_counter()
    sum(range(10**6))
    n = int(1.5e6 / (time.perf_counter() - start))  # sum over a range never checks for signals: ~1.5 s

    def in_c(data_source, solution_str, ground_truth, extra_info=None):
        return float(sum(range(n)) > 0) if data_source == "b" else 1.0

    scores, extras = RewardManager(in_c, timeout_s=0.1, on_error="zero").score(["a", "b"], ["x", "y"], [0, 0])
    assert scores == [1.0, 0.0] and extras[ERRORS_KEY] == [0.0, 1.0]


# C code that holds the GIL and does not return when a signal arrives (it retries on EINTR, as much C code
# does): SIGALRM is blocked on the calling thread, then libc's sleep runs through ctypes.PyDLL, which keeps
# the GIL. No thread of the process can run meanwhile, the timer's handler included.
STUCK_IN_C = textwrap.dedent(
    """
    import ctypes, signal

    def _stuck():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        ctypes.PyDLL(None).sleep(60)

    def stuck_on_b(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "b":
            _stuck()
        return 1.0

    def batch_stuck(data_sources, solution_strs, ground_truths, extra_infos):
        _stuck()
        return [1.0] * len(solution_strs)
    """
)


@pytest.mark.parametrize(
    ("name", "thread", "said"),
    [
        ("stuck_on_b", False, "on sample 1 (of 3 in this call)"),
        ("stuck_on_b", True, "on sample 1 (of 3 in this call)"),
        ("batch_stuck", False, "on a batch of 3 samples"),
    ],
    ids=["main-thread", "background-thread", "batch"],
)
def test_a_call_stuck_in_c_code_holding_the_gil_stops_the_process_with_one_line(tmp_path, name, thread, said):
    """The watchdog process names the function, the sample and the fix, and stops the process."""
    path = tmp_path / "stuck.py"
    path.write_text(STUCK_IN_C)
    kind = "batch" if name.startswith("batch") else "naive"
    script = textwrap.dedent(
        f"""
        import threading
        from hybridflow.rewards import RewardManager

        manager = RewardManager(({str(path)!r}, {name!r}), kind={kind!r}, timeout_s=0.5, on_error="zero")
        score = lambda: print(manager.score(["a", "b", "c"], ["x", "y", "z"], [0, 0, 0]))
        if {thread}:
            worker = threading.Thread(target=score)
            worker.start()
            worker.join()
        else:
            score()
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    took = time.monotonic() - start
    assert done.returncode == -signal.SIGTERM and done.stdout == "", done.stderr
    assert 5.0 < took < 40  # stuck_after(0.5) = 5.5 s after the call began, not the 60 s it sleeps
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: reward function {name} ({path}) has run "), lines
    assert said in lines[0] and "past reward.timeout_s=0.5" in lines[0] and "the run is stopped" in lines[0]
    assert "reward.num_workers >= 1" in lines[0]
