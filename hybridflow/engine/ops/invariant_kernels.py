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


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, pos_ptr, scale,
    sq_r, sq_h, sk_n, sk_h, so_r, so_h,
    GROUP: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    kvh = h // GROUP
    d = tl.arange(0, D)
    j = tl.arange(0, C)
    q = tl.load(q_ptr + r * sq_r + h * sq_h + d).to(tl.float32)  # (D,)
    start = tl.load(starts_ptr + r)
    pos = tl.load(pos_ptr + r)
    chunks = pos // C + 1
    tops = tl.full((C,), float("-inf"), tl.float32)
    for c in range(0, chunks):  # pass 1: the row's largest score (exact in any order)
        at = c * C + j  # (C,) positions in the sequence
        k = tl.load(
            k_ptr + (start + at)[:, None] * sk_n + kvh * sk_h + d[None, :],
            mask=(at <= pos)[:, None],
            other=0.0,
        )
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # (C,)
        tops = tl.maximum(tops, tl.where(at <= pos, s, float("-inf")))
    top = tl.max(tops, axis=0)
    totals = tl.zeros((C,), dtype=tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    for c in range(0, chunks):  # pass 2: in position order, the exponentials and their values
        at = c * C + j
        valid = at <= pos
        k = tl.load(
            k_ptr + (start + at)[:, None] * sk_n + kvh * sk_h + d[None, :], mask=valid[:, None], other=0.0
        )
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        p = tl.where(valid, tl.exp(s - top), 0.0)  # (C,)
        totals += p
        v = tl.load(
            v_ptr + (start + at)[:, None] * sk_n + kvh * sk_h + d[None, :], mask=valid[:, None], other=0.0
        )
        acc += tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    out = acc / tl.sum(totals, axis=0)
    tl.store(out_ptr + r * so_r + h * so_h + d, out.to(out_ptr.dtype.element_ty))


def attend(
    q: torch.Tensor,  # (R, H, D)
    keys: torch.Tensor,  # (N, KVH, D)
    values: torch.Tensor,  # (N, KVH, D)
    starts: torch.Tensor,  # (R,) int: where each row's sequence begins in keys
    positions: torch.Tensor,  # (R,) int: each row reads keys starts .. starts + position
    scale: float,
    chunk: int,
) -> torch.Tensor:
    """``exact_attention.attend`` on CUDA: one program per (row, head), the chunks in position order."""
    r, h, d = q.shape
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    out = torch.empty_like(q)
    if r == 0:
        return out
    assert keys.stride() == values.stride() and d & (d - 1) == 0, "contiguous K and V, a power-of-2 head dim"
    _attend_kernel[(r, h)](
        q, keys, values, out, starts.to(torch.int64), positions.to(torch.int64), float(scale),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
        GROUP=h // keys.shape[1], D=d, C=chunk,
    )  # fmt: skip
    return out
