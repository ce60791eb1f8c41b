"""The reshard plan as data: every rank receives exactly the part of its generation shard it lacks, once."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan, chunk_box
from hybridflow.engine.parallel.layout import ShardLayout, check_tp, kind_of
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.engine.rollout.tp import shard_config
from hybridflow.models import build_tiny_model

# A layer's worth of shapes (hidden 64, 8 heads of 8, 2 KV heads, intermediate 96, vocab 101, odd on purpose)
SHAPES = {
    "model.embed_tokens.weight": (101, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "model.layers.0.self_attn.k_proj.weight": (16, 64),
    "model.layers.0.self_attn.v_proj.weight": (16, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (96, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 96),
    "model.norm.weight": (64,),
    "lm_head.weight": (101, 64),
}


def plan_for(world: int, tp: int, row_dim1: bool, vocab: int = 101) -> ReshardPlan:
    specs = []
    for name, shape in SHAPES.items():
        shape = (vocab, shape[1]) if shape[0] == 101 else shape
        kind = kind_of(name)
        dim = 1 if row_dim1 and kind == "row" and shape[1] % world == 0 else 0
        specs.append(ParamSpec(name, shape, dim, ShardLayout(kind, shape, tp, head_rows=8)))
    return ReshardPlan(specs, GenerateView(world, tp), elem_size=2, bucket_bytes=4096)


def elements(box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(lo, hi) for lo, hi in box))) if box is not None else set()


@pytest.mark.parametrize(("world", "tp"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 8)])
@pytest.mark.parametrize("row_dim1", [False, True])
def test_each_rank_receives_what_it_lacks_exactly_once(world: int, tp: int, row_dim1: bool) -> None:
    plan = plan_for(world, tp, row_dim1)
    for rank in range(world):
        want = 0
        for i, p in enumerate(plan.params):
            need = elements(plan.needed(i, rank))
            got: list[tuple[int, ...]] = []
            for t in plan.transfers:
                if t.param == i and t.dst == rank:
                    assert elements(t.box) <= elements(plan.held(i, t.src))  # the sender holds it
                    got += elements(t.box)
            assert sorted(got) == sorted(need), p.name  # every needed element, once
            want += len(need - elements(plan.held(i, rank)))
        assert plan.bytes_received(rank) == want * 2  # the minimum: what the rank does not hold itself
    assert sum(plan.bytes_sent(r) for r in range(world)) == sum(plan.bytes_received(r) for r in range(world))


def test_training_shards_inside_generation_shards_mean_small_gathers() -> None:
    """HybridFlow's ordering: rank r's shard lies inside its generation shard; peers share its tp rank.

    (With sizes the ranks divide: an uneven FSDP chunk can straddle two generation shards.)
    """
    plan = plan_for(8, 2, row_dim1=True, vocab=128)
    view = plan.view
    for t in plan.transfers:
        kind = plan.params[t.param].layout.kind
        assert view.tp_rank(t.src) == view.tp_rank(t.dst) or kind in ("replicated", "kv"), plan.params[
            t.param
        ]
    at_full_tp = plan_for(8, 8, row_dim1=True, vocab=128)
    sharded = [i for i, p in enumerate(at_full_tp.params) if p.layout.kind in ("column", "row")]
    assert not [t for t in at_full_tp.transfers if t.param in sharded and t.src != t.dst]  # nothing moves


def test_generation_buffers_are_a_tp_th_of_a_copy_but_for_replicated_parts() -> None:
    full = plan_for(4, 1, True).generation_bytes()
    half = plan_for(4, 2, True).generation_bytes()
    assert full == plan_for(4, 1, True).full_bytes()
    assert 0.5 * full < half < 0.55 * full  # norms, the shared KV heads and the vocabulary's padding row
    assert "rank 3: receives" in str(plan_for(4, 2, True)) and "generate_view=(tp=2, dp=2)" in str(
        plan_for(4, 2, True)
    )


def test_buckets_cover_the_parameters_in_order() -> None:
    plan = plan_for(2, 2, True)
    assert [i for b in plan.buckets for i in b] == list(range(len(SHAPES)))
    assert len(plan.buckets) > 1


def test_fsdp_chunks_follow_torch_chunk() -> None:
    boxes = [chunk_box((5, 3), 0, 4, r) for r in range(4)]
    assert boxes == [((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 5), (0, 3)), None]  # the last chunk is empty
    assert [tuple(c.shape) for c in torch.arange(15).view(5, 3).chunk(4)] == [(2, 3), (2, 3), (1, 3)]
    assert chunk_box((6, 8), 1, 4, 3) == ((0, 6), (6, 8)) and chunk_box((6,), None, 4, 2) == ((0, 6),)


def test_kv_heads_fewer_than_tp_are_shared() -> None:
    layout = ShardLayout("kv", (16, 64), 4, head_rows=8)  # 2 KV heads, tp 4
    assert layout.local_shape() == (8, 64)
    assert [layout.box(t)[0] for t in range(4)] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    vocab = ShardLayout("vocab", (101, 64), 4)
    assert vocab.local_shape() == (26, 64) and vocab.box(3) == ((78, 101), (0, 64))


def test_models_that_tp_cannot_split_are_named() -> None:
    config = build_tiny_model(
        "qwen2", vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=2
    ).config
    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=4 .*num_attention_heads=6"):
        check_tp(config, 4)
    assert shard_config(config, 2).num_attention_heads == 3 and shard_config(config, 2).head_dim == 8
    with pytest.raises(ValueError, match="no tensor-parallel layout"):
        kind_of("model.layers.0.mlp.experts.0.weight")
