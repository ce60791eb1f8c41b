"""Keys judged by their last name wherever they appear, and keys refused with a pointer to the one to write.

The HybridFlow write-ups and verl's configs use keys hybridflow has no field for: quantisation outside
``rollout.quantization`` (our own key, as ``rollout.kv_cache_dtype`` is), expert parallelism outside a role's
megatron section (``expert_model_parallel_size``, ``*.ep_size``: it is ``<role>.parallel.ep``), expert tensor
parallelism, the training strategy outside verl's keys (``actor_rollout_ref.strategy: megatron``: fsdp, fsdp2
and megatron all mean FSDP2 with Megatron-style views here), FSDP1's ``mixed_precision.buffer_dtype``, and
``algorithm.grpo_n`` and ``critic.hybrid_engine``, which are nobody's keys.
Each is judged here only when it is not one of our own keys, verl's keys or a key inside a free-form mapping
(``model.override_config.quantization_config`` stays the model's). A value that asks for what hybridflow does
anyway (``quantization: null``, ``expert_model_parallel_size: 1``) is accepted with a notice; any other
value is refused, saying what is not there yet and where it is planned.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.aliases import STRATEGIES, IgnoredKey, Refusal, strategy_notice

EP_WHERE = "expert parallelism is a size of each role's training view, not a key of its own here"
ETP_ISSUE = (
    "expert tensor parallelism is not supported: experts are split over ranks whole (actor.parallel.ep)"
)


def _is_fp8(value: Any) -> bool:
    """fp8, fp8_e4m3, fp8_e5m2, e4m3fn, ... (vLLM's and SGLang's spellings)."""
    text = str(value).lower()
    return "fp8" in text or "e4m3" in text or "e5m2" in text


def _anything(value: Any) -> bool:
    return True


_ROLLOUT_DTYPE_FIX = "remove {key} (or set it to null): the rollout generates in rollout.dtype (auto: the "
_ROLLOUT_DTYPE_FIX += "training compute dtype)"

# last name of a key -> how its values are judged
BY_NAME: dict[str, IgnoredKey] = {
    "quantization": IgnoredKey(
        "the rollout generates from the trainer's own weights in rollout.dtype, unquantized",
        (None, "none"),
        refusals=(
            Refusal(
                _is_fp8,
                "only the rollout quantises its weights",
                "remove {key} and set rollout.quantization=fp8",
                "fp8, fp8_e4m3, fp8_e5m2, ...",
            ),
            Refusal(
                _anything,
                "a quantized rollout is not supported: the rollout reads the trainer's weights in "
                "rollout.dtype",
                _ROLLOUT_DTYPE_FIX,
                "any other",
            ),
        ),
    ),
    "buffer_dtype": IgnoredKey(
        "FSDP2 casts parameters only: buffers (RoPE's inv_freq, ...) stay in float32, as loaded",
        ("float32", "fp32"),
        refusals=(
            Refusal(
                _anything,
                "buffers stay in float32 (FSDP2, which hybridflow trains with, casts parameters only)",
                "remove {key} (or set it to float32); the compute dtype is {role}.fsdp.param_dtype",
                "any other",
            ),
        ),
    ),
    **{
        name: IgnoredKey(
            "expert parallelism is a size of each role: actor.parallel.ep (ref.parallel.ep, critic.parallel.ep)",
            (None, 1),
            refusals=(
                Refusal(_anything, EP_WHERE, "set {role}.parallel.ep={value} and remove {key}", "any other"),
            ),
        )
        for name in ("expert_model_parallel_size", "expert_parallel_size", "ep_size")
    },
    # the write-ups' actor_rollout_ref.strategy, actor.strategy, ref.strategy (verl's own strategy keys, with
    # the role's name in the notice, are in aliases.VERL_IGNORED)
    "strategy": IgnoredKey(
        strategy_notice(None),
        STRATEGIES,
        refusals=(
            Refusal(
                _anything,
                "hybridflow trains with FSDP2, with Megatron-style tensor and pipeline parallelism on top",
                "set {key}=fsdp2, fsdp or megatron (all three mean this), or remove it; the layout is "
                "{role}.tensor_parallel_size and {role}.pipeline_parallel_size",
                "any other (deepspeed, ...)",
            ),
        ),
    ),
    "expert_tensor_parallel_size": IgnoredKey(
        "experts are not split over tensor-parallel ranks in training: each expert is whole on its rank",
        (None, 1),
        refusals=(Refusal(_anything, ETP_ISSUE, "remove {key} (or set it to 1)", "any other"),),
    ),
}

# last name of a key that is nobody's -> (what to write instead, '{value}' the value given; why)
POINTERS: dict[str, tuple[str, str]] = {
    "grpo_n": (  # algorithm.grpo_n
        "set rollout.n={value} (verl: actor_rollout_ref.rollout.n)",
        "GRPO's group size is the number of responses sampled per prompt, rollout.n",
    ),
    "hybrid_engine": (  # critic.hybrid_engine, ref.hybrid_engine (the actor's is actor.hybrid_engine)
        "remove it (actor.hybrid_engine is the switch, and it is the actor's)",
        "only the actor generates, so only it switches its weights between a training and a generation layout",
    ),
}


def judged_by_name(path: str) -> tuple[str, IgnoredKey] | None:
    """``(last name, entry)`` when ``path``'s last name is judged by value here; else None."""
    name = path.rsplit(".", 1)[-1]
    entry = BY_NAME.get(name)
    return None if entry is None else (name, entry)


def pointer(path: str, value: Any) -> tuple[str, str] | None:
    """``(why, fix)`` for a key that is nobody's but means one of ours; else None."""
    found = POINTERS.get(path.rsplit(".", 1)[-1])
    if found is None:
        return None
    fix, why = found
    shown = "N" if value is None or isinstance(value, (dict, list)) else value
    return why, fix.format(value=shown)
