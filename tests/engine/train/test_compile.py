"""Compiled decoder layers on packed batches: new sequence bounds must not recompile them."""

from __future__ import annotations

import torch

from hybridflow.engine.ops.modules import decoder_layers
from hybridflow.engine.ops.packed_attention import use_packed_attention
from hybridflow.engine.ops.packing import build_scoring_inputs
from hybridflow.engine.train.scorer import PolicyScorer
from hybridflow.models import build_tiny_model


def ragged(seed: int, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """Left-padded rows of random lengths (so every call has new sequence bounds and a new total)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for b in range(rows):
        mask[b, : int(torch.randint(0, width - 4, (1,), generator=g))] = 0
    return ids * mask, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_new_bounds_do_not_recompile_and_outputs_match_eager() -> None:
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=4)
    use_packed_attention(lm)
    scorer = PolicyScorer(lm).eval()
    batches = [ragged(seed, rows, 12) for seed, rows in enumerate((3, 4, 5, 6, 3))]
    with torch.no_grad():
        eager = [scorer(build_scoring_inputs(*b, 4, True))[0] for b in batches]
        for layer in decoder_layers(lm):
            layer.compile(backend=counting_backend)
        compiled = []
        for i, b in enumerate(batches):
            compiled.append(scorer(build_scoring_inputs(*b, 4, True))[0])
            if i == 1:
                settled = len(graphs)  # the first call, then one recompile that makes the sizes dynamic
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(graphs) == settled, f"{len(graphs) - settled} recompiles for new sequence bounds"
