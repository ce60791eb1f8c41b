"""The resharder on its own: gloo processes fill their generation buffers from FSDP-style training shards.

Each rank holds the ``chunk_box`` of every full tensor the plan says it holds; after ``Resharder.run`` every
target must equal the rank's ``ShardLayout`` box of the full tensor, cast to the generation dtype, with the
parts the plan leaves unfilled (padding rows of the last vocabulary slice, a row-parallel bias off rank 0)
zero, and the bytes received equal to the plan's. Small buckets force several all-to-alls per switch.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world_kept
from test_plan import plan_for

from hybridflow.engine.hybrid.plan import ReshardPlan
from hybridflow.engine.hybrid.resharder import Resharder


def _full(plan: ReshardPlan, i: int) -> torch.Tensor:
    """Parameter ``i``'s full tensor: distinct, reproducible values."""
    shape = plan.params[i].shape
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _slice(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(lo, hi) for lo, hi in box)]


def _expected(plan: ReshardPlan, i: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The generation buffer rank ``rank`` should hold for parameter ``i`` (zeros where nothing is needed)."""
    out = torch.zeros(plan.params[i].layout.local_shape(), dtype=dtype)
    box = plan.needed(i, rank)
    if box is not None:
        part = _slice(_full(plan, i), box).to(dtype)
        out[tuple(slice(0, n) for n in part.shape)] = part
    return out


def reshard(rank: int, tp: int, row_dim1: bool, vocab: int, dtype: torch.dtype) -> dict:
    """Run one switch on this rank; return its buffers' mismatches and bytes."""
    from hybridflow.utils.dist import init_distributed, world_size

    init_distributed()
    world = world_size()
    plan = plan_for(world, tp, row_dim1, vocab)
    sources = []
    for i in range(len(plan.params)):
        held = plan.held(i, rank)
        sources.append(_slice(_full(plan, i), held).clone() if held is not None else torch.empty(0))
    targets = [torch.full(p.layout.local_shape(), 7.0, dtype=dtype) for p in plan.params]  # stale values
    resharder = Resharder(plan, rank, torch.device("cpu"), dtype)
    received = resharder.run(sources, targets)
    wrong = [
        p.name
        for i, p in enumerate(plan.params)
        if not torch.equal(targets[i], _expected(plan, i, rank, dtype))
    ]
    return {
        "wrong": wrong,
        "received": received,
        "plan_bytes": plan.bytes_received(rank),
        "buckets": len(plan.buckets),
    }


@pytest.mark.parametrize(
    "world,tp,row_dim1,vocab",
    [(2, 1, False, 101), (2, 2, True, 101), (4, 2, True, 101), (4, 4, False, 5)],  # vocab 5 < 4 slices of 2
)
def test_every_rank_gets_exactly_its_generation_shard(
    world: int, tp: int, row_dim1: bool, vocab: int
) -> None:
    results = run_world_kept(world, reshard, tp, row_dim1, vocab, torch.bfloat16)
    for rank, out in enumerate(results):
        assert out["wrong"] == [], f"rank {rank}"
        assert out["received"] == out["plan_bytes"] and out["buckets"] > 1
    assert sum(r["received"] for r in results) > 0


def test_one_rank_copies_locally_and_receives_nothing() -> None:
    (out,) = run_world_kept(1, reshard, 1, False, 101, torch.float32)
    assert out == {"wrong": [], "received": 0, "plan_bytes": 0, "buckets": out["buckets"]}
