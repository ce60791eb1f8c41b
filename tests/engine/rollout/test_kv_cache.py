"""The paged KV cache's device side: K and V written through block tables the block pool hands out (shared
prompt blocks, a copied partial block, ragged lengths) are read back by decode attention exactly as dense
per-sequence attention over the same keys and values (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.triton_util import needs_kernels

from hybridflow.engine.rollout import decode_attention
from hybridflow.engine.rollout.block_pool import BlockPool
from hybridflow.engine.rollout.kv_cache import PagedKVCache, paged_decode_attention

LAYERS, KVH, H, D, BS = 2, 2, 4, 8, 4
needs_kernel = needs_kernels(decode_attention)


def _kv(token: int, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token's K and V at a position: a fixed function, so shared prefixes hold equal values."""
    g = torch.Generator().manual_seed(token * 7919 + position * 31 + layer)
    return torch.randn(KVH, D, generator=g), torch.randn(KVH, D, generator=g)


def _dense_attention(q: torch.Tensor, tokens: list[int], layer: int) -> torch.Tensor:
    k, v = zip(*(_kv(t, p, layer) for p, t in enumerate(tokens)))
    k, v = torch.stack(k).transpose(0, 1), torch.stack(v).transpose(0, 1)  # (KVH, L, D)
    out = F.scaled_dot_product_attention(q[:, None, :], k, v, enable_gqa=True)  # (H, 1, D)
    return out[:, 0]


def _write(cache: PagedKVCache, table: list[int], tokens: list[int], start: int) -> None:
    """Write positions ``start``.. of one sequence through its block table (what prefill and decode do)."""
    tables = torch.tensor([table])
    positions = torch.arange(start, len(tokens))
    where = cache.locate(tables, torch.zeros_like(positions), positions)
    for layer in range(LAYERS):
        k, v = zip(*(_kv(tokens[p], p, layer) for p in positions.tolist()))
        cache.write(layer, torch.stack(k), torch.stack(v), where)


def test_decode_attention_through_block_tables_equals_dense_attention() -> None:
    pool = BlockPool(num_blocks=24, block_size=BS)
    cache = PagedKVCache(LAYERS, 24, BS, KVH, D)
    cache.storage.normal_()  # stale values everywhere: masking must keep them out
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [19]]
    seqs: list[tuple[list[int], list[int]]] = []  # (block table, tokens)
    for g, prompt in enumerate(prompts):
        first = pool.allocate(prompt)
        _write(cache, first.blocks, prompt, first.cached_tokens)  # the prompt's prefill, once
        samples = [first]
        for _ in range(2):  # n = 3: the samples share the full blocks; a partial one is copied
            table, copy = pool.fork(first)
            if copy is not None:
                cache.copy_block(*copy)
            samples.append(table)
        for k, table in enumerate(samples):
            response = [100 + 10 * g + k + i for i in range(k * 3 + 1)]  # ragged, divergent
            tokens = prompt + response
            pool.append(table, response, tokens)
            _write(cache, table.blocks, tokens, len(prompt))
            seqs.append((table.blocks, tokens))
    width = max(len(blocks) for blocks, _ in seqs)
    tables = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks, _ in seqs])  # fixed shape
    lengths = torch.tensor([len(tokens) for _, tokens in seqs])
    q = torch.randn(len(seqs), H, D, generator=torch.Generator().manual_seed(0))
    for layer in range(LAYERS):
        got = paged_decode_attention(q, cache, layer, tables, lengths)
        want = torch.stack([_dense_attention(q[i], tokens, layer) for i, (_, tokens) in enumerate(seqs)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sizes_and_the_bytes_of_a_block() -> None:
    assert PagedKVCache.bytes_per_block(24, 16, 2, 64, torch.bfloat16) == 2 * 24 * 16 * 2 * 64 * 2
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(2, 4, 0, 2, 8)


@needs_kernel
@pytest.mark.parametrize("page", [4, 16])
def test_the_fused_kernel_through_block_tables_equals_the_reference(page: int) -> None:
    """RoPE, the write of the new token and attention in one launch over scattered blocks (float32 in the
    interpreter, bf16 on CUDA): the output, and the cache written only at each row's position."""
    from hybridflow.engine.rollout import decode_attention as da

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    blocks, width, batch, heads, kvh, dim = 40, 6, 5, 14, 2, 32
    cache = PagedKVCache(2, blocks, page, kvh, dim, dtype, device)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=g))
    tables = torch.randperm(blocks, generator=g)[: batch * width].view(
        batch, width
    )  # rows own distinct blocks
    positions = torch.tensor([0, 1, page, width * page - 1, 2 * page + 1])  # block edges and a full row
    q = torch.randn(batch, heads, 1, dim, generator=g)
    new = da.NewToken(
        *(torch.randn(batch, kvh, 1, dim, generator=g) for _ in range(2)), *_rope(positions, dim)
    )
    to = dict(device=device, dtype=dtype)
    q, new = q.to(**to), da.NewToken(*(t.to(**to) for t in new))
    tables, positions = tables.to(device), positions.to(device)
    want_cache = PagedKVCache(2, blocks, page, kvh, dim, dtype, device)
    want_cache.storage.copy_(cache.storage)
    where = want_cache.locate(tables, torch.arange(batch, device=device), positions)
    want_cache.write(1, da.rope_reference(new.k, new.cos, new.sin)[:, :, 0], new.v[:, :, 0], where)
    want = paged_decode_attention(
        da.rope_reference(q, new.cos, new.sin)[:, :, 0], want_cache, 1, tables, positions + 1, dim**-0.5
    )
    for splits in (1, 3):
        got_cache = PagedKVCache(2, blocks, page, kvh, dim, dtype, device)
        got_cache.storage.copy_(cache.storage)
        got = torch.ops.hybridflow.decode_attention_rope_paged(
            q, new.k, new.v, new.cos, new.sin, got_cache.storage, 1, positions, tables, dim**-0.5
        ) if splits == 1 else da.decode_attention_triton(
            q, got_cache.storage[1, 0], got_cache.storage[1, 1], positions, dim**-0.5,
            new=new, table=tables, block_n=16, num_splits=splits,
        )  # fmt: skip
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[:, :, 0].float(), want.float(), **tol)
        torch.testing.assert_close(got_cache.storage[1, 1], want_cache.storage[1, 1], atol=0, rtol=0)  # v
        assert torch.equal(got_cache.storage[0], want_cache.storage[0])  # the other layer is untouched


def _rope(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, dim) of rotate-half RoPE at ``positions`` (base 10000)."""
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = positions[:, None].float() * inv  # (B, dim / 2)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()
