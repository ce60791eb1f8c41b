"""Drives ``LlamaRunner``'s prefill and decode directly, without the engine's scheduler: a paged KV cache in
which row r of a call owns its own run of blocks (block 0 is the device's scratch block, as in the engine),
so a test addresses sequences by row as the engine addresses them by block table."""

from __future__ import annotations

import torch

from hybridflow.engine.rollout.kv_cache import PagedKVCache


class RowCache:
    """``rows`` sequences of up to ``max_len`` positions in blocks of ``block_size``, for ``runner``."""

    def __init__(self, runner, rows: int, max_len: int, block_size: int = 4, fp8: bool = False) -> None:
        self.runner = runner
        self.width = -(-max_len // block_size)  # blocks per row
        sizes = (runner.num_layers, rows * self.width + 1, block_size, runner.num_kv_heads, runner.head_dim)
        self.cache = PagedKVCache(*sizes, runner.dtype, runner.device, fp8=fp8)
        self.tables = torch.arange(rows * self.width).view(rows, self.width) + 1  # (rows, width) on the host

    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: list[int] | torch.Tensor | None = None,
        starts: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Right-padded ``ids`` (b, t) of ``lengths`` into ``rows`` (default 0..b-1) from ``starts`` (default
        0: a start > 0 continues a row's cached prefix); the logits after each row's last token (b, V)."""
        b = ids.shape[0]
        rows = torch.arange(b) if rows is None else torch.as_tensor(rows)
        starts = torch.zeros(b, dtype=torch.long) if starts is None else torch.as_tensor(starts)
        return self.runner.prefill_paged(ids, lengths.cpu(), starts, self.cache, self.tables[rows])

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int] | None = None
    ) -> torch.Tensor:
        """One decode step: token b of row ``rows[b]`` (default b) written at ``positions[b]``; logits
        (B, V)."""
        rows = list(range(tokens.shape[0])) if rows is None else rows
        tables = self.tables[rows].to(self.runner.device)
        return self.runner.decode_paged(tokens, positions, self.cache, tables)

    def kv(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``row`` in ``layer``, in position order: each (width * block_size, KVH, D)."""
        k, v = self.cache.gather(layer, self.tables[row : row + 1].to(self.runner.device))
        return k[0], v[0]
