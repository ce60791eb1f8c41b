"""Token balancing over data-parallel replicas (``trainer.balance_batch``, verl's ``_balance_batch``).

Each model replica of a role computes on a contiguous share of the step's samples, and the step waits for the
slowest, so a share holding most of the long responses sets the pace. Reordering the samples so that every
share holds about the same number of tokens (same count of samples each, as the split needs) evens the
replicas out. The roles may have different data-parallel sizes (an actor at tp=2 beside an FSDP2 critic):
balancing over the least common multiple of them (``balance_parts``) makes each role's share a run of
equally heavy parts. The order changes nothing else: advantages group samples by ``uid``, and every later
stage keeps rows aligned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def balance_parts(dp_sizes: Iterable[int]) -> int:
    """The parts to balance over: the least common multiple of the roles' data-parallel sizes (each divides
    the world, so this does too)."""
    return math.lcm(*dp_sizes)


def balanced_groups(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` groups of equal size with close token sums (longest first, to the
    lightest group that has room: the LPT rule under a size cap)."""
    n = len(lengths)
    assert parts >= 1 and n % parts == 0, f"{n} samples do not split into {parts} equal groups"
    cap = n // parts
    sums, groups = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        open_ = [p for p in range(parts) if len(groups[p]) < cap]
        p = min(open_, key=lambda p: (sums[p], p))
        groups[p].append(i)
        sums[p] += lengths[i]
    return [sorted(g) for g in groups]


def balance_order(lengths: Sequence[int], parts: int) -> tuple[np.ndarray, dict[str, float]]:
    """The row order giving part r the r-th balanced group, and the per-part token totals before and after.

    The metrics use verl's names: ``global_seqlen/{min,max,minmax_diff}`` of the contiguous parts the
    replicas would have had, ``global_seqlen/balanced_{min,max}`` after, and ``global_seqlen/mean``.
    """
    groups = balanced_groups(lengths, parts)
    size = len(lengths) // parts
    before = [sum(lengths[r * size : (r + 1) * size]) for r in range(parts)]
    after = [sum(lengths[i] for i in g) for g in groups]
    metrics = {
        "global_seqlen/min": float(min(before)),
        "global_seqlen/max": float(max(before)),
        "global_seqlen/minmax_diff": float(max(before) - min(before)),
        "global_seqlen/balanced_min": float(min(after)),
        "global_seqlen/balanced_max": float(max(after)),
        "global_seqlen/mean": float(sum(before) / parts),
    }
    return np.array([i for g in groups for i in g], dtype=np.int64), metrics
