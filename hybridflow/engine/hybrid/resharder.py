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
from hybridflow.engine.hybrid.fp8_scales import Fp8Scales
from hybridflow.engine.hybrid.plan import ReshardPlan, Transfer, volume
from hybridflow.engine.ops.fp8 import FP8
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
        quantised: list[bool] | None = None,
    ) -> None:
        """``quantised``: per parameter, whether it goes in FP8 (rowwise scales, ``fp8_scales``)."""
        self.plan, self.rank, self.device, self.dtype = plan, rank, device, dtype
        self.link = as_link(group)
        quantised = quantised or [False] * len(plan.params)
        self.fp8 = Fp8Scales(plan, rank, quantised, self.link, device) if any(quantised) else None
        self.dtypes = [FP8 if q else dtype for q in quantised]  # each parameter's wire and buffer dtype
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
    def run(
        self,
        sources: list[torch.Tensor],
        targets: list[torch.Tensor],
        scales: dict[int, torch.Tensor] | None = None,
    ) -> int:
        """Fill ``targets`` (this rank's generation buffers, by parameter) from ``sources`` (its training
        shards, by parameter; host tensors are moved over piece by piece); returns the bytes received (FP8
        scales included).

        A rank that only sends (a trainer rank of a cross-pool plan) passes no targets, one that only
        receives no sources: the plan never reads them. With FP8 parameters every rank first takes part in
        the scales' all-reduce, and a receiver's ``scales`` (by parameter, its rows') are filled."""
        for i in self.partial:
            targets[i].zero_()
        if self.fp8 is not None:
            self.fp8.compute(sources)
            for i, scale in (scales or {}).items():
                self.fp8.fill(i, scale)
        received = sum(self._bucket(transfers, sources, targets) for transfers in self.buckets)
        return received + self.plan.scale_bytes_received(self.rank)  # the scales came with the all-reduce

    def _source(self, t: Transfer, sources: list[torch.Tensor]) -> torch.Tensor:
        """The box ``t`` sends (or copies), on this rank's device in its wire dtype (FP8 quantised with its
        rows' scales, or the rollout dtype)."""
        held = self.plan.held(t.param, self.rank)
        piece = _part(sources[t.param], t.box, held).to(self.device, non_blocking=True)  # DMA if offloaded
        if self.dtypes[t.param] == FP8:
            return self.fp8.quantise(t.param, t.box, piece)
        return piece.to(self.dtype)

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
            send_splits[t.dst] += volume(t.box) * self.dtypes[t.param].itemsize
        for t in recvs:
            recv_splits[t.src] += volume(t.box) * self.dtypes[t.param].itemsize
        # Bytes on the wire: FP8 projections and rollout-dtype tensors travel in one buffer per bucket.
        pieces = [self._source(t, sources).reshape(-1).view(torch.uint8) for t in sends]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=self.device)
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        # Every rank calls this for every bucket, with its own splits (zeros included), so the calls match.
        self.link.all_to_all(recv, send, recv_splits, send_splits)
        offset = 0
        for t in recvs:
            target = self._target(t, targets)
            n = target.numel() * target.element_size()
            target.copy_(recv[offset : offset + n].view(target.dtype).view(target.shape))
            offset += n
        return recv.numel()
