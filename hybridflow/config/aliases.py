"""verl's config keys, mapped to hybridflow's fields so verl users can keep their habits.

Keys are the dotted names verl's example scripts and ``ppo_trainer.yaml`` use; they work as command-line
overrides and as nested YAML keys. A key that is also one of our own field paths (``data.train_files``,
``trainer.total_epochs``, ``algorithm.adv_estimator``, ...) needs no entry: it is accepted as it is.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_ARR = "actor_rollout_ref"

VERL_ALIASES: dict[str, str] = {
    # model
    f"{_ARR}.model.path": "model.path",
    f"{_ARR}.model.trust_remote_code": "model.trust_remote_code",
    f"{_ARR}.model.override_config": "model.override_config",
    f"{_ARR}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    f"{_ARR}.model.use_remove_padding": "model.use_remove_padding",
    f"{_ARR}.model.use_rmpad": "model.use_remove_padding",
    f"{_ARR}.model.custom_chat_template": "model.custom_chat_template",
    "data.tokenizer": "model.tokenizer_path",
    # data
    "data.seed": "trainer.seed",
    f"{_ARR}.rollout.prompt_length": "data.max_prompt_length",
    f"{_ARR}.rollout.response_length": "data.max_response_length",
    # actor
    f"{_ARR}.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    f"{_ARR}.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
    f"{_ARR}.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    f"{_ARR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{_ARR}.actor.shuffle": "actor.shuffle",
    f"{_ARR}.actor.clip_ratio": "actor.clip_ratio",
    f"{_ARR}.actor.clip_ratio_low": "actor.clip_ratio_low",
    f"{_ARR}.actor.clip_ratio_high": "actor.clip_ratio_high",
    f"{_ARR}.actor.clip_ratio_c": "actor.clip_ratio_c",
    f"{_ARR}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{_ARR}.actor.loss_scale_factor": "actor.loss_scale_factor",
    f"{_ARR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{_ARR}.actor.use_torch_compile": "actor.use_torch_compile",
    f"{_ARR}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{_ARR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{_ARR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{_ARR}.actor.grad_clip": "actor.grad_clip",
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    f"{_ARR}.actor.policy_loss.loss_mode": "actor.policy_loss.loss_mode",
    f"{_ARR}.actor.policy_loss.clip_cov_ratio": "actor.policy_loss.clip_cov_ratio",
    f"{_ARR}.actor.policy_loss.clip_cov_lb": "actor.policy_loss.clip_cov_lb",
    f"{_ARR}.actor.policy_loss.clip_cov_ub": "actor.policy_loss.clip_cov_ub",
    f"{_ARR}.actor.policy_loss.kl_cov_ratio": "actor.policy_loss.kl_cov_ratio",
    f"{_ARR}.actor.policy_loss.ppo_kl_coef": "actor.policy_loss.ppo_kl_coef",
    f"{_ARR}.actor.optim.lr": "actor.optim.lr",
    f"{_ARR}.actor.optim.weight_decay": "actor.optim.weight_decay",
    f"{_ARR}.actor.optim.betas": "actor.optim.betas",
    f"{_ARR}.actor.optim.lr_warmup_steps": "actor.optim.lr_warmup_steps",
    f"{_ARR}.actor.optim.lr_warmup_steps_ratio": "actor.optim.lr_warmup_steps_ratio",
    f"{_ARR}.actor.optim.warmup_style": "actor.optim.lr_scheduler_type",
    f"{_ARR}.actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler_type",
    f"{_ARR}.actor.optim.min_lr_ratio": "actor.optim.min_lr_ratio",
    f"{_ARR}.actor.optim.num_cycles": "actor.optim.num_cycles",
    f"{_ARR}.actor.optim.clip_grad": "actor.grad_clip",
    f"{_ARR}.actor.fsdp_config.param_offload": "actor.fsdp.param_offload",
    f"{_ARR}.actor.fsdp_config.optimizer_offload": "actor.fsdp.optimizer_offload",
    f"{_ARR}.actor.fsdp_config.reshard_after_forward": "actor.fsdp.reshard_after_forward",
    f"{_ARR}.actor.fsdp_config.fsdp_size": "actor.fsdp.fsdp_size",
    # rollout
    f"{_ARR}.rollout.name": "rollout.engine",
    f"{_ARR}.rollout.n": "rollout.n",
    f"{_ARR}.rollout.temperature": "rollout.temperature",
    f"{_ARR}.rollout.top_p": "rollout.top_p",
    f"{_ARR}.rollout.top_k": "rollout.top_k",
    f"{_ARR}.rollout.do_sample": "rollout.do_sample",
    f"{_ARR}.rollout.ignore_eos": "rollout.ignore_eos",
    f"{_ARR}.rollout.dtype": "rollout.dtype",
    f"{_ARR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{_ARR}.rollout.max_num_seqs": "rollout.max_num_seqs",
    f"{_ARR}.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    f"{_ARR}.rollout.max_model_len": "rollout.max_model_len",
    f"{_ARR}.rollout.tensor_model_parallel_size": "rollout.tensor_model_parallel_size",
    f"{_ARR}.rollout.free_cache_engine": "rollout.free_cache_engine",
    f"{_ARR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu": "rollout.log_prob_micro_batch_size_per_gpu",
    f"{_ARR}.rollout.log_prob_use_dynamic_bsz": "rollout.log_prob_use_dynamic_bsz",
    f"{_ARR}.rollout.log_prob_max_token_len_per_gpu": "rollout.log_prob_max_token_len_per_gpu",
    f"{_ARR}.rollout.val_kwargs.n": "rollout.val_kwargs.n",
    f"{_ARR}.rollout.val_kwargs.temperature": "rollout.val_kwargs.temperature",
    f"{_ARR}.rollout.val_kwargs.top_p": "rollout.val_kwargs.top_p",
    f"{_ARR}.rollout.val_kwargs.top_k": "rollout.val_kwargs.top_k",
    f"{_ARR}.rollout.val_kwargs.do_sample": "rollout.val_kwargs.do_sample",
    # reference
    f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size_per_gpu",
    f"{_ARR}.ref.log_prob_use_dynamic_bsz": "ref.log_prob_use_dynamic_bsz",
    f"{_ARR}.ref.log_prob_max_token_len_per_gpu": "ref.log_prob_max_token_len_per_gpu",
    f"{_ARR}.ref.fsdp_config.param_offload": "ref.fsdp.param_offload",
    f"{_ARR}.ref.fsdp_config.reshard_after_forward": "ref.fsdp.reshard_after_forward",
    f"{_ARR}.nccl_timeout": "trainer.nccl_timeout",
    # critic
    "critic.model.fsdp_config.param_offload": "critic.fsdp.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.fsdp.optimizer_offload",
    "critic.model.fsdp_config.fsdp_size": "critic.fsdp.fsdp_size",
    "critic.model.use_rmpad": "critic.model.use_remove_padding",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "critic.optim.clip_grad": "critic.grad_clip",
    # reward
    "reward_model.enable": "reward.model.enable",
    "reward_model.model.path": "reward.model.path",
    "reward_model.model.trust_remote_code": "reward.model.trust_remote_code",
    "reward_model.micro_batch_size_per_gpu": "reward.model.micro_batch_size_per_gpu",
    "reward_model.max_length": "reward.model.max_length",
    "reward_model.model.fsdp_config.param_offload": "reward.model.param_offload",
    "reward_model.reward_manager": "reward.manager",
    "reward_model.launch_reward_fn_async": "reward.launch_async",
    "reward_model.overlong_buffer.enable": "reward.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_buffer.penalty_factor",
    "reward_model.overlong_buffer.log": "reward.overlong_buffer.log",
    "custom_reward_function.path": "reward.custom_function.path",
    "custom_reward_function.name": "reward.custom_function.name",
    "custom_reward_function.reward_kwargs": "reward.custom_function.reward_kwargs",
    # trainer
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}

# Short forms of our own keys (the issue tracker and the README write `actor.lr=1e-6`).
SHORTHANDS: dict[str, str] = {
    "actor.lr": "actor.optim.lr",
    "critic.lr": "critic.optim.lr",
}

# verl values that mean something else here, per key (a value not listed passes through unchanged).
VERL_VALUE_MAPS: dict[str, dict[Any, Any]] = {
    # Our built-in engine takes the place of vLLM and SGLang.
    f"{_ARR}.rollout.name": {"vllm": "native", "sglang": "native"},
}

# verl keys that have no effect here: accepted with a one-line warning so verl scripts run unchanged.
VERL_IGNORED: dict[str, str] = {
    f"{_ARR}.hybrid_engine": "the hybrid engine is always on",
    f"{_ARR}.actor.strategy": "the training engine is always FSDP2",
    "critic.strategy": "the training engine is always FSDP2",
    "reward_model.strategy": "the training engine is always FSDP2",
    f"{_ARR}.actor.entropy_from_logits_with_chunking": "entropy is always computed in chunks",
    f"{_ARR}.actor.entropy_checkpointing": "the engine decides what to recompute",
    f"{_ARR}.actor.fsdp_config.grad_offload": "gradients are never offloaded (FSDP2)",
    "critic.model.fsdp_config.grad_offload": "gradients are never offloaded (FSDP2)",
    f"{_ARR}.ref.fsdp_config.optimizer_offload": "the reference has no optimizer",
    f"{_ARR}.ref.ulysses_sequence_parallel_size": "the reference uses the actor's setting",
    f"{_ARR}.rollout.mode": "the built-in engine has one mode",
    f"{_ARR}.rollout.enable_chunked_prefill": "prefill is always chunked by max_num_batched_tokens",
    f"{_ARR}.rollout.load_format": "the engine reads the trainer's weights in place",
    f"{_ARR}.model.use_shm": "models load from a local directory",
    f"{_ARR}.model.use_liger": "liger kernels are not used",
    f"{_ARR}.model.use_fused_kernels": "the engine picks its own kernels",
    "data.dataloader_num_workers": "prompts are tokenised up front",
    "trainer.default_hdfs_dir": "HDFS upload is not supported; checkpoints stay in trainer.default_local_dir",
    "trainer.del_local_ckpt_after_load": "local checkpoints are kept",
}

# verl keys whose meaning we do not map automatically: using one is an error that says what to write.
_PER_GPU_FIX = "divide the global value by trainer.nnodes * trainer.n_gpus_per_node and set '{}'"
VERL_UNSUPPORTED: dict[str, str] = {
    f"{_ARR}.actor.ppo_micro_batch_size": _PER_GPU_FIX.format("actor.ppo_micro_batch_size_per_gpu"),
    f"{_ARR}.rollout.log_prob_micro_batch_size": _PER_GPU_FIX.format(
        "rollout.log_prob_micro_batch_size_per_gpu"
    ),
    f"{_ARR}.ref.log_prob_micro_batch_size": _PER_GPU_FIX.format("ref.log_prob_micro_batch_size_per_gpu"),
    "critic.ppo_micro_batch_size": _PER_GPU_FIX.format("critic.ppo_micro_batch_size_per_gpu"),
    "reward_model.micro_batch_size": _PER_GPU_FIX.format("reward.model.micro_batch_size_per_gpu"),
}

_noticed: set[str] = set()


def _longest_prefix(path: str, table: dict[str, Any]) -> str | None:
    """The longest key of ``table`` that is ``path`` itself or a dotted prefix of it."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in table:
            return key
    return None


