"""plan.switch: the generation weights and switch bytes of views with experts split whole over ep_g ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.engine.hybrid.memory import view_memory
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.plan.search import meta_model
from hybridflow.plan.shapes import shape_config
from hybridflow.plan.switch import GenerateSplit, expert_sizes, generation_bytes, switch_figures

# Qwen3-30B-A3B by hand (plan/shapes.py): hidden 2048, 48 layers, 32 heads and 4 KV heads of 128 dims,
# 128 experts of intermediate 768 a layer, vocabulary 151936, untied.
H, LAYERS, E, I_MOE, VOCAB = 2048, 48, 128, 768, 151936
Q, KV = 32 * 128, 4 * 128  # q rows, k (and v) rows
EXPERT = 3 * I_MOE * H  # one expert of one layer: gate and up (2I x H) and down (H x I)
BF16 = 2


def _tiny(model_type: str, **sizes) -> torch.nn.Module:
    config = AutoConfig.for_model(
        model_type, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, **sizes
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


TINY = {
    "qwen3_moe": dict(
        num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=96, vocab_size=1000, tie_word_embeddings=False, mlp_only_layers=[0],
    ),
    "qwen2_moe": dict(
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, intermediate_size=96, vocab_size=1001, tie_word_embeddings=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_count_is_the_reshard_plans_where_the_engine_builds_the_view(family: str) -> None:
    """Every rank's bytes as the engine's reshard plan moves them, for the views it builds (ep_g 1 or tp_g)."""
    model = _tiny(family, **TINY[family])
    views = [
        (4, 1, 1, 1, 2, 1),
        (4, 1, 1, 2, 2, 2),
        (4, 2, 1, 2, 4, 4),
        (4, 1, 2, 1, 2, 2),
        (4, 2, 1, 1, 1, 1),
    ]
    for world, tp, pp, ep, tp_g, ep_g in views:
        dims = ParallelDims(world, tp, pp, 1, ep)
        engine = view_memory(model, dims, tp_g, ep_generate=ep_g)
        mine = switch_figures(model, dims, tp_g, ep_g)
        assert (mine.generation_bytes, mine.received_bytes) == (
            engine.generation_bytes,
            engine.received_bytes,
        )


def test_the_count_is_the_reshard_plans_for_a_dense_model_too() -> None:
    """KV heads shared by rollout ranks (2 KV heads over 4 and 8), a padded last vocabulary slice (999 rows),
    pipeline stages and row-parallel weights FSDP2 shards on dim 1."""
    model = _tiny(
        "llama", num_key_value_heads=2, intermediate_size=96, vocab_size=999, tie_word_embeddings=True
    )
    for world, tp, pp, tp_g in [(4, 1, 1, 4), (8, 2, 1, 8), (8, 1, 2, 4), (8, 4, 2, 2)]:
        dims = ParallelDims(world, tp, pp)
        engine, mine = view_memory(model, dims, tp_g), switch_figures(model, dims, tp_g)
        assert (mine.generation_bytes, mine.received_bytes) == (
            engine.generation_bytes,
            engine.received_bytes,
        )


def test_experts_across_rollout_groups_are_each_held_once_per_expert_group() -> None:
    split = GenerateSplit(8, 2, 4)  # tp 2, 4 groups, experts over 2 groups' ranks: 2 expert groups of 4
    assert str(split) == "(tp=2, ep=4, dp=4)" and split.span == 2
    for first in (0, 1):  # groups 0 and 1 form one expert group, 2 and 3 the other
        ranks = [r for r in range(8) if r % 4 in (2 * first, 2 * first + 1)]
        assert sorted(split.ep_rank(r) for r in ranks) == [0, 1, 2, 3]
    assert [split.ep_rank(r) for r in range(8)] == [r // 4 * 2 + r % 2 for r in range(8)]
    assert expert_sizes(8, 2, 128) == [1, 2, 4, 8] and expert_sizes(8, 4, 8) == [1, 4, 8]
    assert expert_sizes(16, 4, 8) == [1, 4, 8]  # 8 experts do not split 16 ways
    with pytest.raises(ValueError):
        GenerateSplit(8, 4, 2)  # ep below tp but above 1: neither sliced nor whole over the group


@pytest.fixture(scope="module")
def qwen3_30b() -> torch.nn.Module:
    return meta_model(shape_config("qwen3-30b-a3b"))


def test_30b_a3b_generation_weights_with_experts_across_two_groups_by_hand(qwen3_30b) -> None:
    # tp_g = 4, ep_g = 8 on 8 GPUs: a quarter of the attention and vocabulary, 16 of the 128 experts a layer
    attention = (Q * H + 2 * KV * H + H * Q) // 4 + 2 * 128 + 2 * H  # q, k, v, o; q/k norms, the layer norms
    router = E * H
    layer = attention + router + E // 8 * EXPERT
    embeddings = 2 * (VOCAB // 4) * H + H  # embedding and head, a quarter of the vocabulary each; final norm
    assert generation_bytes(qwen3_30b, 8, 4, 8) == (LAYERS * layer + embeddings) * BF16
    # whole over the group instead (ep_g = tp_g): 32 experts a layer
    assert generation_bytes(qwen3_30b, 8, 4, 4) - generation_bytes(qwen3_30b, 8, 4, 8) == (
        LAYERS * 16 * EXPERT * BF16
    )


def test_30b_a3b_switch_moves_whole_experts_from_their_training_holders_by_hand(qwen3_30b) -> None:
    """Train (fsdp=8, ep=2): rank r holds experts 64 (r % 2) + 16 (r // 2) .. +16 (ep rank r % 2, then FSDP2 over
    the 4 ranks holding the same half). Generate tp=4, ep=8: rank r holds experts 16 r .. +16, so rank 0 has
    them, rank 1 needs all 16 from others; at ep=4 (whole over each group) rank r needs 32 (r // 2) .. +32:
    rank 0 holds 16 of them, rank 1 none. Everything else moves the same in both, so the difference of two
    ranks' bytes is whole experts' alone."""
    dims = ParallelDims(8, 1, 1, 1, 2)
    wide, group = switch_figures(qwen3_30b, dims, 4, 8), switch_figures(qwen3_30b, dims, 4, 4)
    expert_bytes = LAYERS * EXPERT * BF16  # one expert of every layer
    assert group.received[0] - wide.received[0] == 16 * expert_bytes  # 16 -> 0 experts received
    assert group.received[1] - wide.received[1] == 16 * expert_bytes  # 32 -> 16
    assert wide.received[1] - wide.received[0] == 16 * expert_bytes  # rank 0 holds its own, rank 1 none


def test_671b_views_on_64_gpus() -> None:
    """DeepSeek-V3's shape: 256 routed experts a layer in 58 sparse layers, 3 dense; generate tp=8, ep=8 from
    training (fsdp=64, ep=64), where each rank holds 4 experts a layer, all among the 32 it generates with."""
    model = meta_model(shape_config("deepseek-v3-671b"))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(671.03e9, rel=1e-5)
    h, expert, sparse = 7168, 3 * 2048 * 7168, 58
    # q (and its bias) and o over 8, k and v one KV head of 96 rows each (with biases), the two layer norms
    attention = (12288 * h + 12288) // 8 + 2 * (96 * h + 96) + h * 1536 + 2 * h
    moe = 256 * h + h + 3 * 2048 * h // 8 + 32 * expert  # router, shared gate, shared expert / 8, 32 experts
    dense = 3 * 18432 * h // 8
    embeddings = 2 * (129280 // 8) * h + h
    weights = (sparse * (attention + moe) + 3 * (attention + dense) + embeddings) * BF16
    dims = ParallelDims(64, 1, 1, 1, 64)
    figures = switch_figures(model, dims, 8, 8)
    assert figures.generation_bytes == weights
    moved = sparse * 28 * expert * BF16  # 28 of each rank's 32 experts a layer come from other ranks
    assert moved < figures.received_bytes < moved + (weights - sparse * 32 * expert * BF16)
    # experts over all 64 ranks instead: 4 a layer, each rank's own, so every rank receives exactly 28 experts
    # a layer less (the attention, dense layers and embeddings move alike in both)
    assert switch_figures(model, dims, 8, 64).received == tuple(r - moved for r in figures.received)
