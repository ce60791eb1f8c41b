"""The role sections of the configuration schema: the actor, the critic and the reference, with the optimizer,
FSDP2 and parallel sections they hold (``schema`` holds the rest and re-exports these)."""

# ruff: noqa: RUF009 - option() and section() return dataclasses.field(...), which ruff cannot see

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.algo_schema import PolicyLossConfig
from hybridflow.config.parallel import ParallelConfig, ParallelSizes
from hybridflow.config.schema_base import option, section


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = option(1e-6, "Peak learning rate.")
    weight_decay: float = option(0.01, "AdamW decoupled weight decay.")
    betas: list[float] = option([0.9, 0.999], "AdamW betas [beta1, beta2].")
    eps: float = option(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = option("constant", "Schedule after warm-up: constant or cosine.")
    lr_warmup_steps: int = option(-1, "Linear warm-up steps; -1 uses lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = option(
        0.0, "Warm-up as a fraction of the total steps (when lr_warmup_steps < 0)."
    )
    min_lr_ratio: float = option(0.0, "Cosine schedule floor as a fraction of lr.")
    num_cycles: float = option(0.5, "Number of cosine cycles over training (0.5 = one half-cosine decay).")


@dataclass
class FSDPConfig:
    """FSDP2 sharding, mixed precision and CPU offload of one role."""

    param_offload: bool = option(False, "Keep parameters on CPU between phases.")
    optimizer_offload: bool | str = option(
        False, "Keep optimizer state on CPU between phases; auto: only for a rollout short of room."
    )
    optimizer_step_on_cpu: bool = option(
        False,
        "Step AdamW on the CPU: fp32 masters and moments on the host, only compute-dtype weights/grads on device.",
    )
    pin_memory: bool = option(True, "Offload through pinned (page-locked) host memory: faster DMA copies.")
    reshard_after_forward: bool | None = option(
        None, "Free gathered parameters after each layer's forward; null = only when sharded over > 1 rank."
    )
    fsdp_size: int = option(-1, "Ranks per FSDP shard group: only -1 (all ranks) for now.")
    param_dtype: str = option(
        "auto", "Compute dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32."
    )
    reduce_dtype: str = option("float32", "Dtype of gradient reductions.")
    master_dtype: str = option("auto", "Master/optimizer dtype; auto = float32 (ref: its compute dtype).")


@dataclass
class ActorConfig(ParallelSizes):
    """The policy update: mini-batches, clipping, KL loss, entropy bonus, optimizer."""

    ppo_mini_batch_size: int = option(
        16, "Prompts per optimizer step (multiplied by rollout.n into samples)."
    )
    ppo_micro_batch_size_per_gpu: int = option(
        8, "Samples per GPU per forward/backward (gradient accumulation)."
    )
    use_dynamic_bsz: bool = option(False, "Size micro-batches by tokens (ppo_max_token_len_per_gpu) instead.")
    ppo_max_token_len_per_gpu: int = option(
        16384, "Token budget per GPU per micro-batch with dynamic batch size."
    )
    ppo_epochs: int = option(1, "Passes over each batch of rollouts.")
    shuffle: bool = option(False, "Shuffle samples between PPO epochs.")
    clip_ratio: float = option(0.2, "PPO clip range epsilon.")
    clip_ratio_low: float | None = option(None, "Lower clip range; null = clip_ratio.")
    clip_ratio_high: float | None = option(None, "Upper clip range (DAPO clip-higher); null = clip_ratio.")
    clip_ratio_c: float = option(3.0, "Dual-clip constant c (> 1) for negative advantages.")
    loss_agg_mode: str = option(
        "token-mean", "How token losses are aggregated (a true global mean for token-mean)."
    )
    loss_scale_factor: float | None = option(
        None, "Fixed divisor for seq-mean-token-sum-norm; null = max_response_length."
    )
    entropy_coeff: float = option(0.0, "Entropy bonus coefficient.")
    use_kl_loss: bool = option(False, "Add a KL(actor || reference) loss term (GRPO style).")
    kl_loss_coef: float = option(0.001, "Coefficient of the KL loss.")
    kl_loss_type: str = option(
        "low_var_kl", "KL estimator of the KL loss (kl, abs, mse, low_var_kl, ... and '+' variants)."
    )
    grad_clip: float = option(1.0, "Gradient-norm clipping threshold.")
    hybrid_engine: bool = option(
        True, "Reshard the training shards into the rollout's (false: the baseline, a kept copy broadcast)."
    )
    use_torch_compile: bool | None = option(
        None, "torch.compile each decoder layer of the actor and reference; null = on GPU, off on CPU."
    )
    router_replay: str = option(
        "off", "MoE router replay: r3 trains on the rollout's experts, r2 on the old-log-prob pass's; off."
    )
    router_aux_loss_coef: float | None = option(
        None, "MoE load-balancing loss coefficient; null = the model config's router_aux_loss_coef."
    )
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "Policy loss mode and its parameters.")
    optim: OptimConfig = section(OptimConfig, "Actor optimizer.")
    fsdp: FSDPConfig = section(FSDPConfig, "Actor FSDP2 settings.")
    parallel: ParallelConfig = section(
        ParallelConfig, "Actor training view (also the reference's, unless set)."
    )


