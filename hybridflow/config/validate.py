"""Range, enum and consistency checks of a Config; every problem names the field and the fix.

The checks of one subject live beside this module: batch sizes (``batches``: verl's normalisation, whole
mini-batches), the rollout dtype (``dtypes``), the roles' parallel sizes against the world (``views``) and
the algorithms (``validate_algos``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hybridflow.config.batches import check_train_batch
from hybridflow.config.choices import CHOICES
from hybridflow.config.dtypes import check_rollout_dtype
from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.schema import Config, schema_index
from hybridflow.config.schema_base import get_path
from hybridflow.config.validate_algos import (
    check_adv_estimator_inputs,
    check_policy_loss,
    check_rollout_correction,
)
from hybridflow.config.validate_async import (
    check_async,
    check_harness,
    check_kv_cache_dtype,
    check_multi_turn,
    check_quantization,
    check_tool_task,
)
from hybridflow.config.validate_exact import check_exact
from hybridflow.config.validate_lora import check_lora
from hybridflow.config.views import check_train_views, expert_sizes, not_dividing, ranks_text

logger = logging.getLogger(__name__)

# rule name -> (predicate, what it requires)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    ">=1": (lambda v: v >= 1, "must be at least 1"),
    ">=0": (lambda v: v >= 0, "must be 0 or more"),
    ">0": (lambda v: v > 0, "must be greater than 0"),
    ">1": (lambda v: v > 1, "must be greater than 1"),
    ">=-1": (lambda v: v >= -1, "must be -1 (off) or more"),
    "(0,1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "[0,1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "[0,0.5)": (lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
    "[0,1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
}

# fmt: off
_RANGES: dict[str, list[str]] = {
    ">=1": [
        "data.task_train_size", "data.task_val_size", "data.max_prompt_length", "data.max_response_length",
        "data.train_batch_size", "data.val_batch_size", "data.gen_batch_size",
        "rollout.n", "rollout.val_kwargs.n", "rollout.max_num_seqs", "rollout.max_num_batched_tokens",
        "rollout.max_model_len", "rollout.tensor_model_parallel_size", "rollout.expert_parallel_size",
        "rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_tool_response_length",
        "rollout.multi_turn.max_user_turns", "rollout.multi_turn.max_parallel_calls",
        "rollout.multi_turn.sandbox.processes", "rollout.multi_turn.sandbox.scratch_mb",
        "rollout.multi_turn.sandbox.file_mb", "rollout.harness.max_concurrency",
        "rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_max_token_len_per_gpu",
        "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu",
        "actor.ppo_epochs",
        "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
        "critic.ppo_max_token_len_per_gpu", "critic.ppo_epochs",
        "ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_max_token_len_per_gpu",
        "reward.model.micro_batch_size_per_gpu", "reward.model.max_length",
        "algorithm.kl_ctrl.horizon",
        "trainer.total_epochs", "trainer.total_training_steps", "trainer.max_ckpt_to_keep",
        "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.nccl_timeout",
    ],
    ">=0": [
        "rollout.temperature", "rollout.val_kwargs.temperature",
        "actor.clip_ratio", "actor.clip_ratio_low", "actor.clip_ratio_high", "actor.kl_loss_coef",
        "actor.optim.weight_decay", "critic.optim.weight_decay", "critic.cliprange_value",
        "actor.optim.lr", "critic.optim.lr",  # lr=0 is the no-learning control run
        "actor.policy_loss.ppo_kl_coef", "actor.router_aux_loss_coef",
        "reward.num_workers", "reward.overlong_buffer.len", "reward.overlong_buffer.penalty_factor",
        "algorithm.kl_ctrl.kl_coef", "trainer.critic_warmup", "trainer.log_val_generations",
        "trainer.cpu_threads",
        "preference.sft_coef", "preference.desirable_weight", "preference.undesirable_weight",
        "model.lora_rank",
    ],
    ">0": [
        "actor.optim.eps", "critic.optim.eps",
        "actor.optim.num_cycles", "critic.optim.num_cycles", "actor.grad_clip", "critic.grad_clip",
        "actor.loss_scale_factor", "reward.timeout_s",
        "actor.policy_loss.clip_cov_ratio", "actor.policy_loss.kl_cov_ratio", "algorithm.kl_ctrl.target_kl",
        "actor.policy_loss.dro_beta", "actor.policy_loss.tau_pos", "actor.policy_loss.tau_neg",
        "algorithm.rollout_correction.rollout_token_veto_threshold",
        "preference.beta", "trainer.gpu_memory_gb", "model.lora_alpha", "rollout.multi_turn.tool_timeout_s",
        "rollout.harness.timeout_s",
    ],
    ">1": ["actor.clip_ratio_c"],
    ">=-1": ["rollout.top_k", "rollout.val_kwargs.top_k"],
    "[0,0.5)": ["preference.label_smoothing"],
    "[0,1)": ["model.lora_dropout"],
    "(0,1]": ["rollout.gpu_memory_utilization", "rollout.top_p", "rollout.val_kwargs.top_p"],
    "[0,1]": [
        "rollout.min_p", "algorithm.gamma", "algorithm.lam",
        "actor.optim.lr_warmup_steps_ratio", "critic.optim.lr_warmup_steps_ratio",
        "actor.optim.min_lr_ratio", "critic.optim.min_lr_ratio",
    ],
}
# fmt: on


def _example(path: str, rule: str) -> str:
    default = schema_index()[0][path].default
    ok, _ = _RULES[rule]
    if default is not None and ok(default):
        return f"e.g. {path}={default} (the default)"
    return f"set {path} to a value that is {_RULES[rule][1].removeprefix('must be ')}"


def _check_ranges(cfg: Config, out: list[Problem]) -> None:
    for rule, paths in _RANGES.items():
        ok, requirement = _RULES[rule]
        for path in paths:
            value = get_path(cfg, path)
            if value is not None and not ok(value):  # None means 'derived from another field'
                out.append(Problem(path, f"{requirement}, got {value!r}", _example(path, rule)))
    for section in ("actor", "critic"):
        betas = get_path(cfg, f"{section}.optim.betas")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            out.append(
                Problem(
                    f"{section}.optim.betas",
                    f"must be two numbers in [0, 1), got {betas!r}",
                    f"e.g. {section}.optim.betas=[0.9,0.999]",
                )
            )


def _check_choices(cfg: Config, out: list[Problem]) -> None:
    """Each enumerated field holds a built-in name, or one of its choice sources' (asked only then)."""
    from hybridflow.config.choices import choices_for, unknown_choice_fix

    for path, names in CHOICES.items():
        value = get_path(cfg, path)
        for v in value if isinstance(value, list) else [value]:
            if v is None or v in names:
                continue
            try:
                valid = choices_for(path, cfg)
            except ConfigError as exc:  # a source could not answer (a module it imports is broken)
                out.extend(p for p in exc.problems if p not in out)
                continue
            if v not in valid:
                out.append(Problem(path, f"unknown value {v!r}", unknown_choice_fix(path, valid)))


