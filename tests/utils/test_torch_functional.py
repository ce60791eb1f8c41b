"""Masked statistics and the chunked log-prob / entropy helpers against straightforward references."""

import math

import pytest
import torch

from hybridflow.utils.torch_functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

F64 = torch.float64


def test_masked_sum_and_mean_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])  # second row fully masked, NaN must not leak
    assert masked_sum(values, mask).item() == 4.0
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    rows = masked_mean(values, mask, axis=-1)
    assert rows.tolist() == pytest.approx([2.0, 0.0])  # a fully masked row is 0, not NaN
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0


def test_masked_var_and_whiten_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 0])
    # mean 2, unbiased variance ((1)^2 + 0 + 1^2) / (3 - 1) = 1; biased 2/3
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    whitened = masked_whiten(values, mask)
    scale = 1 / math.sqrt(1 + 1e-8)
    assert whitened[:3].tolist() == pytest.approx([-scale, 0.0, scale])
    unshifted = masked_whiten(values, mask, shift_mean=False)
    assert unshifted[:3].tolist() == pytest.approx([2 - scale, 2.0, 2 + scale])


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.tensor([1.0, 2.0]), torch.tensor([1, 0]))


def _reference_logprobs(logits, labels):
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
def test_logprobs_match_log_softmax_across_chunk_boundaries(chunk_rows):
    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=F64) * 3  # 7 rows: not a multiple of 3
    labels = torch.randint(0, 11, (7,))
    got = logprobs_from_logits(logits, labels, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), _reference_logprobs(logits, labels), atol=1e-5)


def test_logprobs_gradient_matches_autograd():
    torch.manual_seed(1)
    logits = (torch.randn(2, 5, 13, dtype=F64) * 2).requires_grad_()
    labels = torch.randint(0, 13, (2, 5))
    upstream = torch.randn(2, 5, dtype=F64)
    got = logprobs_from_logits(logits, labels, chunk_rows=3)
    assert got.shape == (2, 5)
    (grad,) = torch.autograd.grad((got.double() * upstream).sum(), logits)
    (ref_grad,) = torch.autograd.grad((_reference_logprobs(logits, labels) * upstream).sum(), logits)
    assert grad.dtype == F64
    # The helper works in float32 internally, hence float32-level tolerance.
    assert torch.allclose(grad, ref_grad, atol=1e-5)


def test_logprobs_bf16_input():
    torch.manual_seed(2)
    logits = torch.randn(6, 17).bfloat16().requires_grad_()
    labels = torch.randint(0, 17, (6,))
    got = logprobs_from_logits(logits, labels, chunk_rows=4)
    assert got.dtype == torch.float32
    ref = _reference_logprobs(logits.detach().float(), labels)  # same bf16 values, upcast
    assert torch.allclose(got, ref, atol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    assert grad.dtype == torch.bfloat16
    float_logits = logits.detach().float().requires_grad_()
    (ref_grad,) = torch.autograd.grad(_reference_logprobs(float_logits, labels).sum(), float_logits)
    assert torch.allclose(grad.float(), ref_grad, atol=1e-2)  # bf16 rounding of the gradient


def test_logprobs_shape_mismatch():
    with pytest.raises(ValueError, match="leading dims"):
        logprobs_from_logits(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))


def _reference_entropy(logits):
    return -(torch.softmax(logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(dim=-1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_entropy_matches_direct_formula_and_gradient(chunk_rows):
    torch.manual_seed(3)
    logits = (torch.randn(7, 9, dtype=F64) * 2).requires_grad_()
    got = entropy_from_logits(logits, chunk_rows=chunk_rows)
    ref = _reference_entropy(logits)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=1e-5)
    upstream = torch.randn(7, dtype=F64)
    (grad,) = torch.autograd.grad((got.double() * upstream).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), logits)
    assert torch.allclose(grad, ref_grad, atol=1e-5)


def test_entropy_known_values_and_shapes():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    got = entropy_from_logits(logits)
    assert got.shape == (1, 2)
    assert got[0, 0].item() == pytest.approx(math.log(4))  # uniform
    assert got[0, 1].item() == pytest.approx(0.0, abs=1e-6)  # (nearly) one-hot
    assert entropy_from_logits(torch.zeros(0, 3, 5)).shape == (0, 3)
