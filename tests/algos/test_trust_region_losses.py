"""DPPO (TV, KL), SAPO, geo_mean, DRO and GSPO's aggregation (trust_region_losses), and bypass mode (policy_loss),
with values worked out by hand."""

import math

import pytest
import torch

from hybridflow.algos import (
    POLICY_LOSS_REGISTRY,
    PolicyLossConfig,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    get_policy_loss_fn,
)

F64 = torch.float64
LOSS_AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


def test_registered_under_verl_names():
    for name, fn in {
        "dppo_tv": compute_policy_loss_dppo_tv,
        "dppo_kl": compute_policy_loss_dppo_kl,
        "sapo": compute_policy_loss_sapo,
        "geo_mean": compute_policy_loss_geo_mean,
        "dro": compute_policy_loss_dro,
        "bypass_mode": compute_policy_loss_bypass_mode,
    }.items():
        assert POLICY_LOSS_REGISTRY[name] is fn is get_policy_loss_fn(name)


# One row, four tokens: probabilities old -> new and advantages.
OLD_P = [0.3, 0.5, 0.4, 0.9]
NEW_P = [0.45, 0.9, 0.25, 0.999]
ADV = [1.0, 1.0, -1.0, 1.0]


def _dppo_inputs():
    old = torch.log(torch.tensor([OLD_P], dtype=F64))
    new = torch.log(torch.tensor([NEW_P], dtype=F64)).requires_grad_()
    return old, new, torch.tensor([ADV], dtype=F64), torch.ones(1, 4, dtype=F64)


def _binary_kl(p_old: float, p: float) -> float:
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))


def _dppo_expected(keep: list[int], c: float = 3.0) -> float:
    """-A * min(r, c) * log p on kept tokens, token-mean over the 4 tokens."""
    total = 0.0
    for p_old, p, a, k in zip(OLD_P, NEW_P, ADV, keep):
        total += -a * min(p / p_old, c) * math.log(p) * k
    return total / 4


def test_dppo_tv_drops_tokens_whose_probability_moved_too_far():
    old, new, adv, mask = _dppo_inputs()
    # p - p_old = 0.15 (A>0, keep), 0.4 (A>0, > 0.2: drop), -0.15 (A<0, keep), 0.099 (A>0, keep)
    loss, m = compute_policy_loss_dppo_tv(old, new, adv, mask, "token-mean", {"clip_ratio": 0.2})
    assert loss.item() == pytest.approx(_dppo_expected([1, 0, 1, 1]))
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_lower"].item() == 0.0  # no kept ratio above c = 3
    loss.backward()
    # the truncated ratio is a stop-gradient weight: d/dlogp = -A * r / 4, and 0 where dropped
    expected_grad = [-a * (p / q) / 4 * k for q, p, a, k in zip(OLD_P, NEW_P, ADV, [1, 0, 1, 1])]
    torch.testing.assert_close(new.grad, torch.tensor([expected_grad], dtype=F64))


def test_dppo_truncates_at_clip_ratio_c():
    old, new, adv, mask = _dppo_inputs()
    cfg = {"clip_ratio": 0.2, "clip_ratio_c": 1.2}
    loss, m = compute_policy_loss_dppo_tv(old, new, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx(_dppo_expected([1, 0, 1, 1], c=1.2))
    # kept tokens with r > 1.2: token 0 (1.5); token 3 has r = 1.11; token 1 (1.8) is dropped
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 4)


def test_dppo_kl_uses_the_binary_kl():
    old, new, adv, mask = _dppo_inputs()
    kls = [_binary_kl(q, p) for q, p in zip(OLD_P, NEW_P)]  # 0.047, 0.511, 0.054, 0.367
    assert kls[0] < 0.2 < kls[1] and kls[2] < 0.2 < kls[3]
    loss, m = compute_policy_loss_dppo_kl(old, new, adv, mask, "token-mean", PolicyLossConfig())
    # tokens 1 and 3 rose (A > 0) by more than 0.2 nats of binary KL: dropped (TV kept token 3)
    assert loss.item() == pytest.approx(_dppo_expected([1, 0, 1, 0]), rel=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 4)
    # a probability that FELL with A > 0 is always kept, however far
    far = torch.log(torch.tensor([[0.01]], dtype=F64))
    kept, _ = compute_policy_loss_dppo_kl(
        torch.log(torch.tensor([[0.9]], dtype=F64)), far, torch.ones(1, 1, dtype=F64), torch.ones(1, 1)
    )
    assert kept.item() == pytest.approx(-(0.01 / 0.9) * math.log(0.01))


