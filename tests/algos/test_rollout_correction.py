"""Rollout correction: truncated IS weights, rejection masks and mismatch metrics by hand."""

import math

import pytest
import torch

from hybridflow.algos.rollout_correction import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)

F64 = torch.float64


def _token_case():
    """Ratios 0.4, 1.5, 3 and a padded position holding garbage."""
    log_ratio = torch.log(torch.tensor([[0.4, 1.5, 3.0, 1e6]], dtype=F64))
    return log_ratio, torch.tensor([[1, 1, 1, 0]], dtype=F64)


def _seq_case():
    """Row 0: product 1.2 * 1.5 = 1.8; row 1: 2 * 2 = 4; row 2: fully masked."""
    ratios = torch.tensor([[1.2, 1.5, 1.0], [2.0, 2.0, 7.0], [9.0, 9.0, 9.0]], dtype=F64)
    return torch.log(ratios), torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=F64)


def test_token_is_weights_and_metrics():
    log_ratio, mask = _token_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[0.4, 1.5, 2.0, 0.0]], dtype=F64))
    assert m["rollout_is_mean"].item() == pytest.approx(3.9 / 3)
    assert m["rollout_is_max"].item() == pytest.approx(3.0)  # raw ratio, before truncation
    assert m["rollout_is_min"].item() == pytest.approx(0.4)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 3)  # fraction truncated
    assert m["rollout_is_ratio_fraction_low"].item() == pytest.approx(1 / 3)  # below 1 / 2
    ess = 1.3**2 / ((0.4**2 + 1.5**2 + 2.0**2) / 3)
    assert m["rollout_is_eff_sample_size"].item() == pytest.approx(ess)


