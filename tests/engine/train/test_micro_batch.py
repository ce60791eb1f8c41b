import pytest
import torch

from hybridflow.engine.train.micro_batch import (
    fixed_micro_batches,
    min_micro_batches,
    restore_order,
    token_budget_micro_batches,
)


def test_fixed_micro_batches_covers_rows_in_order() -> None:
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_micro_batches(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        fixed_micro_batches(4, 0)


def test_token_budget_respects_budget_and_balances() -> None:
    lens = [9, 1, 8, 2, 5, 5]  # 30 tokens
    parts = token_budget_micro_batches(lens, max_token_len=10)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert len(parts) == 3
    assert [sum(lens[i] for i in p) for p in parts] == [10, 10, 10]


def test_token_budget_raises_for_a_sequence_longer_than_budget() -> None:
    with pytest.raises(ValueError, match="12 tokens exceeds the per-GPU token budget of 10"):
        min_micro_batches([3, 12], 10)


def test_forced_count_and_lower_bound() -> None:
    lens = [4, 4, 4, 4]
    assert len(token_budget_micro_batches(lens, 16)) == 1
    assert len(token_budget_micro_batches(lens, 16, num_micro_batches=3)) == 3
    with pytest.raises(ValueError, match="below the minimum"):
        token_budget_micro_batches(lens, 8, num_micro_batches=1)


def test_min_micro_batches_steps_up_when_packing_is_tight() -> None:
    # Sum 18 <= 2 * 9, but {6, 6, 6} cannot be packed into two bins of 9.
    assert min_micro_batches([6, 6, 6], 9) == 3


def test_restore_order_inverts_the_partition() -> None:
    x = torch.arange(6.0)[:, None] * 10  # (6, 1)
    parts = [[1, 4], [0, 5], [2, 3]]
    outs = [x[p] for p in parts]
    assert torch.equal(restore_order(outs, parts), x)
