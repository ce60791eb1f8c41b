"""The training view: a role's W ranks on a ``(pp, tp, dp)`` device mesh, and the data its ranks share.

FSDP2 shards over ``dp``; DTensor tensor parallelism (``tp``) splits each decoder layer over ``tp``.
Ranks are laid out with dp innermost: rank r is data-parallel rank ``r % dp`` and tensor-parallel rank
``(r // dp) % tp``, which is the generation view's ordering (``view.GenerateView``: tensor-parallel rank
``r // dp_g``). So when the rollout's tensor-parallel size equals the trainer's, a rank's generation shard
is the union of its FSDP peers' training shards of the same tensor-parallel shard, and at dp = 1 it is the
rank's own training shard: the switch copies it in place.

The ranks of one model replica (its tp x pp ranks, the ranks with the same dp coordinate) compute on the same
rows: the driver splits a batch by ``dp`` and hands every rank of replica d the d-th share
(``workers.dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.engine.parallel.layout import Box
from hybridflow.utils.errors import UserError

MESH_DIMS = ("pp", "tp", "dp")


@dataclass(frozen=True)
class TrainView:
    """``world`` ranks training as ``pp`` pipeline stages x ``tp`` tensor-parallel ranks x ``dp`` replicas.

    ``sp`` (Ulysses, ``ulysses``): FSDP2 still shards over every rank, and each data-parallel group of sp
    consecutive ranks splits its micro-batches' tokens; a group is one model replica for the data.
    """

    world: int
    tp: int = 1
    pp: int = 1
    role: str = "actor"  # for messages: the config section the sizes come from
    sp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world % (self.tp * self.pp):
            raise UserError(
                f"{self.role}.tensor_parallel_size={self.tp} x {self.role}.pipeline_parallel_size={self.pp} "
                f"must divide the {self.world} ranks (trainer.nnodes x trainer.n_gpus_per_node)"
            )
        if self.sp < 1 or self.world % self.sp or (self.sp > 1 and not self.fsdp_only):
            raise UserError(
                f"{self.role}.ulysses_sequence_parallel_size={self.sp} must divide the {self.world} ranks and "
                f"comes with tensor_parallel_size=1 and pipeline_parallel_size=1 (got {self.tp} and {self.pp})"
            )

    @property
    def dp(self) -> int:
        """The data-parallel size: model replicas, each over tp x pp ranks (or a group of sp ranks)."""
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def fsdp_only(self) -> bool:
        """Whether this is the plain FSDP2 view (no tensor or pipeline parallelism)."""
        return self.tp == 1 and self.pp == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, tp_rank, dp_rank)`` of ``rank``."""
        if self.sp > 1:  # tp = pp = 1: a group's sp ranks are consecutive (its all-to-alls stay on a node)
            return 0, 0, rank // self.sp
        return rank // (self.tp * self.dp), (rank // self.dp) % self.tp, rank % self.dp

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of model replica ``dp_rank`` (every stage and tensor-parallel rank), in rank order."""
        return [r for r in range(self.world) if self.coords(r)[2] == dp_rank]

    def __str__(self) -> str:
        if self.fsdp_only:
            return f"(fsdp={self.world})" if self.sp == 1 else f"(fsdp={self.world}, sp={self.sp})"
        return f"(tp={self.tp}, pp={self.pp}, dp={self.dp})"


def build_mesh(view: TrainView, device: torch.device) -> DeviceMesh:
    """The ``(pp, tp, dp)`` device mesh of the view over the default group (every rank calls it)."""
    return init_device_mesh(device.type, (view.pp, view.tp, view.dp), mesh_dim_names=MESH_DIMS)


def _chunk(lo: int, hi: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of the range [lo, hi) as ``torch.chunk`` splits it (empty parts at the end)."""
    size = -(-(hi - lo) // parts)
    return min(lo + i * size, hi), min(lo + (i + 1) * size, hi)


def train_box(
    kind: str,
    shape: tuple[int, ...],
    view: TrainView,
    rank: int,
    fsdp_dim: int = 0,
    stages: tuple[int, ...] | None = None,
) -> Box | None:
    """The box of a full parameter ``rank`` holds in ``view``, from the parameter's tensor-parallel ``kind``
    (``layout.kind_of``) alone: what the DTensors give (a test checks it), for plans of models no machine
    here can hold. Layers' column (and kv) weights split dim 0 over tp, row weights dim 1; FSDP2 then splits
    the rank's piece over dp along ``fsdp_dim`` (dim 0, or the dim a layout function marked). ``stages``: the
    pipeline stages holding the parameter (None: every stage)."""
    pp_rank, tp_rank, dp_rank = view.coords(rank)
    if stages is not None and pp_rank not in stages:
        return None  # another pipeline stage's parameter (``pipeline.stage_of_param``)
    box = [(0, n) for n in shape]
    split = {"column": 0, "kv": 0, "row": 1}.get(kind) if view.tp > 1 else None
    if split is not None:
        box[split] = _chunk(0, shape[split], view.tp, tp_rank)
    fsdp_rank, fsdp_size = (rank, view.world) if view.sp > 1 else (dp_rank, view.dp)  # sp: FSDP2 over all
    box[fsdp_dim] = _chunk(*box[fsdp_dim], fsdp_size, fsdp_rank)
    return None if any(lo >= hi for lo, hi in box) else tuple(box)