def _check_consistency(cfg: Config, out: list[Problem]) -> None:
    check_train_batch(cfg, out)
    if not cfg.use_critic and cfg.algorithm.adv_estimator == "gae":
        out.append(
            Problem(
                "critic.enable",
                "algorithm.adv_estimator=gae needs a critic",
                "set critic.enable=true (or null), or pick a critic-free estimator such as grpo",
            )
        )
    for prefix in ("rollout", "rollout.val_kwargs"):
        if get_path(cfg, f"{prefix}.do_sample") and get_path(cfg, f"{prefix}.temperature") == 0:
            out.append(
                Problem(
                    f"{prefix}.temperature",
                    f"is 0 while {prefix}.do_sample=true",
                    f"set {prefix}.do_sample=false for greedy decoding, or a {prefix}.temperature > 0",
                )
            )
    _check_rollout(cfg, out)
    _check_token_budgets(cfg, out)
    check_rollout_dtype(cfg, out)
    check_rollout_correction(cfg, out)
    check_policy_loss(cfg, out)
    check_adv_estimator_inputs(cfg, out)
    _check_trainer(cfg, out)
    _check_offload(cfg, out)
    _check_unimplemented(cfg, out)
    check_async(cfg, out)
    check_quantization(cfg, out)
    check_kv_cache_dtype(cfg, out)
    check_multi_turn(cfg, out)
    check_harness(cfg, out)
    check_tool_task(cfg, out)
    check_lora(cfg, out)
    check_exact(cfg, out)


