"""RMSNorm and SiLU-mul fused with static FP8 activation quantisation: one Triton kernel each (uncompiled decode).

With static activation scales (``fp8.quantise_static``) the quantisation is elementwise, so it belongs in the
kernel that produces the activations. A compiled decode gets that from inductor; an uncompiled one (CUDA graphs
over eager kernels, the engine's default) would run the norm, then divide, clamp and cast, then materialise the
(M, 1) scale rows ``_scaled_mm`` wants: these kernels do it in one pass each. ``rms_norm_quant`` is
``quantise_static(blocks.rms_norm(x, weight, eps), scale)`` and ``silu_mul_quant`` is
``quantise_static(F.silu(gate) * up, scale)``, each rounding to the activations' dtype where the torch ops do
(the norm's cast back, the weight's product, SiLU, the product), so they differ from the torch path only by
the float32 sum order of the norm's mean square. Both return a ``QuantisedInput`` (the FP8 activations and
the scale as contiguous (M, 1) rows), which ``fp8.fp8_linear`` takes instead of x. ``quant`` is the
quantisation alone, one kernel instead of torch's divide, clamp and cast, for an input no fused op produces
(the attention output into o_proj). The three share one epilogue (``_store_quantised``).

Triton's CPU interpreter converts to e4m3 wrongly where rounding carries into the exponent and for subnormals,
so interpreted (tests on CPU) the kernels store the scaled, clamped float32 values and torch casts them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path runs instead
    triton = None
    tl = None

_BLOCK = 1024  # SiLU-mul's columns per program (elementwise; the norm takes a whole row per program)
FP8 = torch.float8_e4m3fn  # as ``fp8.FP8`` (that module imports this one)
FP8_MAX = float(torch.finfo(FP8).max)  # 448


class QuantisedInput(NamedTuple):
    """Activations already quantised with a static scale by the kernel that produced them."""

    data: torch.Tensor  # (M, K) float8_e4m3fn
    rows: torch.Tensor  # (M, 1) float32: the static scale on every row, contiguous (``_scaled_mm``'s rowwise)
    lead: tuple[int, ...]  # the activations' leading dims (M = their product)
    dtype: torch.dtype  # the activations' dtype: the output's


def available() -> bool:
    """Whether the kernels can be launched at all (triton imports)."""
    return triton is not None


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernels replace torch's ops for ``x``: CUDA, triton, and not under torch.compile (there
    inductor fuses the elementwise quantisation into the producer itself)."""
    return x.is_cuda and available() and not torch.compiler.is_compiling()


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when triton loaded)."""
    return triton is not None and type(_rms_norm_quant_kernel).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _store_quantised(y, s_ptr, q_ptr, offsets, mask, FP8_LIMIT: tl.constexpr, RAW: tl.constexpr):
        """Quantise float32 ``y`` with the static scale at ``s_ptr`` and store it at ``q_ptr + offsets``:
        ``(y / s).clamp(-448, 448)`` in e4m3 (float32 when ``RAW``: the interpreter's cast is inexact)."""
        s = tl.load(s_ptr)
        q = tl.minimum(tl.maximum(y / s, -FP8_LIMIT), FP8_LIMIT)
        if RAW:
            tl.store(q_ptr + offsets, q, mask=mask)
        else:
            tl.store(q_ptr + offsets, q.to(tl.float8e4nv), mask=mask)
        return s

    @triton.jit
    def _rms_norm_quant_kernel(
        x_ptr, w_ptr, s_ptr, q_ptr, rows_ptr, k, stride_x, eps,
        FP8_LIMIT: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < k
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / k + eps)
        normed = (xf * inv).to(x.dtype)  # HF: normalise in float32, cast back, then the weight
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
        s = _store_quantised(y, s_ptr, q_ptr, row * k + cols, mask, FP8_LIMIT, RAW)
        tl.store(rows_ptr + row, s)

    @triton.jit
    def _silu_mul_quant_kernel(
        g_ptr, u_ptr, s_ptr, q_ptr, rows_ptr, n, stride_g, stride_u,
        FP8_LIMIT: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu: float32 math, rounded to the dtype
        y = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        s = _store_quantised(y, s_ptr, q_ptr, row * n + cols, mask, FP8_LIMIT, RAW)
        if block == 0:
            tl.store(rows_ptr + row, s)

    @triton.jit
    def _quant_kernel(
        x_ptr, s_ptr, q_ptr, rows_ptr, n, stride_x,
        FP8_LIMIT: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        s = _store_quantised(y, s_ptr, q_ptr, row * n + cols, mask, FP8_LIMIT, RAW)
        if block == 0:
            tl.store(rows_ptr + row, s)


def _outputs(m: int, k: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the quantised activations (M, K): FP8, or float32 when interpreted; the scale rows (M, 1))."""
    dtype = torch.float32 if _interpreting() else FP8
    q = torch.empty(m, k, dtype=dtype, device=like.device)
    return q, torch.empty(m, 1, dtype=torch.float32, device=like.device)


def _handover(
    q: torch.Tensor, rows: torch.Tensor, lead: tuple[int, ...], dtype: torch.dtype
) -> QuantisedInput:
    """The kernel's outputs as a ``QuantisedInput`` (interpreted, torch casts the float32 values to e4m3)."""
    return QuantisedInput(q.to(FP8) if q.dtype != FP8 else q, rows, lead, dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor) -> QuantisedInput:
    """``blocks.rms_norm(x, weight, eps)`` (x (..., K)) quantised with the static ``scale`` (1,), one kernel."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    flat = x.reshape(-1, k)  # (M, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    q, rows = _outputs(flat.shape[0], k, flat)
    block = triton.next_power_of_2(k)
    _rms_norm_quant_kernel[(flat.shape[0],)](
        flat, weight, scale, q, rows, k, flat.stride(0), eps,
        FP8_LIMIT=FP8_MAX, RAW=_interpreting(), BLOCK=block,
    )  # fmt: skip
    return _handover(q, rows, lead, x.dtype)


def silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> QuantisedInput:
    """``F.silu(gate) * up`` (each (..., I), rows may be strided: the halves of a fused gate/up output)
    quantised with the static ``scale`` (1,), one kernel."""
    lead, n = tuple(gate.shape[:-1]), gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # (M, I): views where the layout allows
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    q, rows = _outputs(g.shape[0], n, g)
    grid = (g.shape[0], triton.cdiv(n, _BLOCK))
    _silu_mul_quant_kernel[grid](
        g, u, scale, q, rows, n, g.stride(0), u.stride(0),
        FP8_LIMIT=FP8_MAX, RAW=_interpreting(), BLOCK=_BLOCK,
    )  # fmt: skip
    return _handover(q, rows, lead, gate.dtype)


def quant(x: torch.Tensor, scale: torch.Tensor) -> QuantisedInput:
    """``fp8.quantise_static(x, scale)`` (x (..., K), e.g. the attention output into o_proj), one kernel."""
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    flat = x.reshape(-1, n)  # (M, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    q, rows = _outputs(flat.shape[0], n, flat)
    grid = (flat.shape[0], triton.cdiv(n, _BLOCK))
    _quant_kernel[grid](
        flat, scale, q, rows, n, flat.stride(0), FP8_LIMIT=FP8_MAX, RAW=_interpreting(), BLOCK=_BLOCK
    )
    return _handover(q, rows, lead, x.dtype)
