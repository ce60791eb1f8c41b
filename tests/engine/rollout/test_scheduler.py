import pytest

from hybridflow.engine.rollout.scheduler import PromptGroup, SlotScheduler


def groups(lengths: list[int], n: int) -> list[PromptGroup]:
    return [PromptGroup(i, list(range(length)), n) for i, length in enumerate(lengths)]


def test_admission_fills_free_slots_in_fifo_order() -> None:
    sched = SlotScheduler(num_slots=5, max_batched_tokens=100, groups=groups([3, 4, 5], n=2))
    calls = sched.admit()
    assert [[(c.group.index, c.start, c.length) for c in call] for call in calls] == [[(0, 0, 3), (1, 0, 4)]]
    assert sched.owner == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [g.first_slot for g in sched.groups[:2]] == [0, 2]
    assert sched.admit() == []  # one slot left, a group needs two


def test_prefill_budget_splits_calls_and_chunks_long_prompts() -> None:
    sched = SlotScheduler(num_slots=8, max_batched_tokens=8, groups=groups([3, 4, 10, 2], n=1))
    calls = sched.admit()
    shape = [[(c.group.index, c.start, c.length, c.last) for c in call] for call in calls]
    assert shape == [
        [(0, 0, 3, True), (1, 0, 4, True)],  # 2 rows x 4 padded tokens fit the budget of 8
        [(2, 0, 8, False)],
        [(2, 8, 2, True), (3, 0, 2, True)],
    ]
    for call in calls:
        assert len(call) * max(c.length for c in call) <= 8


def test_release_keeps_running_slots_dense() -> None:
    sched = SlotScheduler(num_slots=6, max_batched_tokens=100, groups=groups([2, 2, 2], n=2))
    sched.admit()
    assert sched.owner == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    moves = sched.release([1, 4, 5])
    assert moves == [(3, 1)]
    assert sched.owner == [(0, 0), (1, 1), (1, 0)]
    moves = sched.release([0, 1, 2])
    assert moves == [] and sched.owner == []
    assert sched.done


def test_release_moves_tail_into_several_holes() -> None:
    sched = SlotScheduler(num_slots=6, max_batched_tokens=100, groups=groups([1] * 6, n=1))
    sched.admit()
    moves = sched.release([0, 2])
    assert moves == [(5, 0), (4, 2)]
    assert sched.owner == [(5, 0), (1, 0), (4, 0), (3, 0)]


def test_group_wider_than_the_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="n=4 samples per prompt need 4 KV-cache slots but only 3 fit"):
        SlotScheduler(num_slots=3, max_batched_tokens=10, groups=groups([2], n=4))
