"""Prompt + response batches in the engine's training layout, for the tests that score, train or generate on one.

The layout is the engine's own, ``hybridflow.engine.pack_prompt_response``: prompts left-padded to the longest
one (as the rollout receives them), responses right-padded to the response length, position ids counting real
tokens from 0, pad id 0. The tokens are random and seeded:

- ``prompt_batch``: left-padded prompts of the given lengths, what ``generate`` takes;
- ``rollout_batch``: prompts and responses of the given lengths, optionally ``n`` samples per prompt in their
  groups and responses that end at EOS, plus random fields (advantages, reference log-probs, values, ...)
  drawn after the tokens from the same generator;
- ``grouped_batch``: given token lists, ``n`` responses per prompt in their groups;
- ``draw_fields``: random fields added to a batch, each drawn as its ``Draw`` says.

A batch's tokens are one (B, P + R) draw cut to each row's lengths: a row's tokens sit in the columns they
occupy in the layout (so the batches the tests drew by hand before this module keep their exact values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridflow.engine import pack_prompt_response
from hybridflow.protocol import Batch

# Token ids are drawn from [3, 60): above the char tokenizer's pad, bos and eos (0, 1, 2) and inside the
# 64-token vocabulary of the tests' tiny models.
TOKENS = (3, 60)
PAD = 0
PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class Draw:
    """How ``draw_fields`` draws a field: N(0, 1) when ``low`` is None, else uniform on (low, high]."""

    low: float | None = None
    high: float = 0.0
    masked: bool = False  # zero past each response's end (the response mask's zeros)
    per_row: bool = False  # one value per row (B,) instead of one per response token (B, R)


NORMAL = Draw(masked=True)  # advantages, values, returns: N(0, 1) on the response tokens, 0 past them


def draw_fields(batch: Batch, generator: torch.Generator | int, **fields: Draw) -> Batch:
    """``batch`` with each of ``fields`` drawn in turn from ``generator`` (or a new one seeded with it)."""
    g = generator if isinstance(generator, torch.Generator) else torch.Generator().manual_seed(generator)
    mask = batch["response_mask"]  # (B, R)
    for name, draw in fields.items():
        shape = mask.shape[:1] if draw.per_row else mask.shape  # (B,) or (B, R)
        if draw.low is None:
            value = torch.randn(shape, generator=g)
        else:  # high - (high - low) * [0, 1) is (low, high]: a log-prob's range is closed at its top
            value = draw.high - (draw.high - draw.low) * torch.rand(shape, generator=g)
        if draw.masked:
            if draw.per_row:
                raise ValueError(f"{name}: a per-row value has no response tokens to mask")
            value = value * mask
        batch[name] = value
    return batch


def grouped_batch(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    response_length: int,
    pad_token_id: int = PAD,
) -> Batch:
    """``len(responses) / len(prompts)`` responses per prompt in the engine's layout, grouped as the rollout
    returns them: prompt i's at rows i * n to i * n + n - 1."""
    n, rest = divmod(len(responses), len(prompts))
    if rest or not n:
        raise ValueError(f"{len(responses)} responses are not a whole number of samples per prompt")
    rows = [list(p) for p in prompts for _ in range(n)]
    return pack_prompt_response(rows, [list(r) for r in responses], response_length, pad_token_id)


def prompt_batch(lengths: Sequence[int], seed: int = 0, tokens: tuple[int, int] = TOKENS) -> Batch:
    """Random prompts of ``lengths`` tokens, left-padded: ``input_ids``, ``attention_mask``, ``position_ids``
    (B, P), P the longest."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    grid = torch.randint(*tokens, (len(lengths), P), generator=g).tolist()  # (B, P)
    prompts = [row[P - length :] for row, length in zip(grid, lengths)]
    packed = pack_prompt_response(prompts, [[] for _ in prompts], 0, PAD)  # the layout's prompt half
    return Batch({key: packed[key] for key in PROMPT_FIELDS})


def rollout_batch(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    response_length: int,
    seed: int = 0,
    *,
    n: int = 1,
    eos_token_id: int | None = None,
    tokens: tuple[int, int] = TOKENS,
    **fields: Draw,
) -> Batch:
    """Random prompts of ``prompt_lengths`` tokens, each with ``n`` responses of ``response_lengths`` (grouped,
    as ``grouped_batch``) in an R = ``response_length`` budget, then ``fields`` drawn as ``draw_fields``.

    With ``eos_token_id`` every response that stops short of R ends with it (one that reaches R was cut).
    """
    if len(response_lengths) != n * len(prompt_lengths):
        raise ValueError(
            f"{len(response_lengths)} response lengths for {len(prompt_lengths)} prompts x n={n}"
        )
    g = torch.Generator().manual_seed(seed)
    P, R = max(prompt_lengths), response_length
    grid = torch.randint(*tokens, (len(response_lengths), P + R), generator=g).tolist()  # (B, P + R)
    # A group's prompt is its first row's: the columns it would occupy in the layout.
    prompts = [grid[i * n][P - length : P] for i, length in enumerate(prompt_lengths)]
    responses = [row[P : P + length] for row, length in zip(grid, response_lengths)]
    if eos_token_id is not None:
        responses = [[*r[:-1], eos_token_id] if 0 < len(r) < R else r for r in responses]
    return draw_fields(grouped_batch(prompts, responses, R), g, **fields)
