"""The rollout a worker or ``hybridflow generate`` gets: the built-in engine, or HF ``generate`` where the
built-in engine does not run the model (``rollout.engine=hf`` forces it)."""

from __future__ import annotations

import logging

from torch import nn

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.hf_fallback import HFRollout
from hybridflow.engine.rollout.support import fallback_reason
from hybridflow.models.families import fallback_notice
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


def make_rollout(
    model: nn.Module, engine: str = "native", pad_token_id: int = 0, **kwargs
) -> PagedEngine | HFRollout:
    """The built-in engine when the architecture is supported, else HF ``generate`` with one warning (refused
    with ``kv_cache_dtype="fp8"``: HF generate keeps its own cache in the model's dtype)."""
    if engine not in ("native", "hf"):
        raise ValueError(f"unknown rollout engine {engine!r}; use native or hf")
    if engine == "native":
        reason = fallback_reason(model, kwargs.get("max_model_len"))
        if reason is None:
            return PagedEngine(model, **kwargs)
        logger.warning(fallback_notice(model.config, reason))
    if kwargs.get("kv_cache_dtype", "auto") != "auto":
        why = f"the built-in engine does not run this model ({reason})" if engine == "native" else "engine=hf"
        raise UserError(
            f"rollout.kv_cache_dtype={kwargs['kv_cache_dtype']} is the built-in paged engine's KV cache, and "
            f"{why}; set rollout.kv_cache_dtype=auto"
        )
    return HFRollout(model, pad_token_id, kwargs.get("max_model_len"))
