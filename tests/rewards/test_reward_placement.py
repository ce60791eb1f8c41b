"""place_on_last_token: each score on the last valid response token, zeros elsewhere."""

from __future__ import annotations

import pytest
import torch

from hybridflow.rewards import place_on_last_token


def test_scores_land_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    out = place_on_last_token(torch.tensor([0.5, -1.0, 7.0, 2.0, 3.0]), mask)
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.5, 0.0],
            [-1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],  # fully masked: gets nothing
            [0.0, 0.0, 0.0, 2.0],
            [0.0, 0.0, 3.0, 0.0],  # a mask with a hole: the last set position
        ]
    )
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32


def test_lists_dtype_and_shape_checks():
    out = place_on_last_token([1, 2], torch.tensor([[True, False], [True, True]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    half = place_on_last_token(torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3))
    assert half.dtype == torch.float64 and half.tolist() == [[0.0, 0.0, 1.0]]
    assert place_on_last_token([1.0], torch.ones(1, 0)).shape == (1, 0)
    with pytest.raises(ValueError, match="scores must be"):
        place_on_last_token([1.0, 2.0, 3.0], torch.ones(2, 3))
    with pytest.raises(ValueError, match="response_mask"):
        place_on_last_token([1.0], torch.ones(3))
