"""The spellings of verl and the HybridFlow write-ups that issue 38 lists, and what each does here.

Shared by tests/config/test_spellings.py (as overrides and as YAML) and tests/cli/test_spelling_refusals.py
(the command line, in the bad-input sweep).
"""

from __future__ import annotations

from typing import Any

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
