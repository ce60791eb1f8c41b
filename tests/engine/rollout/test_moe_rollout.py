"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral) in the built-in rollout engine on CPU: greedy tokens equal
to HF ``generate``, sampled log-probs equal to the trainer's recomputation, preemption changing nothing, the
routing records (router replay) equal to what ``MoEBlock`` chooses on prompt + response, a model with dense and
sparse layers, weights refreshed in place, and DeepSeek-V3 (MLA) refused with HF ``generate`` instead."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from test_engine import PROMPTS, greedy, hf_greedy_left_padded
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen2MoeForCausalLM

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.factory import make_rollout
from hybridflow.engine.rollout.hf_fallback import HFRollout
from hybridflow.engine.rollout.kv_cache import PagedKVCache
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.support import fallback_reason
from hybridflow.engine.rollout.types import GenerationOutput
from hybridflow.models.moe import install_moe, keep_records, records
from hybridflow.models.tiny import build_tiny_model
from hybridflow.utils.errors import UserError

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")


def lively_moe(
    arch: str, layers: int = 2, dense_layers: tuple[int, ...] = (), seed: int = 1, scale: float = 0.5
) -> torch.nn.Module:
    """A tiny MoE with large weights (``scale``: greedy outputs vary) and routers drawn (N(0, 0.5)) so that
    tokens pick differently."""
    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=layers, seed=seed)
    if dense_layers:  # Qwen2-MoE's mlp_only_layers: these layers keep a plain MLP
        config = copy.deepcopy(model.config)
        config.mlp_only_layers = list(dense_layers)
        torch.manual_seed(seed)
        model = Qwen2MoeForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):  # as tests/models/test_moe.py: routers start at zero in some
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def routing_by_moe_block(model: torch.nn.Module, prompt: list[int], out: GenerationOutput) -> torch.Tensor:
    """The experts ``MoEBlock`` (the trainer's block) chooses on prompt + response but its last token:
    (P + R - 1, sparse layers, k)."""
    keep_records(model, True)
    try:
        with torch.no_grad():
            model(torch.tensor([prompt + out.token_ids[:-1]]))
        return torch.stack([r.ids for r in records(model)], dim=1)  # (N, L, k)
    finally:
        keep_records(model, False)


def tokens(outs: list[list[GenerationOutput]]) -> list[list[tuple[list[int], str]]]:
    return [[(s.token_ids, s.finish_reason) for s in g] for g in outs]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_equal_hf_generate(arch: str) -> None:
    model = lively_moe(arch)
    want = hf_greedy_left_padded(model, PROMPTS, 8)
    assert len({tuple(t) for t in want}) == len(PROMPTS)  # lively: the prompts' outputs differ
    engine = PagedEngine(model, num_blocks=64, block_size=4)
    assert [g[0].token_ids for g in engine.generate(PROMPTS, greedy(8))] == want
    # n samples sharing a prompt's prefill, EOS ids that end them at different places.
    free = engine.generate(PROMPTS, greedy(10))
    stops = [free[0][0].token_ids[3], free[2][0].token_ids[6]]
    got = engine.generate(PROMPTS, greedy(10, n=2, eos_token_ids=stops))
    for f, g in zip(free, got):
        end = next((k + 1 for k, t in enumerate(f[0].token_ids) if t in stops), 10)
        assert [s.token_ids for s in g] == [f[0].token_ids[:end]] * 2
    assert {s.finish_reason for g in got for s in g} == {"eos", "length"}
    assert all(s.routed_experts is None for g in got for s in g)  # not asked for


