"""The policy losses' own keys (dro_beta, tau_pos/tau_neg, bypass_mode's settings): verl's names and
defaults, verl's aliases, validation, and the way into the PolicyLossConfig the actor builds; the
optimal-token-baseline estimators refused at start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import ConfigError, load_config, schema_index
from hybridflow.config.choices import POLICY_LOSSES

_BYPASS = "algorithm.rollout_correction.bypass_old_logprob_for_rollout=true"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return str(info.value)


def test_defaults_are_verls() -> None:
    pl = load_config().actor.policy_loss
    assert (pl.dro_beta, pl.tau_pos, pl.tau_neg) == (None, 1.0, 1.05)
    rc = pl.rollout_correction
    assert rc.loss_type == "ppo_clip"
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize) == (None, 2.0, False)
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == (None, None)


def test_loss_mode_help_lists_every_builtin_loss() -> None:
    help_text = schema_index()[0]["actor.policy_loss.loss_mode"].help
    missing = [name for name in POLICY_LOSSES if name not in help_text]
    assert not missing, f"actor.policy_loss.loss_mode's help lacks {missing}"
    assert "dro" in POLICY_LOSSES and "bypass_mode" in POLICY_LOSSES


def test_verl_keys_reach_the_fields() -> None:
    arr = "actor_rollout_ref.actor"
    cfg = load_config(
        overrides=[
            f"{arr}.policy_loss.loss_mode=bypass_mode",
            f"{arr}.policy_loss.dro_beta=0.25",
            f"{arr}.tau_pos=0.9",
            f"{arr}.tau_neg=1.2",
            f"{arr}.policy_loss.rollout_correction.loss_type=reinforce",
            f"{arr}.policy_loss.rollout_correction.rollout_is=sequence",
            f"{arr}.policy_loss.rollout_correction.rollout_is_threshold=3.0",
            f"{arr}.policy_loss.rollout_correction.rollout_is_batch_normalize=true",
            f"{arr}.policy_loss.rollout_correction.rollout_rs=token",  # older alias of token_k1
            f"{arr}.policy_loss.rollout_correction.rollout_rs_threshold=0.5_2.0",
            _BYPASS,
        ]
    )
    pl = cfg.actor.policy_loss
    assert (pl.loss_mode, pl.dro_beta, pl.tau_pos, pl.tau_neg) == ("bypass_mode", 0.25, 0.9, 1.2)
    rc = pl.rollout_correction
    assert (rc.loss_type, rc.rollout_is, rc.rollout_is_threshold) == ("reinforce", "sequence", 3.0)
    assert rc.rollout_is_batch_normalize is True
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("token_k1", "0.5_2.0")


def test_dro_without_beta_is_refused() -> None:
    message = _error(["actor.policy_loss.loss_mode=dro"])
    assert message == (
        "actor.policy_loss.dro_beta: is null, but actor.policy_loss.loss_mode=dro needs its quadratic "
        "log-ratio penalty (a number > 0); fix: set actor.policy_loss.dro_beta to a positive number, "
        "e.g. actor.policy_loss.dro_beta=0.1"
    )
    load_config(overrides=["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"])


@pytest.mark.parametrize(
    "key", ["actor.policy_loss.dro_beta", "actor.policy_loss.tau_pos", "actor.policy_loss.tau_neg"]
)
@pytest.mark.parametrize("value", ["0", "-0.5"])
def test_nonpositive_knobs_are_refused(key: str, value: str) -> None:
    message = _error(["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1", f"{key}={value}"])
    assert message.startswith(f"{key}: must be greater than 0, got {float(value)!r}; fix: ")


def test_bypass_mode_needs_the_rollouts_log_probs() -> None:
    message = _error(["actor.policy_loss.loss_mode=bypass_mode"])
    assert message.startswith("actor.policy_loss.loss_mode: is bypass_mode, which takes the old log-probs")
    assert "fix: set algorithm.rollout_correction.bypass_old_logprob_for_rollout=true" in message
    load_config(overrides=["actor.policy_loss.loss_mode=bypass_mode", _BYPASS])


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("rollout_rs=token_k9", "rollout_rs", "unknown option(s) 'token_k9'"),
        ("rollout_is_threshold=abc", "rollout_is_threshold", "'abc' is neither a number"),
        ("rollout_is=tokens", "rollout_is", "unknown value 'tokens'"),
        ("loss_type=pg", "loss_type", "unknown value 'pg'"),
    ],
)
def test_bad_bypass_settings_are_refused(override: str, field: str, words: str) -> None:
    prefix = "actor.policy_loss.rollout_correction"
    message = _error([f"{prefix}.{override}"])
    assert message.startswith(f"{prefix}.{field}: {words}"), message


def test_bad_rs_threshold_for_a_k2_option() -> None:
    prefix = "actor.policy_loss.rollout_correction"
    message = _error([f"{prefix}.rollout_rs=token_k2", f"{prefix}.rollout_rs_threshold=0.5_2.0"])
    assert message.startswith(f"{prefix}.rollout_rs_threshold: '0.5_2.0' for token_k2: k2/k3 options take")


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_is_refused_at_start(name: str) -> None:
    message = _error([f"algorithm.adv_estimator={name}"])
    assert message.startswith(
        f"algorithm.adv_estimator: {name} needs a per-token sum_pi_squared (the sum over the vocabulary of "
        "pi^2), which the actor does not compute yet; fix: use one of: gae, grpo, "
    )
    assert "optimal_token_baseline," not in message
    assert message.endswith("; the function stays callable from hybridflow.algos")


def test_optimal_token_baseline_stays_callable_from_python() -> None:
    from hybridflow import algos

    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        assert callable(algos.get_adv_estimator_fn(name))
    assert callable(algos.compute_optimal_token_baseline_advantage)
    assert callable(algos.compute_multi_turn_optimal_token_baseline_advantage)


def test_the_keys_reach_the_actors_policy_loss_config() -> None:
    from hybridflow.algos.policy_loss import get_config_value
    from hybridflow.engine.roles.actor import ActorEngine

    cfg = load_config(
        overrides=[
            "actor.policy_loss.loss_mode=bypass_mode",
            "actor.policy_loss.dro_beta=0.3",
            "actor.policy_loss.tau_pos=0.8",
            "actor.policy_loss.tau_neg=1.3",
            "actor.policy_loss.rollout_correction.loss_type=reinforce",
            "actor.policy_loss.rollout_correction.rollout_is=token",
            _BYPASS,
        ]
    )
    # _loss_config reads only these attributes of the engine: no model, no process group.
    fake = SimpleNamespace(actor=cfg.actor, dp_sum=lambda v: v, engine=SimpleNamespace(dp_size=1))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss_cfg = ActorEngine._loss_config(fake, {"response_mask": mask})
    assert (loss_cfg.loss_mode, loss_cfg.dro_beta, loss_cfg.tau_pos, loss_cfg.tau_neg) == (
        "bypass_mode",
        0.3,
        0.8,
        1.3,
    )
    assert loss_cfg.rollout_correction is cfg.actor.policy_loss.rollout_correction
    assert get_config_value(loss_cfg, "rollout_correction").loss_type == "reinforce"
    assert (loss_cfg.batch_num_tokens, loss_cfg.global_batch_size) == (3, 2)


def test_bypass_loss_reads_its_settings_from_the_config() -> None:
    """reinforce with token IS weights: -w * A * log_prob, w = exp(log_prob - rollout_log_prob) (value 1
    here, detached), against ppo_clip's -ratio * A = -1 * A at ratio 1; both token-mean over the mask."""
    from hybridflow.algos import PolicyLossConfig, get_policy_loss_fn

    cfg = load_config(overrides=["actor.policy_loss.loss_mode=bypass_mode", _BYPASS]).actor.policy_loss
    logp = torch.tensor([[-0.5, -1.0]])
    adv = torch.tensor([[1.0, 2.0]])
    mask = torch.ones(1, 2)
    fn = get_policy_loss_fn("bypass_mode")
    clip_loss, _ = fn(
        logp, logp, adv, mask, "token-mean", PolicyLossConfig(rollout_correction=cfg.rollout_correction)
    )
    assert clip_loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    cfg.rollout_correction.loss_type = "reinforce"
    cfg.rollout_correction.rollout_is = "token"
    pg_loss, _ = fn(
        logp, logp, adv, mask, "token-mean", PolicyLossConfig(rollout_correction=cfg.rollout_correction)
    )
    assert pg_loss.item() == pytest.approx(-(1.0 * -0.5 + 2.0 * -1.0) / 2)
