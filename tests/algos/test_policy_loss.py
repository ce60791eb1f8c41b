"""Policy losses against hand-computed values, config handling, registry and edge cases."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algos.policy_loss import (
    PolicyLossConfig,
    compute_entropy_loss,
    compute_policy_loss_gpg,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_config_value,
)
from hybridflow.algos.registry import POLICY_LOSS_REGISTRY, get_policy_loss_fn, register_policy_loss
from hybridflow.algos.trust_region_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
)

F64 = torch.float64
REQUIRED = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "reinforce"]
METRIC_KEYS = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def _t(values):
    return torch.tensor(values, dtype=F64)


def _ratio_case():
    """One row of five tokens covering each PPO branch; old_log_prob = 0 so ratio = r."""
    ratios = [1.5, 0.5, 1.5, 5.0, 0.5]
    advantages = _t([[1.0, 1.0, -1.0, -1.0, -1.0]])
    log_prob = torch.log(_t([ratios])).requires_grad_()
    return torch.zeros(1, 5, dtype=F64), log_prob, advantages, torch.ones(1, 5, dtype=F64)


def test_vanilla_by_hand():
    old, lp, adv, mask = _ratio_case()
    loss, metrics = compute_policy_loss_vanilla(old, lp, adv, mask, config=PolicyLossConfig())
    # per token: clipped -1.2 | -0.5 | 1.5 | dual-clipped -A*c = 3 | clipped -A*0.8 = 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 3.0 + 0.8) / 5)
    assert set(metrics) == METRIC_KEYS
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    expected_kl = -sum(math.log(r) for r in [1.5, 0.5, 1.5, 5.0, 0.5]) / 5
    assert metrics["actor/ppo_kl"].item() == pytest.approx(expected_kl)
    assert not metrics["actor/ppo_kl"].requires_grad
    (grad,) = torch.autograd.grad(loss, lp)
    # d/dlp of -A*r is -A*r where unclipped; clipped and dual-clipped tokens have no gradient.
    assert torch.allclose(grad, _t([[0.0, -0.5 / 5, 1.5 / 5, 0.0, 0.0]]))


def test_vanilla_asymmetric_clip_from_mapping_config():
    old, lp, adv, mask = _ratio_case()
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3}
    loss, _ = compute_policy_loss_vanilla(old, lp, adv, mask, config=config)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 1.5 + 3.0 + 0.9) / 5)


def test_vanilla_dual_clip_boundary():
    c = 3.0
    adv = _t([[-1.0, -1.0]])
    lp = torch.log(_t([[c * (1 - 1e-6), c * (1 + 1e-6)]])).requires_grad_()
    old = torch.zeros_like(lp)
    loss, metrics = compute_policy_loss_vanilla(
        old, lp, adv, torch.ones_like(adv), config={"clip_ratio_c": c}
    )
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.5)  # only the token above c
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 0].item() == pytest.approx(c * (1 - 1e-6) / 2)
    assert grad[0, 1].item() == 0.0
    assert loss.item() == pytest.approx((c * (1 - 1e-6) + c) / 2)


def test_vanilla_rejects_clip_ratio_c_at_most_one():
    old, lp, adv, mask = _ratio_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(old, lp, adv, mask, config={"clip_ratio_c": 1.0})
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)


def test_rollout_is_weights_scale_per_token():
    old, lp, adv, mask = _ratio_case()
    weights = _t([[2.0, 1.0, 0.5, 1.0, 0.0]])
    loss, _ = compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-1.2 * 2 - 0.5 + 1.5 * 0.5 + 3.0 + 0.0) / 5)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=weights[:, :3])


@pytest.mark.parametrize("name", REQUIRED)
def test_constant_weights_scale_every_loss(name):
    torch.manual_seed(0)
    old = torch.randn(3, 4, dtype=F64)
    lp = old + 0.05 * torch.randn(3, 4, dtype=F64)
    adv = torch.randn(3, 4, dtype=F64)
    mask = torch.ones(3, 4, dtype=F64)
    config = PolicyLossConfig(clip_cov_lb=100.0)  # no Clip-Cov picks: keeps the loss deterministic
    fn = get_policy_loss_fn(name)
    base, metrics = fn(old, lp, adv, mask, config=config)
    scaled, _ = fn(old, lp, adv, mask, config=config, rollout_is_weights=torch.full((3, 4), 2.0, dtype=F64))
    assert scaled.item() == pytest.approx(2 * base.item())
    assert set(metrics) == METRIC_KEYS


@pytest.mark.parametrize("name", REQUIRED)
def test_zero_advantages_give_zero_loss_and_gradient(name):
    old = torch.zeros(2, 3, dtype=F64)
    lp = torch.full((2, 3), -0.3, dtype=F64, requires_grad=True)
    loss, metrics = get_policy_loss_fn(name)(
        old, lp, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    )
    (grad,) = torch.autograd.grad(loss, lp)
    assert all(torch.isfinite(v) for v in metrics.values())
    if name == "kl_cov":
        # The KL penalty does not depend on A: one top-covariance token of six pays 0.1 * |-0.3|.
        assert loss.item() == pytest.approx(0.1 * 0.3 / 6)
        assert (grad != 0).sum() == 1
        return
    assert loss.item() == 0.0
    assert (grad == 0).all()


@pytest.mark.parametrize("name", REQUIRED)
def test_fully_masked_row_contributes_nothing(name):
    torch.manual_seed(1)
    old = torch.randn(3, 4, dtype=F64)
    lp = old + 0.1 * torch.randn(3, 4, dtype=F64)
    adv = torch.randn(3, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=F64)
    lp[1], adv[1] = 50.0, 1e6  # garbage under the masked row
    config = PolicyLossConfig(clip_cov_lb=100.0)
    fn = get_policy_loss_fn(name)
    with_row, with_metrics = fn(old, lp, adv, mask, config=config)
    keep = [0, 2]
    without_row, without_metrics = fn(old[keep], lp[keep], adv[keep], mask[keep], config=config)
    assert torch.isfinite(with_row)
    assert with_row.item() == pytest.approx(without_row.item(), rel=1e-10)
    for key in METRIC_KEYS:
        assert with_metrics[key].item() == pytest.approx(without_metrics[key].item(), rel=1e-10, abs=1e-12)


def test_gspo_by_hand():
    old = torch.zeros(2, 3, dtype=F64)
    lp = torch.log(_t([[1.1, 1.3, 1.0], [1.5, 1.5, 1.0]])).requires_grad_()
    adv = torch.ones(2, 3, dtype=F64)
    mask = _t([[1, 1, 0], [1, 1, 0]])
    loss, metrics = compute_policy_loss_gspo(old, lp, adv, mask, loss_agg_mode="token-mean", config=None)
    s0 = math.sqrt(1.1 * 1.3)  # row 0: geometric-mean ratio, inside the clip range
    assert loss.item() == pytest.approx((-s0 - 1.2) / 2)  # row 1: ratio 1.5 clipped to 1.2
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, _t([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]]))


def test_gpg_by_hand():
    lp = _t([[-0.5, -2.0]]).requires_grad_()
    loss, metrics = compute_policy_loss_gpg(
        lp.detach().clone(), lp, _t([[2.0, 1.0]]), torch.ones(1, 2, dtype=F64)
    )
    assert loss.item() == pytest.approx((1.0 + 2.0) / 2)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, _t([[-1.0, -0.5]]))
    assert metrics["actor/ppo_kl"].item() == 0.0


def test_cispo_by_hand():
    ratios = [1.5, 0.5, 1.0]
    lp = torch.log(_t([ratios])).requires_grad_()
    loss, metrics = compute_policy_loss_cispo(
        torch.zeros(1, 3, dtype=F64), lp, torch.ones(1, 3, dtype=F64), torch.ones(1, 3)
    )
    assert loss.item() == pytest.approx(-(1.2 * math.log(1.5) + 0.8 * math.log(0.5)) / 3)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 3)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, _t([[-1.2 / 3, -0.8 / 3, -1.0 / 3]]))  # the clipped weight has no gradient


def test_reinforce_by_hand_default_seq_mean_token_sum():
    lp = _t([[-1.0, -2.0], [-0.5, 0.0]]).requires_grad_()
    adv = _t([[1.0, 1.0], [-2.0, -2.0]])
    mask = _t([[1, 1], [1, 0]])
    loss, _ = compute_policy_loss_reinforce(lp.detach(), lp, adv, mask)
    assert loss.item() == pytest.approx(((1.0 + 2.0) + (-1.0)) / 2)
    weighted, _ = compute_policy_loss_reinforce(
        lp.detach(), lp, adv, mask, rollout_is_weights=_t([[0.5, 2.0], [1, 1]])
    )
    assert weighted.item() == pytest.approx(((0.5 + 4.0) + (-1.0)) / 2)


def _cov_case():
    # mean(A) = 0, mean(logp) = -1.6: cov = [4.5, 0.5, 0.5, 0.5]; only token 0 lies in (lb, ub) = (1, 5).
    adv = _t([[3.0, -1.0, -1.0, -1.0]])
    lp = _t([[-0.1, -2.1, -2.1, -2.1]]).requires_grad_()
    return adv, lp, torch.ones(1, 4, dtype=F64)


def test_clip_cov_by_hand():
    adv, lp, mask = _cov_case()
    loss, metrics = compute_policy_loss_clip_cov(
        lp.detach().clone(), lp, adv, mask, config=PolicyLossConfig()
    )
    assert loss.item() == pytest.approx((0.0 + 1.0 + 1.0 + 1.0) / 4)  # ratio 1: loss -A, token 0 detached
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(1 / 4)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, _t([[0.0, 0.25, 0.25, 0.25]]))


def test_kl_cov_by_hand():
    adv, lp, mask = _cov_case()
    old = lp.detach() - 0.1  # log-ratio 0.1 everywhere
    config = {"policy_loss": {"kl_cov_ratio": 0.25}}  # verl layout: sub-knobs under policy_loss
    loss, metrics = compute_policy_loss_kl_cov(old, lp, adv, mask, config=config)
    r = math.exp(0.1)
    assert loss.item() == pytest.approx(((-3 + 1 + 1 + 1) * r + 0.1 * 0.1) / 4)  # ppo_kl_coef 0.1 on token 0
    assert metrics["actor/ppo_kl"].item() == pytest.approx(0.1)  # verl reports |log ratio| here
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        compute_policy_loss_kl_cov(old, lp, adv, mask, config={"kl_cov_ratio": 0.0})


def test_config_lookup_sources_and_defaults():
    assert get_config_value(None, "clip_ratio_c") == 3.0
    assert get_config_value({"clip_ratio": 0.3}, "clip_ratio") == 0.3
    verl_like = SimpleNamespace(
        clip_ratio=0.2,
        clip_ratio_low=None,
        policy_loss=SimpleNamespace(clip_cov_ratio=0.5),
        global_batch_info={"dp_size": 4, "batch_num_tokens": 100},
    )
    assert get_config_value(verl_like, "clip_cov_ratio") == 0.5
    assert get_config_value(verl_like, "dp_size") == 4
    assert get_config_value(verl_like, "clip_ratio_low") is None  # None means "use clip_ratio"
    assert get_config_value(verl_like, "kl_cov_ratio") == 0.0002
    with pytest.raises(KeyError):
        get_config_value(verl_like, "no_such_knob")


def test_global_batch_info_from_config_reaches_agg_loss():
    old, lp, adv, mask = _ratio_case()
    local, _ = compute_policy_loss_vanilla(old, lp, adv, mask)
    config = dataclasses.replace(PolicyLossConfig(), batch_num_tokens=10, dp_size=2)
    global_, _ = compute_policy_loss_vanilla(old, lp, adv, mask, config=config)
    assert global_.item() == pytest.approx(local.item() * 5 / 10 * 2)


def test_registry():
    assert set(REQUIRED) <= set(POLICY_LOSS_REGISTRY)
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla

    @register_policy_loss("test_custom")
    def custom(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return log_prob.sum(), {}

    try:
        assert get_policy_loss_fn("test_custom") is custom
    finally:
        POLICY_LOSS_REGISTRY.pop("test_custom")
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss_fn("test_custom")


def test_policy_loss_config_validation():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        PolicyLossConfig(clip_cov_ratio=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PolicyLossConfig().clip_ratio = 0.3


def test_entropy_loss_by_hand():
    logits = _t([[[0.0, 0.0], [math.log(3.0), 0.0]], [[5.0, 1.0], [0.0, 0.0]]])
    mask = _t([[1, 1], [0, 0]])
    h_uniform = math.log(2.0)
    h_skewed = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert compute_entropy_loss(logits, mask).item() == pytest.approx((h_uniform + h_skewed) / 2, rel=1e-6)
    summed = compute_entropy_loss(logits, mask, "token-sum")
    assert summed.item() == pytest.approx(h_uniform + h_skewed, rel=1e-6)
    scaled = compute_entropy_loss(logits, mask, batch_num_tokens=4)
    assert scaled.item() == pytest.approx((h_uniform + h_skewed) / 4, rel=1e-6)