def test_sequence_is_weights():
    log_ratio, mask = _seq_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "sequence", 2.0)
    expected = torch.tensor([[1.8, 1.8, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(weights, expected)
    assert m["rollout_is_mean"].item() == pytest.approx((1.8 + 2.0) / 2)  # over valid sequences
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 2)
    assert m["rollout_is_max"].item() == pytest.approx(4.0)


def test_batch_normalize_and_detached():
    log_ratio, mask = _token_case()
    log_ratio.requires_grad_()
    weights, m = compute_rollout_correction_weights(
        log_ratio, mask, "token", 2.0, rollout_is_batch_normalize=True
    )
    assert not weights.requires_grad
    assert m["rollout_is_batch_norm_factor"].item() == pytest.approx(1.3)
    assert torch.allclose(weights, torch.tensor([[0.4, 1.5, 2.0, 0.0]], dtype=F64) / 1.3)


def test_token_rejection():
    log_ratio, mask = _token_case()
    new_mask, m = compute_rollout_rejection_mask(log_ratio, mask, "token", 2.0)  # keep [0.5, 2]
    assert torch.equal(new_mask, torch.tensor([[0, 1, 0, 0]], dtype=F64))
    assert m["rollout_rs_masked_fraction"].item() == pytest.approx(2 / 3)
    assert m["rollout_rs_seq_masked_fraction"].item() == pytest.approx(1.0)
    assert m["rollout_rs_ratio_fraction_high"].item() == pytest.approx(1 / 3)
    assert m["rollout_rs_ratio_fraction_low"].item() == pytest.approx(1 / 3)
    lower_mask, _ = compute_rollout_rejection_mask(
        log_ratio, mask, "token", 2.0, rollout_rs_threshold_lower=0.3
    )
    assert torch.equal(lower_mask, torch.tensor([[1, 1, 0, 0]], dtype=F64))


def test_rejection_bounds_are_inclusive_and_dtype_kept():
    log_ratio = torch.tensor([[math.log(2.0), math.log(0.5), math.log(2.0) + 1e-3]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    new_mask, _ = compute_rollout_rejection_mask(log_ratio, mask, "token", 2.0)
    assert new_mask.dtype == torch.bool
    assert new_mask.tolist() == [[True, True, False]]


def test_sequence_and_geometric_rejection():
    log_ratio, mask = _seq_case()
    seq_mask, m = compute_rollout_rejection_mask(log_ratio, mask, "sequence", 2.0)
    assert torch.equal(seq_mask, torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0]], dtype=F64))
    assert m["rollout_rs_masked_fraction"].item() == pytest.approx(2 / 4)
    assert m["rollout_rs_seq_masked_fraction"].item() == pytest.approx(1 / 2)
    # geometric means: sqrt(1.8) = 1.34 kept, 2.0 rejected at an upper bound of 1.5
    geo_mask, _ = compute_rollout_rejection_mask(log_ratio, mask, "geometric", 1.5)
    assert torch.equal(geo_mask, seq_mask)
    geo_keep_all, _ = compute_rollout_rejection_mask(log_ratio, mask, "geometric", 2.5)
    assert torch.equal(geo_keep_all, mask)


def test_offpolicy_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.0, -9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    m = compute_offpolicy_metrics(old, rollout, mask)  # log r = [0.5, -1]
    assert m["kl"].item() == pytest.approx((-0.5 + 1.0) / 2)
    assert m["k3_kl"].item() == pytest.approx(((math.exp(0.5) - 1.5) + math.exp(-1.0)) / 2)
    assert m["chi2_token"].item() == pytest.approx((math.exp(1.0) + math.exp(-2.0)) / 2 - 1)
    assert m["training_ppl"].item() == pytest.approx(math.exp(1.5))
    assert m["rollout_ppl"].item() == pytest.approx(math.exp(1.25))
    assert m["log_prob_abs_diff_mean"].item() == pytest.approx(0.75)
    assert m["log_prob_abs_diff_max"].item() == pytest.approx(1.0)


def test_combined_function():
    log_ratio, mask = _seq_case()
    rollout = torch.zeros_like(log_ratio)
    weights, new_mask, m = compute_rollout_correction_and_rejection_mask(log_ratio, rollout, mask)
    assert weights is None
    assert torch.equal(new_mask, mask) and new_mask is not mask
    assert all(key.startswith("rollout_corr/") for key in m)
    assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" not in m
    weights, new_mask, m = compute_rollout_correction_and_rejection_mask(
        log_ratio, rollout, mask, rollout_is="sequence", rollout_rs="sequence", rollout_rs_threshold=2.0
    )
    assert torch.allclose(weights[:, 0], torch.tensor([1.8, 2.0, 0.0], dtype=F64))
    assert new_mask[1].sum() == 0
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"].item() == pytest.approx(0.5)


def test_empty_mask_gives_finite_metrics():
    log_ratio = torch.randn(2, 3)
    mask = torch.zeros(2, 3)
    _, _, m = compute_rollout_correction_and_rejection_mask(
        log_ratio,
        torch.zeros(2, 3),
        mask,
        rollout_is="token",
        rollout_rs="geometric",
        rollout_rs_threshold=2.0,
    )
    assert all(torch.isfinite(v) for v in m.values())


def test_errors():
    log_ratio, mask = _token_case()
    with pytest.raises(ValueError, match="token"):
        compute_rollout_correction_weights(log_ratio, mask, "geometric")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        compute_rollout_correction_weights(log_ratio, mask, "token", 0.0)
    with pytest.raises(ValueError, match="geometric"):
        compute_rollout_rejection_mask(log_ratio, mask, "tok", 2.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compute_rollout_rejection_mask(log_ratio, mask, "token", None)
    with pytest.raises(ValueError, match="<="):
        compute_rollout_rejection_mask(log_ratio, mask, "token", 2.0, rollout_rs_threshold_lower=3.0)
    with pytest.raises(ValueError, match="shape"):
        compute_rollout_correction_and_rejection_mask(log_ratio, log_ratio[:, :2], mask)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compute_rollout_correction_and_rejection_mask(log_ratio, log_ratio, mask, rollout_rs="token")
