"""trainer.balance_batch: every data-parallel rank gets a share of the samples with about the same tokens."""

from __future__ import annotations

import math
import random

import pytest
from support.dist_util import run_world_kept as run_world

from hybridflow.trainer.balance import balance_order, balance_parts, balanced_groups


def test_groups_are_equal_sized_cover_every_sample_and_even_out_the_tokens() -> None:
    rng = random.Random(0)
    for parts in (2, 4, 8):
        lengths = sorted((rng.randint(1, 1000) for _ in range(8 * parts)), reverse=True)  # worst for slices
        groups = balanced_groups(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert {len(g) for g in groups} == {8}
        sums = [sum(lengths[i] for i in g) for g in groups]
        order, metrics = balance_order(lengths, parts)
        assert sorted(order.tolist()) == list(range(len(lengths)))
        assert metrics["global_seqlen/balanced_max"] == max(sums)
        # LPT keeps the spread within one sample; contiguous slices of sorted lengths are far apart
        assert max(sums) - min(sums) <= max(lengths)
        assert metrics["global_seqlen/balanced_max"] < metrics["global_seqlen/max"]
        assert metrics["global_seqlen/mean"] == pytest.approx(sum(lengths) / parts)


def test_roles_of_different_data_parallel_sizes_each_get_even_shares() -> None:
    """An actor at tp=2 on 4 ranks (dp=2) beside an FSDP2 critic (dp=4): balanced over lcm(2, 4) = 4 parts,
    each role's contiguous shares hold about the same tokens."""
    assert balance_parts([2, 2, 4]) == 4 and balance_parts([2, 3]) == 6 and balance_parts([1, 1]) == 1
    rng = random.Random(1)
    lengths = sorted((rng.randint(1, 1000) for _ in range(64)), reverse=True)
    order, _ = balance_order(lengths, balance_parts([2, 4]))
    ordered = [lengths[i] for i in order]
    for dp in (2, 4):
        size = len(ordered) // dp
        sums = [sum(ordered[d * size : (d + 1) * size]) for d in range(dp)]
        assert max(sums) - min(sums) <= max(lengths), dp


def test_one_group_keeps_the_order() -> None:
    order, metrics = balance_order([5, 1, 3], 1)
    assert order.tolist() == [0, 1, 2] and metrics["global_seqlen/minmax_diff"] == 0.0


def spmd(rank: int, balance: bool) -> list[dict[str, float]]:
    """One rank of a 2-process GRPO run on CPU (every rank runs the driver)."""
    from test_old_log_prob import run

    return run(
        ["trainer.n_gpus_per_node=2", "trainer.device=cpu", f"trainer.balance_batch={str(balance).lower()}"]
    )


def test_two_ranks_train_on_balanced_shares() -> None:
    balanced = run_world(2, spmd, True)[0]
    plain = run_world(2, spmd, False)[0]
    for step in balanced:
        assert step["global_seqlen/balanced_max"] <= step["global_seqlen/max"]
        assert all(math.isfinite(v) for v in step.values())
    assert not any(k.startswith("global_seqlen/") for k in plain[0])
    # the same samples, scores and advantages whatever their order: the first step's reward agrees
    assert balanced[0]["critic/score/mean"] == pytest.approx(plain[0]["critic/score/mean"])
