"""The algorithm sections of the configuration schema: the policy loss, the rollout correction, the
advantage estimator and the KL in the reward (``schema`` holds the rest and re-exports these)."""

# ruff: noqa: RUF009 - option() and section() return dataclasses.field(...), which ruff cannot see

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.rollout_correction import canonical_rollout_rs, split_rollout_rs, translate_lower
from hybridflow.config.schema_base import option, section


@dataclass
class CorrectionWeights:
    """The importance weights and the rejection of the rollout/trainer mismatch: the fields the rollout
    correction (``algorithm.rollout_correction``) and the bypass-mode loss (``policy_loss.rollout_correction``)
    share."""

    rollout_is: str | None = option(None, "Importance weights: null (off), token or sequence.")
    rollout_is_threshold: float | str = option(
        2.0,
        "IS threshold: a number truncates the weights (TIS); 'lower_upper' zeroes those outside (IcePop).",
    )
    rollout_is_batch_normalize: bool = option(False, "Normalise importance weights to mean 1 over the batch.")
    rollout_rs: str | None = option(
        None,
        "Rejection: null (off) or options, comma-chained (token_k1, seq_mean_k3, ...; docs/algorithms.md).",
    )
    rollout_rs_threshold: float | str | None = option(
        None, "Upper rejection threshold; null = rollout_is_threshold. 'lower_upper' for k1; one per option."
    )

    def __post_init__(self) -> None:
        """Older rollout_rs names become verl 0.9.1's; a null rejection threshold is rollout_is_threshold."""
        self.rollout_rs = canonical_rollout_rs(self.rollout_rs)
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            self.rollout_rs_threshold = self.rollout_is_threshold


@dataclass
class BypassLossConfig(CorrectionWeights):
    """What loss_mode=bypass_mode reads (verl's policy_loss.rollout_correction).

    In bypass mode the old policy is the rollout's
    (``algorithm.rollout_correction.bypass_old_logprob_for_rollout``), so the importance weights and the
    rejection compare the current policy with the rollout's, inside the loss.
    """

    loss_type: str = option(
        "ppo_clip",
        "ppo_clip: PPO clip on pi/pi_rollout, no IS weights; reinforce: IS-weighted policy gradient.",
    )


@dataclass
class PolicyLossConfig:
    """Which policy loss the actor minimises and its extra knobs."""

    loss_mode: str = option(
        "vanilla",
        "vanilla, dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov, "
        "geo_mean, dro, cispo, bypass_mode or reinforce.",
    )
    clip_cov_ratio: float = option(0.0002, "Fraction of tokens clipped by clip_cov.")
    clip_cov_lb: float = option(1.0, "Lower covariance bound of clip_cov.")
    clip_cov_ub: float = option(5.0, "Upper covariance bound of clip_cov.")
    kl_cov_ratio: float = option(0.0002, "Fraction of tokens given the KL penalty by kl_cov.")
    ppo_kl_coef: float = option(0.1, "KL penalty coefficient of kl_cov.")
    dro_beta: float | None = option(
        None, "Quadratic log-ratio penalty of dro (> 0); required with loss_mode=dro (verl's default: null)."
    )
    tau_pos: float = option(1.0, "sapo's gate temperature for positive advantages (verl's actor.tau_pos).")
    tau_neg: float = option(1.05, "sapo's gate temperature for other advantages (verl's actor.tau_neg).")
    rollout_correction: BypassLossConfig = section(
        BypassLossConfig, "Settings of loss_mode=bypass_mode (verl's policy_loss.rollout_correction)."
    )


@dataclass
class KLControlConfig:
    """The coefficient of the in-reward KL penalty."""

    type: str = option("fixed", "KL controller: fixed or adaptive.")
    kl_coef: float = option(0.001, "(Initial) KL coefficient.")
    horizon: int = option(10000, "Adaptive controller horizon in samples.")
    target_kl: float = option(0.1, "Adaptive controller target KL.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose rewards do not vary."""

    enable: bool = option(False, "Drop zero-variance groups and generate more until the batch is full.")
    metric: str = option(
        "seq_reward", "Per-sequence metric whose variance is checked (e.g. seq_reward, acc)."
    )
    max_num_gen_batches: int = option(10, "Most generation rounds per step; 0 or less means unlimited.")


@dataclass
class RolloutCorrectionConfig(CorrectionWeights):
    """Importance weighting and rejection for the rollout/trainer mismatch (verl 0.9.1's options)."""

    rollout_rs_threshold_lower: float | None = option(
        None,
        "Deprecated: lower bound on pi_train/pi_rollout for k1 options; folded into rollout_rs_threshold.",
    )
    rollout_token_veto_threshold: float | None = option(
        None, "Reject a sequence with any token ratio below this; null = off. Not implemented yet."
    )
    bypass_old_logprob_for_rollout: bool = option(
        False, "Use the rollout's log-probs as the old policy (no recompute pass; verl's bypass mode)."
    )
    use_pure_rollout_correction: bool = option(
        False, "Plain importance-weighted policy gradient, no PPO clip. Not implemented yet."
    )

    def __post_init__(self) -> None:
        """Older rollout_rs names become verl 0.9.1's; a missing rejection threshold is rollout_is_threshold.

        The deprecated ``rollout_rs_threshold_lower`` (bounds ``[lower, upper]`` on pi_train / pi_rollout)
        is rewritten as the equal verl spec (``1/upper_1/lower``, bounds on pi_rollout / pi_train) where it
        can be; validation explains the cases where it cannot.
        """
        super().__post_init__()
        lower, upper = self.rollout_rs_threshold_lower, self.rollout_rs_threshold
        if lower is None or not isinstance(self.rollout_rs, str):
            return
        options, unknown = split_rollout_rs(self.rollout_rs)
        numeric = isinstance(upper, int | float) and not isinstance(upper, bool)
        if (
            not unknown
            and options
            and all(o.endswith("k1") for o in options)
            and numeric
            and 0 < lower < upper
        ):
            self.rollout_rs_threshold = translate_lower(float(upper), float(lower))
            self.rollout_rs_threshold_lower = None


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""

    adv_estimator: str = option("grpo", "Advantage estimator (grpo, gae, rloo, reinforce_plus_plus, ...).")
    gamma: float = option(1.0, "Discount factor.")
    lam: float = option(1.0, "GAE lambda.")
    norm_adv_by_std_in_grpo: bool = option(True, "Divide GRPO advantages by the group std (false = Dr.GRPO).")
    use_kl_in_reward: bool = option(False, "Subtract a KL penalty from the token rewards.")
    kl_penalty: str = option("kl", "KL estimator of the in-reward penalty.")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "KL coefficient controller.")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "Rollout correction.")
