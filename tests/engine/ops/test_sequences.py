"""Token-id prompts and responses into the training layout."""

from __future__ import annotations

import random

import pytest
import torch

from hybridflow.engine.ops.sequences import pack_prompt_response, pad_rows


def test_pad_rows_pads_either_side_and_marks_the_real_entries() -> None:
    rows = [[1, 2, 3], [], [4]]
    right, right_mask = pad_rows(rows, 4, 0, torch.long)
    assert right.tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 0, 0, 0]]
    assert right_mask.tolist() == [[True, True, True, False], [False] * 4, [True, False, False, False]]
    left, left_mask = pad_rows([[0.5, 0.25], [1.0]], 3, -1.0, torch.float32, left=True)
    assert left.dtype == torch.float32
    assert left.tolist() == [[-1.0, 0.5, 0.25], [-1.0, -1.0, 1.0]]
    assert left_mask.tolist() == [[False, True, True], [False, False, True]]
    with pytest.raises(ValueError, match="row 1 has 3 entries, more than the width 2"):
        pad_rows([[1], [1, 2, 3]], 2, 0, torch.long)


def test_pack_prompt_response_matches_the_layout_row_by_row() -> None:
    """Left-padded prompts, right-padded responses (empty ones too), positions counting real tokens."""
    rng = random.Random(0)
    prompts = [[rng.randint(3, 99) for _ in range(rng.randint(1, 7))] for _ in range(12)]
    responses = [[rng.randint(3, 99) for _ in range(rng.randint(0, 5))] for _ in range(12)]
    batch = pack_prompt_response(prompts, responses, 5, pad_token_id=2)
    P = max(map(len, prompts))
    for b, (p, r) in enumerate(zip(prompts, responses)):
        assert batch["input_ids"][b].tolist() == [2] * (P - len(p)) + p + r + [2] * (5 - len(r))
        mask = [0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (5 - len(r))
        assert batch["attention_mask"][b].tolist() == mask
        positions = [max(i - (P - len(p)), 0) for i in range(P + 5)]
        assert batch["position_ids"][b, : P + len(r)].tolist() == positions[: P + len(r)]
        assert batch["responses"][b].tolist() == r + [2] * (5 - len(r))
        assert batch["response_mask"][b].tolist() == [1.0] * len(r) + [0.0] * (5 - len(r))
    with pytest.raises(ValueError, match="response 1 has 6 tokens, more than the response length 5"):
        pack_prompt_response([[1], [1]], [[1], [1] * 6], 5, pad_token_id=0)
