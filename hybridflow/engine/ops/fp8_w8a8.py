"""FP8 x FP8 matmul for decode-sized batches (W8A8): one Triton kernel, scales applied to the accumulator.

At 16-256 tokens a projection is memory-bound: its time is the time to stream the weight. cuBLAS's FP8 GEMM
with rowwise scales (``torch._scaled_mm``) picks 128 x 128 tiles there and reads the FP8 weight at well under
the H200's bandwidth (7B gate projection at 64 tokens: 42 µs against bf16's 36, RESULTS.md issue 45), so
halving the bytes bought nothing. This kernel tiles for a skinny M: one M tile holds the whole batch, narrow N
tiles spread a projection over every SM, long K tiles keep each program streaming its weight rows, and the
FP8 tensor-core dot accumulates in float32. The activations' scales (one per row, or one static scale with
stride 0) and the weight's rowwise scales multiply the accumulator once at the end, then the bias.

The activations come in FP8, quantised upstream: by ``fp8_fused``'s norm / SiLU-mul / quantisation kernels in
an uncompiled decode, by inductor fused into their producer in a compiled one. (Quantising each tile in this
kernel as it is loaded was measured too: every N tile repeats the division, 1.5-3x slower on an H200.)

The launch configuration comes from a table keyed by the token count and the projection's shape class
(``_CONFIGS``; no autotuning: the first call may happen under CUDA-graph capture), which also says where
cuBLAS is the faster kernel. Triton's CPU interpreter computes FP8 dots on raw bits, so interpreted (tests
on CPU) the tiles are upcast to float32 for the dot; ``w8a8_reference`` is the same math in torch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference runs instead
    triton = None
    tl = None

FP8 = torch.float8_e4m3fn
# Beyond this (prefill) cuBLAS's large tiles win: ``fp8.fp8_linear`` calls _scaled_mm instead.
MAX_TOKENS = 256
WIDE = 8192  # N above this: a "wide" projection (the joined gate/up of a 1.5B-7B model)
LONG_K = 8192  # K above this: a "long" one (the down projection), which wants deeper pipelining

Config = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
# By token count, then by the projection's class: from ``benchmarks/fp8_gemm.py --sweep`` on one H200 over
# the 1.5B and 7B shapes (per class the configuration least slower than each projection's best). The batch
# sits in one M tile; narrow N tiles with long K tiles, so a 3584-wide projection still spreads over the 132
# SMs. None: cuBLAS's _scaled_mm is faster there (a wide projection above 64 tokens: the 7B gate/up at 128
# tokens 50 against 57 µs, at 256 66 against 95). The 32-token row is interpolated, not swept.
_CONFIGS: tuple[tuple[int, dict[str, Config | None]], ...] = (
    (16, {"narrow": (16, 32, 256, 4, 3), "long_k": (16, 32, 256, 4, 5), "wide": (16, 64, 128, 4, 3)}),
    (32, {"narrow": (32, 32, 256, 4, 3), "long_k": (32, 32, 256, 4, 5), "wide": (32, 64, 128, 4, 3)}),
    (64, {"narrow": (64, 32, 256, 4, 3), "long_k": (64, 32, 256, 4, 5), "wide": (64, 64, 128, 4, 3)}),
    (128, {"narrow": (64, 32, 256, 4, 3), "long_k": (64, 64, 256, 4, 5), "wide": None}),
    (MAX_TOKENS, {"narrow": (64, 64, 128, 4, 3), "long_k": (64, 64, 256, 4, 3), "wide": None}),
)


def projection_class(n: int, k: int) -> str:
    """The table's column for an (N, K) weight: "wide" (N > WIDE), "long_k" (K > LONG_K) or "narrow"."""
    return "wide" if n > WIDE else "long_k" if k > LONG_K else "narrow"


def config_for(m: int, n: int, k: int) -> Config | None:
    """The launch configuration for ``m`` tokens through an (N, K) weight; None where _scaled_mm is faster
    (or ``m`` is above every row of the table)."""
    for limit, by_class in _CONFIGS:
        if m <= limit:
            return by_class[projection_class(n, k)]
    return None


