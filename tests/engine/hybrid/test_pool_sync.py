"""Weights streamed from a trainer pool to a separate rollout pool through a cross-pool reshard plan.

The plan as data (trainer ranks holding ``train_box`` boxes, the rollout pool's view placed after them): no
transfer into a trainer rank, every needed element from exactly one holder. On gloo processes (``PoolSync``):
trainer ranks holding whole replicas or real FSDP2 shards over a mesh of the trainer pool only, rollout
ranks building their shard from a meta skeleton; every rollout rank's buffers equal its slice of the full
weights bit-exact after a first sync and, in the same tensors, after the trainer changes its weights; the
bytes received are the plan's and the trainer ranks receive nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist_util import run_world_kept
from test_plan import SHAPES

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan, contains, intersect, volume
from hybridflow.engine.hybrid.pool_sync import PoolSync
from hybridflow.engine.parallel.dims import ParallelDims, train_box
from hybridflow.engine.parallel.layout import ShardLayout, kind_of
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.models import build_tiny_model

VOCAB, HIDDEN = 65, 32  # an odd vocabulary: uneven FSDP chunks and a padded last vocabulary slice


def plan_problems(plan: ReshardPlan) -> list[str]:
    """What breaks the cross-pool rules: a transfer into or out of the wrong pool, a box not held by its
    sender or not needed by its receiver, a needed element received twice or not at all."""
    view, out = plan.view, []
    for t in plan.transfers:
        if view.generates(t.src) or not view.generates(t.dst):
            out.append(f"{plan.params[t.param].name}: {t.src} -> {t.dst} crosses the pools the wrong way")
        if not contains(plan.held(t.param, t.src), t.box) or not contains(plan.needed(t.param, t.dst), t.box):
            out.append(f"{plan.params[t.param].name}: {t.box} from {t.src} to {t.dst} not held or not needed")
    for rank in range(plan.world):
        for i, p in enumerate(plan.params):
            boxes = [t.box for t in plan.transfers if t.param == i and t.dst == rank]
            overlap = any(intersect(a, b) for j, a in enumerate(boxes) for b in boxes[j + 1 :])
            # disjoint boxes inside the needed one whose volumes add up to it: an exact cover
            if overlap or sum(map(volume, boxes)) != volume(plan.needed(i, rank)):
                out.append(
                    f"{p.name}@{rank}: received {sum(map(volume, boxes))} of {volume(plan.needed(i, rank))}"
                )
    return out


def cross_plan(trainers: int, rollout: int, tp: int, tp_train: int = 1) -> ReshardPlan:
    """SHAPES from ``ParallelDims(trainers, tp=tp_train)`` on ranks 0..T-1 into R rollout ranks after them."""
    dims = ParallelDims(trainers, tp=tp_train)
    specs, holdings = [], [[] for _ in range(trainers + rollout)]
    for name, shape in SHAPES.items():
        layout = ShardLayout(kind_of(name), shape, tp, head_rows=8)
        specs.append(ParamSpec(name, shape, None, layout))
        for rank in range(trainers):
            holdings[rank].append(train_box(kind_of(name), shape, dims, rank))
        for rank in range(trainers, trainers + rollout):
            holdings[rank].append(None)  # the rollout pool holds nothing
    view = GenerateView(rollout, tp, first=trainers)
    return ReshardPlan(specs, view, 2, 4096, holdings, str(dims))


@pytest.mark.parametrize(
    ("trainers", "rollout", "tp", "tp_train"),
    [(1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 1), (4, 2, 2, 2)],
)
def test_the_cross_pool_plan_sends_only_from_trainers_each_element_once(
    trainers: int, rollout: int, tp: int, tp_train: int
) -> None:
    plan = cross_plan(trainers, rollout, tp, tp_train)
    assert plan.cross_pool and plan.world == trainers + rollout and plan_problems(plan) == []
    assert plan.uncovered() == []
    for rank in range(trainers):
        assert plan.bytes_received(rank) == 0 and plan.bytes_sent(rank) > 0
    for rank in range(trainers, trainers + rollout):  # nothing held locally: every needed element comes over
        need = sum(volume(plan.needed(i, rank)) for i in range(len(plan.params)))
        assert plan.bytes_received(rank) == need * 2 and plan.bytes_sent(rank) == 0
    assert sum(map(plan.bytes_sent, range(plan.world))) == sum(map(plan.bytes_received, range(plan.world)))
    assert f"rank {trainers} (rollout): receives" in str(plan) and "rank 0 (trainer)" in str(plan)


def test_a_view_on_a_pool_numbers_its_groups_inside_it() -> None:
    view = GenerateView(4, 2, first=3)
    assert [view.generates(r) for r in range(8)] == [False] * 3 + [True] * 4 + [False]
    assert [(view.tp_rank(r), view.dp_rank(r)) for r in range(3, 7)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert view.group_ranks(1) == [4, 6] and str(view) == "(tp=2, dp=2, ranks 3-6)"
    assert str(GenerateView(4, 2)) == "(tp=2, dp=2)"  # the colocated view prints as before
    with pytest.raises(ValueError, match=r"not one of the generation view's ranks 3\.\.6"):
        view.tp_rank(0)
    with pytest.raises(ValueError, match="needs every rank's holdings"):
        ReshardPlan(cross_plan(1, 1, 1).params, GenerateView(2, 1, first=1), 2, 4096)


def full_weights(arch: str) -> torch.nn.Module:
    """The model every rank builds alike (the trainer's weights; on a rollout rank only the reference)."""
    return build_tiny_model(arch, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, seed=1)


def _expected(layout: ShardLayout, full: torch.Tensor, t: int, dtype: torch.dtype) -> torch.Tensor:
    """Tensor-parallel rank ``t``'s generation buffer of ``full`` (zeros where it needs nothing)."""
    out = torch.zeros(layout.local_shape(), dtype=dtype)
    box = layout.box(t)
    if box is not None:
        part = layout.plan_view(full)[tuple(slice(lo, hi) for lo, hi in box)]
        layout.plan_view(out)[tuple(slice(0, n) for n in part.shape)] = part.to(dtype)
    return out


def _trainer_module(lm: torch.nn.Module, fsdp: bool, trainer_group) -> torch.nn.Module:
    """A trainer rank's module: FSDP2 shards over a mesh of the trainer pool only, or a whole replica."""
    if not fsdp:
        return copy.deepcopy(lm)
    from torch.distributed.device_mesh import DeviceMesh

    from hybridflow.engine.parallel.fsdp import shard_model

    sharded = copy.deepcopy(lm)
    mesh = DeviceMesh.from_group(trainer_group, "cpu")
    return shard_model(sharded, list(sharded.model.layers), torch.device("cpu"), mesh=mesh)


def _mismatches(sync: PoolSync, lm: torch.nn.Module, t: int, dtype: torch.dtype, scale: float) -> list[str]:
    """The generation weights that are not rank ``t``'s slice of ``scale`` x the full weights, bit for bit."""
    from hybridflow.engine.parallel.layout import layouts

    lays, full = layouts(lm, sync.view.tp, sync.view.ep), dict(lm.named_parameters())
    got = dict(sync.module.named_parameters())
    return [n for n in got if not torch.equal(got[n], _expected(lays[n], scale * full[n].detach(), t, dtype))]


def stream(rank: int, spec: dict) -> dict | None:
    """One run of the stream on this rank: two syncs, the trainer scaling its weights between them."""
    import torch.distributed as dist

    from hybridflow.engine.rollout.tp import meta_model

    dist.init_process_group("gloo")
    spare = spec.get("spare", 0)  # ranks 0..spare-1 take no part (another role's ranks)
    trainers, rollout, tp, ep = spec["trainers"], spec["rollout"], spec["tp"], spec.get("ep", 1)
    dtype = spec.get("dtype", torch.float32)
    group = dist.new_group(list(range(spare, spare + trainers + rollout))) if spare else None
    trainer_group = dist.new_group(list(range(spare, spare + trainers)))  # collective: every rank creates it
    if rank < spare:
        return None
    view = GenerateView(rollout, tp, ep, first=trainers)  # in the group's ranks: the trainer pool first
    me = rank - spare
    lm = full_weights(spec["arch"])
    cpu = torch.device("cpu")
    trainer = None if view.generates(me) else _trainer_module(lm, spec.get("fsdp", False), trainer_group)
    sync = PoolSync(trainer if trainer is not None else meta_model(lm), view, dtype, cpu, 1 << 13, group)
    first = sync.sync(trainer)
    wrong = [_mismatches(sync, lm, view.tp_rank(me), dtype, 1.0)] if sync.module is not None else []
    if trainer is not None:
        with torch.no_grad():
            for p in trainer.parameters():  # a "training step" on this rank's shards
                getattr(p, "_local_tensor", p).mul_(-0.5)
    ptrs = None if sync.module is None else [p.data_ptr() for p in sync.module.parameters()]
    second = sync.sync(trainer)
    out = {"received": [first, second], "plan_bytes": sync.plan.bytes_received(me)}
    out["problems"] = plan_problems(sync.plan) if me == 0 else None
    out["sent"], out["has_module"] = sync.plan.bytes_sent(me), sync.module is not None
    if sync.module is None:
        return out
    out["wrong"] = [*wrong, _mismatches(sync, lm, view.tp_rank(me), dtype, -0.5)]
    out["same_tensors"] = ptrs == [p.data_ptr() for p in sync.module.parameters()]
    out["whole_bytes"] = sum(p.numel() for p in lm.parameters()) * torch.empty((), dtype=dtype).element_size()
    if tp == 1 and dtype == torch.float32:  # a whole replica: the trainer's logits (its buffers came over)
        ids = torch.tensor([[3, 4, 5, 6]])
        with torch.no_grad():
            for p in lm.parameters():
                p.mul_(-0.5)
            out["same_logits"] = torch.equal(sync.module(ids).logits, lm(ids).logits)
    out["line"] = sync.sync_line()
    return out


def check(results: list, spec: dict) -> None:
    """Every rollout rank filled bit-exact in the same tensors, bytes as planned, nothing into a trainer."""
    spare, trainers = spec.get("spare", 0), spec["trainers"]
    results = results[spare:]
    assert results[0]["problems"] == []
    for me, out in enumerate(results):
        assert out["received"] == [out["plan_bytes"]] * 2, me  # what the all-to-alls delivered, both syncs
        if me < trainers:
            assert out["plan_bytes"] == 0 and not out["has_module"], me
            continue
        assert out["wrong"] == [[], []] and out["same_tensors"] and out["sent"] == 0, (me, out["wrong"])
        assert out["plan_bytes"] > 0 and "Pool sync:" in out["line"]
        if spec["tp"] == 1:
            assert out["plan_bytes"] == out["whole_bytes"] and out.get("same_logits", True), me
    assert sum(r["sent"] for r in results) == sum(r["plan_bytes"] for r in results)


WORLD_2 = [dict(trainers=1, rollout=1, tp=1, arch="qwen2")]
WORLD_3 = [
    dict(trainers=2, rollout=1, tp=1, arch="qwen2", fsdp=True),  # real FSDP2 shards on a sub-mesh
    dict(trainers=1, rollout=2, tp=1, arch="qwen2"),  # two rollout groups of one rank
    dict(trainers=1, rollout=2, tp=2, arch="qwen2", dtype=torch.bfloat16),  # cast on the way
    dict(trainers=1, rollout=1, tp=1, arch="qwen2", spare=1),  # the two pools a subgroup of the world
    dict(trainers=1, rollout=2, tp=2, arch="qwen2_moe"),  # every expert sliced over the group
    dict(trainers=1, rollout=2, tp=2, ep=2, arch="mixtral"),  # whole experts split over the group
]
WORLD_4 = [
    dict(trainers=2, rollout=2, tp=2, arch="qwen2", fsdp=True),
    dict(trainers=2, rollout=2, tp=2, arch="qwen2_moe", fsdp=True),
]
BASE = ("trainers", "rollout", "tp", "arch")  # every case's keys; the others are named in its id


def _name(spec: dict) -> str:
    """``T2+R2-tp2-qwen2-fsdp``: the pools, the rollout's view and the model of a case."""
    extra = [k if v is True else f"{k}{v}".replace("torch.", "") for k, v in spec.items() if k not in BASE]
    return "-".join([f"T{spec['trainers']}+R{spec['rollout']}", f"tp{spec['tp']}", spec["arch"], *extra])


# Ordered by world size: the kept processes of one size serve its cases in a row.
@pytest.mark.parametrize("spec", WORLD_2 + WORLD_3 + WORLD_4, ids=_name)
def test_the_rollout_pool_receives_its_shard_bit_exact_in_place(spec: dict) -> None:
    world = spec.get("spare", 0) + spec["trainers"] + spec["rollout"]
    check(run_world_kept(world, stream, spec), spec)
