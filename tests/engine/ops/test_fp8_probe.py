"""The start-up FP8 probe: what it runs (every kernel's layer against bf16's, on CPU too) and, on CUDA, its
timings, with the process's kernel kept."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.ops.fp8 import FP8_KERNELS, current_kernel, use_kernel
from hybridflow.engine.ops.fp8_probe import MIN_GAIN, copies_for, fp8_probe, layer_runs, pick_kernel


@pytest.mark.parametrize("compiled", [False, True])
def test_every_kernel_runs_the_layer_bf16_runs(compiled: bool) -> None:
    # q/k/v 96 rows (q 64 + k/v 16 each), attention 64, intermediate 96; 5 tokens. On CPU the static kernels'
    # fused producers and the Triton GEMM run in the interpreter (tests/conftest.py) or fall back to torch.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16, fp8, layers = layer_runs((64, 96, 64, 96), 5, device, compiled)
    assert layers >= 1
    want = bf16()
    before = current_kernel()
    try:
        for name in FP8_KERNELS:
            use_kernel(name)
            for got, ref in zip(fp8(), want, strict=True):
                assert got.shape == ref.shape
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 0.08, (name, err)  # e4m3 rounding of weights (and activations for W8A8)
    finally:
        use_kernel(before)


@pytest.mark.parametrize(("tp", "compiled"), [(1, False), (2, False), (1, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_times_every_kernel_and_keeps_the_kernel_in_use(tp: int, compiled: bool) -> None:
    use_kernel("w8a16")
    try:
        # A GQA layer (q 256 wide, k/v 64) whose widths split over tp = 2.
        probe = fp8_probe(
            256,
            512,
            torch.device("cuda"),
            q_dim=256,
            kv_dim=64,
            tp=tp,
            tokens=16,
            repeats=3,
            compiled=compiled,
            model_layers=2,
        )
        assert current_kernel() == "w8a16"
    finally:
        use_kernel("scaled_mm")
    assert set(probe) == {*FP8_KERNELS, "bf16"}
    assert all(0 < us < 1e4 for us in probe.values()), probe


def test_fp8_is_kept_only_where_it_beats_bf16_by_the_margin() -> None:
    # The H200's figures (µs per layer, benchmarks/RESULTS.md): 7B eager, 0.5B compiled (a near tie).
    seven_b = {
        "w8a16": 337.6,
        "scaled_mm": 282.0,
        "scaled_mm_static": 138.1,
        "triton_w8a8": 103.3,
        "bf16": 167.8,
    }
    half_b = {"w8a16": 95.5, "scaled_mm": 153.7, "scaled_mm_static": 33.7, "triton_w8a8": 26.1, "bf16": 26.4}
    assert pick_kernel(seven_b) == ("triton_w8a8", True)
    assert pick_kernel(half_b) == ("triton_w8a8", False)  # faster, not by MIN_GAIN: bf16 stays
    assert pick_kernel(seven_b, "w8a16") == ("w8a16", False)  # asked for, and slower than bf16
    assert pick_kernel({**half_b, "bf16": 26.1 * MIN_GAIN + 0.1}) == ("triton_w8a8", True)


def test_the_probe_streams_as_many_layers_as_outgrow_l2_but_no_more_than_the_model_has() -> None:
    l2 = 50 * 2**20  # the H200's
    assert copies_for(15 * 2**20, l2, 24) == 7  # a 0.5B layer in FP8: 105 MB over seven
    assert copies_for(233 * 2**20, l2, 28) == 1  # a 7B layer already outgrows it
    assert copies_for(2**16, l2, 2) == 2  # a tiny model decodes from L2 too: its own two layers
