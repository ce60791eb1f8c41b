"""verl's config keys, mapped to hybridflow's fields so verl users can keep their habits.

Keys are the dotted names verl's example scripts and ``ppo_trainer.yaml`` use; they work as command-line
overrides and as nested YAML keys. A key that is also one of our own field paths (``data.train_files``,
``trainer.total_epochs``, ``algorithm.adv_estimator``, ...) needs no entry: it is accepted as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.config.parallel import flat_aliases

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
    f"{_ARR}.model.lora_rank": "model.lora_rank",
    f"{_ARR}.model.lora_alpha": "model.lora_alpha",
    f"{_ARR}.model.target_modules": "model.target_modules",
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
    f"{_ARR}.actor.router_replay.mode": "actor.router_replay",
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
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "actor.parallel.sp",
    f"{_ARR}.ref.ulysses_sequence_parallel_size": "ref.parallel.sp",
    f"{_ARR}.actor.megatron.tensor_model_parallel_size": "actor.parallel.tp",
    f"{_ARR}.actor.megatron.pipeline_model_parallel_size": "actor.parallel.pp",
    f"{_ARR}.ref.megatron.tensor_model_parallel_size": "ref.parallel.tp",
    f"{_ARR}.ref.megatron.pipeline_model_parallel_size": "ref.parallel.pp",
    "critic.megatron.tensor_model_parallel_size": "critic.parallel.tp",
    "critic.megatron.pipeline_model_parallel_size": "critic.parallel.pp",
    f"{_ARR}.actor.policy_loss.loss_mode": "actor.policy_loss.loss_mode",
    f"{_ARR}.actor.policy_loss.clip_cov_ratio": "actor.policy_loss.clip_cov_ratio",
    f"{_ARR}.actor.policy_loss.clip_cov_lb": "actor.policy_loss.clip_cov_lb",
    f"{_ARR}.actor.policy_loss.clip_cov_ub": "actor.policy_loss.clip_cov_ub",
    f"{_ARR}.actor.policy_loss.kl_cov_ratio": "actor.policy_loss.kl_cov_ratio",
    f"{_ARR}.actor.policy_loss.ppo_kl_coef": "actor.policy_loss.ppo_kl_coef",
    f"{_ARR}.actor.policy_loss.dro_beta": "actor.policy_loss.dro_beta",
    f"{_ARR}.actor.tau_pos": "actor.policy_loss.tau_pos",
    f"{_ARR}.actor.tau_neg": "actor.policy_loss.tau_neg",
    **{
        f"{_ARR}.actor.policy_loss.rollout_correction.{name}": f"actor.policy_loss.rollout_correction.{name}"
        for name in (
            "loss_type",
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
        )
    },
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
    f"{_ARR}.actor.fsdp_config.mixed_precision.param_dtype": "actor.fsdp.param_dtype",
    f"{_ARR}.actor.fsdp_config.mixed_precision.reduce_dtype": "actor.fsdp.reduce_dtype",
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
    f"{_ARR}.rollout.expert_parallel_size": "rollout.expert_parallel_size",
    f"{_ARR}.rollout.quantization": "rollout.quantization",
    f"{_ARR}.rollout.kv_cache_dtype": "rollout.kv_cache_dtype",
    f"{_ARR}.rollout.multi_turn.enable": "rollout.multi_turn.enable",
    f"{_ARR}.rollout.multi_turn.format": "rollout.multi_turn.format",
    f"{_ARR}.rollout.multi_turn.tool_config_path": "rollout.multi_turn.tool_config_path",
    f"{_ARR}.rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_assistant_turns",
    f"{_ARR}.rollout.multi_turn.max_user_turns": "rollout.multi_turn.max_user_turns",
    f"{_ARR}.rollout.multi_turn.max_parallel_calls": "rollout.multi_turn.max_parallel_calls",
    f"{_ARR}.rollout.multi_turn.max_tool_response_length": "rollout.multi_turn.max_tool_response_length",
    f"{_ARR}.rollout.update_weights_bucket_megabytes": "rollout.update_weights_bucket_megabytes",
    f"{_ARR}.hybrid_engine": "actor.hybrid_engine",
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
    f"{_ARR}.ref.fsdp_config.mixed_precision.param_dtype": "ref.fsdp.param_dtype",
    f"{_ARR}.ref.fsdp_config.mixed_precision.reduce_dtype": "ref.fsdp.reduce_dtype",
    f"{_ARR}.nccl_timeout": "trainer.nccl_timeout",
    # critic
    "critic.model.fsdp_config.param_offload": "critic.fsdp.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.fsdp.optimizer_offload",
    "critic.model.fsdp_config.fsdp_size": "critic.fsdp.fsdp_size",
    "critic.model.fsdp_config.mixed_precision.param_dtype": "critic.fsdp.param_dtype",
    "critic.model.fsdp_config.mixed_precision.reduce_dtype": "critic.fsdp.reduce_dtype",
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


def _short_forms() -> dict[str, str]:
    """The HybridFlow write-ups' and verl's short spellings of training-view, FSDP and rollout keys."""
    out = {"rollout.tp_size": "rollout.tensor_model_parallel_size"}
    out[f"{_ARR}.rollout.tp_size"] = "rollout.tensor_model_parallel_size"
    out["rollout.ep_size"] = out[f"{_ARR}.rollout.ep_size"] = "rollout.expert_parallel_size"
    # megatron.tp_size / pp_size: a top-level megatron section is the actor's (the reference follows it), and
    # so is the write-ups' actor_rollout_ref.megatron (verl's actor_rollout_ref.actor.megatron)
    megatron = {"": "actor", f"{_ARR}.": "actor", "actor.": "actor", f"{_ARR}.actor.": "actor"}
    megatron["critic."] = "critic"
    megatron |= {"ref.": "ref", f"{_ARR}.ref.": "ref"}
    for prefix, role in megatron.items():
        for short, long, ours in (
            ("tp_size", "tensor_model_parallel_size", "parallel.tp"),
            ("pp_size", "pipeline_model_parallel_size", "parallel.pp"),
            ("ep_size", "expert_model_parallel_size", "parallel.ep"),
        ):
            out[f"{prefix}megatron.{short}"] = f"{role}.{ours}"
            if f"{prefix}megatron.{long}" not in VERL_ALIASES:
                out[f"{prefix}megatron.{long}"] = f"{role}.{ours}"
    # actor.fsdp_config.* (verl's, without actor_rollout_ref. in front) for every role
    for role in ("actor", "ref", "critic"):
        for name in ("param_offload", "optimizer_offload", "reshard_after_forward", "fsdp_size"):
            if role != "ref" or name != "optimizer_offload":  # the reference has no optimizer
                out[f"{role}.fsdp_config.{name}"] = f"{role}.fsdp.{name}"
        for name in ("param_dtype", "reduce_dtype"):
            out[f"{role}.fsdp_config.mixed_precision.{name}"] = f"{role}.fsdp.{name}"
    return out


# Short forms of our own keys (the issue tracker and the README write `actor.lr=1e-6`), the flat spellings
# of the parallel sections' sizes (`actor.tensor_parallel_size` is `actor.parallel.tp`) and the write-ups'
# short spellings of verl's keys (`rollout.tp_size`, `megatron.tp_size`, `actor.fsdp_config.*`).
SHORTHANDS: dict[str, str] = {
    "actor.lr": "actor.optim.lr",
    "critic.lr": "critic.optim.lr",
    **flat_aliases(),
    **_short_forms(),
}

# Values that mean something else here, per key as written: verl's, and the write-ups' rollout.engine=vllm
# (a value not listed passes through unchanged).
_ENGINES = {"vllm": "native", "sglang": "native"}  # our built-in engine takes the place of vLLM and SGLang
VERL_VALUE_MAPS: dict[str, dict[Any, Any]] = {
    f"{_ARR}.rollout.name": _ENGINES,
    "rollout.engine": _ENGINES,
    f"{_ARR}.actor.router_replay.mode": {"disabled": "off", "R2": "r2", "R3": "r3"},
}

# What runs in place of a translated value: one warning line ('{key}' is the key as written, '{value}' its
# value, '{ours}' the value it runs as).
_ENGINE_NOTE = (
    "{key}={value}: the built-in rollout engine replaces {name} here (it generates from the trainer's own "
    "weights, nothing to install); running as rollout.engine={ours}"
)
VALUE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}  # how a value is named in a note
VERL_VALUE_NOTES: dict[str, str] = {f"{_ARR}.rollout.name": _ENGINE_NOTE, "rollout.engine": _ENGINE_NOTE}


@dataclass(frozen=True)
class Refusal:
    """Why some values of an ignored key are refused (e.g. fp8: not there yet, with its issue) and the fix."""

    matches: Callable[[Any], bool]
    reason: str
    fix: str
    values: str  # the values it refuses, as the docs list them


@dataclass(frozen=True)
class IgnoredKey:
    """A verl key with no field here: the values that ask for what hybridflow does anyway, and the others.

    An accepted value changes nothing and logs ``notice`` (how hybridflow behaves) once; any other value is
    refused: ``refusal`` says what it asks for that hybridflow does not do, ``fix`` what to write instead
    (``{key}`` is the verl key).
    """

    notice: str
    accepts: tuple[Any, ...] | None = None  # None: every value
    refusal: str = ""
    fix: str = ""
    refusals: tuple[Refusal, ...] = ()  # particular refused values, with their own reason and fix

    def _special(self, value: Any) -> Refusal | None:
        return next((r for r in self.refusals if r.matches(value)), None)

    def accepts_value(self, value: Any) -> bool:
        """Whether ``value`` is one of the accepted values (``True`` is not ``1`` here)."""
        if self.accepts is None:
            return True
        return any(type(value) is type(ok) and value == ok for ok in self.accepts)

    def accepted_text(self) -> str:
        """The accepted values as a user writes them: 'true or false', 'fsdp or fsdp2', 'any value'."""
        if self.accepts is None:
            return "any value"
        return " or ".join(_yaml_literal(v) for v in self.accepts)

    def refused_message(self, value: Any) -> str:
        """Why ``value`` is refused."""
        special = self._special(value)
        if special is not None:
            return f"{value!r}: {special.reason}"
        if self.refusal:
            return f"{value!r} is not supported: {self.refusal}"
        return f"{value!r} is not a value of this verl key: use {self.accepted_text()}"

    def fix_for(self, key: str, value: Any = None) -> str:
        """The fix of a refused value of ``key`` (``value``: the refused one, for the particular refusals;
        ``{role}`` in a fix is the role the key names, actor by default)."""
        special = self._special(value)
        fix = special.fix if special is not None else self.fix
        role = next((part for part in key.split(".") if part in ("actor", "ref", "critic")), "actor")
        text = fix or "set {key}=" + self.accepted_text() + ", or remove it"
        return text.format(key=key, value=value, role=role)


def _yaml_literal(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "''" if value == "" else str(value)


_BOOL = (True, False)
_FSDP = ("fsdp", "fsdp2")
# hybridflow trains every role with FSDP2 and builds Megatron's layouts itself (DTensor tensor parallelism,
# torch.distributed.pipelining): verl's fsdp, fsdp2 and megatron strategies all mean that here.
STRATEGIES = ("fsdp", "fsdp2", "megatron")
_ONLY_FSDP2 = (
    "hybridflow trains with FSDP2, with Megatron-style tensor and pipeline parallelism on top (the role's "
    "parallel section)"
)
_FSDP_FIX = "set {key}=fsdp2, fsdp or megatron (all three mean this), or remove it"
_SAME = "either value gives the same numbers"


def strategy_notice(role: str | None) -> str:
    """How ``role`` (None: every role) trains whatever strategy (fsdp, fsdp2, megatron) a key names."""
    if role is None:
        who, tp, pp = "each role trains", "the role's tensor_parallel_size", "its pipeline_parallel_size"
    else:
        who = "the reference runs" if role == "ref" else f"the {role} trains"
        tp, pp = f"{role}.tensor_parallel_size", f"{role}.pipeline_parallel_size"
    return (
        f"{who} with FSDP2 over the data-parallel ranks and, as Megatron does, tensor parallelism inside each "
        f"layer ({tp}) and pipeline stages ({pp}), which verl's and the write-ups' megatron.tp_size / pp_size "
        "keys set: fsdp, fsdp2 and megatron all mean this here"
    )


def _grad_offload(role: str) -> IgnoredKey:
    return IgnoredKey(
        "gradients stay on the device and are freed after every optimizer step",
        (False,),
        "gradients are not offloaded (they are freed after every optimizer step, so none are held between "
        "phases)",
        f"remove it; to free device memory between phases set {role}.fsdp.param_offload=true and/or "
        f"{role}.fsdp.optimizer_offload=true",
    )


# verl keys that have no field here, judged by value: accepted with a one-line warning where hybridflow
# already behaves that way (verl scripts run unchanged), refused with the fix where the value asks for
# something hybridflow does not do.
VERL_IGNORED: dict[str, IgnoredKey] = {
    f"{_ARR}.actor.strategy": IgnoredKey(strategy_notice("actor"), STRATEGIES, _ONLY_FSDP2, _FSDP_FIX),
    f"{_ARR}.ref.strategy": IgnoredKey(strategy_notice("ref"), STRATEGIES, _ONLY_FSDP2, _FSDP_FIX),
    "critic.strategy": IgnoredKey(strategy_notice("critic"), STRATEGIES, _ONLY_FSDP2, _FSDP_FIX),
    "reward_model.strategy": IgnoredKey(
        "the reward model runs forward-only, a whole copy on each rank's device (nothing to shard)",
        _FSDP,
        "the reward model is a whole copy on each rank (no tensor/pipeline-parallel layout)",
        "set {key}=fsdp2 (or fsdp), or remove it",
    ),
    f"{_ARR}.actor.entropy_from_logits_with_chunking": IgnoredKey(
        f"entropy is always computed in row chunks of the logits ({_SAME})", _BOOL
    ),
    f"{_ARR}.actor.entropy_checkpointing": IgnoredKey(
        f"the entropy of each chunk is always recomputed in backward, never stored ({_SAME})", _BOOL
    ),
    f"{_ARR}.actor.fsdp_config.grad_offload": _grad_offload("actor"),
    "critic.model.fsdp_config.grad_offload": _grad_offload("critic"),
    f"{_ARR}.ref.fsdp_config.optimizer_offload": IgnoredKey(
        "the reference has no optimizer, so there is nothing to offload (ref.fsdp.param_offload moves its "
        "weights)",
        _BOOL,
    ),
    f"{_ARR}.rollout.mode": IgnoredKey(
        "the built-in engine generates each step's batch in the worker processes with continuous batching, "
        "in place of verl's sync and async (server) rollouts",
        ("sync", "async"),
    ),
    f"{_ARR}.rollout.enable_chunked_prefill": IgnoredKey(
        "prefill always runs in chunks of rollout.max_num_batched_tokens tokens (set it to at least "
        "data.max_prompt_length to prefill every prompt in one piece)",
        _BOOL,
    ),
    f"{_ARR}.rollout.load_format": IgnoredKey(
        "the rollout reads the trainer's weights in place; nothing is loaded from disk for it"
    ),
    f"{_ARR}.model.use_shm": IgnoredKey(
        "models load from model.path as it is",
        (False,),
        "copying the model to shared memory (/dev/shm) first is not supported",
        "remove it (or copy the model to /dev/shm yourself and set model.path there)",
    ),
    f"{_ARR}.model.use_liger": IgnoredKey(
        "Liger kernels are not used",
        (False,),
        "Liger kernels are not used (the fused LM head already scores without full logits)",
        "remove {key} or set it to false",
    ),
    "critic.model.lora_rank": IgnoredKey(
        "the critic trains every weight",
        (0,),
        "LoRA on the critic is not built (model.lora_rank adapts the actor)",
        "remove {key} or set it to 0",
    ),
    f"{_ARR}.model.use_fused_kernels": IgnoredKey(
        f"log-probs and entropy always come from the fused, chunked LM head, never full logits ({_SAME})",
        _BOOL,
    ),
    "data.dataloader_num_workers": IgnoredKey(
        "prompts are tokenised up front in the trainer process, so there is no loading work for workers"
    ),
    "trainer.default_hdfs_dir": IgnoredKey(
        "checkpoints stay in trainer.default_local_dir",
        (None, ""),
        "uploading checkpoints to HDFS is not supported",
        "remove it (or set it to null); checkpoints are written to trainer.default_local_dir, copy them from "
        "there",
    ),
    "trainer.del_local_ckpt_after_load": IgnoredKey(
        "local checkpoints are kept after a resume",
        (False,),
        "deleting the local checkpoint after loading it is not supported",
        "remove it or set it to false (trainer.max_ckpt_to_keep bounds how many checkpoints stay on disk)",
    ),
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


def value_note(key: str, value: Any) -> str | None:
    """What runs in place of a translated value of ``key`` as written (e.g. rollout.name=vllm), or None."""
    note = VERL_VALUE_NOTES.get(key)
    if note is None:
        return None
    name = VALUE_NAMES.get(value, value) if isinstance(value, str) else value
    return note.format(key=key, value=value, name=name, ours=translate_value(key, value))


def ignored_key(path: str) -> tuple[str, IgnoredKey] | None:
    """The ignored verl key that ``path`` is (or lies below) and its entry; None when there is none."""
    key = _longest_prefix(path, VERL_IGNORED)
    return None if key is None else (key, VERL_IGNORED[key])


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


def notice_mappings(mappings: list[tuple[str, str]]) -> None:
    """One INFO line listing the ``(key as written, our key)`` pairs not yet listed in this process."""
    new = [(written, ours) for written, ours in dict(mappings).items() if written not in _noticed]
    if not new:
        return
    _noticed.update(written for written, _ in new)
    listed = ", ".join(f"'{written}' -> '{ours}'" for written, ours in new)
    logger.info("verl keys and short spellings read as hybridflow's: %s", listed)
