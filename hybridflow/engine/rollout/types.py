"""What the rollout returns: one sampled response (shared by the built-in engine and the HF fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenerationOutput:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token, see sampling.sample for the exact distribution
    finish_reason: str  # "eos", "stop" or "length"
    # Router replay (a mixture of experts, ``record_routing``): the experts each sparse layer chose for every
    # token the model was fed, (P + R - 1, sparse layers, k) uint8 on the host: the prompt's P tokens and the
    # response's R but the last (never fed). Row j is the token at position j; layers in model order.
    routed_experts: torch.Tensor | None = None
