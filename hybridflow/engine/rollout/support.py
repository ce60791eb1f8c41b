"""Which Hugging Face models the rollout engine's fast path runs exactly, and why not when it does not."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# These RoPE types recompute inv_freq from the current sequence length inside HF's forward
# (transformers' dynamic_rope_update): data-dependent, so not capturable; HF generate handles them.
_DYNAMIC_ROPE = ("dynamic", "longrope")
_FALLBACK_HINT = "set rollout.engine=hf to generate with HF generate instead"


def check_supported(config: Any, max_len: int | None = None) -> None:
    """Raise ValueError naming the reason if the fast path cannot run this HF config exactly.

    ``max_len`` (the longest sequence the engine will hold) lets a Mistral config with a sliding window
    through when no sequence can be longer than the window, where sliding attention equals full attention.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY:
        raise ValueError(
            f"model_type {model_type!r} is not in the Llama family the rollout engine runs "
            f"({', '.join(FAMILY)}); {_FALLBACK_HINT}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only SiLU-gated MLPs); {_FALLBACK_HINT}")
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"sliding-window attention (use_sliding_window=true) is not supported; {_FALLBACK_HINT}"
        )
    window = getattr(config, "sliding_window", None) if model_type == "mistral" else None
    if window is not None and (max_len is None or max_len > window):
        raise ValueError(
            f"this Mistral config uses a sliding window of {window} tokens, which the rollout engine does not "
            f"implement; sequences of at most {window} tokens are exact (pass max_len), otherwise "
            f"{_FALLBACK_HINT}"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if not isinstance(rope_type, str) or any(d in rope_type for d in _DYNAMIC_ROPE):
        raise ValueError(
            f"rope type {rope_type!r} changes its frequencies with the sequence length and is not "
            f"supported (default, linear, llama3 and yarn are); {_FALLBACK_HINT}"
        )
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported; {_FALLBACK_HINT}")


def check_structure(hf_model: nn.Module) -> None:
    """Raise ValueError unless the module has the HF *ForCausalLM layout the runner binds to."""
    base = getattr(hf_model, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
    if base is None or missing or not hasattr(hf_model, "lm_head"):
        raise ValueError(
            f"{type(hf_model).__name__} lacks the HF *ForCausalLM layout (model.embed_tokens, model.layers, "
            f"model.norm, model.rotary_emb, lm_head); pass the causal LM itself, not its base model or a wrapper"
        )


def supports(hf_model: nn.Module, max_len: int | None = None) -> bool:
    """Whether ``LlamaRunner`` can run this HF causal LM exactly (the reason is logged when not)."""
    try:
        check_supported(getattr(hf_model, "config", None), max_len)
        check_structure(hf_model)
    except ValueError as err:
        logger.warning("fast rollout path unavailable: %s", err)
        return False
    return True
