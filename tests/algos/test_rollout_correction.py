"""Rollout correction (verl 0.9.1 API): IS weights, TIS/IcePop, every rejection option, metrics, by hand."""

import math

import pytest
import torch

from hybridflow.algos.rollout_correction import (
    ROLLOUT_RS_ALIASES,
    ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    normalize_rollout_rs,
    parse_rollout_rs_thresholds,
)
from hybridflow.algos.rollout_metrics import (
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
)

F64 = torch.float64
LN = math.log


def _token_case():
    """Ratios r = 0.4, 1.5, 3 and a padded position holding garbage."""
    return torch.log(torch.tensor([[0.4, 1.5, 3.0, 1e6]], dtype=F64)), torch.tensor([[1, 1, 1, 0]], dtype=F64)


def _seq_case():
    """Row 0: r = 1.2, 1.5 (product 1.8); row 1: 2, 2 (product 4); row 2: fully masked."""
    ratios = torch.tensor([[1.2, 1.5, 1.0], [2.0, 2.0, 7.0], [9.0, 9.0, 9.0]], dtype=F64)
    return torch.log(ratios), torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=F64)


def test_token_tis_weights_and_metrics():
    log_ratio, mask = _token_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[0.4, 1.5, 2.0, 0.0]], dtype=F64))
    assert m["rollout_is_mean"].item() == pytest.approx(3.9 / 3)
    assert m["rollout_is_max"].item() == pytest.approx(2.0)  # the applied (truncated) weights, as verl 0.9.1
    assert m["rollout_is_min"].item() == pytest.approx(0.4)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 3)  # raw 3 > 2
    assert m["rollout_is_ratio_fraction_low"].item() == pytest.approx(1 / 3)  # raw 0.4 < 1/2
    mean, mean_sq = 3.9 / 3, (0.16 + 2.25 + 4.0) / 3
    assert m["rollout_is_std"].item() == pytest.approx(math.sqrt(mean_sq - mean**2))
    assert m["rollout_is_eff_sample_size"].item() == pytest.approx(mean**2 / mean_sq, rel=1e-6)
    assert m["rollout_is_seq_mean"].item() == pytest.approx(1.3)  # one row: its mean weight
    assert m["rollout_is_seq_max_deviation"].item() == pytest.approx(0.3)
    assert m["rollout_is_seq_fraction_high"].item() == 0.0  # raw row mean (0.4 + 1.5 + 3) / 3 = 1.63 < 2
    assert "rollout_is_oob_ratio" not in m


def test_token_icepop_zeroes_weights_outside_the_bounds():
    log_ratio, mask = _token_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_2.0")
    assert torch.allclose(weights, torch.tensor([[0.0, 1.5, 0.0, 0.0]], dtype=F64))  # 0.4 and 3 are out
    assert m["rollout_is_oob_ratio"].item() == pytest.approx(2 / 3)
    assert m["rollout_is_mean"].item() == pytest.approx(0.5)
    # a float-like string is a plain TIS bound
    tis, _ = compute_rollout_correction_weights(log_ratio, mask, "token", "2.0")
    assert torch.allclose(tis, torch.tensor([[0.4, 1.5, 2.0, 0.0]], dtype=F64))


