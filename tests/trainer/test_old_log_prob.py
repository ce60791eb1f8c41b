"""Where the update's old log-probs come from: a separate pass, the rollout (bypass), or the update itself."""

from __future__ import annotations

import math

import pytest
from support.dist_util import run_world_kept as run_world

from hybridflow.config import load_config
from hybridflow.config.off_policy import old_log_prob_source
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer import ppo
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer

BASE = [
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",  # several micro-batches: the update's log-probs are reassembled
    "data.max_response_length=8",
    "data.task_train_size=40",
    "data.task_val_size=8",
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
]


@pytest.mark.parametrize(
    ("overrides", "source"),
    [
        ([], "update"),
        (["actor.ppo_mini_batch_size=2"], "recompute"),
        (["actor.ppo_epochs=2"], "recompute"),
        (["algorithm.use_kl_in_reward=true"], "recompute"),
        (["algorithm.rollout_correction.rollout_is=token"], "recompute"),
        (["algorithm.rollout_correction.rollout_rs=token"], "recompute"),
        (["algorithm.rollout_correction.bypass_old_logprob_for_rollout=true"], "rollout"),
    ],
)
def test_the_source_follows_the_config(overrides: list[str], source: str) -> None:
    assert old_log_prob_source(load_config(None, BASE + overrides)) == source


def char_parity_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that varies within groups, so that advantages, and the gradient, are not zero."""
    return float(sum(map(ord, solution_str)) % 2)


def run(overrides: list[str]) -> list[dict[str, float]]:
    cfg = load_config(None, BASE + overrides)
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    components = build_components(cfg, model, tokenizer, reward_fn=char_parity_reward)
    return PPOTrainer(cfg, components).fit()


def test_on_policy_skips_the_pass_and_trains_exactly_as_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fused = run([])
    monkeypatch.setattr(ppo, "old_log_prob_source", lambda cfg: "recompute")
    separate = run([])
    assert "timing_s/old_log_prob" in separate[0] and "timing_s/old_log_prob" not in fused[0]
    for a, b in zip(fused, separate):
        # The update is the same computation either way: its ratio's denominator is its own log-probs.
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        # The mismatch metrics come from the update's forward instead of the separate pass.
        mismatch = [k for k in b if k.startswith("rollout_corr/")]
        assert mismatch and set(mismatch) == {k for k in a if k.startswith("rollout_corr/")}
        for key in mismatch:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert all(h["actor/grad_norm"] > 0 for h in fused)  # a real update, not a zero gradient


def test_bypass_uses_the_rollout_log_probs_as_the_old_policy() -> None:
    history = run(["algorithm.rollout_correction.bypass_old_logprob_for_rollout=true", "actor.ppo_epochs=2"])
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["rollout_corr/kl"] == 0.0  # old == rollout by construction
        assert metrics["timing_s/old_log_prob"] < 1.0  # a copy, not a forward pass


def spmd_history(rank: int, source: str | None) -> list[dict[str, float]]:
    """One rank of a 2-process run (every rank runs the driver); ``source`` forces where old log-probs come from."""
    if source is not None:
        ppo.old_log_prob_source = lambda cfg: source
    return run(["trainer.n_gpus_per_node=2", "trainer.device=cpu"])


def test_two_ranks_return_the_update_log_probs_in_the_batch_order() -> None:
    fused = run_world(2, spmd_history, None)[0]
    separate = run_world(2, spmd_history, "recompute")[0]
    assert "timing_s/old_log_prob" not in fused[0]
    for a, b in zip(fused, separate):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        for key in [k for k in b if k.startswith("rollout_corr/")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
