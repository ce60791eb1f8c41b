"""The rollout's MoE routing records in the training layout (router replay)."""

from __future__ import annotations

import torch

from hybridflow.engine.ops.sequences import layout_padding, pack_prompt_response, pack_routing
from hybridflow.models.moe import NO_EXPERT
from hybridflow.protocol import Batch


def _records(prompt: int, response: int, layers: int = 2, k: int = 2, base: int = 0) -> torch.Tensor:
    n = prompt + response - 1  # the last response token is never fed to the model
    return (torch.arange(n * layers * k).view(n, layers, k) + base).to(torch.uint8)


def test_pack_routing_aligns_with_the_tokens() -> None:
    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    batch = pack_prompt_response(prompts, responses, 4, 0)  # P = 3, R = 4
    recs = [_records(3, 2), _records(1, 3, base=100)]
    routed = pack_routing([3, 1], recs, 3, 4)  # (B, P + R, L, k)
    assert routed.shape == (2, 7, 2, 2) and routed.dtype == torch.uint8
    assert torch.equal(routed[0, 0:4], recs[0]) and (routed[0, 4:] == NO_EXPERT).all()
    assert (routed[1, :2] == NO_EXPERT).all() and torch.equal(routed[1, 2:5], recs[1])
    assert (routed[1, 5:] == NO_EXPERT).all()
    # Every routed column is a real token, and every real token but each row's last is routed.
    real = batch["attention_mask"].bool()
    has = (routed != NO_EXPERT).all(-1).all(-1)
    assert (has <= real).all() and torch.equal(has.sum(1), real.sum(1) - 1)


def test_shares_with_shorter_prompts_widen_on_the_left() -> None:
    a = pack_prompt_response([[5, 6, 7]], [[1]], 2, 0)
    a["routed_experts"] = pack_routing([3], [_records(3, 1)], 3, 2)
    b = pack_prompt_response([[8]], [[3, 4]], 2, 0)
    b["routed_experts"] = pack_routing([1], [_records(1, 2, base=50)], 1, 2)
    merged = Batch.concat([a, b], pad=layout_padding(0))
    assert merged["routed_experts"].shape == (2, 5, 2, 2)
    assert (merged["routed_experts"][1, :2] == NO_EXPERT).all()
    assert torch.equal(merged["routed_experts"][1, 2:4], _records(1, 2, base=50))