def _check_unimplemented(cfg: Config, out: list[Problem]) -> None:
    """verl settings whose layouts hybridflow does not have yet: refused, so none is silently ignored."""
    _check_rollout_tp(cfg, out)
    check_train_views(cfg, out)
    for role in ("actor", "critic", "ref"):
        size = get_path(cfg, f"{role}.fsdp.fsdp_size")
        if size not in (-1, cfg.trainer.world_size):
            out.append(
                Problem(
                    f"{role}.fsdp.fsdp_size",
                    f"is {size}, but hybrid sharding (FSDP groups smaller than the world of "
                    f"{cfg.trainer.world_size} ranks) is not implemented: every role shards over all ranks",
                    f"set {role}.fsdp.fsdp_size=-1",
                )
            )
    if cfg.reward.model.enable and cfg.reward.model.max_length is not None:
        out.append(
            Problem(
                "reward.model.max_length",
                f"is {cfg.reward.model.max_length}, but the reward model scores whole sequences (no truncation)",
                "leave it null; data.max_prompt_length + data.max_response_length bound what it reads",
            )
        )
    if cfg.data.gen_batch_size is not None and not cfg.algorithm.filter_groups.enable:
        out.append(
            Problem(
                "data.gen_batch_size",
                "sets the prompts of a dynamic-sampling round, but algorithm.filter_groups.enable is false",
                "leave it null, or set algorithm.filter_groups.enable=true",
            )
        )


def _check_rollout_tp(cfg: Config, out: list[Problem]) -> None:
    """A tensor-parallel rollout: groups of tp ranks of the world, the built-in engine, the hybrid engine;
    experts split whole (``rollout.expert_parallel_size``) over tp x k ranks, k dividing the groups."""
    tp, world, path = (
        cfg.rollout.tensor_model_parallel_size,
        cfg.trainer.world_size,
        "rollout.tensor_model_parallel_size",
    )
    _check_rollout_ep(cfg, out)
    if tp == 1:
        return
    if world % tp:
        out.append(not_dividing(path, tp, world))
    if cfg.rollout.engine != "native":
        out.append(
            Problem(path, f"is {tp} with rollout.engine={cfg.rollout.engine}", "use rollout.engine=native")
        )
    if not cfg.actor.hybrid_engine:
        out.append(
            Problem(
                "actor.hybrid_engine",
                f"is false with {path}={tp}: the baseline keeps a whole copy on every rank",
                f"set actor.hybrid_engine=true, or {path}=1",
            )
        )


