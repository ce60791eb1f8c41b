"""Scoring hidden states with the LM head in row chunks: log-probs (and entropy) without full logits.

A 16k-token micro-batch over a 152k vocabulary would need ~10 GB of float32 logits, plus as much again for
autograd. Two implementations keep only one chunk's logits alive at a time:

- ``linear_log_probs`` (the default for an ``nn.Linear`` head): one autograd Function over all chunks. Its
  forward saves the hidden rows (and the entropy when it has a gradient), nothing of size V. Its backward
  recomputes each chunk's logits and their softmax (one kernel that reads the compute-dtype logits: fewer
  passes over V than upcasting them and subtracting a saved logsumexp), forms the gradient of the logits
  in place, and applies both matmuls of the head (grad of the hidden rows; grad of the weight accumulated
  across chunks in one buffer).
  On GPU the softmax statistics and the gradient of the logits come from Triton kernels (``head_kernels``),
  one pass over the chunk's logits each way; the PyTorch ops below are the CPU path and the reference.
- the activation-checkpointed path (any head module): autograd through ``log_softmax``-style fp32 math on
  each chunk, recomputed in backward. Kept as the reference and for heads that are not a plain linear map.

Gradients, with z = logits / T, p = softmax(z), H = -sum_j p_j log p_j and upstream grads g (log-prob) and
h (entropy) of one row:
    d logp_y / d z_j = onehot_j(y) - p_j
    d H / d z_j      = -p_j (log p_j + H)
so  d loss / d logits_j = [g (onehot_j(y) - p_j) - h p_j (log p_j + H)] / T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridflow.engine.ops.head_kernels import fused_head_available, head_grad_logits_, head_stats
from hybridflow.engine.ops.invariant import exact_on, token_log_probs

HEAD_CHUNK_ROWS = 2048


def stats_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax statistics: at least float32 (bf16 logits lose the range log-softmax needs)."""
    return torch.promote_types(compute_dtype, torch.float32)


def _normalized(logits: torch.Tensor, temperature: float, log: bool) -> torch.Tensor:
    """(log-)softmax over V of ``logits / T`` (r, V) in ``stats_dtype``; at T = 1 the kernel upcasts itself."""
    fn = torch.log_softmax if log else torch.softmax
    acc = stats_dtype(logits.dtype)
    if temperature == 1.0:
        return fn(logits, dim=-1, dtype=acc)  # reads the compute dtype: no float32 copy of the logits
    return fn(logits.to(acc).div_(temperature), dim=-1)  # (r, V)


def _chunk_forward(
    hidden: torch.Tensor,  # (r, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    labels: torch.Tensor,  # (r,)
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (r,), entropy (r,) or None) of one chunk in ``stats_dtype(weight)``; no autograd."""
    log_p = _normalized(F.linear(hidden, weight, bias), temperature, log=True)  # (r, V)
    logp = log_p.gather(1, labels[:, None]).squeeze(1)  # (r,)
    entropy = None
    if with_entropy:
        entropy = -log_p.exp().mul_(log_p).sum(-1)  # (r,)  H = -sum p log p
    return logp, entropy


def _chunk_grad_logits(
    hidden: torch.Tensor,  # (r, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,
    labels: torch.Tensor,  # (r,)
    grad_logp: torch.Tensor,  # (r,) float32, already divided by T
    entropy: torch.Tensor | None,  # (r,) float32 when the entropy has a gradient
    grad_entropy: torch.Tensor | None,  # (r,) float32, already divided by T
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits (r, V) of one chunk in the compute dtype, recomputing its logits (module doc).

    The float32 work is written as q (r, V) times a per-row scale s, and the last pass multiplies and
    rounds to the compute dtype at once. The one-hot term is added in float32 before that rounding: for a
    confident token p_y - 1 would otherwise cancel catastrophically in bf16.
    """
    logits = F.linear(hidden, weight, bias)  # (r, V)
    rows = labels[:, None]  # (r, 1)
    if grad_entropy is None:
        q = _normalized(logits, temperature, log=False)  # (r, V) p
        q.scatter_add_(1, rows, torch.full_like(grad_logp[:, None], -1.0))  # p - onehot
        scale = -grad_logp  # grad = -g (p - onehot) / T
    else:
        log_p = _normalized(logits, temperature, log=True)  # (r, V)
        q = log_p.exp()  # (r, V) p
        bracket = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None])
        q.mul_(bracket).scatter_add_(1, rows, -grad_logp[:, None])  # p (g + h (log p + H)) - g onehot
        scale = torch.full_like(grad_logp, -1.0)
    grad = torch.empty_like(logits)  # (r, V) compute dtype
    del logits
    return torch.mul(q, scale[:, None], out=grad)


