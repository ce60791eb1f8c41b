"""Optimal token baseline estimators (single- and multi-turn), with values worked out by hand."""

import math

import numpy as np
import pytest
import torch

from hybridflow.algos import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    get_adv_estimator_fn,
)

F64 = torch.float64
HALF = math.log(0.5)


def test_registered_under_verl_names():
    assert AdvantageEstimator.OPTIMAL_TOKEN_BASELINE.value == "optimal_token_baseline"
    assert get_adv_estimator_fn("optimal_token_baseline") is compute_optimal_token_baseline_advantage
    tir = ADV_ESTIMATOR_REGISTRY["tir_optimal_token_baseline"]
    assert tir is compute_multi_turn_optimal_token_baseline_advantage


def _case():
    """Group a: row 0 (3 tokens, reward 1 at the end), row 1 (2 tokens, reward 2 at t=1), an empty row 3;
    group b: row 2 alone. pi = 0.5 and sum pi^2 = 0.5 everywhere: w = 1 - 2 * 0.5 + 0.5 = 0.5 per token."""
    rewards = torch.tensor([[0, 0, 1.0], [0, 2.0, 0], [0, 0, 3.0], [0, 0, 0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=F64)
    old_lp = torch.full((4, 3), HALF, dtype=F64)
    spi2 = torch.full((4, 3), 0.5, dtype=F64)
    return rewards, mask, np.array(["a", "a", "b", "a"], dtype=object), old_lp, spi2


def test_otb_per_position_baseline_and_zero_tail():
    rewards, mask, index, old_lp, spi2 = _case()
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, index, old_lp, spi2)
    # returns-to-go G: row 0 = 1, 1, 1; row 1 = 2, 2, (0); row 2 = 3, 3, 3. Cumulative W: 0.5, 1, 1.5.
    # t=0: (1 * 0.5 + 2 * 0.5) / 1.0 = 1.5; t=1: (1 * 1 + 2 * 1) / 2 = 1.5; t=2: only row 0, but row 0 is
    # the group's single longest row past the second-longest length 2: baseline 0 there.
    expected = torch.tensor([[-0.5, -0.5, 1.0], [0.5, 0.5, 0.0], [3.0, 3.0, 3.0], [0, 0, 0]], dtype=F64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor([[1, 1, 1.0], [2, 2, 0], [3, 3, 3], [0, 0, 0]], dtype=F64))
    no_tail, _ = compute_optimal_token_baseline_advantage(
        rewards, mask, index, old_lp, spi2, handle_zero_tail=False
    )
    assert no_tail[0, 2].item() == pytest.approx(0.0, abs=1e-7)  # baseline 1 * 1.5 / 1.5 = 1 -> 1 - 1
    # the empty row changes nothing (left out of group a): without it the result is the same
    keep = [0, 1, 2]
    alone, _ = compute_optimal_token_baseline_advantage(
        rewards[keep], mask[keep], index[keep], old_lp[keep], spi2[keep]
    )
    torch.testing.assert_close(alone, expected[keep])


def test_otb_rollout_is_weights_scale_w_by_their_square():
    rewards, mask, index, old_lp, spi2 = _case()
    weights = torch.ones(4, 3, dtype=F64)
    weights[1] = 2.0  # row 1's w becomes 0.5 * 4 = 2: W = 2, 4
    adv, _ = compute_optimal_token_baseline_advantage(
        rewards, mask, index, old_lp, spi2, rollout_is_weights=weights
    )
    # t=0: (1 * 0.5 + 2 * 2) / 2.5 = 1.8; t=1: (1 * 1 + 2 * 4) / 5 = 1.8
    torch.testing.assert_close(adv[0, :2], torch.tensor([1 - 1.8, 1 - 1.8], dtype=F64))
    torch.testing.assert_close(adv[1, :2], torch.tensor([2 - 1.8, 2 - 1.8], dtype=F64))


def test_tir_otb_aligns_turns_by_valid_token_across_observation_holes():
    # row 0: tokens at 0, 2, 3 (hole at 1, whose reward never counts); row 1: tokens at 0, 1. Same group.
    rewards = torch.tensor([[0, 7.0, 0, 1.0], [0, 2.0, 0, 0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=F64)
    index = np.array([0, 0])
    old_lp, spi2 = torch.full((2, 4), HALF, dtype=F64), torch.full((2, 4), 0.5, dtype=F64)
    adv, ret = compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, index, old_lp, spi2)
    # packed by valid-token index the rows are those of the single-turn case: G = (1, 1, 1) and (2, 2)
    expected = torch.tensor([[-0.5, 0.0, -0.5, 1.0], [0.5, 0.5, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor([[1, 0, 1, 1.0], [2, 2, 0, 0]], dtype=F64))
    # per position instead, row 0's token at t=2 meets no peer: baseline 0 -> it keeps its return 1
    by_position, _ = compute_optimal_token_baseline_advantage(rewards, mask, index, old_lp, spi2)
    assert by_position[0, 2].item() == pytest.approx(1.0)


def test_otb_needs_the_policy_statistics():
    rewards, mask, index, _, _ = _case()
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_optimal_token_baseline_advantage(rewards, mask, index)
