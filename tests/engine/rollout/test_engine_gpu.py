"""The rollout engine on CUDA: CUDA graphs, the fused paged kernel, the fused sampler and compilation change
nothing, float32 greedy equals HF ``generate``, bf16 log-probs stay close to float32, prefill never waits for
the GPU, a small pool completes through preemption, the pool is sized from ``gpu_memory_utilization`` and
handed back at the end, and the cast weights go back between calls."""

from __future__ import annotations

import dataclasses

import pytest
import test_engine as cpu
import torch
from support.row_cache import RowCache

from hybridflow.engine.rollout.blocks import KSplits
from hybridflow.engine.rollout.decode_loop import DECODE_K_SPLITS
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.session import Session
from hybridflow.models import build_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 14], [4], list(range(20, 40))]


def model_on_gpu(dtype: torch.dtype) -> torch.nn.Module:
    model = build_tiny_model("qwen2", vocab_size=256, hidden_size=128, num_hidden_layers=2, seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to("cuda", dtype).eval()


def test_bf16_logprobs_against_a_float32_recomputation(capsys: pytest.CaptureFixture) -> None:
    model = model_on_gpu(torch.float32)
    engine = PagedEngine(model, dtype=torch.bfloat16)  # fp32 masters, bf16 generation (cast buffers)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=0)
    outs = [(p, s) for p, g in zip(PROMPTS, engine.generate(PROMPTS, params)) for s in g]
    diffs = []
    with torch.no_grad():
        for prompt, s in outs:
            ids = torch.tensor([prompt + s.token_ids], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            ref = logp[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            diffs.append((ref - torch.tensor(s.logprobs, device="cuda")).abs())
    mean_abs = torch.cat(diffs).mean().item()
    with capsys.disabled():
        print(f"\nbf16 rollout vs fp32 recomputation: mean |d logprob| = {mean_abs:.4f}")
    assert mean_abs < 0.1


def _tokens(engine: PagedEngine, params: SamplingParams) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in engine.generate(PROMPTS, params)]


def test_fused_sampler_draws_do_not_depend_on_graph_padding() -> None:
    # float32: eager and graphed steps then give the same logits even when their batch shapes differ.
    model = model_on_gpu(torch.float32)
    graphed = PagedEngine(model, max_num_seqs=8, sync_interval=3)
    eager = PagedEngine(model, max_num_seqs=8, sync_interval=3, enforce_eager=True)
    assert graphed.fused_sampler and eager.fused_sampler
    # 12 samples in 8 seats, 16 EOS ids: ragged finishes, seats handed on, and padded graph buckets.
    sampled = SamplingParams(
        n=3, max_new_tokens=12, temperature=0.8, seed=5, eos_token_ids=list(range(0, 256, 16))
    )
    first = _tokens(graphed, sampled)
    assert len({len(t) for g in first for t in g}) > 1  # some samples did stop early
    assert first == _tokens(eager, sampled)  # padding rows change no draw of the live rows
    assert first != _tokens(graphed, dataclasses.replace(sampled, seed=6))


def test_fused_sampler_in_bf16_graphs_equal_eager_and_seeds_repeat() -> None:
    model = model_on_gpu(torch.bfloat16)
    graphed = PagedEngine(model, max_num_seqs=8, sync_interval=3)
    eager = PagedEngine(model, max_num_seqs=8, sync_interval=3, enforce_eager=True)
    assert graphed.fused_sampler and graphed.runner.float_logits is False  # bf16 logits into the kernel
    # 8 samples in 8 seats and no EOS: eager and graphed steps have the same shapes, so the same logits.
    greedy = SamplingParams(n=2, max_new_tokens=12, temperature=0.0, do_sample=False)
    assert _tokens(graphed, greedy) == _tokens(eager, greedy)
    sampled = SamplingParams(n=2, max_new_tokens=12, temperature=0.8, seed=5)
    first = _tokens(graphed, sampled)
    assert first == _tokens(graphed, sampled) == _tokens(eager, sampled)
    assert len({tuple(t) for g in first for t in g}) > 4
    # Filtered sampling stays on sample(), which now reads the bf16 logits itself.
    top_k = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, top_k=3, seed=1)
    assert _tokens(graphed, top_k) == _tokens(eager, top_k)


def test_compiled_decode_and_prefill_equal_the_uncompiled_engine(capsys: pytest.CaptureFixture) -> None:
    # float32, so fusion cannot flip a token through rounding: compiled prefill (chunks of two shapes, so the
    # dynamic recompile runs too) and compiled decode steps with combo kernels (RoPE and the cache write).
    # (In bf16 on this tiny random model, 4 of 8 greedy samples stay identical: fusion rounds differently,
    # and the early log-probs differ by up to ~0.2; on the H200 the float32 run differs by 6.7e-6.)
    model = model_on_gpu(torch.float32)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=16, sync_interval=3)
    compiled = PagedEngine(model, compile_decode=True, **kw)
    plain = PagedEngine(model, **kw)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.0, do_sample=False, eos_token_ids=[7, 9])
    outs = [e.generate(PROMPTS, params) for e in (compiled, plain)]
    tokens = [[[s.token_ids for s in g] for g in out] for out in outs]
    assert tokens[0] == tokens[1]
    logprobs = [torch.tensor([x for g in out for s in g for x in s.logprobs]) for out in outs]
    with capsys.disabled():
        print(
            f"\ncompiled vs plain engine (float32): max |d logprob| {(logprobs[0] - logprobs[1]).abs().max():.2e}, "
            f"lengths {[len(t) for g in tokens[0] for t in g]}"
        )
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-4, rtol=0)


