"""Scoring hidden states with the LM head in row chunks: log-probs (and entropy) without full logits.

A 16k-token micro-batch over a 152k vocabulary would need ~10 GB of float32 logits, plus as much again for
autograd. Each chunk here is recomputed in backward (activation checkpointing), so only one chunk's logits
exist at a time in either pass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

HEAD_CHUNK_ROWS = 2048


def _score_chunk(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / temperature  # (r, V) float32: log-softmax needs the range
    lse = torch.logsumexp(logits, dim=-1)  # (r,)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - lse  # (r,)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    if not entropy_grad:  # a metric only: no backward through the softmax over V
        with torch.no_grad():
            return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (r,)
    return logp, entropy


def score_hidden_states(
    hidden: torch.Tensor,  # (M, H)
    head: nn.Module,
    labels: torch.Tensor,  # (M,)
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = HEAD_CHUNK_ROWS,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label under ``head(hidden) / temperature`` and optionally the entropy, in float32.

    ``entropy_grad=False`` returns the entropy detached (for the metric), skipping its backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_rows):
        args = (
            hidden[s : s + chunk_rows],
            head,
            labels[s : s + chunk_rows],
            temperature,
            with_entropy,
            entropy_grad,
        )
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_score_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _score_chunk(*args)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
