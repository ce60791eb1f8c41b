"""The layer math's split down projection: the same values as F.linear, eager and traced, in the runner."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine.rollout.blocks import split_linear
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.models import build_tiny_model


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_linear_equals_linear(splits: int) -> None:
    g = torch.Generator().manual_seed(splits)
    x = torch.randn(3, 5, 64, generator=g)  # (b, t, I)
    weight, bias = torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    torch.testing.assert_close(
        split_linear(x, weight, bias, splits), F.linear(x, weight, bias), atol=1e-5, rtol=0
    )
    # bf16: float32 accumulation and one rounding at the end, as cuBLAS's split-K
    xb, wb = x.bfloat16(), weight.bfloat16()
    want = (xb.float() @ wb.float().T).bfloat16()
    assert torch.equal(split_linear(xb, wb, None, splits), want)
    assert split_linear(xb, wb, None, splits).shape == (3, 5, 24)


def test_split_linear_falls_back_when_the_splits_do_not_divide() -> None:
    x, weight = torch.randn(4, 30), torch.randn(6, 30)
    torch.testing.assert_close(split_linear(x, weight, None, 4), F.linear(x, weight), atol=1e-6, rtol=0)


def test_runner_decode_with_a_split_down_projection_equals_cublas_path() -> None:
    model = build_tiny_model("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, seed=1)
    runner = LlamaRunner(model.eval())
    assert runner.config.intermediate_size % 4 == 0  # else split_linear falls back to F.linear
    caches = [runner.make_cache(2, 16) for _ in range(3)]
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 5]])
    lens, slots, starts = torch.tensor([4, 2]), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long)
    for cache in caches:
        runner.prefill(ids, lens, slots, starts, cache)
    token = torch.tensor([10, 11])
    want = runner.decode(token, lens, caches[0])
    runner.down_splits = 4
    torch.testing.assert_close(runner.decode(token, lens, caches[1]), want, atol=1e-5, rtol=0)
    # traced whole, as the compiled engine runs it (aot_eager functionalizes as inductor does)
    compiled = torch.compile(runner.decode, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(token, lens, caches[2]), want, atol=1e-5, rtol=0)
