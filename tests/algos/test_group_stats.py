"""The fraction of prompt groups whose samples all scored alike (``critic/score/zero_std_frac``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algos import compute_grpo_outcome_advantage, group_zero_std_fraction


def test_tied_groups_among_groups_of_two_or_more() -> None:
    # Four prompts, interleaved n=3 as the rollout repeats them: a ties (1, 1, 1), b varies, c ties at 0, and d
    # differs only in the last bits (0.1 + 0.2 is not 0.3): it varies.
    scores = torch.tensor(
        [1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.3, 0.1 + 0.2, 0.3], dtype=torch.float64
    )
    uid = np.array(["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3, dtype=object)
    assert group_zero_std_fraction(scores, uid) == 0.5


def test_groups_of_one_are_left_out_and_none_without_any_group() -> None:
    scores = torch.tensor([0.2, 0.7, 0.7, 0.4])
    assert group_zero_std_fraction(scores, np.array([0, 1, 1, 2])) == 1.0  # only group 1 has two samples
    assert group_zero_std_fraction(scores, np.array([0, 1, 2, 3])) is None  # n=1: no group to judge
    assert group_zero_std_fraction(torch.zeros(0), np.array([], dtype=object)) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tied_group_is_exactly_a_group_grpo_gives_no_advantage(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, groups = 4, 6
    scores = torch.randint(0, 2, (groups * n,), generator=g).float()  # 0/1 rewards: some groups tie by chance
    uid = np.repeat(np.arange(groups), n)
    mask = torch.ones(groups * n, 3)
    rewards = torch.zeros(groups * n, 3)
    rewards[:, -1] = scores
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uid)
    silent = (adv.abs().sum(-1) == 0).view(groups, n).all(-1)  # (groups,)
    assert group_zero_std_fraction(scores, uid) == pytest.approx(float(silent.float().mean()))
