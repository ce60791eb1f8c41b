"""GPU: the tensor-parallel runner's NCCL collectives inside CUDA graphs and torch.compile (one rank's group).

A rollout group of one rank still runs every collective of the tensor-parallel path (the embedding's and the
projections' all-reduces, the logits' all-gather) through NCCL, so this checks that they are captured in the
decode graphs and traced by the compiled decode step, on one GPU. Several GPUs: the multi-GPU issue.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def graphed_with_collectives(rank: int, compiled: bool) -> dict:
    import torch.distributed as dist

    from hybridflow.engine.rollout.engine import PagedEngine
    from hybridflow.engine.rollout.sampling import SamplingParams
    from hybridflow.engine.rollout.tp import RolloutTP, build_shard
    from hybridflow.models import build_tiny_model

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    cuda = torch.device("cuda")
    model = build_tiny_model(
        "qwen2", vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    model = model.to(cuda, torch.bfloat16)
    shard = build_shard(model, 1, torch.bfloat16, cuda)
    shard.load_state_dict(model.state_dict())
    tp = RolloutTP(dist.new_group([0]), 512)
    common = dict(max_model_len=64, compile_decode=compiled, device=cuda)
    with_tp = PagedEngine(shard, dtype=torch.bfloat16, tp=tp, **common)
    plain = PagedEngine(model, dtype=torch.bfloat16, **common)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
    greedy = SamplingParams(n=2, max_new_tokens=24, temperature=0.0, do_sample=False, eos_token_ids=[])
    a, b = with_tp.generate(prompts, greedy), plain.generate(prompts, greedy)
    return {
        "graphs": with_tp.use_graphs,
        "same": [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b],
        "gap": max(
            abs(u - v) for g, h in zip(a, b) for x, y in zip(g, h) for u, v in zip(x.logprobs, y.logprobs)
        ),
    }


@pytest.mark.parametrize("compiled", [False, True])
def test_collectives_run_inside_decode_graphs(compiled: bool) -> None:
    (out,) = run_world(1, graphed_with_collectives, compiled, timeout=600)
    assert out["graphs"] and out["same"] and out["gap"] < 1e-2, out
