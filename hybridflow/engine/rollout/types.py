"""What the rollout returns: one sampled response (shared by the built-in engine and the HF fallback)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationOutput:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token, see sampling.sample for the exact distribution
    finish_reason: str  # "eos", "stop" or "length"
