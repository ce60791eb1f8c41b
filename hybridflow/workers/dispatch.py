"""How the driver's calls reach the ranks of a worker group: split by data-parallel rank, broadcast, rank 0.

``split_batch`` cuts a Batch into one contiguous chunk per rank, padding it first (by repeating its last
rows) when it does not divide; ``merge_batches`` concatenates the ranks' outputs in rank order and strips the
padding. Samples of one prompt stay together as long as the batch's size divides by n x world, which the
config's batch sizes guarantee; padding only happens for odd validation sizes.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from hybridflow.protocol import Batch


class Dispatch(Enum):
    """How one method's call is spread over the group's ranks."""

    SPLIT = "split"  # each rank gets its data-parallel chunk; outputs are concatenated in rank order
    BROADCAST = "broadcast"  # every rank gets the same arguments; rank 0's result is returned
    RANK0 = "rank0"  # only rank 0 is called


def split_batch(batch: Batch, world: int) -> tuple[list[Batch], int]:
    """``world`` contiguous chunks of ``batch`` (padded to a multiple of ``world``) and the pad count."""
    if world == 1:
        return [batch], 0
    padded, pad = batch.pad_to_divisor(world)
    return padded.chunk(world), pad


def merge_batches(outputs: list[Batch], pad: int) -> Batch:
    """The ranks' outputs concatenated in rank order, without the padding rows."""
    merged = outputs[0] if len(outputs) == 1 else Batch.concat(outputs)
    return merged.unpad(pad) if pad else merged


def first_result(results: list[Any]) -> Any:
    """Rank 0's result (the metrics of an update are reduced over all ranks already)."""
    return results[0]
