"""Step-level metrics that combine the workers' reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.trainer.metrics import (
    ZERO_STD_KEY,
    SignalWatch,
    add_reshard_stats,
    add_rollout_stats,
    step_peak_memory,
)


def test_the_step_peak_is_the_largest_phase_peak() -> None:
    memory = {
        "memory/actor.generate_peak_gib": 23.7,
        "memory/actor.update_actor_peak_gib": 26.6,
        "memory/ref.compute_ref_log_prob_peak_gib": 10.1,
    }
    assert step_peak_memory(memory) == {"perf/max_memory_allocated_gb": 26.6}
    assert step_peak_memory({}) == {}  # CPU: no phase peaks, no metric


def test_rollout_stats_add_up_over_generation_rounds() -> None:
    """Dynamic sampling generates several rounds per step: counts and times sum, the rate is recomputed."""
    metrics: dict[str, float] = {}
    add_rollout_stats(metrics, None)  # HF generate keeps no stats
    assert metrics == {}
    first = {"prefill_tokens": 10, "decode_steps": 4, "decode_tokens": 40, "prefill_s": 0.5, "decode_s": 2.0}
    first["slots"] = 8
    second = {"prefill_tokens": 6, "decode_steps": 2, "decode_tokens": 20, "prefill_s": 0.5, "decode_s": 1.0}
    second["slots"] = 4
    add_rollout_stats(metrics, first)
    assert metrics["perf/rollout_decode_tokens_per_s"] == pytest.approx(20.0)
    add_rollout_stats(metrics, second)
    assert metrics["rollout/decode_tokens"] == 60
    assert metrics["timing_s/gen_decode"] == pytest.approx(3.0)
    assert metrics["perf/rollout_decode_tokens_per_s"] == pytest.approx(20.0)
    assert metrics["rollout/prefill_tokens"] == 16
    assert metrics["rollout/kv_slots"] == 8  # the largest call's, not a sum


def test_the_engines_scheduler_figures_take_the_largest_call_and_sum_preemptions() -> None:
    metrics: dict[str, float] = {}
    base = {"prefill_tokens": 1, "decode_steps": 1, "decode_tokens": 1, "prefill_s": 0.1, "decode_s": 0.1}
    add_rollout_stats(
        metrics, {**base, "kv_blocks_used": 0.4, "concurrent_seqs_peak": 8.0, "preemptions": 2.0}
    )
    add_rollout_stats(
        metrics, {**base, "kv_blocks_used": 0.2, "concurrent_seqs_peak": 16.0, "preemptions": 1.0}
    )
    assert metrics["rollout/kv_blocks_used"] == 0.4 and metrics["rollout/concurrent_seqs_peak"] == 16.0
    assert metrics["rollout/preemptions"] == 3.0 and metrics["rollout/prefix_cache_hit_rate"] == 0.0


def test_reshard_stats_count_what_a_frozen_vision_tower_saved() -> None:
    metrics: dict[str, float] = {}
    two_ranks = [
        {"seconds": 0.5, "bytes": 3 * 2**20, "skipped_bytes": 2 * 2**20},
        {"seconds": 0.7, "bytes": 4 * 2**20, "skipped_bytes": 1 * 2**20},
    ]
    add_reshard_stats(metrics, two_ranks)
    add_reshard_stats(metrics, two_ranks)  # two switches in the step
    assert metrics["reshard/frozen_skipped_mib"] == 4.0 and metrics["timing_s/reshard"] == 1.4
    assert metrics["reshard/rank1_received_mib"] == 8.0
    without: dict[str, float] = {}
    add_reshard_stats(without, [{"seconds": 0.1, "bytes": 1.0}])
    assert "reshard/frozen_skipped_mib" not in without


def _cfg(n: int = 8, temperature: float = 0.6) -> SimpleNamespace:
    return SimpleNamespace(rollout=SimpleNamespace(n=n, temperature=temperature))


def _step(low: float, high: float, tied: float | None) -> dict[str, float]:
    out = {"critic/score/min": low, "critic/score/max": high, "critic/score/mean": (low + high) / 2}
    if tied is not None:
        out[ZERO_STD_KEY] = tied
    return out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_constant_reward_is_said_once_after_the_first_steps(caplog) -> None:
    watch = SignalWatch(_cfg(), total_steps=40)
    with caplog.at_level("WARNING", logger="hybridflow.trainer.metrics"):
        for step in range(1, 6):
            watch.update(_step(0.5, 0.5, 1.0), lambda: "the reward function <lambda> (data_source 'x')")
            assert len(_warnings(caplog)) == (0 if step < 3 else 1)
    (said,) = _warnings(caplog)
    assert said.startswith(
        "the reward was 0.5 for every sample of the first 3 steps (the reward function <lambda>"
    )
    assert "every advantage is 0" in said


def test_tied_groups_in_every_early_step_name_the_fixes(caplog) -> None:
    watch = SignalWatch(_cfg(n=4, temperature=0.7), total_steps=None)  # a loop with no step limit
    with caplog.at_level("WARNING", logger="hybridflow.trainer.metrics"):
        for low, high in [(0.0, 1.0), (0.0, 1.0), (1.0, 2.0)]:  # groups differ from each other, not within
            watch.update(_step(low, high, 1.0), lambda: "the built-in scorer of data_source 'gsm8k'")
    (said,) = _warnings(caplog)
    assert "in each of the first 3 steps every prompt's 4 samples got the same reward" in said
    assert "critic/score/zero_std_frac = 1; TRL's frac_reward_zero_std" in said
    for fix in ("check the built-in scorer of data_source 'gsm8k'", "rollout.temperature, now 0.7",
                "algorithm.filter_groups.enable=true"):  # fmt: skip
        assert fix in said


@pytest.mark.parametrize(
    "steps",
    [
        [(0.0, 1.0, 1.0), (0.0, 1.0, 0.75), (0.0, 1.0, 1.0)],  # one step had a group that varied: a signal
        [(0.0, 1.0, None), (0.0, 1.0, None), (0.0, 1.0, None)],  # GAE: no groups, varied scores
        [
            (0.5, 0.5, 1.0),
            (0.5, 0.5, 1.0),
            (0.0, 1.0, 0.5),
            (0.5, 0.5, 1.0),
        ],  # judged on the first three only
    ],
)
def test_a_run_with_some_signal_is_not_warned_about(steps, caplog) -> None:
    watch = SignalWatch(_cfg(), total_steps=100)
    with caplog.at_level("WARNING", logger="hybridflow.trainer.metrics"):
        for low, high, tied in steps:
            watch.update(_step(low, high, tied), lambda: "nobody")
    assert _warnings(caplog) == []


def test_a_shorter_run_is_judged_at_its_last_step_and_other_ranks_stay_quiet(caplog, monkeypatch) -> None:
    with caplog.at_level("WARNING", logger="hybridflow.trainer.metrics"):
        watch = SignalWatch(_cfg(), total_steps=2)
        watch.update(_step(0.0, 0.0, 1.0), lambda: "f")
        assert _warnings(caplog) == []
        watch.update(_step(0.0, 0.0, 1.0), lambda: "f")
        assert _warnings(caplog)[0].startswith("the reward was 0 for every sample of the first 2 steps (f)")
        monkeypatch.setenv("RANK", "1")
        quiet = SignalWatch(_cfg(), total_steps=1)
        quiet.update(_step(0.0, 0.0, 1.0), lambda: "f")
    assert len(_warnings(caplog)) == 1
