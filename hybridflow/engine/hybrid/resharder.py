"""Runs a ``ReshardPlan`` at every train -> generate switch: one all-to-all per bucket, cast on the way.

Each rank packs the boxes it sends, already cast to the generation dtype (half the bytes of float32
masters in bf16), into one flat buffer ordered by receiver; ``all_to_all_single`` delivers exactly the plan's
bytes; the receiver unpacks them into its generation buffers in place, so tensors bound by the rollout
runner (and CUDA graphs captured on them) stay valid. A rank's own part never leaves it (a local copy).
Buffers the plan leaves partly unfilled (the padding rows of the last vocabulary slice, a row-parallel bias
off rank 0) are zeroed first. Across pools (a cross-pool plan) a trainer rank only packs and sends, a rollout
rank only receives; the collective runs over the process group of the two pools.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hybridflow.engine.hybrid.bridge import Link, as_link
from hybridflow.engine.hybrid.plan import ReshardPlan, Transfer, volume
from hybridflow.engine.parallel.layout import Box


def _part(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The view of ``t`` (which holds ``origin`` of the full tensor) on ``box`` of the full tensor."""
    return t[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))]


class Resharder:
    """This rank's side of a ``ReshardPlan``: what it sends, receives and copies, bucket by bucket.

    ``rank``: this rank in ``group``, the process group of the plan's ranks (None: the default group; or a
    ``Bridge`` across two worlds)."""

    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        group: dist.ProcessGroup | Link | None = None,
    ) -> None:
        self.plan, self.rank, self.device, self.dtype = plan, rank, device, dtype
        self.link = as_link(group)
        self.world = plan.world
        if self.world > 1 and self.link.size() != self.world:
            raise ValueError(f"a plan of {self.world} ranks over a group of {self.link.size()}")
        by_param = defaultdict(list)
        for t in plan.transfers:
            if rank in (t.src, t.dst):
                by_param[t.param].append(t)
        self.buckets = [[t for i in params for t in by_param[i]] for params in plan.buckets]
        self.partial = [  # buffers the plan does not fill completely: zeroed before every refresh
            i
            for i, p in enumerate(plan.params)
            if plan.view.generates(rank)  # a trainer rank of a cross-pool plan has no buffers
            and volume(plan.needed(i, rank)) < volume(tuple((0, n) for n in p.layout.local_shape()))
        ]
        self.received_bytes = plan.bytes_received(rank)

    @torch.no_grad()
    def run(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> int:
        """Fill ``targets`` (this rank's generation buffers, by parameter) from ``sources`` (its training
        shards, by parameter; host tensors are moved over piece by piece); returns the bytes received.

        A rank that only sends (a trainer rank of a cross-pool plan) passes no targets, one that only
        receives no sources: the plan never reads them."""
        for i in self.partial:
            targets[i].zero_()
        received = sum(self._bucket(transfers, sources, targets) for transfers in self.buckets)
        return received * torch.empty((), dtype=self.dtype).element_size()

    def _source(self, t: Transfer, sources: list[torch.Tensor]) -> torch.Tensor:
        held = self.plan.held(t.param, self.rank)
        piece = _part(sources[t.param], t.box, held)
        return piece.to(self.device, non_blocking=True)  # a DMA for a pinned, offloaded shard

    def _target(self, t: Transfer, targets: list[torch.Tensor]) -> torch.Tensor:
        return _part(targets[t.param], t.box, self.plan.needed(t.param, self.rank))

    def _bucket(
        self, transfers: list[Transfer], sources: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> int:
        """Run one bucket: local copies, then one all-to-all; returns the elements received from others."""
        sends = sorted(
            (t for t in transfers if t.src == self.rank and t.dst != self.rank), key=lambda t: t.dst
        )
        recvs = sorted(
            (t for t in transfers if t.dst == self.rank and t.src != self.rank), key=lambda t: t.src
        )
        for t in transfers:
            if t.src == t.dst == self.rank:
                self._target(t, targets).copy_(self._source(t, sources))
        if self.world == 1:
            return 0
        send_splits, recv_splits = [0] * self.world, [0] * self.world
        for t in sends:
            send_splits[t.dst] += volume(t.box)
        for t in recvs:
            recv_splits[t.src] += volume(t.box)
        pieces = [self._source(t, sources).reshape(-1).to(self.dtype) for t in sends]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=self.dtype, device=self.device)
        recv = torch.empty(sum(recv_splits), dtype=self.dtype, device=self.device)
        # Every rank calls this for every bucket, with its own splits (zeros included), so the calls match.
        self.link.all_to_all(recv, send, recv_splits, send_splits)
        offset = 0
        for t in recvs:
            target = self._target(t, targets)
            n = target.numel()
            target.copy_(recv[offset : offset + n].view(target.shape))
            offset += n
        return recv.numel()
