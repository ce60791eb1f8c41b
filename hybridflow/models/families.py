"""What hybridflow does with each model family, as the family's entry (``models.family``) says: the refusals.

The built-in rollout engine and the tensor-parallel shard rules cover the families whose ``FamilySpec`` says
so: Llama-style decoders, dense (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Seed-OSS) or mixtures of experts
(Qwen2-MoE, Qwen3-MoE, Mixtral: a tensor-parallel rollout slices every expert on its intermediate dim; training
splits their attention and keeps the MoE blocks whole, or splits the experts with expert parallelism,
``parallel.ep``, checked here against the model). Any other causal LM (GPT-2, DeepSeek-V3, a family without an
entry) still trains with FSDP2 over every rank and generates with HF ``generate`` on a whole replica per rank;
only the layouts that need shard rules (tensor parallelism), a Llama-style decoder (pipeline stages, Ulysses)
or tested adapters (LoRA) are refused, at start, naming the family.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from hybridflow.config.parallel import size_key
from hybridflow.models.family import family_name, family_names, family_of
from hybridflow.models.moe import num_experts
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


def model_type(config: Any) -> str:
    """The config's ``model_type`` (the family's name), or its class name when it has none."""
    return family_name(config)


def is_moe(config: Any) -> bool:
    """Whether the config describes a mixture of experts (any routed experts)."""
    return num_experts(config) > 0


def has_shard_rules(config: Any) -> bool:
    """Whether tensor-parallel shard rules exist for this family (its ``FamilySpec.has_shard_rules``)."""
    spec = family_of(config)
    return spec is not None and spec.has_shard_rules


def _listed(where: Any) -> str:
    """The families an entry predicate holds for, as a message lists them."""
    return ", ".join(family_names(lambda s: s.part_of is None and where(s)))


def check_tensor_parallel(config: Any, key: str, size: int) -> None:
    """Refuse ``key=size`` > 1 for a family without tensor-parallel shard rules (UserError naming both).

    Whether the sizes divide is each side's own check (``layout.check_tp``, ``tp.check_train_tp``)."""
    if size <= 1 or has_shard_rules(config):
        return
    raise UserError(
        f"{key}={size}: tensor parallelism has shard rules for {_listed(lambda s: s.has_shard_rules)}, not "
        f"for {model_type(config)!r}; set {key}=1 (this model trains with FSDP2 over every rank and "
        "generates with HF generate on a whole replica per rank)"
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
    spec = family_of(config)
    if size > 1 and (spec is None or not spec.decoder):
        raise UserError(
            f"{key}={size}: {what} splits Llama-style decoders ({_listed(lambda s: s.decoder)}), not "
            f"{model_type(config)!r}; set {key}=1 (this model trains with FSDP2 over every rank)"
        )


def fallback_notice(config: Any, reason: str) -> str:
    """The one warning of a model the built-in rollout engine does not run: what runs instead and why.

    ``reason``: ``engine.rollout.support.fallback_reason``'s; a family the engine runs names it (this model's
    settings), any other its entry's reason, or that it has none."""
    family, spec = model_type(config), family_of(config)
    runs = _listed(lambda s: s.rollout is None)
    if spec is None:
        why = f"it has no entry in models/family.py; the engine runs {runs}"
    elif spec.rollout is not None:
        why = f"it {spec.rollout}; the engine runs {runs}"
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
    paths, Seed-OSS with 0.1 on its attention and residual paths; Llama and Qwen with 0. The config is left
    as it is, so an exported model keeps its settings.
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
        # transformers' Llama-style layers keep rates as float attributes for ``F.dropout``, not as Dropout
        # modules: the attention's ``attention_dropout``, Seed-OSS's ``residual_dropout`` after o and down.
        for name, rate in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(rate, float) and rate > 0:
                setattr(module, name, 0.0)
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

    LoRA wraps the ``nn.Linear`` projections of dense Llama-style decoders whose entry says ``lora`` (tested);
    a mixture of experts keeps its experts as fused 3-D weights (no linear to wrap, and an adapted router would
    move the routing), and other families are not tested (GPT-2's projections are ``Conv1D``)."""
    spec = family_of(config)
    if spec is not None and spec.lora:
        return
    why = "its experts are fused 3-D weights, not nn.Linear" if is_moe(config) else "it is not tested"
    raise UserError(
        f"model.lora_rank: LoRA is built for the dense families {_listed(lambda s: s.lora)}, not for "
        f"{model_type(config)!r} ({why}); set model.lora_rank=0 to train every weight"
    )