def test_sequence_is_weights_leave_fully_masked_rows_out():
    log_ratio, mask = _seq_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "sequence", 2.0)
    expected = torch.tensor([[1.8, 1.8, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(weights, expected)
    assert m["rollout_is_mean"].item() == pytest.approx((1.8 * 2 + 2.0 * 2) / 4)  # over valid tokens
    assert m["rollout_is_max"].item() == pytest.approx(4.0)  # exp of the row sums, valid rows only
    assert m["rollout_is_min"].item() == pytest.approx(1.8)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 2)
    assert m["rollout_is_seq_mean"].item() == pytest.approx(1.9)
    assert m["rollout_is_seq_std"].item() == pytest.approx(math.sqrt(0.02))  # unbiased: (0.1^2 * 2) / 1
    assert m["rollout_is_seq_fraction_high"].item() == pytest.approx(1 / 2)  # raw 4 > 2


def test_batch_normalize_and_detached():
    log_ratio, mask = _token_case()
    log_ratio.requires_grad_()
    weights, m = compute_rollout_correction_weights(
        log_ratio, mask, "token", 2.0, rollout_is_batch_normalize=True
    )
    assert not weights.requires_grad
    assert m["rollout_is_batch_norm_factor"].item() == pytest.approx(1.3)
    assert torch.allclose(weights, torch.tensor([[0.4, 1.5, 2.0, 0.0]], dtype=F64) / 1.3)
    log_ratio, mask = _seq_case()
    weights, m = compute_rollout_correction_weights(log_ratio, mask, "sequence", 2.0, True)
    assert m["rollout_is_batch_norm_factor"].item() == pytest.approx(1.9)  # mean of 1.8 and 2 per sequence
    assert weights[0, 0].item() == pytest.approx(1.8 / 1.9)


def test_aliases_and_chains_normalise():
    assert ROLLOUT_RS_ALIASES == {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
    assert normalize_rollout_rs(" token , seq_max_k2,token_k1 ") == ["token_k1", "seq_max_k2"]
    assert len(ROLLOUT_RS_OPTIONS) == 11
    bounds = parse_rollout_rs_thresholds(["token_k1", "seq_mean_k3"], "0.8_1.25,0.1")
    assert bounds == {"token_k1": (0.8, 1.25), "seq_mean_k3": (None, 0.1)}
    assert parse_rollout_rs_thresholds(["seq_sum_k1", "token_k2"], 2.0) == {
        "seq_sum_k1": (0.5, 2.0),  # a single number u means 1/u .. u
        "token_k2": (None, 2.0),
    }


# Token ratios r of the rejection cases: row 0 = 0.4, 1.5, 3 (pad); row 1 = 1.1, 0.9, 1 (pad); row 2 empty.
RS_RATIOS = torch.tensor([[0.4, 1.5, 3.0, 5.0], [1.1, 0.9, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
RS_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=F64)


def _k(r: float, kind: str) -> float:
    lr = math.log(r)
    return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": r - 1 - lr}[kind]


ROW0, ROW1 = [0.4, 1.5, 3.0], [1.1, 0.9, 1.0]


@pytest.mark.parametrize(
    ("option", "threshold", "keep0", "keep1"),
    [
        # token_k1 keeps log(lo) <= -log r <= log(hi): r in [1/hi, 1/lo] = [0.5, 2]
        ("token_k1", "0.5_2.0", [0, 1, 0], [1, 1, 1]),
        ("token_k1", 2.0, [0, 1, 0], [1, 1, 1]),
        # asymmetric ratio bounds on pi_rollout / pi_train: r in [1/1.2, 1/0.8] = [0.83, 1.25]; 0.9 and 1.1 pass
        ("token_k1", "0.8_1.2", [0, 0, 0], [1, 1, 1]),
        # k2 = 0.5 log(r)^2: 0.42, 0.082, 0.60 | 0.0045, 0.0056, 0
        ("token_k2", 0.1, [0, 1, 0], [1, 1, 1]),
        # k3 = r - 1 - log r: 0.316, 0.095, 0.901 | 0.0047, 0.0054, 0
        ("token_k3", 0.5, [1, 1, 0], [1, 1, 1]),
        # sums of k1: -log(0.4 * 1.5 * 3) = -log 1.8 = -0.588 (r product 1.8) | -log(0.99) = 0.01
        ("seq_sum_k1", 2.0, [1, 1, 1], [1, 1, 1]),
        ("seq_sum_k1", 1.5, [0, 0, 0], [1, 1, 1]),
        # sums of k2: 1.10 | 0.0101
        ("seq_sum_k2", 1.0, [0, 0, 0], [1, 1, 1]),
        # sums of k3: 1.31 | 0.0101
        ("seq_sum_k3", 1.5, [1, 1, 1], [1, 1, 1]),
        ("seq_sum_k3", 1.0, [0, 0, 0], [1, 1, 1]),
        # means of k1: -log(1.8) / 3 = -0.196 | 0.00335; bounds +-log(u): 1.25 -> 0.223 keeps, 1.2 -> 0.182 not
        ("seq_mean_k1", 1.25, [1, 1, 1], [1, 1, 1]),
        ("seq_mean_k1", 1.2, [0, 0, 0], [1, 1, 1]),
        # means of k2: 0.367 | 0.0034
        ("seq_mean_k2", 0.3, [0, 0, 0], [1, 1, 1]),
        # means of k3: 0.437 | 0.0034
        ("seq_mean_k3", 0.5, [1, 1, 1], [1, 1, 1]),
        ("seq_mean_k3", 0.4, [0, 0, 0], [1, 1, 1]),
        # max of k2: 0.604 | 0.0056; max of k3: 0.901 | 0.0054
        ("seq_max_k2", 0.6, [0, 0, 0], [1, 1, 1]),
        ("seq_max_k2", 0.61, [1, 1, 1], [1, 1, 1]),
        ("seq_max_k3", 0.9, [0, 0, 0], [1, 1, 1]),
        ("seq_max_k3", 0.005, [0, 0, 0], [0, 0, 0]),
    ],
)
def test_every_rejection_option(option, threshold, keep0, keep1):
    log_ratio = torch.log(RS_RATIOS)
    new_mask, m = compute_rollout_rejection_mask(log_ratio, RS_MASK, option, threshold)
    expected = torch.tensor([[*keep0, 0], [*keep1, 0], [0, 0, 0, 0]], dtype=F64)
    assert torch.equal(new_mask, expected)
    rejected = 6 - sum(keep0) - sum(keep1)
    assert m["rollout_rs_masked_fraction"].item() == pytest.approx(rejected / 6)
    rows_hit = (sum(keep0) < 3) + (sum(keep1) < 3)
    assert m["rollout_rs_seq_masked_fraction"].item() == pytest.approx(rows_hit / 2)  # the empty row is out
    assert m[f"rollout_rs_{option}_masked_fraction"].item() == pytest.approx(rejected / 6)
    kind = option[-2:]
    stats0, stats1 = [_k(r, kind) for r in ROW0], [_k(r, kind) for r in ROW1]
    if option.startswith("token"):
        assert m[f"rollout_rs_{option}_mean"].item() == pytest.approx(sum(stats0 + stats1) / 6)
        assert m[f"rollout_rs_{option}_max"].item() == pytest.approx(max(stats0 + stats1))
    else:
        agg = {"seq_sum": sum, "seq_mean": lambda s: sum(s) / 3, "seq_max": max}[option[: option.rindex("_")]]
        seq = [agg(stats0), agg(stats1)]
        assert m[f"rollout_rs_{option}_seq_mean"].item() == pytest.approx(sum(seq) / 2)
        assert m[f"rollout_rs_{option}_max"].item() == pytest.approx(max(seq))
        assert m[f"rollout_rs_{option}_min"].item() == pytest.approx(min(seq))
    assert (f"rollout_rs_{option}_seq_fraction_low" in m) == (kind == "k1")


@pytest.mark.parametrize(
    ("old", "new"), [("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")]
)
def test_older_modes_equal_their_options(old, new):
    log_ratio = torch.log(RS_RATIOS)
    for threshold in (1.2, 2.0):
        old_mask, old_m = compute_rollout_rejection_mask(log_ratio, RS_MASK, old, threshold)
        new_mask, new_m = compute_rollout_rejection_mask(log_ratio, RS_MASK, new, threshold)
        assert torch.equal(old_mask, new_mask)
        assert old_m.keys() == new_m.keys()


def test_chained_options_must_all_pass_and_take_one_threshold_each():
    log_ratio = torch.log(RS_RATIOS)
    # token_k1 at 2.0 drops 0.4 and 3 of row 0; seq_max_k3 at 0.005 drops row 1 (max k3 0.0054)
    new_mask, m = compute_rollout_rejection_mask(log_ratio, RS_MASK, "token_k1,seq_max_k3", "2.0,0.005")
    assert torch.equal(new_mask[:2, :3], torch.tensor([[0, 0, 0], [0, 0, 0]], dtype=F64))
    assert m["rollout_rs_token_k1_masked_fraction"].item() == pytest.approx(2 / 6)
    assert m["rollout_rs_masked_fraction"].item() == pytest.approx(1.0)
    # seq_max_k3 at 1.0 keeps both rows (0.901 and 0.0054): only token_k1's two rejections remain
    keep_row1, _ = compute_rollout_rejection_mask(log_ratio, RS_MASK, "token_k1,seq_max_k3", "2.0,1.0")
    assert torch.equal(keep_row1[:2, :3], torch.tensor([[0, 1, 0], [1, 1, 1]], dtype=F64))


def test_rejection_bounds_are_inclusive_and_dtype_kept():
    log_ratio = torch.tensor([[LN(2.0), LN(0.5), LN(2.0) + 1e-3]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    new_mask, _ = compute_rollout_rejection_mask(log_ratio, mask, "token_k1", 2.0)
    assert new_mask.dtype == torch.bool
    assert new_mask.tolist() == [[True, True, False]]


def test_offpolicy_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=F64)  # row 1 fully masked: left out
    m = compute_offpolicy_metrics(old, rollout, mask)  # log r = [0.5, -1]
    assert m["kl"].item() == pytest.approx((-0.5 + 1.0) / 2)
    assert m["k3_kl"].item() == pytest.approx(((math.exp(0.5) - 1.5) + math.exp(-1.0)) / 2)
    assert m["chi2_token"].item() == pytest.approx((math.exp(1.0) + math.exp(-2.0)) / 2 - 1)
    assert m["chi2_seq"].item() == pytest.approx(math.exp(2 * -0.5) - 1)  # (prod r)^2 = exp(2 * (0.5 - 1))
    assert m["training_ppl"].item() == pytest.approx(math.exp(1.5))
    assert m["training_log_ppl"].item() == pytest.approx(1.5)
    assert m["rollout_ppl"].item() == pytest.approx(math.exp(1.25))
    assert m["rollout_log_ppl"].item() == pytest.approx(1.25)
    assert m["log_ppl_diff"].item() == pytest.approx(-1.25 + 1.5)
    assert m["log_ppl_abs_diff"].item() == pytest.approx(0.25)
    assert m["ppl_ratio"].item() == pytest.approx(math.exp(0.25))
    assert m["log_prob_abs_diff_mean"].item() == pytest.approx(0.75)
    assert m["log_prob_abs_diff_max"].item() == pytest.approx(1.0)
    alone = compute_offpolicy_metrics(old, None, mask)  # verl 0.9.1: the rollout's log-probs may be absent
    assert set(alone) == {"training_ppl", "training_log_ppl"}
    prefixed = compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    assert prefixed["rollout_corr/kl"].item() == pytest.approx(0.25)


def test_combined_function():
    log_ratio, mask = _seq_case()
    rollout = torch.zeros_like(log_ratio)
    weights, new_mask, m = compute_rollout_correction_and_rejection_mask(log_ratio, rollout, mask)
    assert weights is None
    assert torch.equal(new_mask, mask) and new_mask is not mask
    assert all(key.startswith("rollout_corr/") for key in m)
    assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" not in m
    weights, new_mask, m = compute_rollout_correction_and_rejection_mask(
        log_ratio,
        rollout,
        mask,
        rollout_is="sequence",
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    assert torch.allclose(weights[:, 0], torch.tensor([1.8, 2.0, 0.0], dtype=F64))
    assert new_mask[1].sum() == 0  # product 4 is outside [0.5, 2]
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"].item() == pytest.approx(0.5)
    none_weights, _, _ = compute_rollout_correction_and_rejection_mask(
        log_ratio, rollout, mask, rollout_is="token", rollout_is_threshold=None
    )
    assert none_weights is None


def test_empty_mask_gives_finite_metrics():
    _, _, m = compute_rollout_correction_and_rejection_mask(
        torch.randn(2, 3),
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        rollout_is="token",
        rollout_rs="seq_mean_k1,token_k3",
        rollout_rs_threshold=2.0,
    )
    assert all(torch.isfinite(v) for v in m.values())


def test_errors():
    log_ratio, mask = _token_case()
    with pytest.raises(ValueError, match="token"):
        compute_rollout_correction_weights(log_ratio, mask, "geometric")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        compute_rollout_correction_weights(log_ratio, mask, "token", 0.0)
    with pytest.raises(ValueError, match="lower bound"):
        compute_rollout_correction_weights(log_ratio, mask, "token", "3.0_2.0")
    with pytest.raises(ValueError, match=r"accepted: token_k1, .*geometric"):
        compute_rollout_rejection_mask(log_ratio, mask, "tok", 2.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compute_rollout_rejection_mask(log_ratio, mask, "token_k1", None)
    with pytest.raises(ValueError, match="lower <= upper"):
        compute_rollout_rejection_mask(log_ratio, mask, "token_k1", "3.0_2.0")
    with pytest.raises(ValueError, match="single upper bound"):
        compute_rollout_rejection_mask(log_ratio, mask, "token_k2", "0.1_2.0")
    with pytest.raises(ValueError, match="one per option"):
        compute_rollout_rejection_mask(log_ratio, mask, "token_k1,token_k2", "2.0,1.0,3.0")
    with pytest.raises(ValueError, match="shape"):
        compute_rollout_correction_and_rejection_mask(log_ratio, log_ratio[:, :2], mask)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compute_rollout_correction_and_rejection_mask(log_ratio, log_ratio, mask, rollout_rs="token")