def test_hf_blocks_and_moe_blocks_generate_alike() -> None:
    model = lively_moe("qwen2_moe")
    installed = copy.deepcopy(model)
    assert install_moe(installed) == 2
    params = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=5)
    a = PagedEngine(model, num_blocks=64, block_size=4).generate(PROMPTS, params)
    b = PagedEngine(installed, num_blocks=64, block_size=4).generate(PROMPTS, params)
    assert tokens(a) == tokens(b)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_sampled_log_probs_equal_the_trainers_recomputation(arch: str) -> None:
    # Smaller weights than the greedy tests': float32 rounding grows with the logits (at scale 0.5 they reach
    # ~20 and both dense and MoE models differ from the recomputation by up to ~1.5e-5; here ~3e-6).
    model = lively_moe(arch, scale=0.2)
    install_moe(model)  # as the trainer loads it
    params = SamplingParams(temperature=0.7, max_new_tokens=9, n=3, seed=11)
    out = PagedEngine(model, num_blocks=64, block_size=4).generate(PROMPTS, params)
    assert len({tuple(s.token_ids) for s in out[1]}) > 1  # the samples differ
    for prompt, samples in zip(PROMPTS, out):
        for s in samples:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
            want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_recorded_routing_equals_what_moe_block_chooses(arch: str) -> None:
    model = lively_moe(arch)
    install_moe(model)
    # Samples end by EOS at different places and ride along until the next sync (sync_interval): their
    # records must not be overwritten meanwhile.
    engine = PagedEngine(model, num_blocks=64, block_size=4, record_routing=True, sync_interval=10)
    free = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3))
    stops = [free[0][0].token_ids[2], free[1][1].token_ids[5]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3, eos_token_ids=stops)
    out = engine.generate(PROMPTS, params)
    assert {s.finish_reason for g in out for s in g} == {"eos", "length"}
    for prompt, samples in zip(PROMPTS, out):
        for s in samples:
            got = s.routed_experts
            assert got.dtype == torch.uint8 and got.device.type == "cpu"
            assert got.shape == (len(prompt) + len(s.token_ids) - 1, 2, 2)
            assert torch.equal(got.long(), routing_by_moe_block(model, prompt, s))
    assert len({tuple(s.routed_experts[:, 0, 0].tolist()) for g in out for s in g}) > 4  # choices differ


def test_a_pool_that_forces_preemption_changes_no_token_and_no_record() -> None:
    model = lively_moe("qwen3_moe")
    install_moe(model)
    params = greedy(12, n=2)
    roomy = PagedEngine(model, num_blocks=64, block_size=4, record_routing=True)
    want = roomy.generate(PROMPTS, params)
    small = PagedEngine(model, num_blocks=12, block_size=4, record_routing=True)
    got = small.generate(PROMPTS, params)
    assert small.preemptions > 0 and roomy.preemptions == 0
    assert tokens(got) == tokens(want)
    for prompt, g, w in zip(PROMPTS, got, want):
        for s, t in zip(g, w):
            assert torch.equal(s.routed_experts, t.routed_experts)
            assert torch.equal(s.routed_experts.long(), routing_by_moe_block(model, prompt, s))


def test_a_model_with_dense_and_sparse_layers() -> None:
    model = lively_moe("qwen2_moe", layers=3, dense_layers=(0,))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "Qwen2MoeMLP",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeSparseMoeBlock",
    ]
    want = hf_greedy_left_padded(model, PROMPTS, 8)
    engine = PagedEngine(model, num_blocks=64, block_size=4, record_routing=True)
    out = engine.generate(PROMPTS, greedy(8))
    assert [g[0].token_ids for g in out] == want
    assert [layer.moe is None for layer in engine.runner.layers] == [True, False, False]
    install_moe(model)
    for prompt, (s,) in zip(PROMPTS, out):
        assert s.routed_experts.shape == (len(prompt) + 7, 2, 2)  # the two sparse layers only
        assert torch.equal(s.routed_experts.long(), routing_by_moe_block(model, prompt, s))


def test_cast_expert_buffers_follow_the_trainers_update() -> None:
    model = lively_moe("mixtral")
    engine = PagedEngine(model, num_blocks=64, block_size=4, dtype=torch.bfloat16)
    before = engine.generate(PROMPTS, greedy(6))
    assert engine.runner.layers[0].moe.gate_up.dtype == torch.bfloat16  # a cast buffer, not the parameter
    with torch.no_grad():  # the trainer's step, in place
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(-1.0)
            layer.mlp.gate.weight.mul_(-1.0)
    after = engine.generate(PROMPTS, greedy(6))
    fresh = PagedEngine(model, num_blocks=64, block_size=4, dtype=torch.bfloat16).generate(PROMPTS, greedy(6))
    assert tokens(after) == tokens(fresh) and tokens(after) != tokens(before)


