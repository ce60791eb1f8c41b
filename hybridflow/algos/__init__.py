"""L2: pure tensor math for RL post-training, under the names of verl's ``core_algos``.

Porting verl code means changing one import: ``from verl.trainer.ppo import core_algos`` becomes
``from hybridflow import algos as core_algos``. Functions take tensors and plain values; where verl passes a
config object, any attribute object or mapping with the same field names works.

Custom algorithms register as in verl, with ``@register_adv_est(name)`` and ``@register_policy_loss(name)``;
``ADV_ESTIMATOR_REGISTRY`` and ``POLICY_LOSS_REGISTRY`` are the very dicts the lookups read, so code that
inspects or patches them works. docs/algorithms.md maps every verl 0.9.1 name to ours.
A name registered before a config is validated is a valid ``algorithm.adv_estimator`` or
``actor.policy_loss.loss_mode`` (``hybridflow.trainer`` hands these registries to config validation, which
lists them in its unknown-value error). verl users register in their reward module: the module that
``reward.custom_function.path`` names is imported, once, before those names are checked, and again in each
rank process (a Ray rank, where the policy loss runs) before it builds its roles.
"""

from hybridflow.algos.advantage import (
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from hybridflow.algos.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    local_batch_info,
)
from hybridflow.algos.group_stats import group_zero_std_fraction
from hybridflow.algos.kl import (
    VALID_KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    compute_kl_in_reward,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from hybridflow.algos.policy_loss import (
    PolicyLossConfig,
    compute_entropy_loss,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_gpg,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
)
from hybridflow.algos.registry import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from hybridflow.algos.rollout_correction import (
    ROLLOUT_IS_MODES,
    ROLLOUT_RS_ALIASES,
    ROLLOUT_RS_MODES,
    ROLLOUT_RS_OPTIONS,
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from hybridflow.algos.rollout_metrics import (
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rs_metrics,
)
from hybridflow.algos.token_baseline import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from hybridflow.algos.trust_region_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
)
from hybridflow.algos.value_loss import (
    compute_value_loss,
)
from hybridflow.utils.torch_functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "ROLLOUT_IS_MODES",
    "ROLLOUT_RS_ALIASES",
    "ROLLOUT_RS_MODES",
    "ROLLOUT_RS_OPTIONS",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "VALID_KL_PENALTIES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLossConfig",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_is_metrics",
    "compute_kl_in_reward",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_offpolicy_metrics",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "group_zero_std_fraction",
    "kl_penalty",
    "kl_penalty_forward",
    "local_batch_info",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]

from hybridflow.algos.preference import (
    DPO_LOSS_TYPES,
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    kto_metrics,
    preference_metrics,
    sequence_logps,
)

__all__ += [
    "DPO_LOSS_TYPES",
    "dpo_loss",
    "kto_kl_estimate",
    "kto_loss",
    "kto_metrics",
    "preference_metrics",
    "sequence_logps",
]