def _check_rollout_ep(cfg: Config, out: list[Problem]) -> None:
    """``rollout.expert_parallel_size``: 1, or tp x k with k dividing the rollout groups; above tp (experts
    across groups, whose tokens meet at every MoE layer) only where the exchange is built."""
    tp, world, key = (
        cfg.rollout.tensor_model_parallel_size,
        cfg.trainer.world_size,
        "rollout.expert_parallel_size",
    )
    ep = cfg.rollout.expert_parallel_size
    if ep <= 1 or tp < 1 or world % tp:  # below 1: the range check's; tp's own checks name a bad tp
        return
    if ep % tp or (world // tp) % (ep // tp):
        sizes = ", ".join(map(str, expert_sizes(world, tp)))
        out.append(
            Problem(
                key,
                f"is {ep} with rollout.tensor_model_parallel_size={tp} on {ranks_text(world)}: experts split "
                f"whole over tp x k ranks, k dividing the {world // tp} rollout groups",
                f"use one of {sizes} (1: each expert sliced over its rollout group)",
            )
        )
        return
    if ep == tp:
        return
    fix = f"set {key}={tp if tp > 1 else 1}"
    refused = {
        "trainer.device": cfg.trainer.device == "cuda",
        "trainer.async_mode": cfg.trainer.async_mode != "sync",
        "rollout.multi_turn.enable": cfg.rollout.multi_turn.enable,
        "rollout.harness.module": bool(cfg.rollout.harness.module),
        "actor.hybrid_engine": not cfg.actor.hybrid_engine,
        "rollout.engine": cfg.rollout.engine != "native",
    }
    for setting in (k for k, on in refused.items() if on):
        what = (
            "runs on CPU/gloo only so far"
            if setting == "trainer.device"
            else f"runs with whole generate calls of the built-in hybrid engine only, not {setting}={get_path(cfg, setting)}"
        )
        out.append(Problem(key, f"is {ep} > tp={tp} (experts across rollout groups), which {what}", fix))


def _check_offload(cfg: Config, out: list[Problem]) -> None:
    """``optimizer_offload`` is true, false, or auto (the trained roles on the rollout's GPUs)."""
    _check_cpu_step(cfg, out)
    for role in ("actor", "critic", "ref"):
        path = f"{role}.fsdp.optimizer_offload"
        value = get_path(cfg, path)
        if isinstance(value, bool):
            continue
        if value != "auto":
            fix = "use true, false or auto (auto: only while a rollout would otherwise run in waves)"
            out.append(Problem(path, f"unknown value {value!r}", fix))
        elif role == "ref":
            fix = "use true or false (the reference has no optimizer)"
            out.append(Problem(path, "auto has no moments to move", fix))
        elif role == "critic" and cfg.trainer.placement == "split":
            fix = (
                "use true or false (auto makes room for the rollout, and a split critic has GPUs of its own)"
            )
            out.append(Problem(path, "auto with trainer.placement=split", fix))


def _check_cpu_step(cfg: Config, out: list[Problem]) -> None:
    """``optimizer_step_on_cpu`` only where there is an optimizer, and not with ``optimizer_offload``."""
    if cfg.ref.fsdp.optimizer_step_on_cpu:
        fix = (
            "set ref.fsdp.optimizer_step_on_cpu=false (ref.fsdp.param_offload keeps its weights on the host)"
        )
        out.append(Problem("ref.fsdp.optimizer_step_on_cpu", "is true: the reference has no optimizer", fix))
    for role in ("actor", "critic"):
        fsdp = get_path(cfg, f"{role}.fsdp")
        if fsdp.optimizer_step_on_cpu and fsdp.optimizer_offload is not False:
            out.append(
                Problem(
                    f"{role}.fsdp.optimizer_offload",
                    f"is {str(fsdp.optimizer_offload).lower()} with {role}.fsdp.optimizer_step_on_cpu=true: the "
                    "moments already live on the host, there is nothing to offload",
                    f"set {role}.fsdp.optimizer_offload=false (or {role}.fsdp.optimizer_step_on_cpu=false)",
                )
            )


def _check_rollout(cfg: Config, out: list[Problem]) -> None:
    r, d = cfg.rollout, cfg.data
    total = d.max_prompt_length + d.max_response_length
    if r.max_model_len is not None and r.max_model_len < total:
        out.append(
            Problem(
                "rollout.max_model_len",
                f"{r.max_model_len} is shorter than max_prompt_length + max_response_length = {total}",
                f"set rollout.max_model_len >= {total} (or null)",
            )
        )
    if d.gen_batch_size is not None and d.gen_batch_size < d.train_batch_size:
        out.append(
            Problem(
                "data.gen_batch_size",
                f"{d.gen_batch_size} is smaller than data.train_batch_size={d.train_batch_size}",
                f"set data.gen_batch_size >= {d.train_batch_size} (or null)",
            )
        )
    ob = cfg.reward.overlong_buffer
    if ob.enable and not 0 < ob.len < d.max_response_length:
        out.append(
            Problem(
                "reward.overlong_buffer.len",
                f"{ob.len} must be between 1 and data.max_response_length - 1 = {d.max_response_length - 1} "
                "when the buffer is enabled",
                f"e.g. reward.overlong_buffer.len={max(1, d.max_response_length // 4)}",
            )
        )
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "grpo_passk") and r.n == 1:
        logger.warning(
            "algorithm.adv_estimator=%s with rollout.n=1: every group has one sample",
            cfg.algorithm.adv_estimator,
        )