def test_recording_needs_a_mixture_of_experts() -> None:
    dense = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(UserError, match="record_routing"):
        PagedEngine(dense, num_blocks=8, block_size=4, record_routing=True)
    config = copy.deepcopy(lively_moe("qwen3_moe", layers=1).config)
    config.num_experts = 255  # uint8 records keep 255 for "not routed" (the trainer's batch layout)
    wide = type(lively_moe("qwen3_moe", layers=1))(config).eval()
    PagedEngine(wide, num_blocks=8, block_size=4)  # runs; only recording is refused
    with pytest.raises(UserError, match="at most 254"):
        PagedEngine(wide, num_blocks=8, block_size=4, record_routing=True)


def test_deepseek_v3_is_refused_naming_mla_and_falls_back_to_hf_generate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    assert "MLA" in fallback_reason(model)
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        rollout = make_rollout(model)
    assert isinstance(rollout, HFRollout)
    assert len([r for r in caplog.records if "HF generate" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="MLA"):
        PagedEngine(model)


def test_the_sparse_decode_step_traces_whole_and_records_in_place() -> None:
    """As the compiled engine runs it (aot_eager functionalizes as inductor does): one graph with no break, the
    same logits, and the routing records reach the cache's tensor; a row that is not live records to scratch."""
    model = lively_moe("qwen3_moe")
    runner = LlamaRunner(model, dtype=torch.bfloat16)  # grouped_mm's meta function (tracing) takes bf16 only
    r = runner
    caches = [
        PagedKVCache(r.num_layers, 6, 4, r.num_kv_heads, r.head_dim, r.dtype, routing=r.routing_shape)
        for _ in range(2)
    ]
    tables = torch.tensor([[1, 2], [3, 4]])
    ids, lengths, starts = (
        torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]),
        torch.tensor([5, 3]),
        torch.zeros(2),
    )
    for cache in caches:
        runner.prefill_paged(ids, lengths, starts.long(), cache, tables)
    token, positions, live = torch.tensor([13, 14]), torch.tensor([5, 3]), torch.tensor([True, False])
    want = runner.decode_paged(token, positions, caches[0], tables, live)
    compiled = torch.compile(runner.decode_paged, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(token, positions, caches[1], tables, live), want, rtol=0, atol=1e-6)
    assert torch.equal(caches[0].routing, caches[1].routing)
    assert caches[0].routing[2, 1].any()  # row 0's position 5: block 2, offset 1
    assert caches[0].routing[0].any() and not caches[0].routing[4].any()  # row 1's went to scratch


def tp_shard(full: torch.nn.Module, tp: int, t: int, ep: int = 1) -> torch.nn.Module:
    """Rank t's tensor-parallel shard of ``full``: the Llama family's rules (``parallel.layout``) for attention,
    norms and vocabulary, ``tp.MOE_RULES`` for the sparse blocks (what the reshard plan will move); ``ep`` =
    tp: whole experts t * E / tp onward instead (``layout``'s ``experts_split``)."""
    from hybridflow.engine.parallel.layout import ShardLayout, generation_kind, kind_of
    from hybridflow.engine.rollout.tp import local_config, moe_kind, moe_pieces, split_experts

    torch.manual_seed(0)
    shard = type(full)(local_config(full.config, tp, ep)).eval()
    if ep > 1:
        split_experts(shard, ep)
    config = full.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sources = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in shard.named_parameters():
            src, kind = sources[name], moe_kind(name)
            if generation_kind(name, ep) == "experts_split":
                box = ShardLayout("experts_split", tuple(src.shape), tp).box(t)
                pieces = [(box, tuple((0, b - a) for a, b in box))]
            elif kind is not None:
                pieces = moe_pieces(kind, tuple(src.shape), tp, t)
            else:
                box = ShardLayout(kind_of(name), tuple(src.shape), tp, head).box(t)
                pieces = [] if box is None else [(box, tuple((0, b - a) for a, b in box))]
            p.zero_()
            for have, put in pieces:
                p[tuple(slice(*b) for b in put)] = src[tuple(slice(*b) for b in have)]
    return shard


