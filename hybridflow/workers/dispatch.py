"""How the driver's calls reach a role's ranks: one share of a batch per model replica.

A role's W ranks form dp model replicas: in its training view a replica is tp x pp ranks or a Ulysses group of
sp ranks, in the actor's generation view a rollout group of tp ranks; each role has its own dp (an actor at
tp=2 on 4 ranks has dp=2 while an FSDP2 critic beside it has dp=4). ``split_batch`` cuts a Batch into dp
contiguous shares, padding it first (by repeating its first rows) when dp does not divide it; every rank of
replica d computes on share d, and only the replica's source rank sends its result back, which
``merge_batches`` concatenates in replica order without the padding rows. Samples of one prompt stay together
as long as the batch's size divides by n x dp, which the config's batch sizes guarantee (dp divides the
world); padding rows only happen for odd validation sizes.

The replicas' shares need not have the same width: a replica lays out its samples with its own prompts'
longest length, so merging widens each share per the training layout (``engine.sequences.layout_padding``).

Each rank tells the driver once where it stands (``DataCoord``: its replica, dp, and whether it is the source);
``train_coord`` and ``generate_coord`` read it from the views, the one place the workers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridflow.protocol import Batch
from hybridflow.protocol.batch import Padding

if TYPE_CHECKING:
    from hybridflow.engine import GenerateView, ParallelDims


@dataclass(frozen=True)
class DataCoord:
    """One rank's place in a role's data: the replica (data-parallel coordinate) whose share it computes on,
    the number of replicas, and whether it is the rank that returns the replica's results."""

    replica: int
    dp: int
    source: bool


SINGLE = DataCoord(0, 1, True)  # a group of one rank


def train_coord(view: ParallelDims, rank: int) -> DataCoord:
    """``rank``'s coordinate in a training view; the replica's first rank returns its results (a pipeline's
    last stage broadcasts its outputs over the replica, so every rank of a replica holds them)."""
    replica = view.coords(rank)[2]
    return DataCoord(replica, view.dp, view.replica_ranks(replica)[0] == rank)


def generate_coord(view: GenerateView, rank: int) -> DataCoord:
    """``rank``'s coordinate in the generation view: its rollout group, whose tensor-parallel rank 0 returns
    the group's samples (every rank of a group draws the same tokens)."""
    return DataCoord(view.dp_rank(rank), view.dp, view.tp_rank(rank) == 0)


@dataclass(frozen=True)
class DataLayout:
    """A role's data over a group's ranks: each rank's replica, and the rank returning each replica's results."""

    replica_of: tuple[int, ...]  # per rank
    sources: tuple[int, ...]  # per replica

    @property
    def dp(self) -> int:
        """The number of replicas: the shares a batch is split into."""
        return len(self.sources)

    @staticmethod
    def of(coords: Sequence[DataCoord]) -> DataLayout:
        """The layout of the ranks' coordinates (in rank order); raises when they do not form one layout."""
        dp = coords[0].dp
        sources = [[r for r, c in enumerate(coords) if c.replica == d and c.source] for d in range(dp)]
        ok = all(c.dp == dp and 0 <= c.replica < dp for c in coords) and all(len(s) == 1 for s in sources)
        assert ok, f"the ranks' data coordinates do not form one layout: {list(coords)}"
        return DataLayout(tuple(c.replica for c in coords), tuple(s[0] for s in sources))


def split_batch(batch: Batch, parts: int) -> tuple[list[Batch], int]:
    """``parts`` contiguous chunks of ``batch`` (padded to a multiple of ``parts``) and the pad count."""
    if parts == 1:
        return [batch], 0
    padded, pad = batch.pad_to_divisor(parts)
    return padded.chunk(parts), pad


def merge_batches(outputs: list[Batch], pad: int, widths: Padding | None = None) -> Batch:
    """The replicas' outputs concatenated in order, without the ``pad`` padding rows; the fields named in
    ``widths`` are first widened to the widest share (see ``Batch.concat``)."""
    merged = outputs[0] if len(outputs) == 1 else Batch.concat(outputs, pad=widths)
    return merged.unpad(pad) if pad else merged
