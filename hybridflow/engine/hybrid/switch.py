"""The hybrid engine's switch at data-parallel size > 1: generation weights refreshed from the FSDP2 shards.

``RolloutShard`` (the hybrid engine, ``actor.hybrid_engine=true``): each rank keeps its generation weights in
the rollout dtype, its tensor-parallel shard of the policy (``rollout.tensor_model_parallel_size`` = tp) or,
at tp = 1, a whole replica. They are built empty in the shard's shape (never a whole copy when tp > 1) and
filled before every generation by the reshard plan (``engine.parallel``): each rank receives exactly the
boxes of its shard it does not hold, bucket by bucket, cast on the way, into the same tensors every time (the
rollout runner binds them once; CUDA graphs captured on them stay valid). Between generations ``release()``
frees their memory (the worker does so with ``rollout.free_cache_engine``): the update then holds no
generation copy beside its shards, and the next ``sync()`` allocates the same storages again.

``BroadcastReplica`` (the baseline, ``actor.hybrid_engine=false``; HybridFlow's ``use_3d_hybrid=False``): a
whole copy kept for good and refreshed by the naive switch, a full state dict gathered on rank 0 and
broadcast tensor by tensor, so that memory and switch time can be put side by side with the hybrid engine.

At world size 1 the hybrid engine needs neither: the rollout engine reads the training module's own
parameters (a cast buffer at most).

The one hook for what a parameter's source is (``merged_sources``): a module that defines
``generation_tensor(name)`` gives its parameter's generation value itself (a LoRA linear: W + (alpha / r) B A,
merged into the shard before it is sent, ``parallel.lora``); the adapters' own parameters are not generation
weights. Merged sources are computed for every parameter before the plan runs (one shard-sized copy of the
adapted weights beside the buckets); merging inside each bucket (or an in-place delta on the generation
buffers) is not built.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan
from hybridflow.engine.hybrid.resharder import Resharder
from hybridflow.engine.ops.fp8 import fp8_parameters
from hybridflow.engine.ops.tensors import Storages, local_shard
from hybridflow.engine.parallel.fsdp import full_state_dict
from hybridflow.engine.parallel.layout import Box, layouts
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.engine.rollout.tp import build_shard, meta_model
from hybridflow.models.adapters import is_adapter_name
from hybridflow.models.vision import is_vision_language
from hybridflow.utils.dist import world_size
from hybridflow.utils.errors import UserError, format_bytes

logger = logging.getLogger(__name__)


def held_box(param: torch.Tensor) -> Box | None:
    """The box of the full parameter this rank holds (a DTensor's local shard on any mesh; None: empty)."""
    if not hasattr(param, "device_mesh"):
        return tuple((0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(n == 0 for n in shape):
        return None  # FSDP2 pads an uneven split with empty shards at the end
    return tuple((o, o + n) for o, n in zip(offset, shape))


def merged_sources(sharded: nn.Module, names: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    """The generation weights among ``names`` whose training-side value their module computes (its
    ``generation_tensor``: a LoRA linear's W + (alpha / r) B A for this rank's shard; a collective, every rank
    computes them in order); found once, at start."""
    out = {}
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = sharded.get_submodule(owner_name) if owner_name else sharded
        merge = getattr(owner, "generation_tensor", None)
        if merge is not None:
            out[name] = functools.partial(merge, attr)
    return out


def generation_parameters(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """``sharded``'s parameters that the generation view holds (the adapters' own are merged in instead)."""
    return {n: p for n, p in sharded.named_parameters() if not is_adapter_name(n)}


def check_vision_tp(model: nn.Module, tp: int) -> None:
    """A vision-language model's rollout replicas are whole: rollout tensor parallelism is refused (UserError)."""
    if tp > 1 and is_vision_language(getattr(model, "config", None)):
        raise UserError(
            f"rollout.tensor_model_parallel_size={tp} with a vision-language model is not supported: its "
            "rollout replicas are whole (set rollout.tensor_model_parallel_size=1; data-parallel replicas work)"
        )


def frozen_tower(sharded: nn.Module) -> set[str]:
    """The names of a vision-language model's vision-tower parameters that are not trained (``requires_grad``
    False: ``model.freeze_vision_tower``): the switch delivers them once. Empty for a text model."""
    if not is_vision_language(getattr(sharded, "config", None)):
        return set()
    return {n for n, p in sharded.named_parameters() if ".visual." in f".{n}" and not p.requires_grad}


def holdings_of(named: dict[str, torch.Tensor], names: list[str]) -> list[list[Box | None]]:
    """Every rank's held box of each of ``names`` (None where a rank holds none): one all-gather at start."""
    mine = [held_box(named[n]) if n in named else None for n in names]
    if world_size() == 1:
        return [mine]
    table: list = [None] * world_size()
    dist.all_gather_object(table, mine)
    return table


class RolloutShard:
    """This rank's generation weights (a tensor-parallel shard, or a whole replica at tp = 1), from the plan."""

    def __init__(
        self,
        sharded: nn.Module,
        view: GenerateView,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        train_view: str | None = None,
        fp8: bool = False,
    ) -> None:
        """``sharded`` is the HF causal LM of the training view (FSDP2 shards, tensor-parallel or not);
        ``train_view`` names that view in the logs. ``fp8``: the dense projections are delivered in FP8
        with rowwise scales (``rollout.quantization=fp8``), the rest in ``dtype``."""
        self.view, self.rank = view, rank
        check_vision_tp(sharded, view.tp)
        self.module = build_shard(sharded, view.tp, dtype, device, view.ep)
        fp8_names = set(fp8_parameters(self.module)) if fp8 else set()
        # A frozen vision tower is delivered at the first switch only and then kept (never released).
        self.frozen = frozen_tower(sharded)
        self.storages = Storages([p for n, p in self.module.named_parameters() if n not in self.frozen])
        # The whole model's parameters: a pipeline stage holds only its own layers, the generation view all.
        skeleton = meta_model(sharded)
        whole = dict(skeleton.named_parameters())
        ours = generation_parameters(sharded)
        generation = dict(self.module.named_parameters())
        if whole.keys() != generation.keys() or not ours.keys() <= whole.keys():
            raise ValueError(
                f"the rollout shard's parameters differ: {sorted(whole.keys() ^ generation.keys())}, "
                f"{sorted(ours.keys() - whole.keys())}"
            )
        lay = layouts(skeleton, view.tp, view.ep)
        self.names = list(whole)
        self.layouts = [lay[n] for n in self.names]  # the plan's coordinates: fused experts as (E, 2, I, H)
        specs = [ParamSpec(n, lay[n].plan_shape, None, lay[n]) for n in self.names]
        for spec in specs:  # the buffers' shapes are what the plan writes into
            got = tuple(generation[spec.name].shape)
            assert got == spec.layout.local_shape(), f"{spec.name}: buffer {got}, layout {spec.layout}"
        elem = torch.empty((), dtype=dtype).element_size()
        holdings = [
            [lay.to_plan(box) for lay, box in zip(self.layouts, boxes)]
            for boxes in holdings_of(ours, self.names)
        ]
        quantised = [n in fp8_names for n in self.names]
        self.plan = ReshardPlan(specs, view, elem, bucket_bytes, holdings, train_view, quantised)
        self.resharder = Resharder(self.plan, rank, device, dtype, quantised=quantised)
        generation = dict(self.module.named_parameters())  # the FP8 weights replaced the empty ones
        self.targets = [lay.plan_view(generation[n]) for lay, n in zip(self.layouts, self.names)]
        modules = dict(self.module.named_modules())
        self.scales = {
            i: modules[n.rsplit(".", 1)[0]].weight_scale for i, n in enumerate(self.names) if quantised[i]
        }
        self.merges = merged_sources(sharded, [n for n in self.names if n in ours])
        self.later: tuple[list[int], Resharder] | None = None  # the switches after the first one
        self.skipped_bytes = 0  # what the later switches leave out on this rank (the frozen tower)
        self.synced = False
        if self.frozen:
            kept = [i for i, n in enumerate(self.names) if n not in self.frozen]
            rest = ReshardPlan(
                [specs[i] for i in kept], view, elem, bucket_bytes, [[h[i] for i in kept] for h in holdings],
                train_view,
            )  # fmt: skip
            resharder = Resharder(rest, rank, device, dtype, quantised=[quantised[i] for i in kept])
            self.later = (kept, resharder)
            self.skipped_bytes = self.plan.bytes_received(rank) - rest.bytes_received(rank)
            logger.info(
                "the frozen vision tower (%d parameters) is delivered at the first switch only: %s less "
                "received by this rank at every later switch",
                len(self.frozen),
                format_bytes(self.skipped_bytes),
            )
        logger.info(
            "HybridEngine initialized: train_view=%s, generate_view=%s, %s; this rank holds %s of generation "
            "weights (a whole copy: %s) and receives %s at every switch",
            self.plan.train_view,
            view,
            f"{dtype} ({len(fp8_names)} projections in FP8 with float32 rowwise scales, counted so below)"
            if fp8_names
            else dtype,
            format_bytes(self.plan.generation_bytes()),
            format_bytes(self.plan.full_bytes()),
            format_bytes(self.plan.bytes_received(rank)),
        )

    def release(self) -> int:
        """Free the generation weights' memory until the next ``sync()``; returns the bytes freed."""
        return self.storages.release()

    def switch_line(self) -> str:
        """What every switch moves, from the plan: the log line of ``ActorWorker``'s switch."""
        plan = self.plan
        whole = format_bytes(plan.full_bytes())
        if self.view.world == 1:  # one rank: its replica (for HF generate) is refreshed by a local copy
            return (
                f"Stage switch: nothing received (one rank); {format_bytes(plan.generation_bytes())} copied "
                f"locally into the rollout's replica (a whole copy is {whole})"
            )
        received = [plan.bytes_received(r) for r in range(self.view.world)]
        most = format_bytes(max(received))
        amount = most if min(received) == max(received) else f"up to {most}"
        shard = "a whole replica" if self.view.tp == 1 else f"a 1/{self.view.tp} tensor-parallel shard"
        if self.view.ep > 1:
            shard += f" (experts split whole, {self.view.ep} ways)"
        line = f"Stage switch: {amount} received per rank into {shard} (a whole copy is {whole})"
        if self.later is not None:
            line += f"; the frozen vision tower ({format_bytes(self.skipped_bytes)}) at the first switch only"
        return line

    @torch.no_grad()
    def sync(self, sharded: nn.Module) -> int:
        """Refresh every generation weight from ``sharded``'s shards (all ranks together); bytes received."""
        self.storages.restore()
        params = generation_parameters(sharded)
        nothing = torch.empty(0)  # another pipeline stage's parameter: the plan never reads it here
        picked, resharder = list(range(len(self.names))), self.resharder
        if self.synced and self.later is not None:  # the frozen tower is in place since the first switch
            picked, resharder = self.later
        self.synced = True
        sources = []
        for i in picked:
            lay, n = self.layouts[i], self.names[i]
            if n not in params:
                sources.append(nothing)
                continue
            sources.append(lay.plan_view(self.merges[n]() if n in self.merges else local_shard(params[n])))
        targets = [self.targets[i] for i in picked]
        scales = {k: self.scales[i] for k, i in enumerate(picked) if i in self.scales}
        return resharder.run(sources, targets, scales)

    @property
    def last_skipped_bytes(self) -> int:
        """What the last ``sync`` did not receive on this rank because the vision tower is frozen."""
        return self.skipped_bytes if self.later is not None and self.synced else 0


class BroadcastReplica:
    """The baseline: a whole copy in the rollout dtype, kept, refreshed by a rank-0 state-dict broadcast."""

    def __init__(
        self,
        sharded: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``pp_group``: the other pipeline stages of this rank's replica, when ``sharded`` is one stage."""
        self.pp_group = pp_group
        self.module = build_shard(sharded, 1, dtype, device)
        self.params = dict(self.module.named_parameters())
        self.world = world_size()
        logger.info(
            "HybridEngine off (actor.hybrid_engine=false): every rank keeps a whole %s copy of the policy, "
            "refreshed by a full state-dict broadcast from rank 0",
            dtype,
        )

    def release(self) -> int:
        """The baseline keeps its copy: nothing is freed."""
        return 0

    def switch_line(self) -> str:
        """What every switch moves: the whole state dict, broadcast from rank 0 to each other rank."""
        whole = format_bytes(sum(p.numel() * p.element_size() for p in self.params.values()))
        if self.world == 1:
            return f"Stage switch (actor.hybrid_engine=false): the kept copy is refreshed locally ({whole})"
        return (
            f"Stage switch (actor.hybrid_engine=false): {whole} received per rank other than rank 0, a full "
            f"state-dict broadcast (a whole copy is {whole})"
        )

    @torch.no_grad()
    def sync(self, sharded: nn.Module) -> int:
        """Gather the full state dict (on rank 0's host), broadcast each tensor; returns the bytes received."""
        state = full_state_dict(sharded, self.pp_group)  # a collective; rank 0 is the one that needs it
        received = 0
        for name, target in self.params.items():
            if self.world == 1 or dist.get_rank() == 0:
                target.copy_(state[name].to(target.device, non_blocking=True))
            if self.world > 1:
                dist.broadcast(target, src=0)
                received += 0 if dist.get_rank() == 0 else target.numel() * target.element_size()
        return received
