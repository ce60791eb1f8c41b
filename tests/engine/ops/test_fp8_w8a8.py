"""The Triton W8A8 kernel (``triton_w8a8``): against its reference, its in-kernel quantisation, and its use.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import pytest
import torch
from support.triton_util import needs_kernels

from hybridflow.engine.ops import fp8_w8a8
from hybridflow.engine.ops.fp8 import (
    FP8,
    act_scale_for,
    current_kernel,
    fp8_linear,
    quantise_rows,
    quantise_static,
    use_kernel,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = (16, 16, 32, 4, 1)  # tiles smaller than the shapes: the tails of M, N and K all run


@pytest.fixture(autouse=True)
def restore_kernel():
    before = current_kernel()
    yield
    use_kernel(before)


def _case(m: int, n: int, k: int, seed: int) -> tuple:
    """Rows of different ranges (weights) and tokens of different magnitudes (activations), quantised."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).to(DEVICE)
    x = (torch.randn(m, k, generator=g) * (0.1 + 3 * torch.rand(m, 1, generator=g))).to(DEVICE)
    q = quantise_rows(w)
    rows = (x.abs().amax(-1) / 448).clamp(min=1e-12)  # (M,) per-token scales
    xq = (x / rows[:, None]).clamp(-448, 448).to(FP8)
    return x, xq, rows, q, torch.randn(n, generator=g).to(DEVICE)


@needs_kernels(fp8_w8a8)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 80), (5, 64, 96), (33, 80, 48), (70, 32, 272)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_the_reference_with_per_row_scales(m: int, n: int, k: int, bias: bool) -> None:
    _, xq, rows, q, b = _case(m, n, k, seed=m + n + k)
    b = b if bias else None
    out = fp8_w8a8.w8a8_linear(xq, rows, q.data, q.scale, b, torch.float32, config=SMALL)
    ref = fp8_w8a8.w8a8_reference(xq, rows, q.data, q.scale, b, torch.float32)
    # FP8 products are exact in float32; only the order of the float32 sums differs.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_kernels(fp8_w8a8)
@pytest.mark.parametrize("m", [3, 16, 40])
def test_a_static_scale_is_one_scale_for_every_row(m: int) -> None:
    x, _, _, q, b = _case(m, 96, 160, seed=m)
    s = act_scale_for(x.abs().amax()).reshape(1)  # (1,): a calibrated static scale, read with stride 0
    xq = quantise_static(x, s)
    out = fp8_w8a8.w8a8_linear(xq, s, q.data, q.scale, b, torch.float32, config=SMALL)
    rows = s.expand(m).contiguous()  # (M,): the same scale written out per row
    want = fp8_w8a8.w8a8_linear(xq, rows, q.data, q.scale, b, torch.float32, config=SMALL)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    ref = fp8_w8a8.w8a8_reference(xq, s, q.data, q.scale, b, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_kernels(fp8_w8a8)
def test_the_default_table_config_and_bf16_output() -> None:
    _, xq, rows, q, _ = _case(21, 64, 128, seed=7)
    out = fp8_w8a8.w8a8_linear(xq, rows, q.data, q.scale)
    ref = fp8_w8a8.w8a8_reference(xq, rows, q.data, q.scale, None, torch.float32)
    assert out.shape == (21, 64) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-2)  # one bf16 rounding of the result


@pytest.mark.parametrize("m", [1, 16, 17, 64, 65, 128, 256])
@pytest.mark.parametrize(("n", "k"), [(4608, 3584), (3584, 18944), (37888, 3584), (64, 64)])
def test_the_config_table_covers_every_decode_batch(m: int, n: int, k: int) -> None:
    cfg = fp8_w8a8.config_for(m, n, k)
    if cfg is None:  # cuBLAS: only for a wide projection above 64 tokens
        assert n > fp8_w8a8.WIDE and m > 64
        return
    bm, bn, bk, warps, stages = cfg
    assert bm >= 16 and bn >= 16 and bk >= 32 and warps in (2, 4, 8) and stages >= 1  # FP8 dots need K >= 32


def test_prefill_sized_inputs_go_to_cublas() -> None:
    assert fp8_w8a8.config_for(fp8_w8a8.MAX_TOKENS + 1, 64, 64) is None


@needs_kernels(fp8_w8a8)
def test_fp8_linear_runs_the_kernel_for_decode_batches_and_scaled_mm_above() -> None:
    x, _, _, q, b = _case(6, 96, 160, seed=3)
    x = x.bfloat16()
    q.act_scale = act_scale_for(x.abs().amax()).reshape(1)
    use_kernel("triton_w8a8")
    out = fp8_linear(x[None], q, b.bfloat16(), static=True)  # (1, 6, N): leading dims kept
    ref = fp8_w8a8.w8a8_reference(
        quantise_static(x, q.act_scale), q.act_scale, q.data, q.scale, b, torch.bfloat16
    )
    assert out.shape == (1, 6, 96)
    torch.testing.assert_close(out[0].float(), ref.float(), rtol=2**-7, atol=2e-2)
    # Above MAX_TOKENS the same call goes to _scaled_mm with the same static scale: the same numbers.
    big = x.repeat(fp8_w8a8.MAX_TOKENS // 6 + 1, 1)  # (M > MAX_TOKENS, K)
    use_kernel("scaled_mm_static")
    want = fp8_linear(big, q, b.bfloat16(), static=True)
    use_kernel("triton_w8a8")
    torch.testing.assert_close(fp8_linear(big, q, b.bfloat16(), static=True), want)
    torch.testing.assert_close(want[:6].float(), out[0].float(), rtol=2**-7, atol=2e-2)


@needs_kernels(fp8_w8a8)
def test_the_kernel_is_one_opaque_op_under_torch_compile() -> None:
    # The compiled decode quantises upstream (inductor fuses it into the producer) and calls the op.
    _, xq, rows, q, b = _case(9, 32, 64, seed=5)

    def f(xq: torch.Tensor) -> torch.Tensor:
        return torch.relu(fp8_w8a8.w8a8_linear(xq, rows, q.data, q.scale, b, torch.float32))

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(xq), f(xq))