def moe_tp_on_ranks(rank: int, world: int, ep: int = 1) -> dict:
    """Each MoE family at tp = world (gloo) against one process: tokens, log-probs and routing records;
    ``ep`` = world: the experts split whole over the ranks instead of sliced."""
    import torch.distributed as dist

    from hybridflow.engine.rollout.tp import RolloutTP

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {}
    for arch in MOE_ARCHS:
        full = lively_moe(arch, scale=0.2)  # smaller logits: float32 rounding well within 1e-5 (see above)
        shard = tp_shard(full, world, rank, ep)
        dim = 0 if ep > 1 else -1  # whole experts, or a slice of every one
        assert (
            shard.model.layers[0].mlp.experts.down_proj.shape[dim] * world
            == (full.model.layers[0].mlp.experts.down_proj.shape[dim])
        )
        params = greedy(10, n=2)
        kw = dict(block_size=4, record_routing=True)
        engine = PagedEngine(shard, num_blocks=16, tp=RolloutTP(dist.group.WORLD, 64), **kw)
        got = engine.generate(PROMPTS, params)
        want = PagedEngine(full, num_blocks=64, **kw).generate(PROMPTS, params)
        pairs = [(x, y) for g, h in zip(got, want) for x, y in zip(g, h)]
        out[arch] = {
            "equal": all(x.token_ids == y.token_ids for x, y in pairs),
            "gap": max(abs(u - v) for x, y in pairs for u, v in zip(x.logprobs, y.logprobs)),
            "routing": all(torch.equal(x.routed_experts, y.routed_experts) for x, y in pairs),
            "preempted": engine.preemptions,
        }
    return out


def test_tensor_parallel_experts_generate_what_one_process_does() -> None:
    """tp = 2 on gloo processes, experts sliced on their intermediate dim, a pool small enough to preempt."""
    from support.dist_util import run_world_kept

    for rank, by_arch in enumerate(run_world_kept(2, moe_tp_on_ranks, 2)):
        for arch, r in by_arch.items():
            assert r["equal"] and r["gap"] < 1e-5 and r["routing"], (rank, arch, r)
            assert r["preempted"] > 0, (rank, arch)


def test_experts_split_whole_over_the_group_generate_what_one_process_does() -> None:
    """Expert parallelism in the rollout (``rollout.expert_parallel_size`` = tp = 2): each rank holds two of
    the four experts whole, adds only their share of each token, and the all-reduce completes the sum."""
    from support.dist_util import run_world_kept

    for rank, by_arch in enumerate(run_world_kept(2, moe_tp_on_ranks, 2, 2)):
        for arch, r in by_arch.items():
            assert r["equal"] and r["gap"] < 1e-5 and r["routing"], (rank, arch, r)


def test_the_expert_shard_rules() -> None:
    from hybridflow.engine.rollout.tp import local_config, moe_kind, moe_pieces, moe_problems

    model = lively_moe("qwen2_moe")
    kinds = {n.split("layers.0.")[1]: moe_kind(n) for n, _ in model.named_parameters() if "layers.0.mlp" in n}
    assert kinds == {
        "mlp.gate.weight": "replicated",
        "mlp.experts.gate_up_proj": "experts_gate_up",
        "mlp.experts.down_proj": "experts_down",
        "mlp.shared_expert.gate_proj.weight": "column",
        "mlp.shared_expert.up_proj.weight": "column",
        "mlp.shared_expert.down_proj.weight": "row",
        "mlp.shared_expert_gate.weight": "replicated",
    }
    assert moe_kind("model.layers.0.self_attn.q_proj.weight") is None
    # (E, 2I, H) = (4, 128, 32) at tp = 2, rank 1: rows 32..64 of the gate half and 96..128 of the up half.
    assert moe_pieces("experts_gate_up", (4, 128, 32), 2, 1) == [
        (((0, 4), (32, 64), (0, 32)), ((0, 4), (0, 32), (0, 32))),
        (((0, 4), (96, 128), (0, 32)), ((0, 4), (32, 64), (0, 32))),
    ]
    assert moe_pieces("experts_down", (4, 32, 64), 2, 1) == [
        (((0, 4), (0, 32), (32, 64)), ((0, 4), (0, 32), (0, 32)))
    ]
    local = local_config(model.config, 2)
    assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (32, 64)
    assert moe_problems(model.config, 2) == [] and moe_problems(model.config, 3) == [
        "moe_intermediate_size=64",
        "shared_expert_intermediate_size=128",
    ]