def test_prefill_queues_without_waiting_for_the_gpu() -> None:
    # The host must be able to queue prefill calls (and the first tokens' sampling and the copies of the
    # samples' partial blocks) while the GPU still runs earlier ones: any stream sync in that path raises
    # under this debug mode. A budget of 16 tokens splits the 20-token prompt into chunks.
    model = model_on_gpu(torch.bfloat16)
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=0)
    for checked in (False, True):  # the first round warms up: first-call allocations are not the point
        engine = PagedEngine(model, block_size=4, max_num_batched_tokens=16, enforce_eager=True)
        ids = [i for p in PROMPTS for i in engine.add(p, params)]
        session = engine._open(demand=(8, 24 + params.max_new_tokens))
        torch.cuda.synchronize()
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            assert engine._prefill_round(session)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        state = session.seats.state
        assert session.seats.num_used == 8 and session.pool.stats.forked_blocks > 0
        assert state.done[:8].logical_not().all() and (state.gen_len[:8] == 1).all()
        engine.abort(ids)


def test_compiled_bf16_decode_splits_the_down_projection_and_keeps_its_values() -> None:
    # compile_decode in bf16 on CUDA runs the down projection as 4 batched GEMMs (bmm with float32 out)
    # whose partials inductor sums into the next norm: the logits must match the eager cuBLAS path.
    model = model_on_gpu(torch.bfloat16)
    engine = PagedEngine(model, max_num_seqs=4, compile_decode=True)
    runner = engine.runner
    assert runner.k_splits == DECODE_K_SPLITS
    assert runner.config.intermediate_size % 4 == 0  # else split_linear falls back to F.linear
    caches = [RowCache(runner, 4, 32) for _ in range(2)]
    ids = torch.tensor([p[:3] for p in PROMPTS if len(p) >= 3] + [[4, 4, 4]])
    lens = torch.full((4,), 3)
    for cache in caches:
        cache.prefill(ids, lens)
    token, positions = torch.tensor([1, 2, 3, 4], device="cuda"), lens.cuda()
    tables = caches[0].tables.cuda()  # the same layout in both caches
    got = torch.compile(runner.decode_paged, fullgraph=True)(
        token, positions, caches[0].cache, tables
    ).float()
    runner.k_splits = KSplits()
    want = runner.decode_paged(token, positions, caches[1].cache, tables).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_compiled_engine_frees_its_cast_weights_between_calls_and_refills_them() -> None:
    # fp32 masters, bf16 generation: the runner's weights are cast buffers, freed after every call by
    # default. Against an engine that keeps them (same compiled kernels), tokens must agree call after call,
    # with a "training step" on the masters in between.
    model = model_on_gpu(torch.float32)
    kw = dict(dtype=torch.bfloat16, max_num_seqs=8, compile_decode=True)
    freeing, keeping = PagedEngine(model, **kw), PagedEngine(model, free_cache_engine=False, **kw)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.0, do_sample=False)
    runs = []
    for _ in range(3):
        runs.append(_tokens(freeing, params))
        assert sum(t.untyped_storage().nbytes() for t in freeing.runner.weight_tensors()) == 0
        assert runs[-1] == _tokens(keeping, params)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert runs[0] != runs[1]


