"""Weights streamed from a trainer pool to a separate rollout pool (``trainer.async_mode=separate``).

The world (or a process group of it) is split in two: a trainer pool whose ranks hold the actor's training
shards (any training view: FSDP2, tensor parallel, expert parallel) and a rollout pool of R ranks generating in
rollout groups of tp_g (``GenerateView(R, tp_g, ep_g, first=...)``). After each update the trainer's weights go
into the rollout pool's generation buffers through the same reshard plan as the colocated switch, only with
senders and receivers in different pools: each rollout rank receives its whole generation shard, each element
from one trainer rank that holds it, bucket by bucket (``rollout.update_weights_bucket_megabytes``), cast to
the rollout dtype on the sender, into the same tensors every time (the rollout runner binds them once).

A rollout rank holds no training module: it builds its shard from a skeleton of the model (the meta device
is enough) and takes the trainer pool's held boxes, parameter shapes and buffers (RoPE tables, as the trainer
computes them) from the one all-gather at construction. Every collective runs over the group of the two
pools only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engine.hybrid.bridge import Link, as_link
from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan
from hybridflow.engine.hybrid.resharder import Resharder
from hybridflow.engine.hybrid.switch import check_vision_tp, held_box
from hybridflow.engine.ops.fp8 import fp8_parameters, quantisable
from hybridflow.engine.ops.tensors import local_shard
from hybridflow.engine.parallel.layout import ShardLayout, layouts
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.engine.rollout.tp import build_shard, meta_model
from hybridflow.utils.errors import format_bytes

logger = logging.getLogger(__name__)


class PoolSync:
    """One rank's side of the stream from the trainer pool into the rollout pool's generation buffers.

    Every rank of both pools constructs it together (a collective over ``group``) and calls ``sync`` together
    after each update: a trainer rank with its training module, a rollout rank with nothing. On a rollout
    rank ``module`` is its generation shard (an HF module of the model's class with local sizes, whose
    parameters are refreshed in place); on a trainer rank it is None.
    """

    def __init__(
        self,
        model: nn.Module,
        view: GenerateView,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        group: dist.ProcessGroup | Link | None = None,
        train_view: str | None = None,
        fp8: bool = False,
    ) -> None:
        """``model``: a trainer rank's training module, or on a rollout rank any model of the same class and
        config (a skeleton on the meta device). ``view``: the rollout pool in ``group``'s ranks (``first``:
        its first rank). ``group``: the two pools' process group (None: the default group), or a ``Bridge``
        when each pool has a world of its own (Ray worker groups). ``train_view``
        names the trainer's view in the logs."""
        check_vision_tp(
            model, view.tp
        )  # a separate pool of a VLM: whole replicas (the tower sent every time)
        self.view, self.link = view, as_link(group)
        self.rank, self.world = self.link.rank(), self.link.size()
        if view.end > self.world or view.world == self.world:
            raise ValueError(
                f"the rollout pool {view} must lie inside the group of {self.world} ranks and leave some for the "
                "trainer pool"
            )
        self.receives = view.generates(self.rank)
        skeleton = meta_model(model)  # every parameter's name and full shape, whatever this rank holds
        self.names = [n for n, _ in skeleton.named_parameters()]
        by_name = layouts(skeleton, view.tp, view.ep)
        self.layouts: list[ShardLayout] = [by_name[n] for n in self.names]
        table = self._gather(model, skeleton)
        holdings = [
            [lay.to_plan(box) for lay, box in zip(self.layouts, row["held"])]  # fused experts as (E, 2, I, H)
            if row is not None
            else [None] * len(self.names)
            for row in table
        ]
        specs = [ParamSpec(n, lay.plan_shape, None, lay) for n, lay in zip(self.names, self.layouts)]
        elem = torch.empty((), dtype=dtype).element_size()
        # rollout.quantization=fp8: the dense projections go in FP8 (every rank decides alike from the shapes)
        self.quantised = [
            fp8 and quantisable(n, lay.local_shape()) for n, lay in zip(self.names, self.layouts)
        ]
        self.plan = ReshardPlan(specs, view, elem, bucket_bytes, holdings, train_view, self.quantised)
        gaps = self.plan.uncovered()
        if gaps:
            raise ValueError(f"the trainer pool holds no copy of parts of: {gaps[:8]}")
        self.resharder = Resharder(self.plan, self.rank, device, dtype, self.link, self.quantised)
        self.scales: dict[int, torch.Tensor] = {}
        self.module: nn.Module | None = None
        self.targets: list[torch.Tensor] = []
        if self.receives:
            self._build_buffers(skeleton, table, dtype, device)
        logger.info(
            "Pool sync initialized: trainer pool of %d ranks train_view=%s -> rollout pool generate_view=%s, %s; "
            "this rank (%d of the group) %s",
            self.world - view.world,
            self.plan.train_view,
            view,
            f"{dtype} (with FP8 projections)" if any(self.quantised) else dtype,
            self.rank,
            f"receives {format_bytes(self.plan.bytes_received(self.rank))} per sync"
            if self.receives
            else f"sends {format_bytes(self.plan.bytes_sent(self.rank))} per sync",
        )

    def _gather(self, model: nn.Module, skeleton: nn.Module) -> list[dict[str, Any] | None]:
        """Every rank's row (a trainer rank's held boxes, full shapes and buffers; None for a rollout rank),
        checked against this rank's skeleton: one all-gather over the group."""
        whole = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
        mine = None
        if not self.receives:
            ours = dict(model.named_parameters())
            if not ours.keys() <= whole.keys():
                raise ValueError(
                    f"parameters outside the model's skeleton: {sorted(ours.keys() - whole.keys())}"
                )
            mine = {
                "held": [held_box(ours[n]) if n in ours else None for n in self.names],
                "shapes": {n: tuple(p.shape) for n, p in ours.items()},  # a DTensor's shape: the full one
                "buffers": {n: b.detach().cpu() for n, b in model.named_buffers()},
            }
        table = self.link.gather_objects(mine)
        for rank, row in enumerate(table):
            if (row is None) != self.view.generates(rank):  # the ranks were given different views
                raise ValueError(
                    f"rank {rank} of the group {'sent no' if row is None else 'sent'} training boxes, but this "
                    f"rank's rollout pool is {self.view}: every rank must be given the same pools"
                )
            wrong = sorted(n for n, s in (row or {}).get("shapes", {}).items() if whole.get(n) != s)
            if wrong:
                raise ValueError(f"the trainer pool's rank {rank} holds another model: {wrong[:8]} differ")
        return table

    def _build_buffers(
        self,
        skeleton: nn.Module,
        table: list[dict[str, Any] | None],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """This rollout rank's generation shard (empty until the first ``sync``) and its buffers in the plan's
        coordinates."""
        buffers: dict[str, torch.Tensor] = {}
        for row in table:
            for name, b in (row or {}).get("buffers", {}).items():
                buffers.setdefault(name, b)  # the same tables on every trainer rank
        absent = sorted(n for n, _ in skeleton.named_buffers() if n not in buffers)
        if absent:
            raise ValueError(f"no trainer rank has the model's buffers {absent[:8]}")
        self.module = build_shard(skeleton, self.view.tp, dtype, device, self.view.ep, buffers)
        fp8_names = set(fp8_parameters(self.module)) if any(self.quantised) else set()
        assert fp8_names == {n for n, q in zip(self.names, self.quantised) if q}, "FP8 weights differ by rank"
        generation = dict(self.module.named_parameters())
        for name, lay in zip(self.names, self.layouts):  # the buffers' shapes are what the plan writes into
            got = tuple(generation[name].shape)
            assert got == lay.local_shape(), f"{name}: buffer {got}, layout {lay}"
        self.targets = [lay.plan_view(generation[n]) for lay, n in zip(self.layouts, self.names)]
        modules = dict(self.module.named_modules())
        self.scales = {
            i: modules[n.rsplit(".", 1)[0]].weight_scale
            for i, n in enumerate(self.names)
            if self.quantised[i]
        }

    @torch.no_grad()
    def sync(self, model: nn.Module | None = None) -> int:
        """Stream the trainer pool's current weights into the rollout pool's buffers (every rank of both pools
        together): a trainer rank passes its training module, a rollout rank nothing. Returns the bytes this
        rank received (none on a trainer rank)."""
        if self.receives:
            return self.resharder.run([], self.targets, self.scales)
        if model is None:
            raise ValueError("a trainer rank passes its training module to PoolSync.sync")
        params = dict(model.named_parameters())
        nothing = torch.empty(0)  # another pipeline stage's parameter: the plan never reads it here
        sources = [
            lay.plan_view(local_shard(params[n])) if n in params else nothing
            for lay, n in zip(self.layouts, self.names)
        ]
        return self.resharder.run(sources, [])

    def sync_line(self) -> str:
        """What every sync moves, from the plan (a log line for the driver)."""
        plan, view = self.plan, self.view
        received = [plan.bytes_received(r) for r in range(view.first, view.end)]
        sent = [plan.bytes_sent(r) for r in range(plan.world) if not view.generates(r)]
        most = format_bytes(max(received))
        amount = most if min(received) == max(received) else f"up to {most}"
        shard = "a whole replica" if view.tp == 1 else f"a 1/{view.tp} tensor-parallel shard"
        return (
            f"Pool sync: {amount} received per rollout rank into {shard}, up to {format_bytes(max(sent))} sent "
            f"per trainer rank (a whole copy is {format_bytes(plan.full_bytes())})"
        )
