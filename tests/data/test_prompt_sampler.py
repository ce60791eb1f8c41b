"""PromptSampler: batches per epoch, order a function of (seed, epoch), exact resume mid-epoch."""

from __future__ import annotations

import pytest

from hybridflow.data import PromptSampler


def test_len_and_coverage() -> None:
    assert len(PromptSampler(10, 3, seed=0)) == 3
    assert len(PromptSampler(10, 3, seed=0, drop_last=False)) == 4
    assert len(PromptSampler(9, 3, seed=0)) == 3
    batches = list(PromptSampler(10, 3, seed=0, drop_last=False))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert sorted(i for b in batches for i in b) == list(range(10))
    kept = [i for b in PromptSampler(10, 3, seed=0) for i in b]
    assert len(kept) == len(set(kept)) == 9


def test_no_shuffle_is_in_order() -> None:
    sampler = PromptSampler(7, 2, seed=5, shuffle=False)
    assert list(sampler) == [[0, 1], [2, 3], [4, 5]]
    assert list(sampler) == [[0, 1], [2, 3], [4, 5]]  # the next epoch is the same


def test_order_depends_only_on_seed_and_epoch() -> None:
    a, b = PromptSampler(50, 5, seed=1), PromptSampler(50, 5, seed=1)
    epochs_a = [list(a) for _ in range(3)]
    assert epochs_a == [list(b) for _ in range(3)]
    assert epochs_a[0] != epochs_a[1]  # reshuffled every epoch
    assert list(PromptSampler(50, 5, seed=2)) != epochs_a[0]
    # A fresh sampler computes epoch 2 without running epochs 0 and 1.
    assert PromptSampler(50, 5, seed=1).epoch_batches(2) == epochs_a[2]
    assert a.epoch == 3 and a.position == 0


def test_resume_mid_epoch_with_next_batch() -> None:
    straight = PromptSampler(23, 4, seed=9)
    expected = [straight.next_batch() for _ in range(13)]  # 5 batches per epoch: crosses two epochs
    first = PromptSampler(23, 4, seed=9)
    got = [first.next_batch() for _ in range(7)]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = PromptSampler(23, 4, seed=9)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(6)]
    assert got == expected


def _train(sampler: PromptSampler, epochs: int, stop_after: int | None = None) -> list[list[int]]:
    """A trainer-style loop over epochs; returns the batches seen, stopping after ``stop_after`` steps."""
    seen = []
    for _ in range(sampler.epoch, epochs):
        for indices in sampler:
            seen.append(indices)
            if stop_after is not None and len(seen) == stop_after:
                return seen
    return seen


@pytest.mark.parametrize("stop_after", [2, 5, 6])  # mid-epoch, the last batch of epoch 0, and epoch 1
def test_resume_in_an_epoch_loop(stop_after: int) -> None:
    expected = _train(PromptSampler(17, 3, seed=4), epochs=3)
    first = PromptSampler(17, 3, seed=4)
    seen = _train(first, epochs=3, stop_after=stop_after)
    resumed = PromptSampler(17, 3, seed=4)
    resumed.load_state_dict(first.state_dict())
    seen += _train(resumed, epochs=3)
    assert seen == expected


def test_rollover_after_last_batch() -> None:
    sampler = PromptSampler(6, 3, seed=0)
    sampler.next_batch()
    assert (sampler.epoch, sampler.position) == (0, 1)
    sampler.next_batch()
    assert (sampler.epoch, sampler.position) == (1, 0)


def test_bad_settings_and_mismatched_resume() -> None:
    with pytest.raises(ValueError, match="no full batch"):
        PromptSampler(3, 4, seed=0)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, 4, seed=0, drop_last=False)
    state = PromptSampler(20, 4, seed=0).state_dict()
    for key, value in [("seed", 1), ("num_items", 21), ("batch_size", 5)]:
        with pytest.raises(ValueError, match=f"{key} was"):
            PromptSampler(20, 4, seed=0).load_state_dict({**state, key: value})
    with pytest.raises(ValueError, match="invalid sampler state"):
        PromptSampler(20, 4, seed=0).load_state_dict({**state, "position": 5})
