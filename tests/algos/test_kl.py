"""KL penalties, straight-through gradients, KL-in-reward and KL controllers against hand values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    compute_kl_in_reward,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
)

LOGPROB = torch.tensor([0.0, -1.0, -2.0])
REF = torch.tensor([-1.0, -1.0, 0.0])
# d = ref - logprob = (-1, 0, 2)
EXPECTED = {
    "k1": [1.0, 0.0, -2.0],
    "abs": [1.0, 0.0, 2.0],
    "k2": [0.5, 0.0, 2.0],
    "k3": [math.exp(-1) + 1 - 1, 0.0, math.exp(2) - 2 - 1],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("name", [*EXPECTED, *ALIASES])
def test_each_estimator_by_hand(name):
    expected = torch.tensor(EXPECTED[ALIASES.get(name, name)])
    torch.testing.assert_close(kl_penalty(LOGPROB, REF, name), expected)


def test_k3_clamps_the_log_ratio_and_the_result():
    logprob = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.0])
    ref = torch.tensor([2.5, 3.0, 1000.0, -1000.0, 0.0])
    out = kl_penalty(logprob, ref, "k3")
    # d = 2.5 stays below 10; d = 3 gives 16.09 -> 10; d = +-1000 is clamped to +-20 first (no inf) -> 10
    torch.testing.assert_close(out, torch.tensor([math.exp(2.5) - 3.5, 10.0, 10.0, 10.0, 10.0]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_keeps_the_value_and_takes_the_k2_gradient(name):
    logprob = LOGPROB.clone().requires_grad_(True)
    out = kl_penalty(logprob, REF, name)
    torch.testing.assert_close(out.detach(), torch.tensor(EXPECTED[ALIASES.get(name[:-1], name[:-1])]))
    (grad,) = torch.autograd.grad(out.sum(), logprob)
    # d/dlogprob of 0.5 (logprob - ref)^2 is logprob - ref
    torch.testing.assert_close(grad, torch.tensor([1.0, 0.0, -2.0]))


def test_plain_k3_has_its_own_gradient():
    logprob = LOGPROB.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_penalty(logprob, REF, "k3").sum(), logprob)
    # d/dlogprob of exp(ref - lp) - (ref - lp) - 1 is 1 - exp(ref - lp)
    torch.testing.assert_close(grad, torch.tensor([1 - math.exp(-1), 0.0, 1 - math.exp(2)]))


@pytest.mark.parametrize("name", ["k4", "full", "k3++", "", "KL"])
def test_unknown_names_raise_with_the_valid_list(name):
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGPROB, REF, name)


def test_compute_rewards_is_k1_in_reward():
    out = compute_rewards(
        torch.tensor([1.0, 2.0]), torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), 0.1
    )
    torch.testing.assert_close(out, torch.tensor([1.0 - 0.05, 2.0 + 0.1]))


def test_compute_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -1.0, -9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, kl_mean = compute_kl_in_reward(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 on valid tokens: row 0 (0.5, -1, 0); row 1 (1, 0) and its padding ignored; row 2 fully masked
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    # per-row token means (-0.5/3, 0.5, 0), then the mean over rows, as verl's actor/reward_kl_penalty
    assert kl_mean == pytest.approx((-0.5 / 3 + 0.5 + 0.0) / 3)


def test_fixed_controller():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=256)
    assert ctrl.value == 0.05
    other = FixedKLController(kl_coef=1.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    ctrl.update(current_kl=torch.tensor(3.0), n_steps=100)  # error -0.5 clipped to -0.2
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * (1 - 0.2 * 100 / 10000))
    before = ctrl.value
    ctrl.update(current_kl=6.6, n_steps=1000)  # error 0.1, inside the clip
    assert ctrl.value == pytest.approx(before * (1 + 0.1 * 1000 / 10000))
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(ctrl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctrl.value, 6.0, 10000.0)


def test_get_kl_controller_from_mapping_or_attributes():
    fixed = get_kl_controller({"type": "fixed", "kl_coef": 0.01})
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    adaptive = get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.1, target_kl=2.0, horizon=500))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 2.0, 500.0)


@pytest.mark.parametrize(
    ("kl_ctrl", "match"),
    [
        ({"type": "pid", "kl_coef": 0.1}, "'fixed' or 'adaptive'"),
        ({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0, "horizon": 0}, "horizon must be > 0"),
        ({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.0, "horizon": 10}, "target_kl > 0"),
    ],
)
def test_get_kl_controller_rejects_bad_settings(kl_ctrl, match):
    with pytest.raises(ValueError, match=match):
        get_kl_controller(kl_ctrl)
