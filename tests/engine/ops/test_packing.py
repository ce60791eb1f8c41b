"""Scoring inputs built on the host: the packed/padded indices by hand, moving them, and no mask building."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.ops.packing import ScoringInputs, build_scoring_inputs, to_device

# Two rows of T = 5 with R = 2 response columns. Row 0: one pad, prompt [11, 12], response [13, 14].
# Row 1: prompt [21, 22, 23], response [24] then a pad. Row 2: nothing at all (fully masked).
IDS = torch.tensor([[0, 11, 12, 13, 14], [21, 22, 23, 24, 0], [0, 0, 0, 0, 0]])
MASK = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
POS = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 3], [0, 0, 0, 0, 0]])


def test_packed_indices_by_hand() -> None:
    got = build_scoring_inputs(IDS, MASK, POS, 2, remove_padding=True)
    assert got.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24]]
    assert got.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert got.seq_bounds == [0, 4, 8]  # the empty row adds no sequence
    assert got.attention_mask is None
    # Token 13 is scored by the hidden state of 12 (packed row 1), 14 by 13 (row 2), 24 by 23 (row 6).
    assert got.gather_index.tolist() == [1, 2, 6]
    assert got.labels.tolist() == [13, 14, 24]
    assert got.scatter_index.tolist() == [0, 1, 2]  # b * R + j: (0, 0), (0, 1), (1, 0)


def test_padded_indices_by_hand() -> None:
    got = build_scoring_inputs(IDS, MASK, POS, 2, remove_padding=False)
    assert got.input_ids is IDS and got.attention_mask is MASK and got.seq_bounds is None
    assert got.gather_index.tolist() == [2, 3, 7]  # b * T + (T - R - 1) + j
    assert got.labels.tolist() == [13, 14, 24]


def test_to_keeps_every_field() -> None:
    inputs = build_scoring_inputs(IDS, MASK, POS, 2, remove_padding=True)
    moved = inputs.to("cpu")
    assert isinstance(moved, ScoringInputs) and moved.seq_bounds == inputs.seq_bounds
    for name in ("input_ids", "position_ids", "gather_index", "labels", "scatter_index"):
        assert torch.equal(getattr(moved, name), getattr(inputs, name)), name
    t = torch.arange(3)
    assert to_device(t, "cpu") is t


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_builds_no_mask_and_matches_padded(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed forward must not reach transformers' packed-sequence detection (a host sync per forward)."""
    import transformers.masking_utils as masking_utils

    from hybridflow.engine.ops.packed_attention import use_packed_attention
    from hybridflow.engine.train.scorer import PolicyScorer
    from hybridflow.models import build_tiny_model

    lm = build_tiny_model(arch, vocab_size=32, hidden_size=32, num_hidden_layers=2, seed=0)
    scorer = PolicyScorer(lm).eval()
    ids = IDS % 32
    with torch.no_grad():
        padded, _ = scorer(build_scoring_inputs(ids, MASK, POS, 2, False))
        use_packed_attention(lm)

        def refuse(*args, **kwargs):
            raise AssertionError("transformers inspected the packed position ids")

        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", refuse)
        packed, _ = scorer(build_scoring_inputs(ids, MASK, POS, 2, True))
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
