"""Which Hugging Face models the rollout engine's fast path runs exactly, and why not when it does not."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hybridflow.models.families import is_moe
from hybridflow.models.family import FamilySpec, family_name, family_of, rollout_families
from hybridflow.models.vision import is_vision_language, text_config
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from hybridflow.models.moe import RouterSpec

logger = logging.getLogger(__name__)

# These RoPE types recompute inv_freq from the current sequence length inside HF's forward
# (transformers' dynamic_rope_update): data-dependent, so not capturable; HF generate handles them.
_DYNAMIC_ROPE = ("dynamic", "longrope")
_FALLBACK_HINT = "set rollout.engine=hf to generate with HF generate instead"


def unsupported_reason(config: Any, max_len: int | None = None) -> str | None:
    """Why the fast path cannot run this HF config exactly, or None when it can.

    Whether it runs the family at all is the family's entry (``models.family``); then the config's own
    settings. ``max_len`` (the longest sequence the engine will hold) lets a config whose family has a
    sliding window (Mistral) through when no sequence can be longer than the window, where sliding attention
    equals full attention.
    """
    spec, family = family_of(config), family_name(config)
    runs = ", ".join(rollout_families())
    if spec is None:
        return f"model_type {family!r} has no entry in models/family.py; the rollout engine runs {runs}"
    if spec.rollout is not None:
        return f"model_type {family!r} {spec.rollout}; the rollout engine runs {runs}"
    if spec.text is not None:  # judged by its language model; the vision tower is HF's own module
        config = text_config(config)
        text = family_of(config)
        if text is None or text.rollout is not None or text.name != spec.text:
            return f"a vision-language model whose language model is {family_name(config)!r} is not supported"
        spec = text
    if is_moe(config) and spec.experts is None:
        return (
            f"model_type {family!r} has routed experts, but its entry in models/family.py is a dense family"
        )
    return _text_reason(config, spec, max_len)


def _text_reason(config: Any, spec: FamilySpec, max_len: int | None) -> str | None:
    """``unsupported_reason``'s checks of a runnable family's config: activation, attention and RoPE."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not supported (only SiLU-gated MLPs)"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention (use_sliding_window=true) is not supported"
    window = getattr(config, "sliding_window", None) if spec.sliding_window else None
    if window is not None and (max_len is None or max_len > window):
        return (
            f"this {spec.name} config uses a sliding window of {window} tokens, which the rollout engine does not "
            f"implement; sequences of at most {window} tokens are exact (pass max_len)"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if not isinstance(rope_type, str) or any(d in rope_type for d in _DYNAMIC_ROPE):
        return (
            f"rope type {rope_type!r} changes its frequencies with the sequence length and is not "
            "supported (default, linear, llama3 and yarn are)"
        )
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not supported"
    return None


def check_supported(config: Any, max_len: int | None = None) -> None:
    """Raise ValueError naming the reason if the fast path cannot run this HF config exactly."""
    reason = unsupported_reason(config, max_len)
    if reason is not None:
        raise ValueError(f"{reason}; {_FALLBACK_HINT}")


def text_base(hf_model: nn.Module) -> nn.Module | None:
    """The decoder stack the runner binds: ``model``, or a vision-language model's ``model.language_model``."""
    base = getattr(hf_model, "model", None)
    if is_vision_language(getattr(hf_model, "config", None)):
        return getattr(base, "language_model", None)
    return base


def structure_problem(hf_model: nn.Module) -> str | None:
    """Why the module lacks the HF *ForCausalLM layout the runner binds to, or None."""
    base = text_base(hf_model)
    if is_vision_language(getattr(hf_model, "config", None)) and not hasattr(hf_model.model, "visual"):
        return f"{type(hf_model).__name__} is a vision-language model without model.visual (its vision tower)"
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
    if base is None or missing or not hasattr(hf_model, "lm_head"):
        return (
            f"{type(hf_model).__name__} lacks the HF *ForCausalLM layout (model.embed_tokens, model.layers, "
            f"model.norm, model.rotary_emb, lm_head); pass the causal LM itself, not its base model or a wrapper"
        )
    return None


def check_structure(hf_model: nn.Module) -> None:
    """Raise ValueError unless the module has the HF *ForCausalLM layout the runner binds to."""
    problem = structure_problem(hf_model)
    if problem is not None:
        raise ValueError(problem)


def fallback_reason(hf_model: nn.Module, max_len: int | None = None) -> str | None:
    """Why ``LlamaRunner`` cannot run this HF causal LM exactly (None: it can), without logging."""
    return unsupported_reason(getattr(hf_model, "config", None), max_len) or structure_problem(hf_model)


def supports(hf_model: nn.Module, max_len: int | None = None) -> bool:
    """Whether ``LlamaRunner`` can run this HF causal LM exactly (the reason is logged when not)."""
    reason = fallback_reason(hf_model, max_len)
    if reason is not None:
        logger.warning("fast rollout path unavailable: %s", reason)
    return reason is None


class Runner(Protocol):
    """What these checks read of ``model.LlamaRunner`` (not imported: it imports this module)."""

    router: RouterSpec | None
    dtype: torch.dtype

    @property
    def graph_safe(self) -> bool: ...


def graphs_fit(runner: Runner) -> bool:
    """Whether the runner's decode step can be captured in CUDA graphs; a mixture of experts whose experts
    cannot run as grouped GEMMs here loops over experts with data-dependent shapes (logged when not)."""
    if runner.graph_safe:
        return True
    logger.warning(
        "the experts of this mixture of experts cannot run as grouped GEMMs in %s on this GPU (those need bf16 "
        "on SM90 or newer): decoding without CUDA graphs, much slower",
        runner.dtype,
    )
    return False


def traceable(runner: Runner) -> bool:
    """Whether torch.compile can trace the decode step: dense, or grouped GEMMs in bf16 (the only dtype
    grouped_mm's meta function takes in torch 2.13); logged when not (compile_decode is then dropped)."""
    if runner.router is None or (runner.graph_safe and runner.dtype == torch.bfloat16):
        return True
    logger.warning("compile_decode needs the experts as grouped GEMMs in bf16; decoding uncompiled")
    return False


def check_routing(router: RouterSpec | None) -> None:
    """``record_routing`` needs a mixture of experts whose expert ids fit the records' uint8 (UserError)."""
    if router is None:
        raise UserError(
            "rollout record_routing=True needs a mixture-of-experts model (router replay); this one is dense: "
            "turn record_routing off"
        )
    if router.num_experts >= 255:  # the trainer's batch marks "not routed" with 255 (ops.sequences)
        raise UserError(
            f"record_routing keeps expert ids as uint8 with 255 meaning 'not routed'; this model has "
            f"{router.num_experts} experts (at most 254): turn record_routing off"
        )
