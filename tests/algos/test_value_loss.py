"""compute_value_loss against hand-computed values."""

import pytest
import torch

from hybridflow.algos.value_loss import compute_value_loss

F64 = torch.float64


def _case():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    values = torch.tensor([[0.5, 0.5, 0.0]], dtype=F64)
    returns = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    return vpreds, returns, values


def test_clipped_value_loss_by_hand():
    vpreds, returns, values = _case()
    # token 0: v clipped to 0.7 -> max(0, 0.09) = 0.09 (clipped term wins)
    # token 1: v clipped to 0.7 -> max(4, 0.49) = 4; token 2: max(1, 1) = 1 (tie: not counted as clipped)
    loss, clipfrac = compute_value_loss(
        vpreds, returns, values, torch.ones(1, 3, dtype=F64), cliprange_value=0.2
    )
    assert loss.item() == pytest.approx(0.5 * (0.09 + 4.0 + 1.0) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert not clipfrac.requires_grad
    (grad,) = torch.autograd.grad(loss, vpreds)
    # token 0 takes the clipped branch, saturated: no gradient. Others: 0.5 * 2 (v - R) / 3.
    assert torch.allclose(grad, torch.tensor([[0.0, 2.0 / 3, -1.0 / 3]], dtype=F64))


def test_mask_modes_and_global_counts():
    vpreds, returns, values = _case()
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 4.0) / 2)
    assert clipfrac.item() == pytest.approx(1 / 2)
    summed, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, "token-sum")
    assert summed.item() == pytest.approx(0.5 * 4.09)
    global_, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, batch_num_tokens=8, dp_size=2)
    assert global_.item() == pytest.approx(0.5 * 4.09 / 8 * 2)


def test_fully_masked_gives_zero():
    vpreds, returns, values = _case()
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.zeros(1, 3), 0.2)
    assert loss.item() == 0.0 and clipfrac.item() == 0.0


def test_errors():
    vpreds, returns, values = _case()
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, returns, values, torch.ones(1, 3), -0.1)
    with pytest.raises(ValueError, match="shape"):
        compute_value_loss(vpreds, returns[:, :2], values, torch.ones(1, 3), 0.2)
