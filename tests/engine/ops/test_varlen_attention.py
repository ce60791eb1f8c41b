"""The packed varlen attention op: exact against per-sequence SDPA (values and gradients), compile-safe."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridflow.engine.ops.packed_attention import per_sequence_attention
from hybridflow.engine.ops.varlen_attention import varlen_attention


def packed(
    lengths: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    seed: int,
    device: str = "cpu",
    dtype=torch.float32,
):
    """Random packed q/k/v (S, H|KVH, D) with gradients, plus the bounds on host and device."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    q, k, v = (
        torch.randn(S, h, dim, generator=g).to(device, dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    bounds = torch.tensor([0, *itertools.accumulate(lengths)])
    return q, k, v, bounds.to(device, torch.int32), bounds


def reference(q, k, v, bounds, scale=None):
    """Per-sequence causal SDPA (the eager path of packed_attention); returns (S, H, D)."""
    out = per_sequence_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], bounds.tolist(), scale, 0.0
    )  # (1, S, H, D)
    return out[0]


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads"), [([5, 1, 9, 3], 4, 2), ([12], 3, 1), ([1, 1], 2, 2)]
)
def test_matches_per_sequence_sdpa_values_and_gradients(lengths, heads, kv_heads) -> None:
    q, k, v, cu, bounds = packed(lengths, heads, kv_heads, 8, seed=len(lengths))
    grad = torch.randn(sum(lengths), heads, 8, generator=torch.Generator().manual_seed(7))
    got = varlen_attention(q, k, v, cu, bounds, scale=0.3)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want = reference(q, k, v, bounds, scale=0.3)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"d{name} differs")


def test_no_attention_across_sequences() -> None:
    q, k, v, cu, bounds = packed([4, 6], 2, 1, 8, seed=3)
    joint = varlen_attention(q, k, v, cu, bounds)
    with torch.no_grad():
        v2 = v.detach().clone()
        v2[:4] += 5.0  # change only the first sequence's values
    moved = varlen_attention(q, k, v2, cu, bounds)
    torch.testing.assert_close(moved[4:], joint[4:])  # the second sequence does not see them
    assert not torch.allclose(moved[:4], joint[:4])


def test_compiles_whole_and_new_bounds_do_not_recompile() -> None:
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v, cu, bounds):
        return (varlen_attention(q * 2.0, k, v, cu, bounds) + 1.0).sum()

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    for seed, lengths in enumerate(([3, 6], [7, 1, 2], [4, 4, 4, 1])):  # S never equals D (duck sizing)
        q, k, v, cu, bounds = packed(lengths, 4, 2, 8, seed)
        torch.testing.assert_close(compiled(q, k, v, cu, bounds), layer(q, k, v, cu, bounds))
    assert len(graphs) == 1, f"{len(graphs) - 1} recompiles for new sequence bounds"


def test_rejects_bad_heads_and_device_bounds() -> None:
    q, k, v, cu, bounds = packed([3], 3, 2, 8, seed=0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, v, cu, bounds)
    q, k, v, cu, bounds = packed([3], 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="CPU tensor"):
        varlen_attention(q, k, v, cu, bounds.to("meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_kernels_match_float32_math_on_gpu() -> None:
    lengths = [300, 17, 1, 700]
    q, k, v, cu, bounds = packed(lengths, 14, 2, 64, seed=1, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(sum(lengths), 14, 64, device="cuda", dtype=torch.bfloat16)
    got = varlen_attention(q, k, v, cu, bounds)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = reference(q32, k32, v32, bounds)
    want_grads = torch.autograd.grad(want, (q32, k32, v32), grad.float())
    assert (got.float() - want).abs().mean() < 2e-3
    for a, b in zip(got_grads, want_grads):
        assert (a.float() - b).abs().mean() < 2e-3 * max(1.0, b.abs().mean().item())
