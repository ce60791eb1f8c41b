"""The rowwise FP8 scales of a switch that delivers projections in FP8 (``rollout.quantization=fp8``).

A row's scale needs its largest magnitude over the whole row, but a rank may hold only part of a row (a
tensor-parallel training view splits a row-parallel weight's columns) or none. So before the buckets run,
every rank takes the row maxima of the boxes it holds, in the plan's coordinates (the scale of a weight of
plan shape (..., K) has shape (...)), and one all-reduce (max) over the plan's ranks gives every rank every
quantised weight's full-row scales. A sender then quantises each box it sends with the scales of its rows,
and a receiver copies the scales of the rows it needs into its buffer: the shard equals the full weight
quantised, then sliced, whatever the views.
"""

from __future__ import annotations

import torch

from hybridflow.engine.hybrid.bridge import Link
from hybridflow.engine.hybrid.plan import ReshardPlan
from hybridflow.engine.ops.fp8 import quantise, row_scales
from hybridflow.engine.parallel.layout import Box


def _rows(box: Box) -> tuple[slice, ...]:
    """The slices of a box's rows (every dim but the last, the one a row's scale spans)."""
    return tuple(slice(lo, hi) for lo, hi in box[:-1])


class Fp8Scales:
    """Full-row scales of the plan's quantised parameters, refreshed at every switch (see the module doc)."""

    def __init__(self, plan: ReshardPlan, rank: int, quantised: list[bool], link: Link, device: torch.device):
        self.plan, self.rank, self.link, self.device = plan, rank, link, device
        self.quantised = quantised
        self.indices = [i for i, q in enumerate(quantised) if q]
        self.shapes = [plan.params[i].layout.plan_shape[:-1] for i in self.indices]
        self.full: dict[int, torch.Tensor] = {}

    def compute(self, sources: list[torch.Tensor]) -> None:
        """Every quantised parameter's full-row scales from every rank's held boxes (one all-reduce)."""
        maxima = [torch.zeros(shape, dtype=torch.float32, device=self.device) for shape in self.shapes]
        for i, amax in zip(self.indices, maxima):
            held = self.plan.held(i, self.rank)
            if held is not None and sources and sources[i].numel():
                local = sources[i].detach().abs().amax(dim=-1).float()  # (held rows,): a partial row's max
                amax[_rows(held)].copy_(local.to(self.device))
        flat = torch.cat([m.reshape(-1) for m in maxima]) if maxima else torch.zeros(0, device=self.device)
        self.link.all_reduce_max(flat)
        self.full = {
            i: row_scales(part).view(shape)
            for i, part, shape in zip(self.indices, flat.split([m.numel() for m in maxima]), self.shapes)
        }

    def quantise(self, param: int, box: Box, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` (the box ``box`` of parameter ``param``, plan coordinates) in FP8 with its rows' scales."""
        return quantise(piece, self.full[param][_rows(box)].to(piece.device))

    def fill(self, param: int, scale: torch.Tensor) -> None:
        """This rank's buffer of scales (its shard's rows, plan coordinates) from the full ones."""
        needed = self.plan.needed(param, self.rank)
        if needed is None:
            return
        local = tuple(slice(0, hi - lo) for lo, hi in needed[:-1])  # the shard's rows start at its origin
        scale[local].copy_(self.full[param][_rows(needed)])
