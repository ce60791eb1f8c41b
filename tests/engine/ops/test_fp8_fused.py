"""RMSNorm and SiLU-mul fused with static FP8 quantisation (``engine.ops.fp8_fused``) against the torch path
(``quantise_static`` of ``blocks.rms_norm`` / ``F.silu(gate) * up``), and the FP8 GEMM on their output.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.triton_util import needs_kernels

from hybridflow.engine.ops import fp8_fused
from hybridflow.engine.ops.fp8 import (
    FP8,
    act_scale_for,
    current_kernel,
    fp8_linear,
    quantise_rows,
    quantise_static,
    use_kernel,
)
from hybridflow.engine.rollout.blocks import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_kernels(fp8_fused)


def _same_up_to_a_step(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """FP8 tensors equal but for a few elements one e4m3 step apart (the norm's float32 sums run in another
    order, which can move a value across a rounding boundary). Triton's CPU interpreter casts float32 to
    bf16 by truncation, not to nearest as the GPU and torch do: interpreted, bf16 moves more values a step."""
    assert got.dtype == FP8 and got.shape == want.shape
    g, w = got.float(), want.float()
    truncating = DEVICE == "cpu" and dtype == torch.bfloat16
    assert (g == w).float().mean() > (0.85 if truncating else 0.97)
    step = w.abs().clamp(min=2.0**-6) / 8  # e4m3: 3 mantissa bits
    assert ((g - w).abs() <= step * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_quantises_as_the_torch_path(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=g) * torch.rand(3, 5, 1, generator=g) * 4).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(96, generator=g)).to(DEVICE, dtype)
    normed = rms_norm(x, weight, 1e-6)  # (b, t, K), K = 96: not a power of two (masked tail)
    scale = act_scale_for(normed.abs().amax() / 1.5).reshape(1)  # a few values beyond: saturate as torch
    got = fp8_fused.rms_norm_quant(x, weight, 1e-6, scale)
    assert got.lead == (3, 5) and got.dtype == dtype
    assert got.rows.shape == (15, 1) and got.rows.is_contiguous() and (got.rows == scale).all()
    _same_up_to_a_step(got.data, quantise_static(normed.reshape(15, 96), scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_silu_mul_quantises_the_halves_of_a_fused_output(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    fused = (torch.randn(2, 3, 2 * 1100, generator=g) * 3).to(DEVICE, dtype)  # (b, t, 2I): gate | up
    gate, up = fused.split(1100, dim=-1)  # strided views; I = 1100 spans two column blocks
    act = F.silu(gate) * up
    scale = act_scale_for(act.abs().amax()).reshape(1)
    got = fp8_fused.silu_mul_quant(gate, up, scale)
    assert got.lead == (2, 3) and got.rows.shape == (6, 1) and (got.rows == scale).all()
    _same_up_to_a_step(got.data, quantise_static(act.reshape(6, 1100), scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantisation_kernel_is_quantise_static(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 1100, generator=g) * torch.rand(5, 1, generator=g) * 3).to(DEVICE, dtype)
    scale = act_scale_for(x.abs().amax() / 1.5).reshape(1)  # a few values beyond the range: they saturate
    got = fp8_fused.quant(x[:, :1000], scale)  # strided rows, K = 1000 spans a masked second column block
    assert got.lead == (5,) and got.rows.shape == (5, 1) and (got.rows == scale).all()
    want = quantise_static(x[:, :1000], scale)
    # elementwise from the same values: the same bits (the interpreter stores float32 and torch casts)
    assert torch.equal(got.data.float(), want.float()) or DEVICE == "cuda"
    _same_up_to_a_step(got.data, want, torch.float32)


def test_the_fp8_gemm_on_fused_activations_is_the_static_path() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).to(DEVICE, torch.bfloat16)
    weight = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    q = quantise_rows((torch.randn(48, 64, generator=g) * 0.05).to(DEVICE))
    q.act_scale = act_scale_for(rms_norm(x, weight, 1e-6).abs().amax()).reshape(1)
    bias = torch.randn(48, generator=g).to(DEVICE, torch.bfloat16)
    before = current_kernel()
    try:
        use_kernel("scaled_mm_static")
        fused = fp8_linear(fp8_fused.rms_norm_quant(x, weight, 1e-6, q.act_scale), q, bias)
        plain = fp8_linear(rms_norm(x, weight, 1e-6), q, bias, static=True)
    finally:
        use_kernel(before)
    assert fused.shape == (4, 48) and fused.dtype == torch.bfloat16
    # the same GEMM on the same FP8 activations but for a few one-step roundings (see above)
    assert (fused.float() - plain.float()).norm() / plain.float().norm() < 0.02