# ---- on the tiny models and prompts of test_engine.py ---------------------------------------------------


def _token_ids(out) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in out]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_graphs_and_the_paged_kernel_give_the_eager_tokens_in_bf16(arch: str) -> None:
    model = cpu.lively_model(arch).cuda().to(torch.bfloat16)
    free = PagedEngine(model, block_size=4, enforce_eager=True).generate(cpu.PROMPTS, cpu.greedy(12))
    stops = [free[0][0].token_ids[3], free[2][0].token_ids[6]]
    for params in (cpu.greedy(12, n=2, eos_token_ids=stops), SamplingParams(n=3, max_new_tokens=12, seed=5)):
        eager = PagedEngine(model, block_size=4, enforce_eager=True)
        assert eager.runner.decode_attention == "triton"
        graphs = PagedEngine(model, block_size=4)
        want = eager.generate(cpu.PROMPTS, params)
        got = graphs.generate(cpu.PROMPTS, params)
        assert _token_ids(got) == _token_ids(want)
        assert graphs.session is None and graphs.pool.num_free == len(graphs.pool.blocks)


def test_float32_greedy_equals_hf_and_a_small_pool_preempts() -> None:
    model = cpu.lively_model("qwen2").cuda()
    params = cpu.greedy(14, n=2)
    want = [[w, w] for w in cpu.hf_greedy_left_padded(model, cpu.PROMPTS, 14)]
    assert _token_ids(PagedEngine(model, block_size=4).generate(cpu.PROMPTS, params)) == want
    small = PagedEngine(model, num_blocks=12, block_size=4)
    assert _token_ids(small.generate(cpu.PROMPTS, params)) == want
    assert small.last_stats.preemptions > 0 and small.last_stats.kv_blocks_used == 1.0


def test_the_pool_is_sized_from_the_memory_share_and_freed() -> None:
    model = cpu.lively_model("qwen2").cuda().to(torch.bfloat16)
    total = torch.cuda.get_device_properties(0).total_memory
    per_block = 2 * 2 * 16 * 2 * 8 * 2  # K and V, 2 layers, 16 positions, 2 KV heads, head dim 8, bf16
    engine = PagedEngine(model, block_size=16, max_num_seqs=8)
    # first-call allocations (cuBLAS workspaces, graph pools) first
    engine.generate(cpu.PROMPTS, cpu.greedy(4, n=2))
    before = torch.cuda.memory_allocated()
    # room for 40 blocks, the scratch block and the decode step's workspace at 8 seats
    engine.cfg.gpu_memory_utilization = (
        before + 41.5 * per_block + Session.workspace(engine.runner, 8)
    ) / total
    # the step API: room for any length, max_num_seqs of them
    ids = engine.add(cpu.PROMPTS[1], cpu.greedy(100, n=8))
    engine.step()
    assert len(engine.pool.blocks) == 40  # the budget, below the 8 x 8 blocks of full-length sequences
    assert engine.session.cache.storage.nbytes == 41 * per_block
    engine.abort(ids)
    assert engine.session is None and engine.pool.num_free == 40
    assert torch.cuda.memory_allocated() <= before + 2**20  # the cache is gone
