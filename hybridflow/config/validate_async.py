"""The rollout's modes: asynchronous training (``trainer.async_mode``) and multi-turn rollouts with tools
(``rollout.multi_turn``): the settings each needs and the features it does not take yet."""

from __future__ import annotations

import os

from hybridflow.config.errors import Problem
from hybridflow.config.schema import Config

MODE = "trainer.async_mode"


def check_async(cfg: Config, out: list[Problem]) -> None:
    """``colocate`` needs the built-in engine's step API and a batch made of whole groups; ``separate`` a Ray
    rollout pool that splits into rollout groups; staleness is 1 to 8 versions."""
    t = cfg.trainer
    if not 1 <= t.max_staleness <= 8:
        out.append(
            Problem(
                "trainer.max_staleness", f"is {t.max_staleness}; it must be 1 to 8", "e.g. 1 (the default)"
            )
        )
    if t.async_mode == "separate":
        check_separate(cfg, out)
    elif t.rollout_pool_size:
        out.append(
            Problem(
                "trainer.rollout_pool_size",
                f"is {t.rollout_pool_size} with {MODE}={t.async_mode}: only a separate run has a rollout pool",
                f"set {MODE}=separate, or trainer.rollout_pool_size=0",
            )
        )
    if t.async_mode == "sync":
        return
    a = cfg.algorithm
    refusals = [
        (cfg.rollout.engine != "native", "rollout.engine", "needs the built-in engine's step API", "native"),
        (
            a.filter_groups.enable,
            "algorithm.filter_groups.enable",
            "draws its own rounds of prompts",
            "false",
        ),
        (
            a.adv_estimator == "remax",
            "algorithm.adv_estimator",
            "generates a greedy baseline mid-step",
            "grpo",
        ),
        (
            cfg.actor.router_replay == "r3" and t.async_mode == "colocate",
            "actor.router_replay",
            "records experts per phase only",
            "r2 or off",
        ),
    ]
    for bad, key, why, fix in refusals:  # each feature the async modes do not take yet, and why
        if bad:
            out.append(
                Problem(
                    key,
                    f"with {MODE}={t.async_mode}: it {why}",
                    f"set {key}={fix}, or {MODE}=sync",
                )
            )


def check_separate(cfg: Config, out: list[Problem]) -> None:
    """``separate``: Ray worker groups, a pool of whole rollout groups, whole batches (nothing to drop)."""
    t, r = cfg.trainer, cfg.rollout
    if t.backend != "ray":
        out.append(
            Problem(
                "trainer.backend",
                f"is {t.backend} with {MODE}=separate: the rollout pool is a worker group of its own",
                f"set trainer.backend=ray, or {MODE}=colocate (one pool)",
            )
        )
    pool, tp = t.rollout_pool_size, r.tensor_model_parallel_size
    if pool < 1 or pool % tp:
        out.append(
            Problem(
                "trainer.rollout_pool_size",
                f"is {pool} with {MODE}=separate: it must be a positive multiple of "
                f"rollout.tensor_model_parallel_size={tp}",
                f"e.g. trainer.rollout_pool_size={tp}",
            )
        )
    if t.staleness_policy == "drop":
        out.append(
            Problem(
                "trainer.staleness_policy",
                f"is drop with {MODE}=separate: each batch is generated whole by weights at most "
                "trainer.max_staleness versions old, so nothing is ever too stale to train",
                "set trainer.staleness_policy=wait",
            )
        )


def check_quantization(cfg: Config, out: list[Problem]) -> None:
    """``rollout.quantization``: null or fp8, on the built-in engine (HF generate runs no FP8 module)."""
    q = cfg.rollout.quantization
    kernels = ("auto", "w8a16", "scaled_mm", "scaled_mm_static", "triton_w8a8")
    if cfg.rollout.quantization_kernel not in kernels:
        out.append(
            Problem(
                "rollout.quantization_kernel",
                f"is {cfg.rollout.quantization_kernel!r}",
                f"set it to one of {', '.join(kernels)}",
            )
        )
    if q is None or str(q).lower() == "none":
        cfg.rollout.quantization = None
        return
    if q != "fp8":
        out.append(
            Problem(
                "rollout.quantization",
                f"is {q!r}: the rollout quantises to FP8 (e4m3, rowwise scales) or not at all",
                "set rollout.quantization=fp8, or null (the rollout in rollout.dtype)",
            )
        )
    elif cfg.rollout.engine != "native":
        out.append(
            Problem(
                "rollout.engine",
                "is hf with rollout.quantization=fp8: the FP8 matmuls are the built-in engine's",
                "set rollout.engine=native, or rollout.quantization=null",
            )
        )
    elif not cfg.actor.hybrid_engine:
        out.append(
            Problem(
                "actor.hybrid_engine",
                "is false with rollout.quantization=fp8: the weights are quantised on the hybrid engine's switch",
                "set actor.hybrid_engine=true, or rollout.quantization=null",
            )
        )


