"""The data the ranks of a training view (``dims.ParallelDims``) share.

The driver hands every rank its own share of the data. The ranks of one model replica (its tp x pp ranks,
the ranks with the same dp coordinate) must compute on the same rows, so ``ShareGroup`` joins their shares
before a pass and hands each rank back its own rows after: the driver's split and merge stay the same for
any view, as they do for the generation view's rollout groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engine.ops.sequences import layout_padding
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.protocol import Batch


def _response_width(share: Batch) -> int | None:
    return share["responses"].shape[1] if "responses" in share else None


class ShareGroup:
    """The ranks of this rank's model replica: they join their data shares and compute on the union."""

    def __init__(self, view: ParallelDims, rank: int, pad_token_id: int | None = None) -> None:
        self.view, self.rank, self.pad_token_id = view, rank, pad_token_id
        self.ranks = view.replica_ranks(view.coords(rank)[2])
        self.group = None
        if len(self.ranks) > 1:  # new_group is collective over the world: every rank creates every group
            for d in range(view.dp):
                group = dist.new_group(view.replica_ranks(d))
                if d == view.coords(rank)[2]:
                    self.group = group

    def join(self, share: Batch) -> tuple[Batch, slice, int | None]:
        """The union of the replica's shares (in rank order), this rank's rows in it and its response width.

        Shares padded to different widths are joined at the widest (``Batch.concat``'s layout padding).
        """
        if self.group is None:
            return share, slice(0, len(share)), _response_width(share)
        shares: list[Any] = [None] * len(self.ranks)
        # Rows only: meta is per rank (its rollout's statistics) and stays this rank's own.
        dist.all_gather_object(shares, Batch(share.tensors, share.non_tensors), group=self.group)
        mine = self.ranks.index(self.rank)
        start = sum(len(s) for s in shares[:mine])
        pad = layout_padding(self.pad_token_id if self.pad_token_id is not None else 0)
        joined = Batch.concat(shares, pad=pad)
        joined.meta.update(share.meta)
        return joined, slice(start, start + len(share)), _response_width(share)

    @staticmethod
    def mine(out: Batch, rows: slice, width: int | None) -> Batch:
        """This rank's rows of a joined pass's output, response-shaped fields cut back to its own width."""
        part = out[rows]
        if width is None:
            return part
        for key in part.keys():  # noqa: SIM118 (Batch is not iterable)
            t = part[key]
            if torch.is_tensor(t) and t.dim() == 2 and t.shape[1] > width:
                part[key] = t[:, :width].contiguous()
        return part
