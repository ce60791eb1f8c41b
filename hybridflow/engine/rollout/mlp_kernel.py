"""The decode step's down projection with SiLU * up applied as it loads its input: a split-K Triton GEMM.

At batch 256 on the H200 the compiled decode step spends 12.9 us per layer on the second half of the MLP:
the SiLU * up kernel (3.0 us), cuBLAS's split-K down GEMM (7.5 us) and its reduce kernel (2.4 us). This
kernel reads gate and up (M, I) straight from the gate/up projection's output, forms silu(gate) * up in
float32 and rounds it once to the weight dtype (as the compiled torch path does), and multiplies it by a
K-slice of the down weight (N, I). Each of the ``num_splits`` K-slices writes a float32 partial product
(S, M, N); the caller sums them as it adds the residual, which inductor fuses into the next RMSNorm
kernel (it unrolls a reduction over at most 8 splits), so the split-K reduce needs no launch of its own.
Two launches per layer fewer than the cuBLAS path.

Status: checked for values in Triton's CPU interpreter; its speed on the H200 is not measured yet, so the
runner uses it only when ``LlamaRunner.fused_down`` is switched on (``benchmarks/rollout.py
--fused-down``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridflow.engine.rollout.decode_attention import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the reference path still works
    triton = None
    tl = None

MAX_SPLITS = 8  # inductor unrolls a sum over at most 8 elements into the consumer kernel


def available() -> bool:
    """Whether the kernel can be launched at all (triton imports)."""
    return triton is not None


def silu_down_reference(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up, rounded once to the weight dtype) @ weight.T in float32: (M, I) twice -> (M, N)."""
    act = (F.silu(gate.float()) * up.float()).to(weight.dtype)  # (M, I)
    return act.float() @ weight.float().T


if triton is not None:

    @triton.jit
    def _silu_down_kernel(
        GATE, UP, W, PART, M, N, K, k_per_split,
        stride_gm, stride_gk, stride_um, stride_uk, stride_wn, stride_wk, stride_ps, stride_pm, stride_pn,
        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One (M tile, N tile, K split): the float32 partial of silu(gate) * up @ W.T over the split's K."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        lo = split * k_per_split
        hi = tl.minimum(lo + k_per_split, K)
        g_ptr = GATE + offs_m[:, None].to(tl.int64) * stride_gm  # (BLOCK_M, 1) row starts
        u_ptr = UP + offs_m[:, None].to(tl.int64) * stride_um
        w_ptr = W + offs_n[None, :].to(tl.int64) * stride_wn  # (1, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(lo, hi, BLOCK_K):
            cols = start + offs_k  # (BLOCK_K,)
            k_ok = cols < hi
            a_mask = m_ok[:, None] & k_ok[None, :]
            gate = tl.load(g_ptr + cols[None, :] * stride_gk, mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(u_ptr + cols[None, :] * stride_uk, mask=a_mask, other=0.0).to(tl.float32)
            act = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)  # (BLOCK_M, BLOCK_K), rounded once
            w = tl.load(w_ptr + cols[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter multiplies bf16 on the raw bits: upcast the (exact) tiles there
                act = act.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(act, w)  # (BLOCK_M, BLOCK_N)
        out = PART + split * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def _interpreting() -> bool:
    return triton is not None and type(_silu_down_kernel).__name__ == "InterpretedFunction"


def launch_config(rows: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages); not tuned on a GPU yet."""
    return (64 if rows >= 64 else 16), 64, 64, 4, 4


def split_layout(
    rows: int, cols: int, inner: int, block_m: int, block_n: int, block_k: int, num_splits: int | None,
    device: torch.device,
) -> tuple[int, int]:  # fmt: skip
    """(splits, K per split): about two programs per SM, at most ``MAX_SPLITS``, whole K blocks per split."""
    tiles = math.ceil(rows / block_m) * math.ceil(cols / block_n)
    want = num_splits or max(1, min(MAX_SPLITS, math.ceil(2 * num_sms(device) / tiles)))
    per_split = math.ceil(math.ceil(inner / want) / block_k) * block_k
    return math.ceil(inner / per_split), per_split


def silu_down_triton(
    gate: torch.Tensor,  # (M, I)
    up: torch.Tensor,  # (M, I)
    weight: torch.Tensor,  # (N, I)
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Launch the kernel; returns the float32 partials (S, M, N) whose sum over S is silu(gate) * up @ W.T."""
    if triton is None:
        raise RuntimeError("silu_down_triton needs triton (pip install triton)")
    rows, inner = gate.shape
    cols = weight.shape[0]
    if up.shape != gate.shape or weight.shape[1] != inner or not gate.dtype == up.dtype == weight.dtype:
        raise ValueError(
            f"silu_down expects gate and up (M, I) and weight (N, I) of one dtype; got {tuple(gate.shape)} "
            f"{gate.dtype}, {tuple(up.shape)} {up.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    if gate.device.type == "cuda" and weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the silu_down kernel takes bf16 or fp16 on CUDA, got {weight.dtype}")
    bm, bn, bk, warps, stages = launch_config(rows, gate.device)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    splits, per_split = split_layout(rows, cols, inner, bm, bn, bk, num_splits, gate.device)
    part = torch.empty((splits, rows, cols), dtype=torch.float32, device=gate.device)
    grid = (math.ceil(rows / bm), math.ceil(cols / bn), splits)
    _silu_down_kernel[grid](
        gate, up, weight, part, rows, cols, inner, per_split,
        *gate.stride(), *up.stride(), *weight.stride(), *part.stride(),
        UPCAST=_interpreting() and weight.dtype != torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=num_warps or warps, num_stages=num_stages or stages,
    )  # fmt: skip
    return part


@torch.library.custom_op("hybridflow::silu_down", mutates_args=())
def silu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel as an opaque op: gate, up (M, I), weight (N, I) -> float32 partials (S, M, N)."""
    return silu_down_triton(gate, up, weight)


@silu_down.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows, inner, cols = gate.shape[0], gate.shape[1], weight.shape[0]
    bm, bn, bk, _, _ = launch_config(rows, gate.device)
    splits, _ = split_layout(rows, cols, inner, bm, bn, bk, None, gate.device)
    return gate.new_empty((splits, rows, cols), dtype=torch.float32)