def check_kv_cache_dtype(cfg: Config, out: list[Problem]) -> None:
    """``rollout.kv_cache_dtype``: auto (null) or fp8 (fp8_e4m3 is the same format), on the built-in engine."""
    r = cfg.rollout
    value = "auto" if r.kv_cache_dtype is None else str(r.kv_cache_dtype).lower()
    r.kv_cache_dtype = {"fp8_e4m3": "fp8"}.get(value, value)
    if r.kv_cache_dtype not in ("auto", "fp8"):
        out.append(
            Problem(
                "rollout.kv_cache_dtype",
                f"is {value!r}: the KV cache is auto (held in rollout.dtype) or fp8 (e4m3, per-head scales)",
                "set rollout.kv_cache_dtype=auto or fp8; for a bf16/fp16/fp32 cache set rollout.dtype "
                "(the rollout's weights and KV cache together)",
            )
        )
    elif r.kv_cache_dtype == "fp8" and r.engine != "native":
        out.append(
            Problem(
                "rollout.engine",
                "is hf with rollout.kv_cache_dtype=fp8: the FP8 KV cache is the built-in engine's paged cache",
                "set rollout.engine=native, or rollout.kv_cache_dtype=auto",
            )
        )


BUILTIN_TOOLS = ("calc", "code_interpreter")


