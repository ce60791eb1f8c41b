"""FP8 weights (e4m3, rowwise scales): quantisation error, scales, the scaled matmul, what is quantised."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.ops.fp8 import (
    ACT_SCALE_MARGIN,
    FP8,
    FP8_MAX,
    calibrate_act_scale,
    current_kernel,
    dequantise,
    fp8_linear,
    fp8_parameters,
    quantisable,
    quantise,
    quantise_rows,
    quantise_static,
    row_scales,
    use_kernel,
)
from hybridflow.models import build_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (48, 32), (896, 4864 // 8)])
def test_quantise_then_dequantise_is_within_three_percent_of_the_norm(
    shape: tuple, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    w = (torch.randn(shape) * torch.logspace(-3, 0, shape[0]).unsqueeze(1)).to(dtype)  # rows of every scale
    q = quantise_rows(w)
    assert q.data.dtype == FP8 and q.scale.shape == (shape[0],) and q.scale.dtype == torch.float32
    err = (dequantise(q) - w.float()).norm() / w.float().norm()
    assert err < 0.03, err
    # every row uses e4m3's whole range: its largest magnitude lands on 448
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((shape[0],), FP8_MAX))


def test_scales_of_the_full_rows_quantise_a_slice_as_the_full_weight_sliced() -> None:
    """The switch's rule: quantisation is elementwise once the rows' scales are known."""
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    full = quantise_rows(w)
    left = quantise(w[8:24, :32], full.scale[8:24])  # a box of rows and half the columns
    assert torch.equal(left.view(torch.uint8), full.data[8:24, :32].view(torch.uint8))


def test_a_zero_row_gets_a_tiny_scale_not_a_division_by_zero() -> None:
    w = torch.randn(16, 32)
    w[3] = 0
    q = quantise_rows(w)
    assert q.scale[3] > 0 and torch.equal(dequantise(q)[3], torch.zeros(32))
    assert torch.equal(row_scales(torch.zeros(2)), torch.full((2,), 1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_linear_is_close_to_the_full_precision_one(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    x = torch.randn(3, 7, 64).to(dtype)  # (b, t, K): batched tokens of different scales
    x[0] *= 30
    y = fp8_linear(x, quantise_rows(w), b.to(dtype))
    ref = x.float() @ w.t() + b
    assert y.shape == (3, 7, 48) and y.dtype == dtype
    assert (y.float() - ref).norm() / ref.norm() < 0.06


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_static_activation_scale_is_calibrated_on_the_valid_tokens_and_quantises_elementwise(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(3)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    x = torch.randn(3, 7, 64).to(dtype)  # (b, t, K): a prefill chunk, right-padded
    x[1, 2] *= 4  # one token of larger activations: it sets the range
    valid = torch.arange(7)[None] < torch.tensor([7, 5, 2])[:, None]  # (b, t)
    x[~valid] = 1000.0  # the padding's values never calibrate
    q = quantise_rows(w)
    q.act_scale = buf = torch.ones(1)
    calibrate_act_scale(x, valid, q.act_scale)
    assert q.act_scale is buf  # filled in place
    amax = x[valid].float().abs().max()
    torch.testing.assert_close(buf, (ACT_SCALE_MARGIN * amax / FP8_MAX).reshape(1))
    tokens = x[valid]  # (n, K)
    ref = tokens.float() @ w.t() + b
    before = current_kernel()
    try:
        use_kernel("scaled_mm_static")
        static = fp8_linear(tokens, q, b.to(dtype), static=True)
        dynamic = fp8_linear(tokens, q, b.to(dtype))  # not told the scale is calibrated: per token
        use_kernel("scaled_mm")
        per_token = fp8_linear(tokens, q, b.to(dtype), static=True)  # this kernel has no static scales
    finally:
        use_kernel(before)
    assert torch.equal(per_token, dynamic) and not torch.equal(static, dynamic)
    for y in (static, dynamic):
        assert y.dtype == dtype and (y.float() - ref).norm() / ref.norm() < 0.06
    # the static path is the dequantised activations times the dequantised weight
    manual = (quantise_static(tokens, buf).float() * buf) @ dequantise(q).t() + b
    torch.testing.assert_close(static.float(), manual.to(dtype).float(), rtol=0.02, atol=0.02)
    # beyond the calibrated range (2x the prefill's largest value) a value saturates, never overflows
    far = quantise_static(torch.tensor([[3.0 * float(amax)]]), buf).float() * buf
    torch.testing.assert_close(far, FP8_MAX * buf.reshape(1, 1))


def test_only_dense_projections_with_dims_of_sixteen_are_quantised() -> None:
    assert quantisable("model.layers.0.self_attn.q_proj.weight", (64, 32))
    assert quantisable("model.layers.3.mlp.down_proj.weight", (32, 128))
    assert not quantisable("model.layers.0.self_attn.q_proj.bias", (64,))
    assert not quantisable("model.layers.0.self_attn.k_proj.weight", (8, 32))  # 8 rows: no scaled GEMM
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        assert not quantisable(name, (64, 32))
    assert not quantisable("model.layers.0.mlp.shared_expert.up_proj.weight", (64, 32))
    assert not quantisable("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 32))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mixtral"])
def test_a_generation_shard_gets_fp8_projections_and_scale_buffers(arch: str) -> None:
    model = build_tiny_model(arch, hidden_size=32, num_hidden_layers=2)
    names = fp8_parameters(model)
    params = dict(model.named_parameters())
    assert names and all(params[n].dtype == FP8 for n in names)
    assert all(".self_attn." in n or ".mlp." in n for n in names)
    assert params["model.embed_tokens.weight"].dtype == torch.float32  # the rest stays as it was
    for n in names:
        owner = model.get_submodule(n.rsplit(".", 1)[0])
        assert owner.weight_scale.shape == (params[n].shape[0],)
    if arch == "mixtral":  # the experts stay in the rollout dtype; the attention is quantised
        assert not any("experts" in n for n in names) and any("q_proj" in n for n in names)


def test_the_fp8_decode_benchmark_runs_on_cpu(tmp_path) -> None:
    """benchmarks/fp8_decode.py on a tiny shape (the GPU runs are the lead's): a row per batch, every
    variant (bf16, FP8 weights through each kernel, and each with the FP8 KV cache)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "fp8_decode.py"
    out = tmp_path / "rows.jsonl"
    args = [
        "--device",
        "cpu",
        "--shapes",
        "tiny",
        "--batches",
        "2",
        "3",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
        "--kernels",
        "scaled_mm",
        "w8a16",
        "scaled_mm_static",
    ]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [2, 3]
    assert all(
        r["bf16_tok_s"] > 0 and r["fp8_tok_s"] > 0 and r["fp8_weight_gib"] < r["bf16_weight_gib"]
        for r in rows
    )
    assert all(0 < r["fp8_logprob_gap"] < 0.1 and 0 < r["fp8_kv_logprob_gap"] < 0.1 for r in rows)
    assert all(r["fp8_kv_tok_s"] > 0 and r["fp8_kv_speedup"] > 0 for r in rows)  # the FP8 KV cache's variants
    assert all(r["fp8_w8a16_kv_tok_s"] > 0 and 0 < r["fp8_w8a16_kv_logprob_gap"] < 0.1 for r in rows)
    static = ("fp8_scaled_mm_static", "fp8_scaled_mm_static_kv")
    assert all(r[f"{v}_tok_s"] > 0 and 0 < r[f"{v}_logprob_gap"] < 0.1 for r in rows for v in static)


def test_the_fp8_gemm_benchmark_checks_the_kernels_on_cpu() -> None:
    """benchmarks/fp8_gemm.py's CPU smoke run: each W8A8 variant within FP8's error of the weight-only one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "fp8_gemm.py"
    args = [
        "--device",
        "cpu",
        "--shapes",
        "tiny",
        "--tokens",
        "3",
        "--kernels",
        "scaled_mm",
        "scaled_mm_static",
    ]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, cwd=script.parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert 0 < row["scaled_mm_rel_err"] < 0.06 and 0 < row["scaled_mm_static_rel_err"] < 0.06, row
