"""The weight-only FP8 kernel (W8A16): the Triton kernel against its reference, and the kernel switch.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import pytest
import torch
from support.triton_util import needs_kernels

from hybridflow.engine.ops import fp8, fp8_gemm
from hybridflow.engine.ops.fp8 import current_kernel, fp8_linear, quantise_rows, use_kernel

# The kernel tests run where the kernel does: the GPU, else the CPU interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def restore_kernel():
    before = current_kernel()
    yield
    use_kernel(before)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, fp8.Fp8Weight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different ranges
    w = w.to(DEVICE)
    return w, quantise_rows(w), torch.randn(n, generator=g).to(DEVICE)


@needs_kernels(fp8_gemm)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 80), (5, 64, 96), (33, 80, 48), (70, 32, 272)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_the_reference_in_float32(m: int, n: int, k: int, bias: bool) -> None:
    _, q, b = _weights(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    ref = fp8_gemm.w8a16_reference(x, q.data, q.scale, b if bias else None)
    # A small config so the tails of M, N and K (not multiples of the tiles) are all exercised.
    out = fp8_gemm.w8a16_linear(x, q.data, q.scale, b if bias else None, config=(16, 16, 32, 4, 1))
    # float32 on a GPU: tl.dot runs in TF32 (10-bit mantissa): ~2^-11 relative per product, sums of up to
    # 272 unit-sized products.
    tol = 1e-5 if DEVICE == "cpu" else 3e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@needs_kernels(fp8_gemm)
def test_the_default_table_config_and_leading_dims_in_bfloat16() -> None:
    _, q, _ = _weights(64, 128, seed=1)
    x = torch.randn(3, 7, 128).bfloat16().to(DEVICE)  # (B, T, K): the kernel flattens the leading dims
    out = fp8_gemm.w8a16_linear(x, q.data, q.scale)
    ref = fp8_gemm.w8a16_reference(x.reshape(21, 128), q.data, q.scale).reshape(3, 7, 64)
    assert out.shape == (3, 7, 64) and out.dtype == torch.bfloat16
    # bf16 output: one rounding of the result (2^-8 relative), the accumulation order differs.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("m", [1, 16, 17, 64, 65, 256, 1000])
def test_the_config_table_covers_every_token_count(m: int) -> None:
    bm, bn, bk, warps, stages = fp8_gemm.config_for(m)
    assert bm >= 16 and bn >= 16 and bk >= 16 and warps in (2, 4, 8) and stages >= 1  # tl.dot needs 16


def test_fp8_linear_follows_the_kernel_in_use_and_both_stay_close_to_full_precision() -> None:
    w, q, b = _weights(96, 160, seed=3)
    x = torch.randn(6, 160, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    if DEVICE == "cuda":  # rowwise _scaled_mm on CUDA writes bf16 only
        w, x, b = w.bfloat16(), x.bfloat16(), b.bfloat16()
    full = torch.nn.functional.linear(x, w, b)
    outs = {}
    for name in fp8.FP8_KERNELS:
        use_kernel(name)
        outs[name] = fp8_linear(x, q, b)
        err = (outs[name].float() - full.float()).norm() / full.float().norm()
        assert err < 0.06, (name, err)  # e4m3 keeps 3 mantissa bits: a few percent of the output's norm
    # W8A16 does not quantise the activations: it is the exact product with the FP8 weights.
    ref = fp8_gemm.w8a16_reference(x, q.data, q.scale, b)
    tol = 1e-5 if DEVICE == "cpu" else 2e-2  # bf16 output on the GPU
    torch.testing.assert_close(outs["w8a16"].float(), ref.float(), rtol=tol, atol=tol)
    assert not torch.equal(outs["w8a16"], outs["scaled_mm"])  # W8A8 also rounds x


def test_an_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown FP8 kernel 'int4'"):
        use_kernel("int4")


@needs_kernels(fp8_gemm)
def test_the_kernel_is_one_opaque_op_under_torch_compile() -> None:
    # The engine compiles its prefill: dynamo must not trace into the Triton launch (it cannot).
    _, q, b = _weights(32, 64, seed=5)
    x = torch.randn(2, 9, 64, device=DEVICE)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(fp8_gemm.w8a16_linear(x, q.data, q.scale, b))

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x))
