"""The layer math's K-split projections: the same values as F.linear, eager and traced, in the runner."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from support.row_cache import RowCache
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.engine.rollout.blocks import KSplits, split_linear
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


def test_k_splits_parse_names_the_bad_entry() -> None:
    assert KSplits.parse("o=2, down=4") == KSplits(o=2, down=4)
    assert KSplits.parse("") == KSplits()
    for bad in ("up=2", "o=0", "o", "down=x"):
        with pytest.raises(ValueError, match=repr(bad.split(",")[0])):
            KSplits.parse(bad)


class BmmCount(TorchDispatchMode):
    """Counts the aten.bmm calls made under it."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.bmm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "k_splits", [KSplits(down=4), KSplits(o=2, gate_up=2), KSplits(qkv=2, o=4, gate_up=4, down=8)]
)
def test_runner_decode_with_split_projections_equals_cublas_path(k_splits: KSplits) -> None:
    model = build_tiny_model("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, seed=1)
    # float64 compute makes the runner cast, so q/k/v and gate/up are fused groups that split_linear can take
    runner = LlamaRunner(model.eval(), dtype=torch.float64)
    assert len(runner.layers[0].qkv) == 1 and len(runner.layers[0].gate_up) == 1
    assert runner.config.intermediate_size % 4 == 0  # else split_linear falls back to F.linear
    caches = [RowCache(runner, 2, 16) for _ in range(3)]
    ids, lens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 5]]), torch.tensor([4, 2])
    for cache in caches:
        cache.prefill(ids, lens)
    token, tables = torch.tensor([10, 11]), caches[0].tables  # the same layout in every cache
    want = caches[0].decode(token, lens)
    runner.k_splits = k_splits
    with BmmCount() as bmm:
        got = caches[1].decode(token, lens)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    split_groups = sum(n > 1 for n in dataclasses.astuple(k_splits))
    assert bmm.calls == split_groups * runner.num_layers  # every split group took the batched path
    # traced whole, as the compiled engine runs it (aot_eager functionalizes as inductor does)
    compiled = torch.compile(runner.decode_paged, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(token, lens, caches[2].cache, tables), want, atol=1e-10, rtol=0)
