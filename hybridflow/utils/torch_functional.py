"""Masked statistics and memory-safe log-prob / entropy helpers (verl's ``torch_functional`` conventions)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# Rows of logits processed at once by the chunked helpers. 2048 rows x 152k vocab x 4 bytes ~ 1.2 GB of
# float32 scratch at the peak, instead of a float32 copy of every row.
LOGPROB_CHUNK_ROWS = 2048


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (NaNs under a zero mask do not leak in)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean over masked elements: ``sum(values * mask) / (sum(mask) + 1e-8)`` as verl defines it."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements; unbiased (N-1) by default."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(
                f"masked_var needs at least 2 unmasked elements for an unbiased variance, got {int(count)}; "
                "the batch has (almost) no valid response tokens"
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten with statistics over all masked elements: ``(x - mean) * rsqrt(var + 1e-8)``."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


class _ChunkedLogProb(torch.autograd.Function):
    """log_softmax(logits)[label] computed row-chunk by row-chunk in float32.

    Only the per-row log-sum-exp is kept for backward, so no float32 copy of the whole (rows, V) logits
    exists in forward or backward; the gradient ``onehot - softmax`` is rebuilt chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:  # (R, V), (R,)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # (R,)
        out = torch.empty_like(lse)  # (R,)
        for s in range(0, logits.shape[0], chunk):
            block = logits[s : s + chunk].float()  # (r, V)
            lse[s : s + chunk] = torch.logsumexp(block, dim=-1)
            out[s : s + chunk] = (
                block.gather(-1, labels[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            )
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # (R,)
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (R, V) in the logits' dtype
        for s in range(0, logits.shape[0], ctx.chunk):
            probs = torch.exp(logits[s : s + ctx.chunk].float() - lse[s : s + ctx.chunk, None])  # (r, V)
            g = grad_out[s : s + ctx.chunk, None].float()  # (r, 1)
            block = -probs * g
            block.scatter_add_(-1, labels[s : s + ctx.chunk, None], g)
            grad[s : s + ctx.chunk] = block.to(grad.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = LOGPROB_CHUNK_ROWS
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits`` in float32, chunked over rows to bound memory.

    ``logits`` is ``(..., V)`` in any float dtype and ``labels`` is ``(...)``; the result is ``(...)``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on leading dims"
        )
    lead = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (R, V)
    flat_labels = labels.reshape(-1).long()  # (R,)
    return _ChunkedLogProb.apply(flat_logits, flat_labels, chunk_rows).reshape(lead)


def _entropy_block(block: torch.Tensor) -> torch.Tensor:  # (r, V) -> (r,)
    block = block.float()
    probs = torch.softmax(block, dim=-1)
    return torch.logsumexp(block, dim=-1) - (probs * block).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = LOGPROB_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` ``(..., V)``, returned in float32 ``(...)``.

    Rows are processed in chunks; under autograd each chunk is recomputed in backward (checkpointed) so
    the float32 softmax of every row is never stored at once.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # (R, V)
    parts = []
    for s in range(0, flat.shape[0], chunk_rows):
        block = flat[s : s + chunk_rows]
        if block.requires_grad:
            parts.append(checkpoint(_entropy_block, block, use_reentrant=False))
        else:
            parts.append(_entropy_block(block))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(lead)
