"""The spellings of verl and the HybridFlow write-ups that issue 38 lists, and what each does here.

Shared by tests/config/test_spellings.py (as overrides and as YAML) and tests/cli/test_spelling_refusals.py
(the command line, in the bad-input sweep).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

A = "actor_rollout_ref"
TWO = ["trainer.n_gpus_per_node=2"]  # a view of 2 ranks needs 2 ranks

# (spelling=value, extra overrides, our key, its value): mapped onto hybridflow's keys (the parallel sizes
# are the roles' parallel sections since issue 39)
MAPPED: list[tuple[str, list[str], str, Any]] = [
    ("actor.fsdp_config.mixed_precision.param_dtype=bf16", [], "actor.fsdp.param_dtype", "bf16"),
    ("actor.fsdp_config.mixed_precision.reduce_dtype=fp32", [], "actor.fsdp.reduce_dtype", "fp32"),
    (f"{A}.actor.fsdp_config.mixed_precision.param_dtype=bf16", [], "actor.fsdp.param_dtype", "bf16"),
    (f"{A}.actor.fsdp_config.mixed_precision.reduce_dtype=fp32", [], "actor.fsdp.reduce_dtype", "fp32"),
    (f"{A}.ref.fsdp_config.mixed_precision.param_dtype=bf16", [], "ref.fsdp.param_dtype", "bf16"),
    ("critic.model.fsdp_config.mixed_precision.param_dtype=bf16", [], "critic.fsdp.param_dtype", "bf16"),
    ("critic.model.fsdp_config.mixed_precision.reduce_dtype=fp32", [], "critic.fsdp.reduce_dtype", "fp32"),
    ("actor.fsdp_config.param_offload=true", [], "actor.fsdp.param_offload", True),
    ("rollout.tp_size=2", TWO, "rollout.tensor_model_parallel_size", 2),
    (f"{A}.rollout.tp_size=2", TWO, "rollout.tensor_model_parallel_size", 2),
    ("megatron.tp_size=2", TWO, "actor.parallel.tp", 2),
    (f"{A}.rollout.kv_cache_dtype=fp8", [], "rollout.kv_cache_dtype", "fp8"),
    ("megatron.pp_size=2", TWO, "actor.parallel.pp", 2),
    ("actor.megatron.tp_size=2", TWO, "actor.parallel.tp", 2),
    ("actor.megatron.pp_size=2", TWO, "actor.parallel.pp", 2),
    (f"{A}.actor.megatron.tp_size=2", TWO, "actor.parallel.tp", 2),
    (f"{A}.actor.megatron.pp_size=2", TWO, "actor.parallel.pp", 2),
    ("critic.megatron.tp_size=2", TWO, "critic.parallel.tp", 2),
    (f"{A}.ref.megatron.pp_size=2", TWO, "ref.parallel.pp", 2),
    ("megatron.ep_size=2", TWO, "actor.parallel.ep", 2),
    ("actor.megatron.ep_size=2", TWO, "actor.parallel.ep", 2),
    (f"{A}.actor.megatron.ep_size=2", TWO, "actor.parallel.ep", 2),
    (f"{A}.actor.megatron.expert_model_parallel_size=2", TWO, "actor.parallel.ep", 2),
    (f"{A}.actor.megatron.expert_model_parallel_size=1", [], "actor.parallel.ep", 1),
    ("critic.megatron.expert_model_parallel_size=2", TWO, "critic.parallel.ep", 2),
    (f"{A}.ref.megatron.expert_model_parallel_size=2", TWO, "ref.parallel.ep", 2),
]

# (spelling=value): accepted, changing nothing, with one notice (the value asks for what hybridflow does)
NO_OPS = [
    "actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
    f"{A}.actor.fsdp_config.mixed_precision.buffer_dtype=float32",
    "actor.quantization=null",
    "expert_model_parallel_size=1",
    f"{A}.actor.megatron.expert_tensor_parallel_size=1",
]

EP = "expert parallelism is a size of each role's training view"
ETP = "expert tensor parallelism is not supported"
# (spelling=value, words of the message, words of the fix: the key to use)
REFUSED: list[tuple[str, str, str]] = [
    (
        "algorithm.grpo_n=8",
        "GRPO's group size is the number of responses sampled per prompt",
        "set rollout.n=8",
    ),
    (
        "actor.fsdp_config.mixed_precision.buffer_dtype=bf16",
        "buffers stay in float32",
        "actor.fsdp.param_dtype",
    ),
    (f"{A}.actor.fsdp_config.mixed_precision.buffer_dtype=fp16", "FSDP2", "actor.fsdp.param_dtype"),
    ("critic.model.fsdp_config.mixed_precision.buffer_dtype=bf16", "FSDP2", "critic.fsdp.param_dtype"),
    (f"{A}.ref.fsdp_config.mixed_precision.buffer_dtype=bf16", "FSDP2", "ref.fsdp.param_dtype"),
    ("expert_model_parallel_size=2", EP, "set actor.parallel.ep=2 and remove expert_model_parallel_size"),
    ("critic.ep_size=2", EP, "set critic.parallel.ep=2"),
    (f"{A}.actor.megatron.expert_tensor_parallel_size=2", ETP, "(or set it to 1)"),
    ("actor.quantization=fp8", "only the rollout quantises its weights", "set rollout.quantization=fp8"),
    ("rollout.kv_cache_dtype=bfloat16", "auto (held in rollout.dtype) or fp8", "set rollout.dtype"),
    ("rollout.kv_cache_dtype=fp8_e5m2", "auto (held in rollout.dtype) or fp8", "auto or fp8"),
    ("rollout.quantization=awq", "quantises to FP8 (e4m3, rowwise scales) or not at all", "fp8, or null"),
]


# ---- the write-ups' snippets as written (issue 60): every key of each is taken, or refused naming the key to use


@dataclass(frozen=True)
class Taken:
    """The key sets our key ``ours`` to ``value`` (a verl key or short spelling, or one of ours as it is)."""

    ours: str
    value: Any


@dataclass(frozen=True)
class Noted:
    """The key has no field here; its value asks for what hybridflow does: accepted with a warning of ``words``."""

    words: str


@dataclass(frozen=True)
class Refused:
    """The key is refused at the key, the fix naming what to write (``fix`` is in it)."""

    fix: str


@dataclass(frozen=True)
class Snippet:
    """A config as the write-ups (or verl's examples) write it: a nested dict or a command line of overrides.

    ``keys``: the fate of every key; ``context``: the cluster and batch around it (world size, micro-batch);
    ``verdict``: what validation says of the whole once every key is read, as (field, words of the fix).
    """

    name: str
    given: dict[str, Any] | list[str]
    keys: dict[str, Taken | Noted | Refused]
    context: list[str] = field(default_factory=list)
    verdict: list[tuple[str, str]] = field(default_factory=list)


def leaf_keys(given: dict[str, Any] | list[str], prefix: str = "") -> list[str]:
    """The dotted keys a snippet writes: a dict's leaves, or the keys of a command line's overrides."""
    if isinstance(given, list):
        return [text.split("=", 1)[0] for text in given]
    out = []
    for key, value in given.items():
        out += leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return out


def without(given: dict[str, Any] | list[str], keys: set[str]) -> dict[str, Any] | list[str]:
    """``given`` less the dotted ``keys``."""
    if isinstance(given, list):
        return [text for text in given if text.split("=", 1)[0] not in keys]
    out: dict[str, Any] = {}
    for key, value in given.items():
        if isinstance(value, dict):
            inner = {k.split(".", 1)[1] for k in keys if k.startswith(f"{key}.")}
            out[key] = without(value, inner)
        elif key not in keys:
            out[key] = value
    return out


EACH_ROLE = (
    "each role trains with FSDP2 over the data-parallel ranks and, as Megatron does, tensor parallelism"
)
VERL_GRPO_EXAMPLE = [  # verl's examples/grpo_trainer/run_qwen2-7b.sh, as written (the model a local directory)
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    f"{A}.model.path=/models/Qwen2-7B-Instruct",
    f"{A}.actor.optim.lr=1e-6",
    f"{A}.model.use_remove_padding=True",
    f"{A}.actor.ppo_mini_batch_size=256",
    f"{A}.actor.ppo_micro_batch_size_per_gpu=40",
    f"{A}.actor.use_kl_loss=True",
    f"{A}.actor.kl_loss_coef=0.001",
    f"{A}.actor.kl_loss_type=low_var_kl",
    f"{A}.actor.entropy_coeff=0",
    f"{A}.model.enable_gradient_checkpointing=True",
    f"{A}.actor.fsdp_config.param_offload=False",
    f"{A}.actor.fsdp_config.optimizer_offload=False",
    f"{A}.rollout.log_prob_micro_batch_size_per_gpu=40",
    f"{A}.rollout.tensor_model_parallel_size=2",
    f"{A}.rollout.name=vllm",
    f"{A}.rollout.gpu_memory_utilization=0.6",
    f"{A}.rollout.n=5",
    f"{A}.ref.log_prob_micro_batch_size_per_gpu=40",
    f"{A}.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[console,wandb]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def _as_written(text: str) -> Taken:
    """An override of verl's spelling or ours: the key it maps onto (from the name) and its value."""
    key, _, raw = text.partition("=")
    ours = {
        f"{A}.model.path": "model.path",
        f"{A}.model.use_remove_padding": "model.use_remove_padding",
        f"{A}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
        f"{A}.actor.fsdp_config.param_offload": "actor.fsdp.param_offload",
        f"{A}.actor.fsdp_config.optimizer_offload": "actor.fsdp.optimizer_offload",
        f"{A}.ref.fsdp_config.param_offload": "ref.fsdp.param_offload",
        f"{A}.rollout.name": "rollout.engine",
    }.get(key, key.removeprefix(f"{A}."))
    value = yaml.safe_load(raw) if key != f"{A}.rollout.name" else "native"
    if ours in ("data.train_files", "data.val_files"):
        value = [value]
    if ours == "actor.optim.lr":
        value = float(raw)
    return Taken(ours, value)


SNIPPETS: list[Snippet] = [
    Snippet(  # the write-ups' 3D layout: train TP=8, PP=4 (+ EP=2) with Megatron, generate TP=4 with vLLM
        "3d_layout_dict",
        {
            A: {"strategy": "megatron", "megatron": {"tp_size": 8, "pp_size": 4, "ep_size": 2}},
            "rollout": {"engine": "vllm", "tp_size": 4, "free_cache_engine": True},
        },
        {
            f"{A}.strategy": Noted(EACH_ROLE),
            f"{A}.megatron.tp_size": Taken("actor.parallel.tp", 8),
            f"{A}.megatron.pp_size": Taken("actor.parallel.pp", 4),
            f"{A}.megatron.ep_size": Taken("actor.parallel.ep", 2),
            "rollout.engine": Taken("rollout.engine", "native"),
            "rollout.tp_size": Taken("rollout.tensor_model_parallel_size", 4),
            "rollout.free_cache_engine": Taken("rollout.free_cache_engine", True),
        },
        ["trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor.ppo_micro_batch_size_per_gpu=4"],
        # every key is read; experts across pipeline stages are not built yet, and the refusal says what to set
        [("actor.parallel.ep", "set actor.pipeline_parallel_size=1")],
    ),
    Snippet(  # the same layout without experts runs
        "3d_layout_dict_dense",
        {
            A: {"strategy": "megatron", "megatron": {"tp_size": 8, "pp_size": 4}},
            "rollout": {"engine": "vllm", "tp_size": 4, "free_cache_engine": True},
        },
        {
            f"{A}.strategy": Noted(EACH_ROLE),
            f"{A}.megatron.tp_size": Taken("actor.parallel.tp", 8),
            f"{A}.megatron.pp_size": Taken("actor.parallel.pp", 4),
            "rollout.engine": Taken("rollout.engine", "native"),
            "rollout.tp_size": Taken("rollout.tensor_model_parallel_size", 4),
            "rollout.free_cache_engine": Taken("rollout.free_cache_engine", True),
        },
        ["trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor.ppo_micro_batch_size_per_gpu=4"],
    ),
    Snippet(  # the write-ups' dtype alignment
        "dtype_alignment_dict",
        {
            "actor": {
                "fsdp_config": {
                    "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
                }
            },
            "rollout": {"dtype": "bfloat16"},
        },
        {
            "actor.fsdp_config.mixed_precision.param_dtype": Taken("actor.fsdp.param_dtype", "bf16"),
            "actor.fsdp_config.mixed_precision.reduce_dtype": Taken("actor.fsdp.reduce_dtype", "fp32"),
            "actor.fsdp_config.mixed_precision.buffer_dtype": Noted(
                "buffers (RoPE's inv_freq, ...) stay in float32"
            ),
            "rollout.dtype": Taken("rollout.dtype", "bfloat16"),
        },
    ),
    Snippet(  # the write-ups' mixture of experts: train TP=8, EP=2 -> generate TP=4
        "moe_command_line",
        ["megatron.tp_size=8", "megatron.ep_size=2", "rollout.tp_size=4"],
        {
            "megatron.tp_size": Taken("actor.parallel.tp", 8),
            "megatron.ep_size": Taken("actor.parallel.ep", 2),
            "rollout.tp_size": Taken("rollout.tensor_model_parallel_size", 4),
        },
        ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor.ppo_micro_batch_size_per_gpu=4"],
    ),
    Snippet(  # issue 38's spellings on one command line: three are nobody's keys, each refused with ours
        "grpo_command_line",
        [
            "algorithm.adv_estimator=grpo",
            "algorithm.grpo_n=8",
            "actor.fsdp_config.param_offload=true",
            "actor.quantization=fp8",
            "rollout.kv_cache_dtype=fp8",
            "critic.hybrid_engine=true",
        ],
        {
            "algorithm.adv_estimator": Taken("algorithm.adv_estimator", "grpo"),
            "algorithm.grpo_n": Refused("set rollout.n=8"),
            "actor.fsdp_config.param_offload": Taken("actor.fsdp.param_offload", True),
            "actor.quantization": Refused("set rollout.quantization=fp8"),
            "rollout.kv_cache_dtype": Taken("rollout.kv_cache_dtype", "fp8"),
            "critic.hybrid_engine": Refused("actor.hybrid_engine is the switch"),
        },
    ),
    Snippet(
        "verl_grpo_example",
        VERL_GRPO_EXAMPLE,
        {text.split("=", 1)[0]: _as_written(text) for text in VERL_GRPO_EXAMPLE},
    ),
]
