"""The paged KV cache's device side (issue 41, second part): one pool of fixed-size blocks per layer, written
and read through block tables, with the CPU reference of decode attention over it. Not yet used by the
engine (``kv_cache.py``'s slots still are); ``block_pool.BlockPool`` decides which block holds what.

Layout: (layers, 2, blocks, block_size, KV heads, head dim), K at [:, 0] and V at [:, 1]. A position p of a
sequence lives at flat row ``table[p // block_size] * block_size + p % block_size`` of its layer's
(blocks * block_size, KVH, D) view: a token's write is one indexed store, whatever block it falls in, and a
block is one contiguous (block_size, KVH, D) run that a paged kernel reads whole. Block tables are fixed-shape
(B, max_blocks) tensors (unused entries any valid block id, masked by the lengths), so a decode step's shapes
do not change as sequences grow: what CUDA graphs need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PagedKVCache:
    """K and V of ``num_blocks`` blocks of ``block_size`` positions per layer, in one allocation."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = dict(layers=num_layers, blocks=num_blocks, block_size=block_size, kv_heads=num_kv_heads)
        bad = {k: v for k, v in {**sizes, "head_dim": head_dim}.items() if v < 1}
        if bad:
            raise ValueError(f"PagedKVCache sizes must be >= 1, got {bad}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.storage = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )  # (layers, 2, N, bs, KVH, D)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers (K and V): the unit a memory budget is divided by."""
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    def rows(self, layer: int, which: int) -> torch.Tensor:
        """Layer ``layer``'s K (``which`` 0) or V (1) as (blocks * block_size, KVH, D) rows, a view."""
        return self.storage[layer, which].flatten(0, 1)

    def slot_rows(self, tables: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The flat rows of ``positions`` (n,) of the sequences ``seq`` (n,) whose block tables are ``tables``
        (B, max_blocks): where a write or a read of those tokens goes."""
        blocks = tables[seq, positions // self.block_size]  # (n,)
        return blocks * self.block_size + positions % self.block_size  # (n,)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Store K and V of n tokens, each (n, KVH, D), at ``rows`` (n,) of ``layer`` (from ``slot_rows``)."""
        self.rows(layer, 0)[rows] = k
        self.rows(layer, 1)[rows] = v

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every layer: a forked sequence's own copy of a partial block."""
        self.storage[:, :, dst] = self.storage[:, :, src]

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every sequence's blocks in position order, each (B, max_blocks * block_size, KVH, D)."""
        k = self.storage[layer, 0][tables]  # (B, M, bs, KVH, D)
        v = self.storage[layer, 1][tables]
        return k.flatten(1, 2), v.flatten(1, 2)


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D): each sequence's newest query, its K and V already written
    cache: PagedKVCache,
    layer: int,
    tables: torch.Tensor,  # (B, max_blocks)
    lengths: torch.Tensor,  # (B,) positions each sequence attends to (its newest token included)
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention through block tables, the CPU reference: gather each sequence's blocks, mask the
    positions past its length, and attend with grouped KV heads. Returns (B, H, D)."""
    k, v = cache.gather(layer, tables)  # (B, L, KVH, D), L = max_blocks * block_size
    positions = torch.arange(k.shape[1], device=q.device)  # (L,)
    mask = positions[None, :] < lengths[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (B, H, 1, D)
        k.transpose(1, 2),  # (B, KVH, L, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],  # (B, 1, 1, L)
        scale=scale,
        enable_gqa=True,
    )  # (B, H, 1, D)
    return out.squeeze(2)
