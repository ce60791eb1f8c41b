"""A sequence of the paged engine: its tokens, what the engine knows of them, and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.engine.rollout.block_pool import BlockTable
from hybridflow.engine.rollout.multimodal import MMPrompt
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.types import GenerationOutput


@dataclass(eq=False)  # compared by identity: a field-wise == over token lists made list.remove O(tokens)
class Sequence:
    """One sample: its tokens, what the engine knows of them, and how it ended (None while it runs)."""

    id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    logprobs: list[float] = field(default_factory=list)  # per token after the prompt (nan: extended)
    versions: list[int] = field(default_factory=list)  # per token after the prompt: weights that sampled it
    table: BlockTable | None = None
    written: int = 0  # leading tokens whose K and V are in the cache
    seat: int | None = None  # its decode row while it has one
    pending: int = 0  # tokens sampled on the device that ``tokens`` does not hold yet (while seated)
    finish_reason: str | None = None
    routing: torch.Tensor | None = None  # its recorded experts, taken from its blocks as it leaves
    mm: MMPrompt | None = None  # its prompt's images (a vision-language model), kept for any re-prefill

    @property
    def response(self) -> list[int]:
        """The tokens after the prompt (sampled and extended)."""
        return self.tokens[self.prompt_len :]

    @property
    def trainable(self) -> list[bool]:
        """Per token after the prompt: sampled by the policy (True) or extended (False)."""
        return [v >= 0 for v in self.versions]

    max_new: int = 0  # its response budget (extended tokens count): params.max_new_tokens unless lower

    @property
    def budget_end(self) -> int:
        """The sequence's length when its response budget (extended tokens included) is spent."""
        return self.prompt_len + (self.max_new or self.params.max_new_tokens)


def positions_for(s: Sequence, steps: int) -> int:
    """Positions a seated sequence's table must hold for ``steps`` decode steps: each writes the token it
    feeds (from its last one on); the last sampled token is never fed, so the budget's end needs no block."""
    return min(len(s.tokens) + s.pending - 1 + steps, s.budget_end - 1)


def to_output(s: Sequence) -> GenerationOutput:
    return GenerationOutput(s.response, s.logprobs, s.finish_reason or "length", s.routing)