@dataclass
class CriticModelConfig:
    """The value model."""

    path: str | None = option(None, "Critic checkpoint (causal LM or saved critic); null = model.path.")
    enable_gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    use_remove_padding: bool = option(False, "Pack sequences without pad tokens.")
    override_config: dict[str, Any] = option({}, "Keys set on the critic's HF model config after loading it.")


@dataclass
class CriticConfig(ParallelSizes):
    """The critic (value model) used by GAE."""

    enable: bool | None = option(None, "Train a critic; null = only when algorithm.adv_estimator is gae.")
    model: CriticModelConfig = section(CriticModelConfig, "Critic model.")
    ppo_mini_batch_size: int | None = option(
        None, "Prompts per critic optimizer step; null = actor.ppo_mini_batch_size."
    )
    ppo_micro_batch_size_per_gpu: int = option(8, "Samples per GPU per critic forward/backward.")
    use_dynamic_bsz: bool = option(False, "Size micro-batches by tokens (ppo_max_token_len_per_gpu) instead.")
    ppo_max_token_len_per_gpu: int = option(
        32768, "Token budget per GPU per micro-batch with dynamic batch size."
    )
    ppo_epochs: int = option(1, "Passes over each batch for the critic.")
    cliprange_value: float = option(0.5, "Value clip range around the old values.")
    loss_agg_mode: str = option("token-mean", "How token value losses are aggregated.")
    grad_clip: float = option(1.0, "Gradient-norm clipping threshold.")
    use_torch_compile: bool | None = option(
        None, "torch.compile each decoder layer of the critic; null = on GPU, off on CPU."
    )
    optim: OptimConfig = section(OptimConfig, "Critic optimizer.", lr=1e-5)
    fsdp: FSDPConfig = section(FSDPConfig, "Critic FSDP2 settings.")
    parallel: ParallelConfig = section(ParallelConfig, "Critic training view.")


@dataclass
class RefConfig(ParallelSizes):
    """The frozen reference policy."""

    enable: bool | None = option(None, "Keep a reference model; null = when a KL loss or KL reward is on.")
    log_prob_micro_batch_size_per_gpu: int = option(16, "Sequences per GPU per reference forward.")
    log_prob_use_dynamic_bsz: bool = option(False, "Size reference micro-batches by tokens instead.")
    log_prob_max_token_len_per_gpu: int = option(
        16384, "Token budget per GPU per forward with dynamic batch size."
    )
    precompute: bool = option(False, "Compute reference log-probs once for the whole dataset (DPO/KTO).")
    fsdp: FSDPConfig = section(FSDPConfig, "Reference FSDP2 settings (param_offload keeps it on CPU).")
    parallel: ParallelConfig = section(
        ParallelConfig,
        "Reference training view; a null size is the actor's.",
        tp=None,
        pp=None,
        sp=None,
        ep=None,
    )
