"""Advantage estimators against values computed by hand or by plain loops written here."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.algos import advantage as adv_mod
from hybridflow.algos.advantage import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

EPS = 1e-6
T = 4


def outcome_batch(scores: list[float], lengths: list[int], pad_reward: float = 0.0):
    """Right-padded (B, T) rewards and mask with each score on the last valid token."""
    rewards = torch.full((len(scores), T), pad_reward)
    mask = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, :n] = 0.0
        mask[i, :n] = 1.0
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def expand(per_row: list[float], mask: torch.Tensor) -> torch.Tensor:
    """Expected (B, T): each row's scalar on its valid tokens, zero elsewhere."""
    return torch.tensor(per_row, dtype=torch.float32)[:, None] * mask


def whiten_by_hand(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_whiten written out with the statistics module: unbiased variance over the valid entries."""
    flat = [float(v) for v, m in zip(values.flatten(), mask.flatten()) if m]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    out = torch.zeros_like(values)
    for idx in mask.nonzero():
        i, j = idx.tolist()
        out[i, j] = (float(values[i, j]) - mean) / math.sqrt(var + 1e-8)
    return out


# Two groups of three and a group of one, right-padded to different lengths.
SCORES = [1.0, 0.0, 2.0, 4.0, 1.0, 1.0, 3.0]
LENGTHS = [3, 2, 4, 1, 4, 2, 3]
UIDS = np.array(["a", "a", "a", "b", "b", "b", "c"], dtype=object)
# group a: mean 1, unbiased std 1; group b: mean 2, deviations (2, -1, -1), std sqrt(3); group c alone.
S3 = math.sqrt(3.0)


@pytest.fixture
def batch():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    return rewards, mask, UIDS.copy()


def test_grpo_by_hand(batch):
    rewards, mask, uids = batch
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, uids)
    expected = [
        0.0,
        -1 / (1 + EPS),
        1 / (1 + EPS),
        2 / (S3 + EPS),
        -1 / (S3 + EPS),
        -1 / (S3 + EPS),
        3 / (1 + EPS),
    ]
    torch.testing.assert_close(adv, expand(expected, mask))
    assert torch.equal(adv, ret)


def test_dr_grpo_without_std(batch):
    rewards, mask, uids = batch
    expected = expand([0.0, -1.0, 1.0, 2.0, -1.0, -1.0, 3.0], mask)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, expected)
    for config in ({"norm_adv_by_std_in_grpo": False}, SimpleNamespace(norm_adv_by_std_in_grpo=False)):
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids, config=config)
        torch.testing.assert_close(adv, expected)
    # An explicit argument wins over the config.
    adv, _ = compute_grpo_outcome_advantage(
        rewards, mask, uids, norm_adv_by_std_in_grpo=True, config={"norm_adv_by_std_in_grpo": False}
    )
    assert adv[3, 0].item() == pytest.approx(2 / (S3 + EPS))


def test_grpo_all_equal_rewards_give_exact_zero():
    rewards, mask = outcome_batch([0.1, 0.1, 0.1, 0.7, 0.7], [2, 4, 3, 1, 2])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([0, 0, 0, 1, 1]))
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros_like(adv))


def test_grpo_uid_order_does_not_matter():
    # interleave-repeated prompts [a, a, b, b] and the same samples shuffled to [a, b, a, b]
    rewards, mask = outcome_batch([1.0, 0.0, 5.0, 2.0], [1, 2, 3, 4])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["a", "a", "b", "b"], dtype=object))
    # a: (1, 0), mean 0.5, unbiased std sqrt(0.5); b: (5, 2), mean 3.5, unbiased std sqrt(4.5)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    b = 1.5 / (math.sqrt(4.5) + EPS)
    torch.testing.assert_close(adv, expand([a, -a, b, -b], mask))
    perm = [0, 2, 1, 3]
    adv_perm, _ = compute_grpo_outcome_advantage(rewards[perm], mask[perm], np.array([7, 9, 7, 9]))
    torch.testing.assert_close(adv_perm, adv[perm])


def test_grpo_vectorised_matches_a_plain_loop_on_a_large_batch():
    gen = torch.Generator().manual_seed(1)
    n_prompts, n = 256, 5
    scores = torch.randint(0, 3, (n_prompts * n,), generator=gen).float()
    scores[:n] = 1.0  # one all-equal group
    rewards, mask = outcome_batch(scores.tolist(), [1 + i % T for i in range(len(scores))])
    uids = np.repeat(np.array([f"p{i}" for i in range(n_prompts)], dtype=object), n)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids)
    expected = []
    for i in range(len(scores)):
        group = [float(scores[j]) for j in range(len(scores)) if uids[j] == uids[i]]
        expected.append((float(scores[i]) - statistics.mean(group)) / (statistics.stdev(group) + EPS))
    torch.testing.assert_close(adv, expand(expected, mask))
    vec, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)
    assert torch.equal(vec, adv)


def test_rloo_by_hand(batch):
    rewards, mask, uids = batch
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, uids)
    # a_i = s_i minus the mean of the other samples; the lone sample of group c keeps its score.
    torch.testing.assert_close(adv, expand([0.0, -1.5, 1.5, 3.0, -1.5, -1.5, 3.0], mask))
    assert torch.equal(adv, ret)
    vec, _ = compute_rloo_vectorized_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(vec, expand([0.0, -1.5, 1.5, 3.0, -1.5, -1.5, 0.0], mask))


def test_opo_length_weighted_baseline(batch):
    rewards, mask, uids = batch
    adv, _ = compute_opo_outcome_advantage(rewards, mask, uids)
    base_a = (3 * 1.0 + 2 * 0.0 + 4 * 2.0) / (3 + 2 + 4)
    base_b = (1 * 4.0 + 4 * 1.0 + 2 * 1.0) / (1 + 4 + 2)
    expected = [1 - base_a, 0 - base_a, 2 - base_a, 4 - base_b, 1 - base_b, 1 - base_b, 3.0]
    torch.testing.assert_close(adv, expand(expected, mask))


def test_gpg_by_hand(batch):
    rewards, mask, uids = batch
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, uids)
    alpha = 7 / 6  # 7 samples, 6 with a non-zero reward
    expected = [alpha * d for d in (0.0, -1.0, 1.0, 2.0, -1.0, -1.0, 3.0)]
    torch.testing.assert_close(adv, expand(expected, mask))
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, uids, f_norm=2.0)
    torch.testing.assert_close(adv, expand([e / 2 for e in expected], mask))


def test_reinforce_plus_plus_baseline_by_hand(batch):
    rewards, mask, uids = batch
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids)
    centered = expand([0.0, -1.0, 1.0, 2.0, -1.0, -1.0, 3.0], mask)
    torch.testing.assert_close(adv, whiten_by_hand(centered, mask))
    assert torch.equal(adv, ret)


def test_passk_by_hand():
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 4.0, 1.0, 1.0, 2.0, 2.0, 0.0], [3, 2, 4, 1, 4, 2, 1, 2, 3])
    uids = np.array(list("aaabbbccc"))
    adv, ret = compute_grpo_passk_outcome_advantage(rewards, mask, uids)
    # a: best 2, runner-up 1, std 1; b: best 4, runner-up 1, std sqrt(3); c: a tie at the top gains nothing
    expected = [0.0, 0.0, 1 / (1 + EPS), 3 / (S3 + EPS), 0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, expand(expected, mask))
    assert torch.equal(adv, ret)
    adv, _ = compute_grpo_passk_outcome_advantage(
        rewards, mask, uids, config={"norm_adv_by_std_in_grpo": False}
    )
    torch.testing.assert_close(adv, expand([0, 0, 1.0, 3.0, 0, 0, 0, 0, 0], mask))


def test_passk_rejects_groups_of_one(batch):
    rewards, mask, uids = batch
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_grpo_passk_outcome_advantage(rewards, mask, uids)


def test_gdpo_by_hand(batch):
    rewards, mask, uids = batch
    # Without reward keys the single component is the outcome score: GRPO, then whitened over tokens.
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, uids)
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(adv, whiten_by_hand(grpo, mask))
    fmt = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # group a: mean 2/3, std sqrt(1/3); b all equal; c alone
    acc = SCORES
    config = {"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [0.5, 2.0]}
    adv, _ = compute_gdpo_outcome_advantage(
        rewards, mask, uids, config=config, non_tensor_batch={"fmt": np.array(fmt), "acc": np.array(acc)}
    )
    sa = math.sqrt(1 / 3)
    fmt_adv = [(1 / 3) / (sa + EPS), (1 / 3) / (sa + EPS), (-2 / 3) / (sa + EPS), 0, 0, 0, 1 / (1 + EPS)]
    acc_adv = [
        0.0,
        -1 / (1 + EPS),
        1 / (1 + EPS),
        2 / (S3 + EPS),
        -1 / (S3 + EPS),
        -1 / (S3 + EPS),
        3 / (1 + EPS),
    ]
    total = expand([0.5 * f + 2.0 * a for f, a in zip(fmt_adv, acc_adv)], mask)
    torch.testing.assert_close(adv, whiten_by_hand(total, mask))
    with pytest.raises(ValueError, match="non_tensor_batch"):
        compute_gdpo_outcome_advantage(rewards, mask, uids, config=config, non_tensor_batch={"fmt": fmt})


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, torch.tensor([0.25, 1.0]), mask)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.5, 2.0, 2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75, 0.0], [1.5, 1.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_remax_outcome_advantage(rewards, None, mask)


def test_reinforce_plus_plus_discounts_and_carries_across_masked_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 3.0, 0.0, 0.0], [1.0, 0.0, 5.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    # row 3 (verl 0.9.1): t=3: 2; t=2: 5 + 0.5 * 2 = 6; the masked t=1 passes 6 through undiscounted and
    # returns 0 there; t=0: 1 + 0.5 * 6 = 4. Row 2's trailing padding changes nothing: 3, then 0 + 0.5 * 3.
    expected_ret = torch.tensor([[0.75, 1.5, 1.0, 2.0], [1.5, 3.0, 0.0, 0.0], [4.0, 0.0, 6.0, 2.0]])
    torch.testing.assert_close(ret, expected_ret)
    torch.testing.assert_close(adv, whiten_by_hand(expected_ret, mask))
    adv_kw, _ = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(adv_kw, adv)


def test_reinforce_plus_plus_multi_turn_holes_skip_their_rewards_and_discount():
    # Two turns of two tokens with a 3-token observation between them; the hole's rewards never count.
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 9.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.9)
    # valid tokens from the end: 1; 0 + 0.9 * 1 = 0.9; (hole) 0 + 0.9 * 0.9 = 0.81; 0 + 0.9 * 0.81 = 0.729
    torch.testing.assert_close(ret, torch.tensor([[0.729, 0.81, 0.0, 0.0, 0.0, 0.9, 1.0]]))
    # the same tokens without the hole give the same returns on them
    _, packed = compute_reinforce_plus_plus_outcome_advantage(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.ones(1, 4), gamma=0.9
    )
    torch.testing.assert_close(ret[mask.bool()], packed[0])


def gae_by_loop(rewards, values, mask, gamma, lam):
    """GAE over each row's valid tokens only, as if the masked tokens were not there."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        next_value, next_gae = 0.0, 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[i, t]]):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            next_gae = delta + gamma * lam * next_gae
            next_value = float(values[i, t])
            advantages[i, t] = next_gae
    returns = (advantages + values) * mask
    return whiten_by_hand(advantages, mask), returns


def test_gae_tiny_case_by_hand():
    rewards, values, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # t=1: delta = 1 - 0.2 = 0.8; t=0: delta = 0.2 - 0.5 = -0.3, gae = -0.3 + 0.8 = 0.5
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))
    std = math.sqrt(0.045)  # unbiased variance of (0.5, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[-0.15, 0.15]]) / math.sqrt(std**2 + 1e-8))


