"""How a run treats tokens its trainer's policy did not sample, decided from the config alone.

``old_log_prob_source`` says where the update's ``old_log_probs`` come from (the trainer runs or skips its
old-log-prob pass by it, and the layout planner counts that pass in its step time); ``default_correction``
gives an asynchronous or quantised rollout token-level importance weights unless the config chose its own.
"""

from __future__ import annotations

import logging

from hybridflow.config.schema import Config

logger = logging.getLogger(__name__)


def old_log_prob_source(cfg: Config, prompts: int | None = None) -> str:
    """Where the update's ``old_log_probs`` come from: "recompute", "rollout" or "update".

    ``prompts`` is the batch's size in prompts (``data.train_batch_size`` when None; the step-wise API's
    batches are the caller's).

    "recompute" is verl's default, a forward pass before the update. "rollout" is verl's bypass mode
    (``rollout_correction.bypass_old_logprob_for_rollout``): the rollout's own log-probs stand in. "update":
    one epoch over one mini-batch is on-policy, so the ratio's denominator is the update's own detached
    log-probs (as in verl's actor) and nothing before the update reads ``old_log_probs`` (no KL in the reward,
    no importance weights or rejection): the update returns those log-probs, taken before its optimizer
    step, for the mismatch metrics, and the separate pass is skipped.
    """
    a, rc = cfg.algorithm, cfg.algorithm.rollout_correction
    if rc.bypass_old_logprob_for_rollout:
        return "rollout"
    batch = cfg.data.train_batch_size if prompts is None else prompts
    on_policy = cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size >= batch
    read_before_update = a.use_kl_in_reward or rc.rollout_is is not None or rc.rollout_rs is not None
    return "update" if on_policy and not read_before_update else "recompute"


def default_correction(cfg: Config) -> None:
    """Weigh tokens the trainer's policy did not sample: token-level truncated importance weights
    (``algorithm.rollout_correction.rollout_is=token``, threshold 2 unless set) when the rollout is
    asynchronous (decoupled PPO: pi_prox / pi_behav) or quantised (FP8: pi_trainer / pi_fp8), unless the
    config chose its own correction."""
    rc = cfg.algorithm.rollout_correction
    why = [
        f"trainer.async_mode={cfg.trainer.async_mode} (decoupled PPO)"
        if cfg.trainer.async_mode != "sync"
        else "",
        "rollout.quantization=fp8 (the rollout samples from FP8 weights)" if cfg.rollout.quantization else "",
    ]
    if not any(why) or rc.rollout_is is not None or rc.bypass_old_logprob_for_rollout:
        return
    rc.rollout_is = "token"
    logger.info(
        "%s: token-level importance weights pi_old / pi_rollout truncated at %s "
        "(algorithm.rollout_correction.rollout_is=token)",
        " and ".join(w for w in why if w),
        rc.rollout_is_threshold,
    )
