"""Weight-only FP8 matmul (W8A16): FP8 weights upcast to bf16 in registers, bf16 activations, one Triton kernel.

Decode is memory-bound: at batch 16-256 a projection's time is the time to read its weight. ``_scaled_mm``
(W8A8) halves those bytes but needs the activations in FP8 too, and quantising them per token is a chain of
small kernels (abs, amax, divide, clamp, cast) that costs more than the bytes saved on the H200 (RESULTS.md,
issue 45). This kernel reads the FP8 weight tile, converts it to the activations' dtype in registers and runs
an ordinary bf16 tensor-core dot; the rowwise scale of the weight is per output column, so it is applied
once to the float32 accumulator at the end. No activation quantisation, no extra launch: the same bytes
saved, none of W8A8's overhead (and its accuracy is that of the FP8 weights alone).

The launch configuration comes from a small table keyed by the number of tokens (no autotuning: the first
call may happen while a CUDA graph is being captured). ``w8a16_reference`` is the same math in torch, for
CPU and for tests.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference runs instead
    triton = None
    tl = None


def available() -> bool:
    """Whether the Triton kernel can be launched at all (triton imports)."""
    return triton is not None


def _interpreting() -> bool:
    """Whether the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 when triton loaded): the
    interpreter computes bf16 dots on the raw bits, so there the tiles are upcast to float32 first."""
    return triton is not None and type(_w8a16_kernel).__name__ == "InterpretedFunction"


def w8a16_reference(
    x: torch.Tensor,  # (M, K)
    data: torch.Tensor,  # (N, K) float8_e4m3fn
    scale: torch.Tensor,  # (N,) float32
    bias: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """x @ (data * scale).T (+ bias) in float32, returned in x's dtype: (M, N)."""
    out = x.float() @ data.float().t() * scale.float()  # (M, N)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by token count, from ``benchmarks/fp8_gemm.py --sweep`` on one
# H200 (the configurations that won most of the 0.5B-7B projections at 16, 64 and 256 tokens): narrow N
# tiles and long K tiles while the batch is small, so a 3584-wide projection still spreads over the 132 SMs.
_CONFIGS = (
    (16, (16, 32, 256, 4, 3)),
    (32, (32, 32, 256, 4, 3)),
    (64, (64, 32, 256, 4, 3)),
    (1 << 30, (128, 64, 128, 4, 3)),
)


def config_for(m: int) -> tuple[int, int, int, int, int]:
    """The launch configuration for ``m`` tokens (the table above)."""
    for limit, cfg in _CONFIGS:
        if m <= limit:
            return cfg
    raise AssertionError("unreachable: the last limit is unbounded")


if triton is not None:

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
        M, N, K, stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        rk = tl.arange(0, BLOCK_K)  # (BK,)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )  # (BM, BK) bf16
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )  # (BK, BN) fp8, the weight's rows read along K (contiguous)
            if UPCAST:  # the CPU interpreter only
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(x, w.to(x.dtype))
        s = tl.load(s_ptr + rn, mask=rn < N, other=1.0)  # (BN,) the weight rows' scales
        acc = acc * s[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def _launch(
    flat: torch.Tensor,  # (M, K) contiguous
    data: torch.Tensor,  # (N, K) float8_e4m3fn
    scale: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
) -> torch.Tensor:
    """One launch of the kernel: (M, N) in flat's dtype."""
    m, k = flat.shape
    n = data.shape[0]
    out = torch.empty(m, n, dtype=flat.dtype, device=flat.device)  # (M, N)
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _w8a16_kernel[grid](
        flat, data, scale, bias if bias is not None else scale, out,
        m, n, k, flat.stride(0), data.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=_interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# An opaque op for torch.compile (the compiled prefill): dynamo does not trace into the Triton launch.
@torch.library.custom_op("hybridflow::w8a16_matmul", mutates_args=())
def w8a16_matmul(
    flat: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """(M, K) @ (data * scale).T (+ bias) -> (M, N) with the table's configuration."""
    return _launch(flat, data, scale, bias, config_for(flat.shape[0]))


@w8a16_matmul.register_fake
def _(flat: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], data.shape[0])


def w8a16_linear(
    x: torch.Tensor,  # (..., K) bf16/fp16
    data: torch.Tensor,  # (N, K) float8_e4m3fn, contiguous
    scale: torch.Tensor,  # (N,) float32
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x @ (data * scale).T (+ bias) with the Triton kernel; (..., N) in x's dtype. ``config`` overrides the
    table (the benchmark sweeps it)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k).contiguous()  # (M, K)
    out = (
        w8a16_matmul(flat, data, scale, bias) if config is None else _launch(flat, data, scale, bias, config)
    )
    return out.reshape(*lead, data.shape[0])
