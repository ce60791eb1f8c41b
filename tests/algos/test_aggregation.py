"""agg_loss: every mode by hand, masked rows, errors, and invariance to the micro-batch / data-parallel split."""

import pytest
import torch

from hybridflow.algos.aggregation import LOSS_AGG_MODES, agg_loss, local_batch_info

# Row 2 is fully masked and holds NaN: it must not leak into any mode.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [float("nan"), 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 1 + 2 + 4),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # the fully masked row is not a sequence
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) / 3 + 4 / 3) / 2),  # default divisor T = 3
    ],
)
def test_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_bool_mask_gives_same_result():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())


def test_global_counts_and_dp_size():
    assert agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=10).item() == pytest.approx(7 / 10)
    assert agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=14).item() == pytest.approx(
        7 / 14 * 2
    )
    assert agg_loss(LOSS, MASK, "token-sum", dp_size=3).item() == pytest.approx(21)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", global_batch_size=5).item() == pytest.approx(7 / 5)
    got = agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2, global_batch_size=4)
    assert got.item() == pytest.approx(5.5 / 4 * 2)
    got = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_batch_size=4, loss_scale_factor=10)
    assert got.item() == pytest.approx((3 / 10 + 4 / 10) / 4)
    tensor_count = agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=torch.tensor(10))
    assert tensor_count.item() == pytest.approx(0.7)


def test_masked_positions_get_no_gradient_and_no_nan():
    loss = LOSS.clone().requires_grad_()
    for mode in LOSS_AGG_MODES:
        (grad,) = torch.autograd.grad(agg_loss(loss, MASK, mode), loss)
        assert torch.isfinite(grad).all()
        assert (grad[MASK == 0] == 0).all()
    (grad,) = torch.autograd.grad(agg_loss(loss, MASK, "token-mean"), loss)
    assert torch.allclose(grad[MASK == 1], torch.full((3,), 1 / 3, dtype=torch.float64))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_is_zero_not_nan(mode):
    loss = torch.randn(2, 3, requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    (grad,) = torch.autograd.grad(out, loss)
    assert (grad == 0).all()
    assert agg_loss(loss, torch.zeros(2, 3), mode, batch_num_tokens=0, global_batch_size=0).item() == 0.0


def test_errors():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "token-mean-seq")
    with pytest.raises(ValueError, match="same shape"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum", dp_size=2)
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match=">= 0"):
        agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=-1)
    with pytest.raises(TypeError):
        agg_loss(LOSS, MASK, "token-mean", batch_num_tokens="7")


def test_local_batch_info_counts():
    info = local_batch_info(MASK)
    assert info["batch_num_tokens"].item() == 3
    assert info["global_batch_size"].item() == 2


def _minibatch():
    torch.manual_seed(0)
    loss = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    # Uneven lengths and one fully masked row, so a naive per-micro-batch mean would differ.
    mask = torch.tensor(
        [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64
    )
    return loss, mask


def _split_sum(loss, mask, mode, sizes, counts, dp_size=1):
    total, start = 0.0, 0
    for size in sizes:
        rows = slice(start, start + size)
        total = total + agg_loss(loss[rows], mask[rows], mode, dp_size=dp_size, loss_scale_factor=4, **counts)
        start += size
    return total


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("sizes", [[2, 3], [1, 1, 3], [5]])
def test_micro_batch_split_matches_unsplit(mode, sizes):
    loss, mask = _minibatch()
    full = agg_loss(loss, mask, mode, loss_scale_factor=4)
    (full_grad,) = torch.autograd.grad(full, loss)
    counts = local_batch_info(mask)  # the global counts of the whole mini-batch
    split = _split_sum(loss, mask, mode, sizes, counts)
    (split_grad,) = torch.autograd.grad(split, loss)
    assert split.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(split_grad, full_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_split_matches_unsplit(mode):
    """Two ranks (rows 0-2 and 3-4), each with micro-batches; FSDP averages the per-rank gradients."""
    loss, mask = _minibatch()
    full = agg_loss(loss, mask, mode, loss_scale_factor=4)
    (full_grad,) = torch.autograd.grad(full, loss)
    counts = local_batch_info(mask)
    rank0 = _split_sum(loss[:3], mask[:3], mode, [1, 2], counts, dp_size=2)
    rank1 = _split_sum(loss[3:], mask[3:], mode, [1, 1], counts, dp_size=2)
    (grad0,) = torch.autograd.grad(rank0, loss)
    (grad1,) = torch.autograd.grad(rank1, loss)
    assert ((rank0 + rank1) / 2).item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose((grad0 + grad1) / 2, full_grad, rtol=1e-12, atol=1e-15)


def test_naive_local_means_would_differ():
    """Guard that the split test is not vacuous: averaging local token-means is NOT the global mean."""
    loss, mask = _minibatch()
    full = agg_loss(loss, mask, "token-mean")
    naive = (agg_loss(loss[:3], mask[:3], "token-mean") + agg_loss(loss[3:], mask[3:], "token-mean")) / 2
    assert abs(naive.item() - full.item()) > 1e-3
