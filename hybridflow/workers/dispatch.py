"""How the driver's calls reach the ranks of a worker group: split by data-parallel rank, broadcast, rank 0.

``split_batch`` cuts a Batch into one contiguous chunk per rank, padding it first (by repeating its first
rows) when it does not divide; ``merge_batches`` concatenates the ranks' outputs in rank order and strips the
padding rows. Samples of one prompt stay together as long as the batch's size divides by n x world, which the
config's batch sizes guarantee; padding rows only happen for odd validation sizes.

The ranks' shares need not have the same width: a rank lays out its samples with its own prompts' longest
length, so merging widens each share per the training layout (``engine.sequences.layout_padding``) first.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from hybridflow.protocol import Batch
from hybridflow.protocol.batch import Padding


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


def merge_batches(outputs: list[Batch], pad: int, widths: Padding | None = None) -> Batch:
    """The ranks' outputs concatenated in rank order, without the ``pad`` padding rows; the fields named in
    ``widths`` are first widened to the widest share (see ``Batch.concat``)."""
    merged = outputs[0] if len(outputs) == 1 else Batch.concat(outputs, pad=widths)
    return merged.unpad(pad) if pad else merged


def first_result(results: list[Any]) -> Any:
    """Rank 0's result (the metrics of an update are reduced over all ranks already)."""
    return results[0]
