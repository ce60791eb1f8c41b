"""What hybridflow does with each model family: the built-in engine's Llama family, the rest, and MoE.

The built-in rollout engine and the tensor-parallel shard rules cover Llama-style decoders: the dense Llama
family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral (a
tensor-parallel rollout slices every expert on its intermediate dim; training splits their attention and keeps
the MoE blocks whole, or splits the experts with expert parallelism, ``parallel.ep``, checked here against the
model). Any other causal LM (GPT-2, DeepSeek-V3, ...) still trains with FSDP2 over every rank and generates
with HF ``generate`` on a whole replica per rank; only the layouts that need shard rules (tensor parallelism)
are refused, at start, naming the family.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from hybridflow.config.parallel import size_key
from hybridflow.models.moe import num_experts
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# Families whose HF module is a Llama-style decoder (model.embed_tokens, model.layers of self_attn + mlp,
# model.norm, model.rotary_emb): pipeline stages and Ulysses split these, dense or mixture of experts.
LLAMA_LAYOUT = (*LLAMA_FAMILY, "qwen2_moe", "qwen3_moe", "mixtral")
SHARD_RULES_FAMILY = LLAMA_LAYOUT  # tensor-parallel shard rules: these decoders, dense or mixture of experts
MOE_FAMILY = ("qwen2_moe", "qwen3_moe", "mixtral")  # the mixtures of experts with shard rules


def model_type(config: Any) -> str:
    """The config's ``model_type`` (the family's name), or its class name when it has none."""
    return getattr(config, "model_type", None) or type(config).__name__


def is_moe(config: Any) -> bool:
    """Whether the config describes a mixture of experts (any routed experts)."""
    return num_experts(config) > 0


def has_shard_rules(config: Any) -> bool:
    """Whether tensor-parallel shard rules exist for this family (Llama-style decoders, dense or MoE)."""
    return model_type(config) in SHARD_RULES_FAMILY


def check_tensor_parallel(config: Any, key: str, size: int) -> None:
    """Refuse ``key=size`` > 1 for a family without tensor-parallel shard rules (UserError naming both).

    Whether the sizes divide is each side's own check (``layout.check_tp``, ``tp.check_train_tp``)."""
    if size <= 1 or has_shard_rules(config):
        return
    family = model_type(config)
    raise UserError(
        f"{key}={size}: tensor parallelism has shard rules for the Llama family only ({', '.join(LLAMA_FAMILY)}, "
        f"and the mixtures of experts {', '.join(MOE_FAMILY)}), not for {family!r}; set {key}=1 (this model "
        "trains with FSDP2 over every rank and generates with HF generate on a whole replica per rank)"
    )


def check_expert_parallel(config: Any, key: str, size: int) -> None:
    """Refuse ``key=size`` > 1 for a dense model, or a size that does not divide the routed experts."""
    if size <= 1:
        return
    experts = num_experts(config)
    if not experts:
        raise UserError(
            f"{key}={size}: expert parallelism splits a mixture of experts' experts, and {model_type(config)!r} "
            f"is a dense model; set {key}=1"
        )
    if experts % size:
        raise UserError(
            f"{key}={size} does not divide the model's {experts} routed experts; use one of "
            f"{[d for d in range(1, experts + 1) if experts % d == 0]} (each rank of a group holds experts / {key})"
        )


def check_layer_split(config: Any, key: str, size: int, what: str) -> None:
    """Refuse ``key=size`` > 1 (pipeline stages, Ulysses) for a family without a Llama-style decoder."""
    family = model_type(config)
    if size > 1 and family not in LLAMA_LAYOUT:
        raise UserError(
            f"{key}={size}: {what} splits Llama-style decoders ({', '.join(LLAMA_LAYOUT)}), not {family!r}; "
            f"set {key}=1 (this model trains with FSDP2 over every rank)"
        )


def fallback_notice(config: Any, reason: str) -> str:
    """The one warning of a model the built-in rollout engine does not run: what runs instead and why."""
    family = model_type(config)
    if is_moe(config) and family not in MOE_FAMILY:
        why = (
            f"which runs dense {', '.join(LLAMA_FAMILY)} and the mixtures of experts {', '.join(MOE_FAMILY)}"
        )
    elif family not in SHARD_RULES_FAMILY:
        why = f"which runs dense {', '.join(LLAMA_FAMILY)}"
    else:
        why = f"this {family} model: {reason}"
    return (
        f"model family {family!r} is outside the built-in rollout engine ({why}): generating with HF "
        "generate on a whole replica per rank, much slower"
    )


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout of ``model``'s modules to 0 in place; returns the config's non-zero rates it overrode.

    RL needs the distribution the rollout sampled from (eval mode, no dropout) to be the one the update
    scores: with dropout the first on-policy ratio is not 1 and the rollout's log-probs differ from the
    trainer's (TRL's ``disable_dropout``). GPT-2 ships with 0.1 on its residual, embedding and attention
    paths; the Llama family with 0. The config is left as it is, so an exported model keeps its settings.
    """
    config = getattr(model, "config", None)
    rates = {
        key: value
        for key, value in (vars(config) if config is not None else {}).items()
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0
    }
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p = 0.0
        # The attention of transformers' Llama-style layers reads a float attribute, not a Dropout module.
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout = 0.0
    return [f"{k}={v:g}" for k, v in sorted(rates.items())]


def check_router_replay(config: Any, mode: str, engine: str, sizes: dict[str, int]) -> None:
    """Refuse ``actor.router_replay`` where it cannot run: a dense model, HF generate for r3, stages or Ulysses.

    ``sizes``: the actor's ``{pp, sp}`` sizes (``config.parallel.role_sizes``)."""
    if mode == "off":
        return
    key = f"actor.router_replay={mode}"
    if not is_moe(config):
        raise UserError(
            f"{key}: {model_type(config)!r} is not a mixture of experts; set actor.router_replay=off"
        )
    if num_experts(config) >= 255:  # uint8 records, 255 meaning "not routed"
        raise UserError(
            f"{key}: this model has {num_experts(config)} routed experts; the routing records hold at most 254 "
            "(uint8); set actor.router_replay=off"
        )
    if mode == "r3" and engine != "native":
        raise UserError(
            f"{key} needs the built-in rollout engine to record the experts (rollout.engine={engine}); set "
            "rollout.engine=native, or actor.router_replay=r2"
        )
    split = [f"{size_key('actor', d)}={sizes[d]}" for d in ("pp", "sp") if sizes.get(d, 1) > 1]
    if split:
        raise UserError(
            f"{key} with {', '.join(split)} is not implemented (the replayed experts follow whole sequences); "
            "set them to 1 or actor.router_replay=off"
        )


def check_lora_family(config: Any) -> None:
    """Refuse ``model.lora_rank`` > 0 for a family the adapters are not built for (UserError naming it).

    LoRA wraps the ``nn.Linear`` projections of dense Llama-style decoders; a mixture of experts keeps its
    experts as fused 3-D weights (no linear to wrap, and an adapted router would move the routing), and other
    families are not tested (GPT-2's projections are ``Conv1D``)."""
    family = model_type(config)
    if family in LLAMA_FAMILY:
        return
    why = "its experts are fused 3-D weights, not nn.Linear" if is_moe(config) else "it is not tested"
    raise UserError(
        f"model.lora_rank: LoRA is built for the dense Llama family ({', '.join(LLAMA_FAMILY)}), not for "
        f"{family!r} ({why}); set model.lora_rank=0 to train every weight"
    )
