"""``ParallelDims``: one role's training view, built once from its parallel section and the world.

The W ranks of a role sit on a ``(pp, tp, dp)`` grid with dp innermost: rank r is data-parallel rank
``r % dp``, tensor-parallel rank ``(r // dp) % tp`` and pipeline stage ``r // (tp * dp)``, which is the
generation view's ordering (``view.GenerateView``: tensor-parallel rank ``r // dp_g``). So when the rollout's
tensor-parallel size equals the trainer's, a rank's generation shard is the union of its FSDP peers' training
shards of the same tensor-parallel shard, and at dp = 1 it is the rank's own training shard: the switch copies
it in place. Ulysses (sp, with tp = pp = 1 for now) groups sp consecutive ranks inside dp, so its
all-to-alls stay on a node; FSDP2 then shards over every rank. Expert parallelism (ep, with pp = sp = 1 for
now) splits the data-parallel ranks as ``(dp_rep, ep)``, ep innermost (torchtitan's layout; the mesh is
``(tp, dp_rep, ep)`` with ``dp`` their last two flattened): a rank of data-parallel rank d holds the experts of
ep rank ``d % ep``, FSDP2 shards those over the ``dp_rep`` ranks ``d // ep`` holding the same ones, and
everything else over all dp = dp_rep x ep ranks (``ep.apply_ep``); tp splits the attention only, the MoE
blocks stay whole on every tp rank.

A ``ParallelDims`` holds the sizes (checked against the world by the config's one check,
``config.views.world_problems``), the rank's coordinates, the token budgets of a group, and once ``build()``
has run (a collective), the named process groups: the one device mesh of the view (``(pp, tp, dp)``,
``(dp, sp)`` under Ulysses, ``(dp_rep, ep)`` with ``dp`` their flattening under expert parallelism; none under
FSDP2 alone). Printed as the logs name the view: ``(fsdp=4)``, ``(fsdp=4, sp=2)``, ``(fsdp=4, ep=2)``,
``(tp=2, pp=2, dp=1)``. The layout planner builds the same
object for its candidates, without groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.parallel import DIMS, role_sizes, size_key
from hybridflow.config.views import world_problems
from hybridflow.engine.parallel.layout import Box
from hybridflow.engine.parallel.pipeline import check_train_pp
from hybridflow.engine.parallel.tp import check_train_tp
from hybridflow.engine.parallel.ulysses import check_ulysses
from hybridflow.models.families import check_expert_parallel
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.dist import init_distributed


@dataclass(frozen=True)
class DimGroups:
    """A built view's process groups: its device mesh (None under FSDP2 alone).

    A replica's ranks need no group of their own: the driver hands each of them the same share
    (``workers.dispatch``)."""

    mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None = None  # expert parallelism: dp_rep x ep flattened, FSDP2's mesh for the rest


@dataclass(frozen=True)
class ParallelDims:
    """``world`` ranks training as ``pp`` stages x ``tp`` tensor-parallel ranks x ``dp`` replicas (sp: Ulysses).

    ``role``: the config section the sizes come from (messages name its fields); ``rank``: this rank (None: a
    plan's view of no rank in particular); ``groups``: set by ``build()``.
    """

    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    role: str = "actor"
    rank: int | None = None
    groups: DimGroups | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        low = [size_key(self.role, d) for d in DIMS if getattr(self, d) < 1]
        if low:
            raise ConfigError([Problem(k, "must be at least 1", f"e.g. {k}=1 (the default)") for k in low])
        problems = world_problems(self.role, self.sizes, self.world)
        if problems:
            raise ConfigError(problems)

    @classmethod
    def of(cls, cfg: Any, role: str, world: int, rank: int | None = None) -> ParallelDims:
        """The view of ``role``'s parallel section (``actor``, ``ref``: null sizes are the actor's, ``critic``)."""
        return cls(world, role=role, rank=rank, **role_sizes(cfg, role))

    @property
    def sizes(self) -> dict[str, int]:
        """``{tp, pp, sp, ep}``."""
        return {d: getattr(self, d) for d in DIMS}

    @property
    def dp(self) -> int:
        """The data-parallel size: model replicas, each over tp x pp ranks (or a group of sp ranks)."""
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def fsdp_only(self) -> bool:
        """Whether this is the plain FSDP2 view (no tensor, pipeline or expert parallelism): every parameter
        sharded over one mesh of every rank (sp keeps that)."""
        return self.tp == 1 and self.pp == 1 and self.ep == 1

    @property
    def splits_layers(self) -> bool:
        """Whether the layers are split over tensor-parallel ranks or pipeline stages (the (pp, tp, dp) mesh)."""
        return self.tp > 1 or self.pp > 1

    def ep_coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rep_rank, ep_rank)`` of ``rank``: which copy of its experts, and which experts (the split of
        its data-parallel rank, ep innermost)."""
        dp_rank = self.coords(rank)[2]
        return dp_rank // self.ep, dp_rank % self.ep

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, tp_rank, dp_rank)`` of ``rank``."""
        if self.sp > 1:  # tp = pp = 1: a group's sp ranks are consecutive (its all-to-alls stay on a node)
            return 0, 0, rank // self.sp
        return rank // (self.tp * self.dp), (rank // self.dp) % self.tp, rank % self.dp

    @property
    def dp_rank(self) -> int:
        """This rank's model replica (its share of the data)."""
        assert self.rank is not None, "a view of no rank in particular"
        return self.coords(self.rank)[2]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        assert self.rank is not None, "a view of no rank in particular"
        return self.coords(self.rank)[0]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of model replica ``dp_rank`` (every stage and tensor-parallel rank), in rank order."""
        return [r for r in range(self.world) if self.coords(r)[2] == dp_rank]

    def token_budget(self, per_gpu: int) -> int:
        """A per-GPU token budget as the budget of one replica's micro-batch (Ulysses: each rank holds 1/sp)."""
        return per_gpu * self.sp

    def budgets(self, section: Any) -> Any:
        """A role section (actor, critic) whose ``ppo_max_token_len_per_gpu`` is per replica (``token_budget``)."""
        return group_budgets(section, self.sp)

    def check_model(self, config: Any) -> None:
        """Raise UserError naming the field when the sizes cannot split this model (heads, KV heads, layers)."""
        if self.tp > 1:
            check_train_tp(config, self.tp, self.role)
        if self.sp > 1:
            check_ulysses(config, self.sp, self.role)
        if self.pp > 1:
            check_train_pp(config, self.pp, self.role)
        if self.ep > 1:
            check_expert_parallel(config, size_key(self.role, "ep"), self.ep)

    def build(self, device_type: str | None = None) -> ParallelDims:
        """This rank's view with its process groups (a collective: every rank calls it, in the same order).

        ``device_type``: of the mesh (None: cuda when this process computes on CUDA, else cpu).
        """
        if self.groups is not None:
            return self
        init_distributed()
        assert dist.get_world_size() == self.world, (dist.get_world_size(), self.world)
        device_type = device_type or ("cuda" if cuda_in_use() else "cpu")
        mesh = flat = None
        if self.ep > 1:  # pp = sp = 1: dp split as (dp_rep, ep), tp outside it
            shape, names = (self.tp, self.dp // self.ep, self.ep), ("tp", "dp_rep", "ep")
            if not self.splits_layers:
                shape, names = shape[1:], names[1:]
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            flat = mesh["dp_rep", "ep"]._flatten("dp")  # FSDP2's mesh for all but the experts, same root
        elif self.splits_layers:
            mesh = init_device_mesh(
                device_type, (self.pp, self.tp, self.dp), mesh_dim_names=("pp", "tp", "dp")
            )
        elif self.sp > 1:
            mesh = init_device_mesh(device_type, (self.dp, self.sp), mesh_dim_names=("dp", "sp"))
        return replace(self, rank=dist.get_rank(), groups=DimGroups(mesh, flat))

    def _built(self) -> DimGroups:
        assert self.groups is not None, "ParallelDims.build() first"
        return self.groups

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group losses and metrics are summed over (None: every rank)."""
        groups = self._built()
        if groups.mesh is None or (self.ep > 1 and not self.splits_layers):  # every rank
            return None
        return (groups.dp_mesh or groups.mesh["dp"]).get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The stages of this rank's replica (None: one stage, without tensor parallelism or beside ep)."""
        mesh = self._built().mesh
        return mesh["pp"].get_group() if mesh is not None and "pp" in mesh.mesh_dim_names else None

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """This rank's Ulysses group (None at sp = 1)."""
        mesh = self._built().mesh
        return None if self.sp == 1 else mesh["sp"].get_group()

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel mesh the layers are split over (None: no tensor or pipeline parallelism)."""
        mesh = self._built().mesh
        return mesh["tp"] if self.splits_layers else None

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: the data-parallel ranks (None: every rank, FSDP2 alone or Ulysses)."""
        groups = self._built()
        if self.ep > 1:
            return groups.dp_mesh
        return groups.mesh["dp"] if self.splits_layers else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ranks a MoE layer's experts are split over (None at ep = 1)."""
        mesh = self._built().mesh
        return mesh["ep"] if self.ep > 1 else None

    @property
    def experts_fsdp_mesh(self) -> DeviceMesh | None:
        """The ranks holding the same experts, which FSDP2 shards them over (None at ep = 1)."""
        mesh = self._built().mesh
        return mesh["dp_rep"] if self.ep > 1 else None

    def __str__(self) -> str:
        if self.ep > 1 and not self.splits_layers:
            return f"(fsdp={self.world}, ep={self.ep})"
        if self.ep > 1:
            return f"(tp={self.tp}, pp={self.pp}, dp={self.dp}, ep={self.ep})"
        if self.fsdp_only:
            return f"(fsdp={self.world})" if self.sp == 1 else f"(fsdp={self.world}, sp={self.sp})"
        return f"(tp={self.tp}, pp={self.pp}, dp={self.dp})"


def group_budgets(section: Any, sp: int) -> Any:
    """A role section (actor, critic) whose per-GPU token budget is per group: times sp (each rank holds 1/sp)."""
    if sp == 1:
        return section
    return replace(section, ppo_max_token_len_per_gpu=section.ppo_max_token_len_per_gpu * sp)


def _chunk(lo: int, hi: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of the range [lo, hi) as ``torch.chunk`` splits it (empty parts at the end)."""
    size = -(-(hi - lo) // parts)
    return min(lo + i * size, hi), min(lo + (i + 1) * size, hi)


def train_box(
    kind: str,
    shape: tuple[int, ...],
    view: ParallelDims,
    rank: int,
    fsdp_dim: int = 0,
    stages: tuple[int, ...] | None = None,
) -> Box | None:
    """The box of a full parameter ``rank`` holds in ``view``, from the parameter's tensor-parallel ``kind``
    (``layout.kind_of``) alone: what the DTensors give (a test checks it), for plans of models no machine
    here can hold. Layers' column (and kv) weights split dim 0 over tp, row weights dim 1; FSDP2 then splits
    the rank's piece over dp along ``fsdp_dim`` (dim 0, or the dim a layout function marked). ``stages``: the
    pipeline stages holding the parameter (None: every stage). ``kind="experts"``: a MoE block's fused
    experts (E, ...) under expert parallelism, E / ep whole experts per ep rank, FSDP2 over ``dp_rep``."""
    if kind == "experts" and view.ep > 1:  # whole experts over ep, then FSDP2 over the ranks holding them
        rep_rank, ep_rank = view.ep_coords(rank)
        box = [(0, n) for n in shape]
        box[0] = _chunk(0, shape[0], view.ep, ep_rank)
        box[fsdp_dim] = _chunk(*box[fsdp_dim], view.dp // view.ep, rep_rank)
        return None if any(lo >= hi for lo, hi in box) else tuple(box)
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
