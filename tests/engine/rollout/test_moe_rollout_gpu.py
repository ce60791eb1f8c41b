"""Mixtures of experts in the paged engine on CUDA: in bf16 the experts run as grouped GEMMs inside CUDA graphs
(and compiled) with the eager path's tokens and routing records; in float32 (no grouped GEMMs on CUDA) the engine
decodes without graphs and still equals HF generate."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, greedy, hf_greedy_left_padded
from test_moe_rollout import MOE_ARCHS, lively_moe

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _outs(out) -> list[list[tuple[list[int], list[list[list[int]]]]]]:
    return [[(s.token_ids, s.routed_experts.tolist()) for s in g] for g in out]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_graphs_give_the_eager_tokens_and_routing_in_bf16(arch: str) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("grouped GEMMs on CUDA need SM90 or newer")
    model = lively_moe(arch).cuda().to(torch.bfloat16)
    params = SamplingParams(n=3, max_new_tokens=12, seed=5)
    eager = PagedEngine(model, block_size=4, enforce_eager=True, record_routing=True)
    graphs = PagedEngine(model, block_size=4, record_routing=True)
    assert graphs.use_graphs and graphs.runner.graph_safe
    want = eager.generate(PROMPTS, params)
    assert _outs(graphs.generate(PROMPTS, params)) == _outs(want)
    compiled = PagedEngine(model, block_size=4, record_routing=True, compile_decode=True)
    assert compiled.cfg.compile_decode
    # Compiled decode fuses the bf16 arithmetic differently, so a near-tie may flip a greedy token (seen on
    # Mixtral after 5 tokens): the runs agree until the first flip, which comes after decoding started, with
    # log-probs within bf16 noise on the common part.
    for got, ref in zip(compiled.generate(PROMPTS, greedy(8)), eager.generate(PROMPTS, greedy(8))):
        a, b = got[0], ref[0]
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert same >= 2, (a.token_ids, b.token_ids)
        # bf16 logits near 20 are 0.125 apart: a log-prob moves by that much with one rounding
        assert max(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])) < 0.25


def test_float32_decodes_without_graphs_and_equals_hf() -> None:
    on_cpu = lively_moe("qwen3_moe")
    want = hf_greedy_left_padded(on_cpu, PROMPTS, 8)
    engine = PagedEngine(on_cpu.cuda(), block_size=4)
    assert not engine.use_graphs  # the loop over experts has data-dependent shapes
    assert [g[0].token_ids for g in engine.generate(PROMPTS, greedy(8))] == want


def test_an_expert_parallel_ranks_share_captures_and_the_shares_sum_to_the_whole() -> None:
    # What each rank of an expert-parallel rollout (rollout.expert_parallel_size) runs: its E / 2 experts'
    # share of every token, with fixed shapes (no host sync), so it captures in a CUDA graph; the two shares
    # sum to the whole block's output (the all-reduce's job across ranks).
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("grouped GEMMs on CUDA need SM90 or newer")
    from hybridflow.models.moe import grouped_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, i, e, k = 64, 256, 128, 8, 2
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=-1)[1]  # (N, k), distinct experts
    w = torch.rand(n, k, device="cuda", generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    down = (torch.randn(e, h, i, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    halves = [(gate_up[r * 4 : (r + 1) * 4], down[r * 4 : (r + 1) * 4], r * 4) for r in range(2)]
    eager = [grouped_experts(x, ids, w, a, b, offset=o) for a, b, o in halves]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up off the default stream, as graph capture wants
        grouped_experts(x, ids, w, *halves[0][:2], offset=0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_experts(x, ids, w, *halves[1][:2], offset=4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager[1])
    whole = grouped_experts(x, ids, w, gate_up, down)
    assert (eager[0].float() + eager[1].float() - whole.float()).abs().max().item() < 0.02
