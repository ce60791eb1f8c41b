"""The reshard plan from an expert-parallel training view (ep whole experts per group, FSDP2 over the rest)
into generation views whose ranks hold whole replicas (tp_g = 1), slices of every expert on its
intermediate dim (tp_g = 2: gate_up's two halves sliced alike, down on its last dim, the router replicated),
or whole experts split over the group (EP generation, ep_g = tp_g): every rank receives exactly the
elements it lacks, each from one holder, and on gloo processes the resharder fills the buffers bit-exact."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.dist_util import run_world_kept as run_world

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan, volume
from hybridflow.engine.parallel.dims import ParallelDims, train_box
from hybridflow.engine.parallel.ep import is_expert
from hybridflow.engine.parallel.layout import ShardLayout, generation_kind
from hybridflow.engine.parallel.view import GenerateView

E, H, INTER = 4, 16, 12  # experts, hidden, expert intermediate (gate_up is (E, 2I, H))
SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (H, H),
    "model.layers.0.self_attn.o_proj.weight": (H, H),
    "model.layers.0.mlp.gate.weight": (E, H),
    "model.layers.0.mlp.experts.gate_up_proj": (E, 2 * INTER, H),
    "model.layers.0.mlp.experts.down_proj": (E, H, INTER),
    "model.layers.0.mlp.shared_expert.up_proj.weight": (INTER, H),
    "model.layers.0.mlp.shared_expert_gate.weight": (1, H),
    "model.norm.weight": (H,),
}
VIEWS = [(2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 2, 2), (4, 4, 2), (4, 4, 4)]  # (world, ep, tp_g)
EP_VIEWS = [(2, 2, 2), (4, 2, 2), (4, 2, 4), (4, 4, 2), (4, 4, 4)]  # (world, ep, tp_g = ep_g)


def plan_for(world: int, ep: int, tp: int, ep_g: int = 1) -> ReshardPlan:
    """The plan of SHAPES from ``ParallelDims(world, ep=ep)`` (its boxes as the DTensors hold them) to tp_g
    (``ep_g`` = tp_g: the experts split whole over each generation group)."""
    view = ParallelDims(world, ep=ep)
    specs, holdings = [], [[] for _ in range(world)]
    for name, shape in SHAPES.items():
        layout = ShardLayout(generation_kind(name, ep_g) if tp > 1 else "replicated", shape, tp)
        specs.append(ParamSpec(name, layout.plan_shape, None, layout))
        kind = "experts" if is_expert(name) else "replicated"
        for rank in range(world):
            holdings[rank].append(layout.to_plan(train_box(kind, shape, view, rank)))
    return ReshardPlan(specs, GenerateView(world, tp, ep_g), 4, 1 << 12, holdings, str(view))


def elements(box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(lo, hi) for lo, hi in box))) if box is not None else set()


@pytest.mark.parametrize(("world", "ep", "tp"), VIEWS)
def test_each_generation_rank_receives_its_experts_or_slices_once_from_a_holder(
    world: int, ep: int, tp: int
) -> None:
    plan = plan_for(world, ep, tp)
    for rank in range(world):
        for i, p in enumerate(plan.params):
            need = elements(plan.needed(i, rank))
            got: list[tuple[int, ...]] = []
            for t in (t for t in plan.transfers if t.param == i and t.dst == rank):
                assert elements(t.box) <= elements(plan.held(i, t.src))  # the sender holds it
                got += elements(t.box)
            assert sorted(got) == sorted(need), p.name  # every needed element, exactly once
    experts = plan.params[3]  # fused experts: (E, 2, I, H) to the plan when sliced, each rank [gate_t; up_t]
    assert experts.shape == ((E, 2, INTER, H) if tp > 1 else (E, 2 * INTER, H))
    assert experts.layout.local_shape() == (E, 2 * INTER // tp, H)
    assert f"train_view=(fsdp={world}, ep={ep})" in str(plan)


def test_ep_generation_ranks_receive_whole_experts_once_from_a_holder() -> None:
    for world, ep, tp in EP_VIEWS:
        plan = plan_for(world, ep, tp, ep_g=tp)
        assert f"generate_view=(tp={tp}, ep={tp}, dp={world // tp})" in str(plan)
        for rank in range(world):
            for i, p in enumerate(plan.params):
                got = []
                for t in (t for t in plan.transfers if t.param == i and t.dst == rank):
                    assert elements(t.box) <= elements(plan.held(i, t.src))
                    got += elements(t.box)
                assert sorted(got) == sorted(elements(plan.needed(i, rank))), (world, ep, tp, p.name)
        gate_up, down = plan.params[3], plan.params[4]  # whole experts: native (E, 2I, H), a box on dim 0
        t = plan.view.tp_rank(world - 1)
        assert gate_up.layout.local_shape() == (E // tp, 2 * INTER, H)
        assert plan.needed(3, world - 1) == ((t * E // tp, (t + 1) * E // tp), (0, 2 * INTER), (0, H))
        assert down.layout.local_shape() == (E // tp, H, INTER)
        if ep == tp:  # train and generate split the experts alike: the ep peers' copies, no slicing
            sizes = {volume(x.box) for x in plan.transfers if x.param == 3}
            assert sizes <= {E // tp * 2 * INTER * H // (world // ep), E // tp * 2 * INTER * H}


def reshard_experts(rank: int, world: int, ep: int, tp: int, ep_g: int = 1) -> dict[str, bool]:
    """Each rank's training boxes cut from known full tensors, resharded into its generation buffers: whether
    each buffer is exactly its slice of the full tensor (gate_up: ``[gate_t; up_t]``)."""
    import torch.distributed as dist

    from hybridflow.engine.hybrid.resharder import Resharder

    dist.init_process_group("gloo")
    plan = plan_for(world, ep, tp, ep_g)
    sources, targets, want = [], [], {}
    for i, p in enumerate(plan.params):
        shape, layout = p.layout.shape, p.layout
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        held = plan.held(i, rank)  # in plan coordinates: cut the plan view of the full tensor
        view = layout.plan_view(full)
        sources.append(view[tuple(slice(lo, hi) for lo, hi in held)] if held else torch.empty(0))
        buffer = torch.full(layout.local_shape(), float("nan"))
        targets.append(layout.plan_view(buffer))
        need = plan.needed(i, rank)
        want[p.name] = (buffer, view[tuple(slice(lo, hi) for lo, hi in need)].reshape(buffer.shape))
    Resharder(plan, rank, torch.device("cpu"), torch.float32).run(sources, targets)
    return {name: torch.equal(got, expected) for name, (got, expected) in want.items()}


@pytest.mark.parametrize(("world", "ep", "tp"), [(2, 2, 2), (4, 2, 2), (4, 4, 1)])
def test_the_resharder_fills_expert_slices_bit_exact(world: int, ep: int, tp: int) -> None:
    for rank, same in enumerate(run_world(world, reshard_experts, world, ep, tp)):
        assert all(same.values()), (rank, [n for n, ok in same.items() if not ok])
    whole = torch.arange(E * 2 * INTER * H, dtype=torch.float32).view(E, 2 * INTER, H)
    layout = ShardLayout("experts_column", (E, 2 * INTER, H), 2)
    box = layout.box(1)  # rank 1's slice: the second half of gate's rows, then of up's
    got = layout.plan_view(whole)[tuple(slice(lo, hi) for lo, hi in box)].reshape(E, INTER, H)
    assert torch.equal(got, torch.cat([whole[:, INTER // 2 : INTER], whole[:, INTER + INTER // 2 :]], dim=1))


@pytest.mark.parametrize(("world", "ep", "tp"), [(2, 2, 2), (4, 2, 2), (4, 2, 4)])
def test_the_resharder_fills_ep_generation_buffers_bit_exact(world: int, ep: int, tp: int) -> None:
    # From (fsdp, ep = 2) into whole experts split over the generation group, each rank's E / tp of them.
    for rank, same in enumerate(run_world(world, reshard_experts, world, ep, tp, tp)):
        assert all(same.values()), (rank, [n for n, ok in same.items() if not ok])


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_the_memory_estimate_of_a_tensor_parallel_moe_rollout(arch: str) -> None:
    # The automatic layout's figures: at tp_g = 2 a rank holds about half of every generation weight (the
    # router, norms and biases whole), and the plan from FSDP2 (training tp keeps the MoE blocks whole)
    # covers every needed element (ReshardPlan checks it, in the plan's (E, 2, I, H) for fused experts).
    from hybridflow.engine.hybrid.memory import unsplit_reason, view_memory
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=1)
    full = sum(p.numel() for p in model.parameters())
    assert unsplit_reason(model, 2, 2) is None
    for train in (ParallelDims(4), ParallelDims(4, tp=2)):
        one, two = (
            view_memory(model, train, 1, rollout_bytes=4),
            view_memory(model, train, 2, rollout_bytes=4),
        )
        assert one.generation_bytes == 4 * full and 0.5 < two.generation_bytes / (4 * full) < 0.51
        assert 0 < two.received_bytes < one.received_bytes