def test_gae_matches_a_loop_on_a_masked_example_with_a_hole():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(3, 7, generator=gen)
    values = torch.randn(3, 7, generator=gen)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 0, 0, 0]], dtype=torch.float32
    )
    values[~mask.bool()] = float("nan")  # whatever sits under the mask must not leak
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    exp_adv, exp_ret = gae_by_loop(rewards, torch.nan_to_num(values), mask, 0.9, 0.8)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)
    adv_cfg, _ = compute_gae_advantage_return(
        rewards, values, mask, config=SimpleNamespace(gamma=0.9, lam=0.8)
    )
    torch.testing.assert_close(adv_cfg, adv)


GROUP_ESTIMATORS = [
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_gdpo_outcome_advantage,
]


@pytest.mark.parametrize("fn", GROUP_ESTIMATORS, ids=lambda f: f.__name__)
def test_fully_masked_row_is_zero_and_does_not_move_the_others(fn, batch):
    rewards, mask, uids = batch
    clean, _ = fn(rewards, mask, uids)
    # the same batch with an extra all-masked member of group a whose padding holds garbage
    bad_rewards = torch.cat([rewards, torch.tensor([[float("nan"), 9.0, float("inf"), 5.0]])])
    bad_mask = torch.cat([mask, torch.zeros(1, T)])
    adv, ret = fn(bad_rewards, bad_mask, np.append(uids, "a"))
    assert torch.equal(adv[-1], torch.zeros(T)) and torch.equal(ret[-1], torch.zeros(T))
    torch.testing.assert_close(adv[:-1], clean)


