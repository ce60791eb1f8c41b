"""Splitting a mini-batch into micro-batches: by a fixed count, or by a token budget (dynamic batch size).

Both return lists of row indices into the mini-batch; ``restore_order`` puts per-micro-batch outputs back in
the original row order. Working on indices keeps these pure and lets the caller slice any Batch with them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from hybridflow.protocol import Batch
from hybridflow.utils.dist import all_reduce_max


def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive rows, ``micro_batch_size`` at a time (the last micro-batch may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, num_rows))) for s in range(0, num_rows, micro_batch_size)]


def _balanced_partition(seq_lens: Sequence[int], k: int) -> list[list[int]]:
    """Longest-processing-time-first: each row, longest first, goes to the bin with the fewest tokens."""
    heap = [(0, b) for b in range(k)]  # (tokens, bin)
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
        tokens, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (tokens + seq_lens[i], b))
    # Keep rows in their original order inside a bin and order bins by first row: deterministic output.
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def min_micro_batches(seq_lens: Sequence[int], max_token_len: int) -> int:
    """The fewest micro-batches for which a balanced split keeps every one within ``max_token_len`` tokens."""
    longest = max(seq_lens, default=0)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the per-GPU token budget of {max_token_len}; raise "
            "ppo_max_token_len_per_gpu (or log_prob_max_token_len_per_gpu) to at least prompt + response length"
        )
    k = max(1, -(-sum(seq_lens) // max_token_len))  # ceil: the lower bound
    while k < len(seq_lens) and any(
        sum(seq_lens[i] for i in b) > max_token_len for b in _balanced_partition(seq_lens, k)
    ):
        k += 1
    return min(k, max(1, len(seq_lens)))


def token_budget_micro_batches(
    seq_lens: Sequence[int], max_token_len: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Balanced micro-batches of at most ``max_token_len`` tokens each.

    ``num_micro_batches`` forces the count (data-parallel ranks agree on the maximum of their minimums so
    every rank runs the same number of forward/backward passes); by default the minimum is used.
    """
    k = min_micro_batches(seq_lens, max_token_len)
    if num_micro_batches is not None:
        if num_micro_batches < k:
            raise ValueError(f"num_micro_batches={num_micro_batches} is below the minimum {k} for the budget")
        k = min(num_micro_batches, len(seq_lens))
    return _balanced_partition(seq_lens, k)


def restore_order(outputs: Sequence[torch.Tensor], indices: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (rows in ``indices`` order) back into the original row order."""
    flat = [i for b in indices for i in b]
    merged = torch.cat(list(outputs), dim=0)  # (rows, ...)
    inverse = torch.empty(len(flat), dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
    return merged[inverse.to(merged.device)]


def micro_batch_indices(
    batch: Batch, micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int
) -> list[list[int]]:
    """Row indices of each micro-batch; with a token budget, every rank runs the same number of them."""
    if not use_dynamic_bsz:
        return fixed_micro_batches(len(batch), micro_batch_size)
    seq_lens = batch["attention_mask"].sum(-1).tolist()
    k = int(all_reduce_max(torch.tensor(min_micro_batches(seq_lens, max_token_len))))
    return token_budget_micro_batches(seq_lens, max_token_len, num_micro_batches=k)


def check_batch(batch: Batch, keys: tuple[str, ...]) -> None:
    """Raise a clear error when the batch lacks a key the stage reads."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch lacks {missing}; it has {batch.keys()}")