def use_table(configs: list[tuple[int, dict[str, Config | None]]]) -> None:
    """Launch with ``configs`` (rows as ``_CONFIGS``'s, ascending token limits) from now on in this process:
    for benchmarks that try a swept table before it is written here."""
    global _CONFIGS
    _CONFIGS = tuple((limit, {c: tuple(v) if v else None for c, v in row.items()}) for limit, row in configs)


def available() -> bool:
    """Whether the kernel can be launched at all (triton imports)."""
    return triton is not None


def _interpreting() -> bool:
    """Whether the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 when triton loaded)."""
    return triton is not None and type(_w8a8_kernel).__name__ == "InterpretedFunction"


def w8a8_reference(
    x: torch.Tensor,  # (M, K) float8_e4m3fn
    x_scale: torch.Tensor,  # (M,) or (1,) float32
    data: torch.Tensor,  # (N, K) float8_e4m3fn
    scale: torch.Tensor,  # (N,) float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(x * x_scale) @ (data * scale).T (+ bias) in float32, returned in ``out_dtype``: (M, N)."""
    out = (x.float() @ data.float().t()) * x_scale.float().reshape(-1, 1) * scale.float()  # (M, N)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


if triton is not None:

    @triton.jit
    def _w8a8_kernel(
        x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
        M, N, K, stride_xm, stride_sx, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        rk = tl.arange(0, BLOCK_K)  # (BK,)
        m_ok, n_ok = rm < M, rn < N
        sx = tl.load(sx_ptr + rm * stride_sx, mask=m_ok, other=1.0)  # (BM,) float32
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # (BM, BK)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # (BK, BN): weight rows read along K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + rk) < K
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:  # the CPU interpreter only
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(x, w)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sw = tl.load(sw_ptr + rn, mask=n_ok, other=1.0)  # (BN,) the weight rows' scales
        acc = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(
    x: torch.Tensor,  # (M, K) float8_e4m3fn
    x_scale: torch.Tensor,  # (M,) or (1,) float32
    data: torch.Tensor,  # (N, K) float8_e4m3fn
    scale: torch.Tensor,  # (N,) float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Config,
) -> torch.Tensor:
    """One launch of the kernel: (M, N) in ``out_dtype``."""
    m, k = x.shape
    n = data.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)  # (M, N)
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _w8a8_kernel[grid](
        x, x_scale, data, scale, bias if bias is not None else scale, out,
        m, n, k, x.stride(0), 0 if x_scale.numel() == 1 else 1, data.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=_interpreting(), EVEN_K=k % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# An opaque op for torch.compile (the compiled decode): dynamo does not trace into the Triton launch, and
# inductor fuses the activations' quantisation into the op that produces them, upstream of this call.
@torch.library.custom_op("hybridflow::w8a8_matmul", mutates_args=())
def w8a8_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(M, K) x with its scales @ (data * scale).T (+ bias) -> (M, N) with the table's configuration (the
    caller checked there is one: ``config_for``)."""
    config = config_for(x.shape[0], data.shape[0], data.shape[1])
    assert config is not None, "no W8A8 configuration for this shape: _scaled_mm runs it"
    return _launch(x, x_scale, data, scale, bias, out_dtype, config)


@w8a8_matmul.register_fake
def _(x, x_scale, data, scale, bias, out_dtype):  # the op's signature
    return x.new_empty(x.shape[0], data.shape[0], dtype=out_dtype)


def w8a8_linear(
    x: torch.Tensor,  # (M, K) float8_e4m3fn
    x_scale: torch.Tensor,  # (M,) per row, or (1,) static, float32
    data: torch.Tensor,  # (N, K) float8_e4m3fn, contiguous
    scale: torch.Tensor,  # (N,) float32
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Config | None = None,
) -> torch.Tensor:
    """The FP8 projection of ``x`` (M, K) by the Triton kernel: (M, N) in ``out_dtype``. ``config`` overrides
    the table (the benchmark sweeps it); without it the table must hold one for the shape."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert x.dtype == FP8, "the activations come quantised (fp8.quantise_static, fp8_fused)"
    if config is None:
        return w8a8_matmul(x, x_scale, data, scale, bias, out_dtype)
    return _launch(x, x_scale, data, scale, bias, out_dtype, config)
