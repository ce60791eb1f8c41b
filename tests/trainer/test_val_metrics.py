import pytest

from hybridflow.trainer.val_metrics import group_stats, ks_for, pass_at_k, validation_metrics


def test_pass_at_k_by_hand() -> None:
    # 4 samples, 1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # 5 samples, 2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(3, 4, 1)


def test_majority_vote_best_and_worst_by_hand() -> None:
    stats = group_stats([1.0, 0.0, 0.0, 1.0], ["12", "13", "13", "12"], [True, False, False, True])
    # "12" and "13" tie with two votes each: the first to reach the top count ("12") wins.
    assert stats["reward/maj@4"] == 1.0
    assert stats["reward/mean@4"] == 0.5 and stats["reward/best@4"] == 1.0 and stats["reward/worst@4"] == 0.0
    assert stats["acc/pass@1"] == pytest.approx(0.5)
    assert stats["acc/pass@2"] == pytest.approx(1 - 1 / 6)  # C(2,2)/C(4,2) = 1/6
    stats = group_stats([0.0, 1.0, 0.0], ["7", "8", "7"], [False, True, False])
    assert stats["reward/maj@3"] == 0.0  # the majority answer "7" is wrong
    assert ks_for(3) == [1, 2, 3] and ks_for(8) == [1, 2, 4, 8]


def test_validation_metrics_average_per_data_source() -> None:
    m = validation_metrics(
        ["a", "a", "b", "b"],
        [1.0, 0.0, 1.0, 1.0],
        ["x", "y", "z", "z"],
        [True, False, True, True],
        n=2,
        prefix="val-core",
    )
    assert m["val-core/a/reward/mean@2"] == 0.5 and m["val-core/b/reward/mean@2"] == 1.0
    assert m["val-core/a/acc/pass@2"] == 1.0 and m["val-core/a/acc/pass@1"] == 0.5
