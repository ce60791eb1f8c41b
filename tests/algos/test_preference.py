"""DPO / cDPO / IPO / KTO losses, gradients and metrics against hand-computed values on tiny batches."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos.preference import (
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    kto_metrics,
    preference_metrics,
    sequence_logps,
)

BETA = 0.5
# A 2-pair batch. h = (pi_c - pi_r) - (ref_c - ref_r):
#   pair 0: (-1.0 + 2.0) - (-1.5 + 1.5) = 1.0
#   pair 1: (-3.0 + 2.5) - (-2.0 + 3.0) = -1.5
PI_C, PI_R = [-1.0, -3.0], [-2.0, -2.5]
REF_C, REF_R = [-1.5, -2.0], [-1.5, -3.0]
H = [1.0, -1.5]


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _dpo(loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    pi_c = torch.tensor(PI_C, dtype=torch.float64, requires_grad=True)
    pi_r = torch.tensor(PI_R, dtype=torch.float64, requires_grad=True)
    ref_c = torch.tensor(REF_C, dtype=torch.float64)
    ref_r = torch.tensor(REF_R, dtype=torch.float64)
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, BETA, loss_type=loss_type, label_smoothing=label_smoothing)
    grads = torch.autograd.grad(out[0].sum(), (pi_c, pi_r))
    return out, grads


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_dpo_sigmoid_values_and_gradients() -> None:
    (losses, chosen, rejected), (g_c, g_r) = _dpo("sigmoid")
    # -logsigmoid(x) = log(1 + exp(-x)), x = beta h = 0.5 and -0.75
    _close(losses, [math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(0.75))])
    # d/dpi_c of -logsigmoid(beta h) = -beta sigmoid(-beta h); pi_r enters h with the opposite sign
    expected = [-BETA * _sig(-0.5), -BETA * _sig(0.75)]
    _close(g_c, expected)
    _close(g_r, [-g for g in expected])
    # rewards = beta (pi - ref): chosen 0.5 * (0.5, -1.0), rejected 0.5 * (-0.5, 0.5)
    _close(chosen, [0.25, -0.5])
    _close(rejected, [-0.25, 0.25])
    assert not chosen.requires_grad and not rejected.requires_grad


def test_cdpo_label_smoothing_values_and_gradients() -> None:
    eps = 0.1
    (losses, _, _), (g_c, g_r) = _dpo("sigmoid", label_smoothing=eps)
    expected_loss = [
        0.9 * math.log(1 + math.exp(-0.5)) + 0.1 * math.log(1 + math.exp(0.5)),
        0.9 * math.log(1 + math.exp(0.75)) + 0.1 * math.log(1 + math.exp(-0.75)),
    ]
    _close(losses, expected_loss)
    # d/dpi_c = -(1 - eps) beta sigmoid(-beta h) + eps beta sigmoid(beta h)
    expected = [-0.9 * BETA * _sig(-x) + 0.1 * BETA * _sig(x) for x in (0.5, -0.75)]
    _close(g_c, expected)
    _close(g_r, [-g for g in expected])


def test_ipo_values_and_gradients() -> None:
    (losses, chosen, _), (g_c, g_r) = _dpo("ipo")
    # (h - 1 / (2 beta))^2 with 1 / (2 * 0.5) = 1: (1 - 1)^2 = 0 and (-1.5 - 1)^2 = 6.25
    _close(losses, [0.0, 6.25])
    # d/dpi_c = 2 (h - 1): 0 and -5
    _close(g_c, [0.0, -5.0])
    _close(g_r, [0.0, 5.0])
    _close(chosen, [0.25, -0.5])


def test_ipo_with_averaged_sequence_logps() -> None:
    # Chosen completions of 2 and 1 tokens, rejected of 1 and 3 tokens (the caller averages for IPO).
    tok_c = torch.tensor([[-1.0, -3.0, 9.0], [-4.0, 9.0, 9.0]])  # (P, T); 9.0 sits under the mask
    tok_r = torch.tensor([[-2.0, 9.0, 9.0], [-1.0, -2.0, -3.0]])
    mask_c = torch.tensor([[1, 1, 0], [1, 0, 0]])
    mask_r = torch.tensor([[1, 0, 0], [1, 1, 1]])
    pi_c, pi_r = sequence_logps(tok_c, mask_c, average=True), sequence_logps(tok_r, mask_r, average=True)
    _close(pi_c, [-2.0, -4.0])
    _close(pi_r, [-2.0, -2.0])
    zeros = torch.zeros(2)
    losses, _, _ = dpo_loss(pi_c, pi_r, zeros, zeros, beta=0.25, loss_type="ipo")
    # h = (0, -2); 1 / (2 * 0.25) = 2: (0 - 2)^2 = 4, (-2 - 2)^2 = 16
    _close(losses, [4.0, 16.0])


def test_sequence_logps_sum() -> None:
    tok = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.25, -0.25]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    _close(sequence_logps(tok, mask), [-3.0, -1.0])  # the NaN under the mask does not leak in
    with pytest.raises(ValueError, match="must match"):
        sequence_logps(tok, mask[:, :2])


def test_dpo_reference_gets_no_gradient() -> None:
    pi_c, pi_r = torch.tensor(PI_C, requires_grad=True), torch.tensor(PI_R, requires_grad=True)
    ref_c, ref_r = torch.tensor(REF_C, requires_grad=True), torch.tensor(REF_R, requires_grad=True)
    losses, _, _ = dpo_loss(pi_c, pi_r, ref_c, ref_r, BETA)
    grads = torch.autograd.grad(losses.sum(), (ref_c, ref_r), allow_unused=True)
    assert grads == (None, None)


def test_dpo_argument_errors() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="sigmoid, ipo"):
        dpo_loss(x, x, x, x, BETA, loss_type="hinge")
    with pytest.raises(ValueError, match="sigmoid' only"):
        dpo_loss(x, x, x, x, BETA, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, BETA, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(x, torch.zeros(3), x, x, BETA)


def test_preference_metrics() -> None:
    (_, chosen, rejected), _ = _dpo("sigmoid")
    metrics = preference_metrics(chosen, rejected, torch.tensor(PI_C), torch.tensor(PI_R))
    # chosen rewards (0.25, -0.5), rejected (-0.25, 0.25): pair 0 wins, pair 1 loses
    assert metrics == pytest.approx(
        {
            "rewards/chosen": (0.25 - 0.5) / 2,
            "rewards/rejected": (-0.25 + 0.25) / 2,
            "rewards/accuracies": 0.5,
            "rewards/margins": (0.5 + -0.75) / 2,
            "logps/chosen": (-1.0 - 3.0) / 2,
            "logps/rejected": (-2.0 - 2.5) / 2,
        }
    )
    tie = preference_metrics(torch.ones(1), torch.ones(1), torch.zeros(1), torch.zeros(1))
    assert tie["rewards/accuracies"] == 0.0


# ---- KTO ---------------------------------------------------------------------------------------------------

KTO_POLICY, KTO_REF = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]  # logratio r = (0.5, -1.0, 0.0)
KTO_LABELS = [True, False, True]


def test_kto_kl_estimate_mean_and_clamp() -> None:
    policy = torch.tensor([-2.0, -1.0, -3.0], requires_grad=True)
    z0 = kto_kl_estimate(policy, torch.tensor([-2.2, -1.4, -3.0]))
    torch.testing.assert_close(z0, torch.tensor((0.2 + 0.4 + 0.0) / 3))
    assert z0.dim() == 0 and not z0.requires_grad
    # A negative mean (policy below the reference on mismatched pairs) clamps to 0.
    assert kto_kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([0.0, 0.0])).item() == 0.0


def test_kto_values_and_gradients_both_labels() -> None:
    beta, w_d, w_u, z0 = 0.5, 1.0, 1.5, 0.2
    policy = torch.tensor(KTO_POLICY, dtype=torch.float64, requires_grad=True)
    kl = torch.tensor(z0, dtype=torch.float64, requires_grad=True)
    losses, rewards = kto_loss(
        policy, torch.tensor(KTO_REF, dtype=torch.float64), torch.tensor(KTO_LABELS), kl, beta, w_d, w_u
    )
    x0, y1, x2 = beta * (0.5 - z0), beta * (z0 - -1.0), beta * (0.0 - z0)
    _close(losses, [w_d * (1 - _sig(x0)), w_u * (1 - _sig(y1)), w_d * (1 - _sig(x2))])
    _close(rewards, [0.25, -0.5, 0.0])
    grad, grad_kl = torch.autograd.grad(losses.sum(), (policy, kl), allow_unused=True)
    # desirable: d/dpi w (1 - sig(beta (r - z0))) = -w beta sig (1 - sig)
    # undesirable: d/dpi w (1 - sig(beta (z0 - r))) = +w beta sig (1 - sig)
    _close(
        grad,
        [
            -w_d * beta * _sig(x0) * (1 - _sig(x0)),
            w_u * beta * _sig(y1) * (1 - _sig(y1)),
            -w_d * beta * _sig(x2) * (1 - _sig(x2)),
        ],
    )
    assert grad_kl is None  # z0 is detached


def test_kto_clamps_a_negative_kl_estimate() -> None:
    policy, ref, labels = torch.tensor(KTO_POLICY), torch.tensor(KTO_REF), torch.tensor(KTO_LABELS)
    clamped, _ = kto_loss(policy, ref, labels, torch.tensor(-0.3), beta=1.0)
    # z0 = 0: desirable 1 - sig(r), undesirable 1 - sig(-r)
    _close(clamped, [1 - _sig(0.5), 1 - _sig(1.0), 1 - _sig(0.0)])


def test_kto_argument_errors() -> None:
    x = torch.zeros(2)
    with pytest.raises(TypeError, match="bool"):
        kto_loss(x, x, torch.tensor([1, 0]), torch.tensor(0.0), 0.1)
    with pytest.raises(ValueError, match="one shape"):
        kto_loss(x, torch.zeros(3), torch.tensor([True, False]), torch.tensor(0.0), 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        kto_loss(x, x, torch.tensor([True, False]), torch.tensor(0.0), 0.1, desirable_weight=-1.0)


def test_kto_metrics() -> None:
    rewards, logps, labels = (
        torch.tensor([0.25, -0.5, 0.0]),
        torch.tensor(KTO_POLICY),
        torch.tensor(KTO_LABELS),
    )
    assert kto_metrics(rewards, logps, labels) == pytest.approx(
        {
            "rewards/chosen": (0.25 + 0.0) / 2,
            "rewards/rejected": -0.5,
            "rewards/margins": 0.125 - -0.5,
            "logps/chosen": (-1.0 - 0.5) / 2,
            "logps/rejected": -2.0,
        }
    )
    only_desirable = kto_metrics(rewards[[0]], logps[[0]], labels[[0]])
    assert only_desirable["rewards/rejected"] == 0.0 and only_desirable["logps/rejected"] == 0.0
    assert only_desirable["rewards/margins"] == 0.25