def test_passk_and_token_estimators_with_a_fully_masked_row():
    rewards, mask = outcome_batch([1.0, 0.0, 3.0, 2.0, 0.0], [2, 3, 0, 1, 4])
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, np.array([0, 0, 0, 1, 1]))
    torch.testing.assert_close(
        adv, expand([1 / (math.sqrt(0.5) + EPS), 0, 0, 2 / (math.sqrt(2) + EPS), 0], mask)
    )
    values = torch.ones_like(rewards)
    for adv, ret in (
        compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0),
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0),
        compute_remax_outcome_advantage(rewards, torch.ones(5), mask),
    ):
        assert (
            torch.isfinite(adv).all()
            and torch.equal(adv[2], torch.zeros(T))
            and torch.equal(ret[2], torch.zeros(T))
        )


def test_outputs_are_zero_outside_the_mask(batch):
    rewards, mask, uids = batch
    for fn in [*GROUP_ESTIMATORS, compute_rloo_vectorized_outcome_advantage]:
        adv, ret = fn(rewards, mask, uids)
        assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert torch.equal(ret[mask == 0], torch.zeros(int((mask == 0).sum())))


def test_bad_inputs_raise_clear_errors(batch):
    rewards, mask, uids = batch
    with pytest.raises(ValueError, match="uid"):
        compute_grpo_outcome_advantage(rewards, mask, None)
    with pytest.raises(ValueError, match="6 uids"):
        compute_grpo_outcome_advantage(rewards, mask, uids[:-1])
    with pytest.raises(ValueError, match="response_mask"):
        compute_grpo_outcome_advantage(rewards, mask[:, :2], uids)


def test_registry_holds_every_builtin_and_resolves_enums():
    for member in AdvantageEstimator:
        assert get_adv_estimator_fn(member) is get_adv_estimator_fn(member.value)
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn(AdvantageEstimator.GAE) is compute_gae_advantage_return


def test_registry_custom_duplicate_and_unknown():
    def my_estimator(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards * 2, token_level_rewards

    try:
        assert register_adv_est("my_est")(my_estimator) is my_estimator
        assert register_adv_est("my_est")(my_estimator) is my_estimator  # the same function again is fine
        adv, _ = get_adv_estimator_fn("my_est")(torch.ones(1, 2), torch.ones(1, 2))
        assert torch.equal(adv, torch.full((1, 2), 2.0))
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("my_est")(lambda **kw: None)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est(AdvantageEstimator.GRPO)(my_estimator)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("my_est", None)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*grpo.*rloo"):
        get_adv_estimator_fn("nope")
    with pytest.raises(TypeError):
        get_adv_estimator_fn(3)
    assert adv_mod.get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