def resolve_alias(path: str) -> tuple[str, str | None]:
    """Map a verl key (or a key below one, such as a sub-key of override_config) or a shorthand to our path.

    Returns ``(our_path, alias)``; ``alias`` is None when ``path`` is neither.
    """
    key = _longest_prefix(path, VERL_ALIASES)
    if key is not None:
        return VERL_ALIASES[key] + path[len(key) :], key
    if path in SHORTHANDS:
        return SHORTHANDS[path], path
    return path, None


def translate_value(verl_key: str, value: Any) -> Any:
    """The value a verl key's value means here (e.g. rollout.name=vllm -> rollout.engine=native)."""
    mapping = VERL_VALUE_MAPS.get(verl_key, {})
    try:
        return mapping.get(value, value)
    except TypeError:  # an unhashable value (a list) is never in a value map
        return value


def ignored_reason(path: str) -> str | None:
    """Why a verl key is ignored, or None when it is not one of the ignored keys."""
    key = _longest_prefix(path, VERL_IGNORED)
    return None if key is None else VERL_IGNORED[key]


def unsupported_fix(path: str) -> str | None:
    """What to write instead of a refused verl key, or None when it is not one of them."""
    key = _longest_prefix(path, VERL_UNSUPPORTED)
    return None if key is None else VERL_UNSUPPORTED[key]


def notice_once(message_key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``message_key`` is seen in this process."""
    if message_key in _noticed:
        return
    _noticed.add(message_key)
    logger.log(level, message)