def test_sapo_soft_gate_always_per_sequence():
    # row 0: two tokens at r = 1 (A = 1, -1), row 1: one token at r = e^0.5 (A = 2), row 2 padding only
    old = torch.zeros(3, 2, dtype=F64)
    new = torch.tensor([[0.0, 0.0], [0.5, 0.0], [0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
    sig = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))  # tau_pos = 1
    row0 = (-(0.5 * 4 / 1.0) * 1 + (0.5 * 4 / 1.05) * 1) / 2  # gate at r = 1 is 2 / tau
    row1 = -(sig * 4) * 2
    for mode in ("token-mean", "seq-mean-token-mean"):  # loss_agg_mode is ignored, as in verl
        loss, m = compute_policy_loss_sapo(old, new, adv, mask, mode, {"tau_pos": 1.0, "tau_neg": 1.05})
        assert loss.item() == pytest.approx((row0 + row1) / 2)
    assert m["actor/pg_clipfrac"].item() == 0.0
    slow, _ = compute_policy_loss_sapo(old, new, adv, mask, "token-mean", {"tau_pos": 2.0})
    assert slow.item() != pytest.approx(loss.item())


def test_geo_mean_clips_token_log_ratios_by_advantage_sign():
    # row 0: log r = 0.3, -0.1 with A = 1: 0.3 clipped to 0.2 -> mean 0.05; row 1: log r = -0.3, 0.1 with
    # A = -1: -0.3 clipped to -0.2 -> mean -0.05; row 2 fully masked (left out of the mean)
    old = torch.zeros(3, 3, dtype=F64)
    new = torch.tensor([[0.3, -0.1, 0.0], [-0.3, 0.1, 9.0], [0.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=F64)
    loss, m = compute_policy_loss_geo_mean(old, new, adv, mask, "token-mean", {"clip_ratio": 0.2})
    assert loss.item() == pytest.approx((-math.exp(0.05) + math.exp(-0.05)) / 2)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    weights = torch.tensor([[4.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    weighted, _ = compute_policy_loss_geo_mean(old, new, adv, mask, "token-mean", {}, weights)
    # row 0 scaled by the geometric mean of its weights, sqrt(4 * 1) = 2
    assert weighted.item() == pytest.approx((-2 * math.exp(0.05) + math.exp(-0.05)) / 2, rel=1e-6)


def test_dro_quadratic_penalty_and_beta_check():
    old = torch.tensor([[-1.5, -2.0]], dtype=F64)
    new = torch.tensor([[-1.0, -2.0]], dtype=F64)
    adv = torch.tensor([[1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    loss, m = compute_policy_loss_dro(old, new, adv, mask, "token-mean", {"policy_loss": {"dro_beta": 0.5}})
    # token 0: -(-1 * 1 - 0.25 * 0.5^2) = 1.0625; token 1: -(-2 * 2 - 0) = 4
    assert loss.item() == pytest.approx((1.0625 + 4.0) / 2)
    assert m["actor/ppo_kl"].item() == pytest.approx(-0.25)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta"):
            compute_policy_loss_dro(old, new, adv, mask, "token-mean", PolicyLossConfig(dro_beta=beta))


def test_bypass_mode_reinforce_and_ppo_clip():
    rollout = torch.log(torch.tensor([[0.5, 0.5]], dtype=F64))  # bypass: old_log_prob is the rollout's
    new = torch.log(torch.tensor([[0.5, 0.8]], dtype=F64))  # r = 1, 1.6
    adv = torch.tensor([[1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    rc = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5}
    loss, m = compute_policy_loss_bypass_mode(
        rollout, new, adv, mask, "token-mean", {"rollout_correction": rc}
    )
    # weights min(r, 1.5) = 1, 1.5: -(1 * 1 * log 0.5 + 1.5 * 2 * log 0.8) / 2
    assert loss.item() == pytest.approx(-(math.log(0.5) + 3.0 * math.log(0.8)) / 2)
    assert m["rollout_corr/rollout_is_mean"].item() == pytest.approx(1.25)
    rc = {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.5}  # ppo_clip by default
    cfg = PolicyLossConfig(rollout_correction=rc)
    loss, m = compute_policy_loss_bypass_mode(rollout, new, adv, mask, "token-mean", cfg)
    # r = 1.6 is outside [1/1.5, 1.5]: rejected; PPO on token 0 alone: -A * r = -1
    assert loss.item() == pytest.approx(-1.0)
    assert m["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rollout_correction"):
        compute_policy_loss_bypass_mode(rollout, new, adv, mask, "token-mean", PolicyLossConfig())
    with pytest.raises(ValueError, match="loss_type"):
        compute_policy_loss_bypass_mode(
            rollout, new, adv, mask, config={"rollout_correction": {"loss_type": "x"}}
        )


def _gspo_case():
    """Row 0: one token, log r = 0.1, A = 1; row 1: three tokens, log r = 0, 0.3, -0.3 (mean 0), A = -2."""
    old = torch.zeros(2, 3, dtype=F64)
    new = torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.3, -0.3]], dtype=F64)
    adv = torch.tensor([[1.0, 0.0, 0.0], [-2.0, -2.0, -2.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=F64)
    return old, new, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_honours_loss_agg_mode_on_variable_lengths(mode):
    old, new, adv, mask = _gspo_case()
    s0 = math.exp(0.1)  # row 0's sequence ratio, inside the clip range [0.8, 1.2]; row 1's is exp(0) = 1
    row0, row1 = [-1.0 * s0], [2.0, 2.0, 2.0]  # per-token losses -A * s
    expected = {
        "token-mean": (sum(row0) + sum(row1)) / 4,
        "token-sum": sum(row0) + sum(row1),
        "seq-mean-token-sum": (sum(row0) + sum(row1)) / 2,
        "seq-mean-token-mean": (sum(row0) / 1 + sum(row1) / 3) / 2,
        "seq-mean-token-sum-norm": (sum(row0) / 3 + sum(row1) / 3) / 2,  # loss_scale_factor = T = 3
    }[mode]
    loss, _ = compute_policy_loss_gspo(old, new, adv, mask, mode, {"clip_ratio": 0.2})
    assert loss.item() == pytest.approx(expected)


def test_gspo_default_mode_is_the_sequence_mean():
    old, new, adv, mask = _gspo_case()
    default, _ = compute_policy_loss_gspo(old, new, adv, mask, config={})
    token_mean, _ = compute_policy_loss_gspo(old, new, adv, mask, "token-mean", {})
    assert default.item() == pytest.approx((-math.exp(0.1) + 2.0) / 2)
    assert token_mean.item() - default.item() == pytest.approx(
        (6 - math.exp(0.1)) / 4 - (2 - math.exp(0.1)) / 2
    )