def check_multi_turn(cfg: Config, out: list[Problem]) -> None:
    """``rollout.multi_turn`` needs the built-in engine, known tools, and a synchronous, single-turn-free step."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    key = "rollout.multi_turn.enable"
    unknown = [t for t in mt.tools if t not in BUILTIN_TOOLS]
    if unknown or not (mt.tools or mt.tool_config_path):
        what = (
            f"names unknown tools {unknown}"
            if unknown
            else "is empty and no rollout.multi_turn.tool_config_path"
        )
        fix = f"use some of {', '.join(BUILTIN_TOOLS)}, e.g. [calc], or declare yours in a tool_config_path file"
        out.append(Problem("rollout.multi_turn.tools", what, fix))
    if mt.sandbox.memory_mb < 128:
        out.append(
            Problem(
                "rollout.multi_turn.sandbox.memory_mb",
                f"is {mt.sandbox.memory_mb}: the interpreter alone needs about 30 MiB of address space, and an "
                "import of numpy several hundred",
                "set it to 128 or more (default 1024)",
            )
        )
    if mt.tool_config_path and not os.path.isfile(mt.tool_config_path):
        out.append(
            Problem(
                "rollout.multi_turn.tool_config_path",
                f"{mt.tool_config_path!r} is not a file",
                "point it to a YAML file",
            )
        )
    refusals = [
        (cfg.rollout.engine != "native", "rollout.engine", "runs episodes on the built-in engine", "native"),
        (cfg.trainer.async_mode != "sync", MODE, "episodes are not carried across steps yet", "sync"),
        (
            cfg.algorithm.adv_estimator == "remax",
            "algorithm.adv_estimator",
            "scores a single-turn greedy baseline",
            "grpo",
        ),
        (
            cfg.actor.router_replay == "r3",
            "actor.router_replay",
            "records the experts of one turn",
            "r2 or off",
        ),
    ]
    for bad, path, why, fix in refusals:
        if bad:
            out.append(
                Problem(path, f"with {key}=true: multi-turn {why}", f"set {path}={fix}, or {key}=false")
            )


# Built-in tasks answered with a tool (data.tasks.TOOL_TASKS; a test keeps the two equal): task -> its tool.
TOOL_TASKS = {"multiply": "calc"}


def check_tool_task(cfg: Config, out: list[Problem]) -> None:
    """A built-in task answered with a tool (``data.task=multiply``) needs multi-turn rollouts with that tool,
    in the call format of its demonstrations (``data.task_kwargs.call_format``, default plain)."""
    task = cfg.data.task
    if task not in TOOL_TASKS or cfg.data.train_files or cfg.rollout.harness.enabled:
        return  # the built-in task is used only without data.train_files; a harness runs its own tools
    mt, tool = cfg.rollout.multi_turn, TOOL_TASKS[task]
    call_format = cfg.data.task_kwargs.get("call_format", "plain")
    keys = f"rollout.multi_turn.enable=true rollout.multi_turn.tools=[{tool}] rollout.multi_turn.format={call_format}"
    if not mt.enable:
        out.append(
            Problem(
                "rollout.multi_turn.enable",
                f"is false, but data.task={task} is answered by calling the {tool} tool",
                f"set {keys}",
            )
        )
        return
    if tool not in mt.tools:
        out.append(
            Problem("rollout.multi_turn.tools", f"lacks {tool}, which data.task={task} calls", f"set {keys}")
        )
    if mt.format != call_format:
        out.append(
            Problem(
                "rollout.multi_turn.format",
                f"is {mt.format}, but data.task={task}'s demonstrations call tools in the {call_format} format",
                f"set rollout.multi_turn.format={call_format}, or data.task_kwargs.call_format={mt.format}",
            )
        )


def check_harness(cfg: Config, out: list[Problem]) -> None:
    """``rollout.harness`` runs your episodes over an endpoint on the built-in engine: one rollout group of one
    rank per replica, a synchronous step, and the harness's reward alone."""
    h = cfg.rollout.harness
    if h.verifiers_config and h.verifiers_env is None:
        out.append(
            Problem(
                "rollout.harness.verifiers_config",
                "is set without rollout.harness.verifiers_env",
                "name the environment in rollout.harness.verifiers_env, or drop the config",
            )
        )
    if not h.enabled:
        return
    key = "rollout.harness.module" if h.verifiers_env is None else "rollout.harness.verifiers_env"
    if h.module is not None and h.verifiers_env is not None:
        out.append(
            Problem(
                "rollout.harness.verifiers_env",
                "is set with rollout.harness.module: episodes are played by one or the other",
                "set rollout.harness.module=null (the environment's harness plays), or verifiers_env=null",
            )
        )
    value = h.module if h.verifiers_env is None else h.verifiers_env
    if not isinstance(value, str) or not value.strip():
        what = "a .py file or an importable module"
        if h.verifiers_env is not None:
            what = "an installed verifiers environment or a .py file"
        out.append(Problem(key, f"is {value!r}", f"name {what}, or leave it null"))
    if h.verifiers_env is not None and h.module is None and h.function != "episode":
        out.append(
            Problem(
                "rollout.harness.function",
                f"is {h.function!r} with rollout.harness.verifiers_env set: the environment's harness plays",
                "leave rollout.harness.function at its default (episode)",
            )
        )
    if not isinstance(h.verifiers_config, dict):
        out.append(
            Problem(
                "rollout.harness.verifiers_config",
                f"is {h.verifiers_config!r}",
                "give a mapping, e.g. {taskset: {...}, agent: {runtime: {type: subprocess}}}",
            )
        )
    if not isinstance(h.function, str) or not h.function.isidentifier():
        out.append(
            Problem("rollout.harness.function", f"is {h.function!r}", "name an async function, e.g. episode")
        )
    if not 0 <= h.port <= 65535:
        out.append(
            Problem("rollout.harness.port", f"is {h.port}", "use 0 (a free port) or a port up to 65535")
        )
    refusals = [
        (cfg.rollout.engine != "native", "rollout.engine", "serves on the built-in engine", "native"),
        (cfg.trainer.async_mode != "sync", MODE, "episodes are not carried across steps yet", "sync"),
        (cfg.rollout.multi_turn.enable, "rollout.multi_turn.enable", "the harness runs the turns", "false"),
        (
            cfg.rollout.tensor_model_parallel_size != 1,
            "rollout.tensor_model_parallel_size",
            "serves from a whole replica per rank",
            "1",
        ),
        (cfg.algorithm.adv_estimator == "remax", "algorithm.adv_estimator", "has no greedy baseline", "grpo"),
        (bool(cfg.reward.custom_function.path), "reward.custom_function.path", "gives the reward", "null"),
        (cfg.reward.model.enable, "reward.model.enable", "gives the reward", "false"),
        (
            cfg.algorithm.filter_groups.enable,
            "algorithm.filter_groups.enable",
            "has no group filter yet",
            "false",
        ),
        (cfg.actor.router_replay == "r3", "actor.router_replay", "does not record experts", "r2 or off"),
    ]
    for bad, path, why, fix in refusals:
        if bad:
            out.append(
                Problem(path, f"with {key} set: the harness {why}", f"set {path}={fix}, or {key}=null")
            )
