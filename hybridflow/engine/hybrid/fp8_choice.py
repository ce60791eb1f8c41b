"""Whether the rollout runs FP8 projections (``rollout.quantization=fp8``), and with which kernel: the
generation weights' dtype is the hybrid actor's to choose, from a probe of this GPU."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridflow.engine.ops.fp8 import use_kernel
from hybridflow.engine.ops.fp8_probe import fp8_probe, pick_kernel
from hybridflow.models.vision import text_config

logger = logging.getLogger(__name__)


def fp8_pays(
    config: Any, device: torch.device, asked: str, force: bool, tp: int, compiled: bool, rank: int
) -> bool:
    """Whether to run FP8 projections, and with which kernel (``use_kernel``): on CUDA a probe of one decode
    layer's projections per kernel (``fp8_probe``, logged) picks the fastest, kept only if it beats bf16 by
    ``fp8_probe.MIN_GAIN`` or ``force`` (``rollout.quantization_force``); on CPU (tests) always yes, with the
    kernel ``asked`` (``rollout.quantization_kernel``; auto: scaled_mm's reference)."""
    if device.type != "cuda":
        use_kernel("scaled_mm" if asked == "auto" else asked)
        return True
    text = text_config(config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dims = (text.num_attention_heads * head_dim, kv_heads * head_dim)  # q and k/v widths
    probe = fp8_probe(
        text.hidden_size, text.intermediate_size, device, *dims, tp,
        compiled=compiled, model_layers=text.num_hidden_layers,
    )  # fmt: skip
    kernel, faster = pick_kernel(probe, asked)
    use_kernel(kernel)
    if rank == 0:
        logger.log(
            logging.INFO if faster or force else logging.WARNING,
            "rollout.quantization=fp8: one decode layer's projections on 64 tokens take %s on this GPU%s: %s",
            ", ".join(f"{k} {v:.1f} us" for k, v in probe.items()),
            " (compiled decode: GEMMs alone)" if compiled else "",
            f"FP8 projections with {kernel}"
            if faster or force
            else "keeping bf16 (rollout.quantization_force=true uses FP8 anyway)",
        )
    return faster or force
