"""The paged engine on CUDA: CUDA graphs and the fused paged kernel give the eager path's tokens, float32
greedy equals HF ``generate``, a small pool completes through preemption, and the pool is sized from
``gpu_memory_utilization`` and handed back at the end."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, greedy, hf_greedy_left_padded, lively_model

from hybridflow.engine.rollout.paged_engine import PagedEngine
from hybridflow.engine.rollout.paged_session import Session
from hybridflow.engine.rollout.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _tokens(out) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in out]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_graphs_and_the_paged_kernel_give_the_eager_tokens_in_bf16(arch: str) -> None:
    model = lively_model(arch).cuda().to(torch.bfloat16)
    free = PagedEngine(model, block_size=4, enforce_eager=True).generate(PROMPTS, greedy(12))
    stops = [free[0][0].token_ids[3], free[2][0].token_ids[6]]
    for params in (greedy(12, n=2, eos_token_ids=stops), SamplingParams(n=3, max_new_tokens=12, seed=5)):
        eager = PagedEngine(model, block_size=4, enforce_eager=True)
        assert eager.runner.decode_attention == "triton"
        graphs = PagedEngine(model, block_size=4)
        want = eager.generate(PROMPTS, params)
        got = graphs.generate(PROMPTS, params)
        assert _tokens(got) == _tokens(want)
        assert graphs.session is None and graphs.pool.num_free == len(graphs.pool.blocks)


def test_float32_greedy_equals_hf_and_a_small_pool_preempts() -> None:
    model = lively_model("qwen2").cuda()
    params = greedy(14, n=2)
    want = [[w, w] for w in hf_greedy_left_padded(model, PROMPTS, 14)]
    assert _tokens(PagedEngine(model, block_size=4).generate(PROMPTS, params)) == want
    small = PagedEngine(model, num_blocks=12, block_size=4)
    assert _tokens(small.generate(PROMPTS, params)) == want
    assert small.last_stats.preemptions > 0 and small.last_stats.kv_blocks_used == 1.0


def test_the_pool_is_sized_from_the_memory_share_and_freed() -> None:
    model = lively_model("qwen2").cuda().to(torch.bfloat16)
    total = torch.cuda.get_device_properties(0).total_memory
    per_block = 2 * 2 * 16 * 2 * 8 * 2  # K and V, 2 layers, 16 positions, 2 KV heads, head dim 8, bf16
    engine = PagedEngine(model, block_size=16, max_num_seqs=8)
    engine.generate(PROMPTS, greedy(4, n=2))  # first-call allocations (cuBLAS workspaces, graph pools) first
    before = torch.cuda.memory_allocated()
    # room for 40 blocks, the scratch block and the decode step's workspace at 8 seats
    engine.cfg.gpu_memory_utilization = (
        before + 41.5 * per_block + Session.workspace(engine.runner, 8)
    ) / total
    ids = engine.add(PROMPTS[1], greedy(100, n=8))  # the step API: room for any length, max_num_seqs of them
    engine.step()
    assert len(engine.pool.blocks) == 40  # the budget, below the 8 x 8 blocks of full-length sequences
    assert engine.session.cache.storage.nbytes == 41 * per_block
    engine.abort(ids)
    assert engine.session is None and engine.pool.num_free == 40
    assert torch.cuda.memory_allocated() <= before + 2**20  # the cache is gone
