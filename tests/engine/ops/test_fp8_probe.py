"""The start-up FP8 probe on CUDA: one decode layer per kernel and bf16, timed, the process's kernel kept."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.ops.fp8 import FP8_KERNELS, current_kernel, use_kernel
from hybridflow.engine.ops.fp8_probe import fp8_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(("tp", "compiled"), [(1, False), (2, False), (1, True)])
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
        )
        assert current_kernel() == "w8a16"
    finally:
        use_kernel("scaled_mm")
    assert set(probe) == {*FP8_KERNELS, "bf16"}
    assert all(0 < us < 1e4 for us in probe.values()), probe
