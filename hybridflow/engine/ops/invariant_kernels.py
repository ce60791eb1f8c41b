"""The CUDA side of ``invariant``: Triton kernels whose per-row reduction order is fixed.

One tiling for every call (no autotuning, no split of K): a program computes a ``BLOCK_M x BLOCK_N`` tile of a
matmul by walking K in ``BLOCK_K`` steps, so an output element is the same sum in the same order whether its
row shares the call with 3 rows or 30,000. Row reductions (a sum, a log-softmax) run one row per program,
walking the row in ``BLOCK`` steps. Accumulation is in float32; outputs take the inputs' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # fixed: a different tile could reduce K in another order
BLOCK = 1024  # row reductions: elements per step


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(ks[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if IEEE:  # float32 inputs: no TF32 rounding of the inputs
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, (rm[:, None] < M) & (rn[None, :] < N)
    )


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) in a's dtype, float32 accumulation, one fixed tiling."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        a, b, out, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, K, stride, B: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, B)
    acc = tl.zeros((B,), dtype=tl.float32)
    for k0 in range(0, K, B):
        acc += tl.load(x_ptr + row * stride + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of x (M, K), one program per row; (M,) in x's dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _row_sum_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), B=BLOCK)
    return out


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride, B: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, B)
    base = x_ptr + row * stride
    top = tl.full((B,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, B):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
    m = tl.max(top, axis=0)
    total = tl.zeros((B,), dtype=tl.float32)
    for v0 in range(0, V, B):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        total += tl.exp(x - m)
    lse = m + tl.log(tl.sum(total, axis=0))
    for v0 in range(0, V, B):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * stride + v0 + cols, (x - lse).to(out_ptr.dtype.element_ty), mask=v0 + cols < V
        )


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x (M, V), one program per row, three passes; x's dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), B=BLOCK)
    return out
