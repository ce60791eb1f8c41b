"""The FP8 paged KV cache (``rollout.kv_cache_dtype=fp8``): quantised K and V with per-(layer, KV head) scales.

Quantise-then-dequantise stays within 3% of the values' norm (e4m3 keeps 3 mantissa bits: at most 1/16 relative
error per element, ~2.5% RMS over a Gaussian); calibration sets each head's scale from its own largest value
(times the margin); decode attention through the FP8 cache (the torch reference, and the Triton kernel in its
CPU interpreter) is close to the float cache's; a block takes half the bytes of bf16, so a budget holds twice
the blocks.
"""

from __future__ import annotations

import pytest
import torch
from support.triton_util import needs_kernels

from hybridflow.engine.ops.fp8 import FP8, FP8_MAX
from hybridflow.engine.rollout import decode_attention as da
from hybridflow.engine.rollout.kv_cache import (
    KV_SCALE_MARGIN,
    PagedKVCache,
    calibrate_kv_scales,
    paged_decode_attention,
)
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.session import Session, blocks_that_fit
from hybridflow.models import build_tiny_model

LAYERS, BLOCKS, BS, KVH, D = 2, 16, 4, 2, 16


def _kv(n: int, seed: int, spread: tuple[float, float] = (1.0, 8.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of n tokens (n, KVH, D), each head with its own magnitude (heads differ by ``spread``)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor(spread)[:, None]  # (KVH, 1)
    return torch.randn(n, KVH, D, generator=g) * mag, torch.randn(n, KVH, D, generator=g) * mag / 2


def _caches(lengths: list[int], seed: int = 0) -> tuple[PagedKVCache, PagedKVCache, torch.Tensor]:
    """A float and an FP8 cache holding the same K and V of rows of ``lengths``, and the rows' tables."""
    width = -(-max(lengths) // BS)
    tables = torch.stack([torch.arange(width) + 1 + r * width for r in range(len(lengths))])  # (B, width)
    float_cache = PagedKVCache(LAYERS, BLOCKS, BS, KVH, D)
    fp8_cache = PagedKVCache(LAYERS, BLOCKS, BS, KVH, D, fp8=True)
    for layer in range(LAYERS):
        ks, vs, places = [], [], []
        for row, n in enumerate(lengths):
            k, v = _kv(n, seed + 10 * layer + row)
            ks.append(k)
            vs.append(v)
            places.append(float_cache.locate(tables, torch.full((n,), row), torch.arange(n)))
        calibrate_kv_scales(torch.cat(ks), torch.cat(vs), fp8_cache.scales, layer)
        for k, v, where in zip(ks, vs, places):
            float_cache.write(layer, k, v, where)
            fp8_cache.write(layer, k, v, where)
    return float_cache, fp8_cache, tables


def test_quantise_then_dequantise_is_within_3_percent_of_the_norm() -> None:
    float_cache, fp8_cache, tables = _caches([13, 6, 9])
    assert fp8_cache.storage.dtype == FP8 and fp8_cache.storage.element_size() == 1
    assert fp8_cache.dtype == torch.float32  # what reads return
    for layer in range(LAYERS):
        want_k, want_v = float_cache.gather(layer, tables)
        got_k, got_v = fp8_cache.gather(layer, tables)
        assert got_k.dtype == torch.float32
        for got, want in ((got_k, want_k), (got_v, want_v)):
            for h in range(KVH):  # each head against its own norm: the scales are per head
                err = (got[:, :, h] - want[:, :, h]).norm() / want[:, :, h].norm()
                assert 0 < err < 0.03, (layer, h, err)


def test_calibration_sets_each_heads_scale_from_its_largest_value() -> None:
    _, fp8_cache, _ = _caches([13, 6, 9])
    s = fp8_cache.scales  # (layers, 2, KVH)
    assert s.shape == (LAYERS, 2, KVH) and s.dtype == torch.float32
    assert (s[:, :, 1] > 4 * s[:, :, 0]).all()  # head 1's values are 8x head 0's: its own scale
    k, _ = _kv(13, 0)  # layer 0's first row: the calibration covered it
    assert (k.abs().amax(dim=(0, 2)) <= s[0, 0] * FP8_MAX / KV_SCALE_MARGIN + 1e-6).all()
    # the largest stored value sits at 448 / margin: headroom for decode tokens larger than the prefill's
    stored = fp8_cache.storage[0, 0].float().abs().max()
    assert FP8_MAX / KV_SCALE_MARGIN / 1.1 < stored <= FP8_MAX / KV_SCALE_MARGIN


def test_values_beyond_the_range_saturate_instead_of_overflowing() -> None:
    cache = PagedKVCache(1, 2, BS, KVH, D, fp8=True)
    k, v = _kv(3, 1)
    calibrate_kv_scales(k, v, cache.scales, 0)
    where = cache.locate(torch.tensor([[1]]), torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]))
    cache.write(0, 1000 * k[:2], v[:2], where)  # 1000x the calibrated range
    got_k, _ = cache.gather(0, torch.tensor([[1]]))
    assert torch.isfinite(got_k).all()
    assert got_k[0, :2].abs().amax() == pytest.approx(float(FP8_MAX * cache.scales[0, 0].max()))


def test_decode_attention_through_the_fp8_cache_is_close_to_the_float_cache() -> None:
    lengths = torch.tensor([13, 6, 9])
    float_cache, fp8_cache, tables = _caches(lengths.tolist())
    # (B, H, D), 2 query heads per KV head; logits of a few units, as a trained model's (not one-hot softmax)
    q = torch.randn(3, 2 * KVH, D, generator=torch.Generator().manual_seed(5)) / 4
    for layer in range(LAYERS):
        want = paged_decode_attention(q, float_cache, layer, tables, lengths, D**-0.5)
        got = paged_decode_attention(q, fp8_cache, layer, tables, lengths, D**-0.5)
        # A convex mix of V rows each ~2.6% off (RMS of e4m3 rounding), with weights from logits that K's
        # ~2.6% moves: two independent errors, ~3.7% in quadrature; the float cache's output within 5%.
        assert ((got - want).norm() / want.norm()) < 0.05


@needs_kernels(da)
def test_the_triton_kernel_dequantises_as_the_reference_does() -> None:
    """The fused kernel on an FP8 cache: RoPE, the quantised write of the step's k and v, attention over the
    blocks with the heads' scales; against the reference attention over the cache the kernel wrote. CPU:
    float32 in Triton's interpreter; CUDA: bf16 (the kernel's dtype there), to bf16's tolerance."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    lengths = [13, 6, 9]
    _, cache, tables = _caches(lengths)
    cache.storage, cache.scales, cache.dtype = cache.storage.to(device), cache.scales.to(device), dtype
    tables = tables.to(device)
    batch, heads = len(lengths), 2 * KVH
    g = torch.Generator().manual_seed(7)
    q, k_new, v_new = (torch.randn(batch, h, 1, D, generator=g) for h in (heads, KVH, KVH))  # (B, h, 1, D)
    angles = torch.rand(batch, D // 2, generator=g) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (B, D)
    q, k_new, v_new, cos, sin = (x.to(device, dtype) for x in (q, k_new, v_new, cos, sin))
    positions = torch.tensor(lengths, device=device)  # each row's new token goes right after its cached ones
    for layer in range(LAYERS):
        got = da.decode_attention_rope_paged(
            q, k_new, v_new, cos, sin, cache.storage, layer, positions, tables, D**-0.5, cache.scales
        )  # (B, H, 1, D)
        # The kernel wrote the new token: its K is the rotated k quantised with the head's scale.
        where = cache.locate(tables, torch.arange(batch, device=device), positions)
        written = cache.storage[layer, 0][where[0], :, where[1]].float()  # (B, KVH, D) in scale units
        want_k = da.rope_reference(k_new, cos, sin)[:, :, 0].float() / cache.scales[layer, 0][:, None]
        assert ((written - want_k).abs() <= want_k.abs() / 16 + 2**-10).all()  # half an e4m3 step
        q_rot = da.rope_reference(q, cos, sin)[:, :, 0]  # (B, H, D)
        want = paged_decode_attention(q_rot, cache, layer, tables, positions + 1, D**-0.5)
        tol = 3e-2 if cuda else 1e-4
        torch.testing.assert_close(got[:, :, 0], want, atol=tol, rtol=tol)


def test_an_fp8_block_takes_half_the_bytes_so_a_budget_holds_twice_the_blocks() -> None:
    runner = LlamaRunner(build_tiny_model("qwen2", vocab_size=64), dtype=torch.bfloat16)
    bf16, fp8 = Session.block_bytes(runner, 16), Session.block_bytes(runner, 16, fp8=True)
    assert bf16 == 2 * fp8 == 2 * (2 * runner.num_layers * 16 * runner.num_kv_heads * runner.head_dim)
    budget = 1000 * bf16
    assert blocks_that_fit(budget, fp8) + 1 == 2 * (blocks_that_fit(budget, bf16) + 1)  # + the scratch block