class _LinearLogProb(torch.autograd.Function):
    """Chunked log-prob (+ entropy) of ``labels`` under ``linear(hidden) / T``; saves no (rows, V) tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, entropy_grad, chunk_rows):
        logps, ents, lses = [], [], []
        kernels = fused_head_available(weight)
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk_rows):
                e = s + chunk_rows
                if kernels:
                    logits = F.linear(hidden[s:e], weight, bias)  # (r, V)
                    lp, ent, lse = head_stats(logits, labels[s:e], temperature, with_entropy)
                    lses.append(lse)
                    del logits
                else:
                    lp, ent = _chunk_forward(
                        hidden[s:e], weight, bias, labels[s:e], temperature, with_entropy
                    )
                logps.append(lp)
                ents.append(ent)
        acc = stats_dtype(weight.dtype)
        logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=acc)  # (M,)
        entropy = torch.cat(ents) if with_entropy and ents else hidden.new_zeros(0, dtype=acc)  # (M,) | (0,)
        lse = torch.cat(lses) if lses else None  # (M,) for the kernels' backward
        keep_entropy = with_entropy and entropy_grad
        ctx.save_for_backward(hidden, weight, bias, labels, entropy if keep_entropy else None, lse)
        ctx.temperature, ctx.chunk_rows, ctx.entropy_grad = temperature, chunk_rows, keep_entropy
        ctx.set_materialize_grads(False)
        if not keep_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, entropy, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.chunk_rows
        grad_entropy = grad_entropy if ctx.entropy_grad else None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        acc = stats_dtype(weight.dtype)
        g_lp = (hidden.new_zeros(hidden.shape[0], dtype=acc) if grad_logp is None else grad_logp.to(acc)) / T
        g_ent = None if grad_entropy is None else grad_entropy.to(acc) / T  # (M,)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None  # (M, H)
        grad_w = torch.zeros_like(weight) if need_w else None  # (V, H)
        grad_b = weight.new_zeros(weight.shape[0], dtype=acc) if need_b else None  # (V,) float32
        for s in range(0, hidden.shape[0], rows):
            e = s + rows
            h = hidden[s:e]  # (r, H)
            ent_rows = None if g_ent is None else entropy[s:e]
            g_ent_rows = None if g_ent is None else g_ent[s:e]
            if lse is not None:  # the Triton kernel: logits recomputed, then overwritten by their gradient
                logits = F.linear(h, weight, bias)  # (r, V)
                g = head_grad_logits_(logits, labels[s:e], lse[s:e], g_lp[s:e], ent_rows, g_ent_rows, T)
            else:
                g = _chunk_grad_logits(h, weight, bias, labels[s:e], g_lp[s:e], ent_rows, g_ent_rows, T)
            # g (r, V) is in the compute dtype: the two matmuls run in it, like the forward's
            if need_b:
                grad_b += g.sum(0, dtype=grad_b.dtype)
            if need_h:
                torch.mm(g, weight, out=grad_h[s:e])  # (r, H)
            if need_w:
                grad_w.addmm_(g.t(), h)  # (V, H), accumulated across chunks in one buffer
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,  # (M, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    labels: torch.Tensor,  # (M,)
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_rows: int = HEAD_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused chunked ``log_softmax(linear(hidden) / T)[labels]`` (and entropy), float32, memory-safe backward.

    ``entropy_grad=False`` returns the entropy detached (a metric only, no backward through it).
    """
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden states ({hidden.dtype}) and LM head weight ({weight.dtype}) must share a dtype; cast "
            "the hidden states to the head's compute dtype first"
        )
    logp, entropy = _LinearLogProb.apply(
        hidden, weight, bias, labels, temperature, with_entropy, entropy_grad, chunk_rows
    )
    return logp, (entropy if with_entropy else None)


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


def _exact_chunk(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rollout.exact``: the rollout's formula (``invariant.token_log_probs``) on the same kernels."""
    logits = head(hidden)  # (r, V) in the compute dtype, as the rollout's runner returns them
    logp = token_log_probs(logits, labels, temperature)  # (r,)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        all_logp = F.log_softmax(logits.float() / temperature, dim=-1)  # (r, V)
        return logp, -(all_logp.exp() * all_logp).sum(-1)


def checkpointed_log_probs(
    hidden: torch.Tensor,  # (M, H)
    head: nn.Module,
    labels: torch.Tensor,  # (M,)
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_rows: int = HEAD_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference path: any ``head`` module, autograd through fp32 math, each chunk checkpointed."""
    logps, ents = [], []
    score = _exact_chunk if exact_on() else _score_chunk
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
            lp, ent = checkpoint(score, *args, use_reentrant=False)
        else:
            lp, ent = score(*args)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def score_hidden_states(
    hidden: torch.Tensor,  # (M, H)
    head: nn.Module,
    labels: torch.Tensor,  # (M,)
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = HEAD_CHUNK_ROWS,
    entropy_grad: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label under ``head(hidden) / temperature`` and optionally the entropy, in float32.

    ``entropy_grad=False`` returns the entropy detached (for the metric), skipping its backward.
    ``fused`` uses ``linear_log_probs`` when ``head`` is an ``nn.Linear``; other heads, or ``fused=False``,
    take the checkpointed path. Call it inside the FSDP2 root's forward: the head's weight is read here,
    when it is the gathered (unsharded) parameter.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if fused and isinstance(head, nn.Linear) and not exact_on():
        args = (labels, temperature, with_entropy, entropy_grad, chunk_rows)
        return linear_log_probs(hidden, head.weight, head.bias, *args)
    return checkpointed_log_probs(hidden, head, labels, temperature, with_entropy, entropy_grad, chunk_rows)