# (use_dynamic_bsz switch, its token budget, whether the role runs): a budget must hold one whole sequence.
# The reference's budget counts whenever its switch is on (the DPO/KTO jobs turn the reference on).
_TOKEN_BUDGETS: list[tuple[str, str, Callable[[Config], bool]]] = [
    ("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu", lambda cfg: True),
    # the critic's updates and its value passes share this budget
    ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", lambda cfg: cfg.use_critic),
    ("rollout.log_prob_use_dynamic_bsz", "rollout.log_prob_max_token_len_per_gpu", lambda cfg: True),
    ("ref.log_prob_use_dynamic_bsz", "ref.log_prob_max_token_len_per_gpu", lambda cfg: True),
]


def _check_token_budgets(cfg: Config, out: list[Problem]) -> None:
    """Micro-batches sized by tokens fail at the first step when one sequence exceeds the budget."""
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    for switch, budget, used in _TOKEN_BUDGETS:
        value = get_path(cfg, budget)
        if get_path(cfg, switch) and used(cfg) and value < total:
            out.append(
                Problem(
                    budget,
                    f"{value} tokens cannot hold one sequence of data.max_prompt_length + "
                    f"data.max_response_length = {total} tokens while {switch}=true",
                    f"set {budget} to at least {total} (or {switch}=false)",
                )
            )


_FILE_LISTS = {
    "data.train_files": "list the files, data.train_files=[FILE,...], or data.train_files=null for the "
    "built-in task",
    "data.val_files": "list the files, data.val_files=[FILE,...], or data.val_files=null (no validation set "
    "when data.train_files is set, the built-in task's held-out split otherwise)",
}


def _check_file_lists(cfg: Config, out: list[Problem]) -> None:
    for path, fix in _FILE_LISTS.items():
        if get_path(cfg, path) == []:
            out.append(Problem(path, "is an empty list", fix))


def _check_trainer(cfg: Config, out: list[Problem]) -> None:
    t = cfg.trainer
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        out.append(
            Problem(
                "trainer.resume_from_path",
                "is empty while trainer.resume_mode=resume_path",
                "set trainer.resume_from_path=DIR, or trainer.resume_mode=auto",
            )
        )
    if t.resume is not None and not str(t.resume).strip():
        out.append(
            Problem("trainer.resume", "is empty", "use auto, disable, or a checkpoint directory (or null)")
        )
    if t.save_freq < -1:
        out.append(
            Problem(
                "trainer.save_freq",
                f"is {t.save_freq}",
                "use a positive step count, -1 to save only at the end, or 0 to save no checkpoint",
            )
        )
    if cfg.reward.model.enable and not cfg.reward.model.path:
        out.append(
            Problem(
                "reward.model.path",
                "is empty while reward.model.enable=true",
                "set reward.model.path=DIR (a sequence-classification checkpoint)",
            )
        )
    if cfg.reward.launch_async and cfg.reward.model.enable:
        out.append(
            Problem(
                "reward.launch_async",
                "is true with a reward model, which scores on the GPU workers the log-prob passes use",
                "set reward.launch_async=false (it overlaps only a reward function with those passes)",
            )
        )
    if cfg.reward.launch_async and cfg.algorithm.adv_estimator == "remax":
        logger.warning(
            "reward.launch_async is off for ReMax: its greedy baseline calls the scorer in the step"
        )
    if cfg.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        logger.warning(
            "actor.use_kl_loss and algorithm.use_kl_in_reward are both on: the KL is penalised twice"
        )


def validate_config(cfg: Config) -> list[Problem]:
    """Every range, enum and consistency problem of ``cfg`` (an empty list when it is usable)."""
    out: list[Problem] = []
    _check_ranges(cfg, out)
    _check_file_lists(cfg, out)
    _check_choices(cfg, out)
    if not out:  # consistency messages assume each value is in range on its own
        _check_consistency(cfg, out)
    return out


def check_config(cfg: Config) -> Config:
    """Raise ConfigError listing every problem of ``cfg``; return it unchanged when it is usable."""
    problems = validate_config(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
