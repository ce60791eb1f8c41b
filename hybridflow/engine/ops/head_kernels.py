"""Triton kernels for the LM head's softmax statistics: one pass over a chunk's logits forward, one backward.

The head scores a chunk of rows against the whole vocabulary (2048 x 152k logits). In PyTorch ops, the
log-softmax, the gather, the entropy and, in backward, the softmax and the gradient of the logits each make
a float32 pass of their own over (rows, V): on an H200 that was ~88 ms of a 0.59 s training step (0.5B
shape, 32k scored tokens). Here the forward reads the compute-dtype logits once (online max / sum-exp,
as in flash attention) and writes three floats per row; the backward reads them once more and writes the
gradient of the logits in place, in the compute dtype. Row statistics are float32.

With z = logits / T, p = softmax(z), lse = logsumexp(z), H = -sum p log p and upstream grads g, h (already
divided by T): d loss / d logits_j = g (onehot_j(y) - p_j) - h p_j (log p_j + H).

The entropy is accumulated relative to the running max m: with s = sum exp(z - m) and t = sum exp(z - m)
(z - m), H = log s - t / s, which has no cancellation between two large numbers.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path in lm_head.py is used
    triton = None

BLOCK_V = 4096  # vocabulary entries per loop iteration of one row's program


def fused_head_available(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels can take these logits (CUDA tensor, Triton installed, rows contiguous)."""
    return triton is not None and logits.is_cuda and logits.stride(-1) == 1


if triton is not None:

    @triton.jit
    def _stats_kernel(
        logits_ptr, row_stride, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, V, inv_t,
        BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        m = tl.full((), float("-inf"), tl.float32)  # running max of z
        s = tl.zeros((), tl.float32)  # sum exp(z - m)
        t = tl.zeros((), tl.float32)  # sum exp(z - m) (z - m)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            z = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, 0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)  # 0 where masked
            if WITH_ENTROPY:
                # Re-base the old t on the new max: sum e_old (z - m_new) = alpha (t + (m - m_new) s); the
                # where() covers the first block, where m = -inf and s = 0.
                shift = tl.where(s > 0, (m - m_new) * s, 0.0)
                t = alpha * (t + shift) + tl.sum(tl.where(valid, e * (z - m_new), 0.0), 0)
            s = s * alpha + tl.sum(e, 0)
            m = m_new
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        z_y = tl.load(base + label).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, z_y - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, tl.log(s) - t / s)

    @triton.jit
    def _grad_kernel(
        logits_ptr, row_stride, labels_ptr, lse_ptr, g_ptr, entropy_ptr, h_ptr, V, inv_t,
        BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        label = tl.load(labels_ptr + row)
        if WITH_ENTROPY:
            ent = tl.load(entropy_ptr + row)
            h = tl.load(h_ptr + row)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_t
            log_p = z - lse
            p = tl.exp(log_p)
            # The one-hot term joins in float32 before rounding: p_y - 1 would cancel in bf16.
            grad = tl.where(offs == label, g, 0.0) - g * p
            if WITH_ENTROPY:
                grad -= h * p * (log_p + ent)
            tl.store(base + offs, grad.to(logits_ptr.dtype.element_ty), mask=valid)


def head_stats(
    logits: torch.Tensor,  # (r, V) compute dtype
    labels: torch.Tensor,  # (r,)
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log p of the labels (r,), entropy (r,) or None, logsumexp (r,)) of ``logits / T``, float32."""
    r, V = logits.shape
    logp, lse = (torch.empty(r, dtype=torch.float32, device=logits.device) for _ in range(2))
    entropy = torch.empty_like(logp) if with_entropy else logp  # (placeholder pointer when unused)
    if r:
        _stats_kernel[(r,)](
            logits, logits.stride(0), labels, logp, entropy, lse, V, 1.0 / temperature,
            BLOCK=BLOCK_V, WITH_ENTROPY=with_entropy, num_warps=8,
        )  # fmt: skip
    return logp, (entropy if with_entropy else None), lse


def head_grad_logits_(
    logits: torch.Tensor,  # (r, V) compute dtype, overwritten with its gradient
    labels: torch.Tensor,  # (r,)
    lse: torch.Tensor,  # (r,) float32 from head_stats
    grad_logp: torch.Tensor,  # (r,) float32, already divided by T
    entropy: torch.Tensor | None,  # (r,) float32 when the entropy has a gradient
    grad_entropy: torch.Tensor | None,  # (r,) float32, already divided by T
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits (r, V), written over ``logits`` (each element is read before it is replaced)."""
    r, V = logits.shape
    with_entropy = grad_entropy is not None
    if r:
        _grad_kernel[(r,)](
            logits, logits.stride(0), labels, lse, grad_logp.contiguous(),
            entropy if with_entropy else lse, grad_entropy.contiguous() if with_entropy else lse,
            V, 1.0 / temperature, BLOCK=BLOCK_V, WITH_ENTROPY=with_entropy, num_warps=8,
        )  # fmt: skip
    return logits
