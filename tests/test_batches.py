"""The tests' batch builders (tests/support/batches.py): the engine's layout, groups of samples, EOS, seeded fields."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, Draw, draw_fields, prompt_batch, rollout_batch

EOS = 2
PROMPT_LENGTHS = [5, 2, 3]
RESPONSE_LENGTHS = [4, 1, 0, 2, 4, 3]  # two samples per prompt; R = 4


def test_groups_share_their_prompt_and_responses_stop_at_eos() -> None:
    batch = rollout_batch(
        PROMPT_LENGTHS, RESPONSE_LENGTHS, 4, 1, n=2, eos_token_id=EOS, advantages=NORMAL, old=Draw(-4.0, -3.0)
    )
    assert batch["input_ids"].shape == (6, 9) and batch["responses"].shape == (6, 4)
    mask = batch["attention_mask"].bool()  # (B, P + R)
    for b, length in enumerate(RESPONSE_LENGTHS):
        prompt_len = PROMPT_LENGTHS[b // 2]
        tokens = batch["input_ids"][b][mask[b]].tolist()  # the row's real tokens, padding dropped
        assert len(tokens) == prompt_len + length and mask[b, 5 - prompt_len : 5 + length].all()
        assert tokens[:prompt_len] == batch["input_ids"][b - b % 2, 5 - prompt_len : 5].tolist()
        assert batch["position_ids"][b, 5 + length - 1] == prompt_len + length - 1
        response = batch["responses"][b, :length].tolist()
        # Only a response cut short of R ends at EOS; drawn tokens never are one.
        assert [t == EOS for t in response] == [0 < length < 4 and j == length - 1 for j in range(length)]
    assert batch["response_mask"].sum(-1).tolist() == RESPONSE_LENGTHS
    assert (batch["advantages"][batch["response_mask"] == 0] == 0).all() and batch["advantages"].std() > 0.5
    assert ((batch["old"] > -4.0) & (batch["old"] <= -3.0)).all()


def test_the_same_seed_gives_the_same_batch() -> None:
    one, again, other = (rollout_batch([3, 1], [2, 2], 3, seed, advantages=NORMAL) for seed in (0, 0, 1))
    for key in one.keys():  # noqa: SIM118 (a Batch is not iterable)
        assert torch.equal(one[key], again[key]), key
    assert not torch.equal(one["input_ids"], other["input_ids"])


def test_prompts_end_at_the_last_column() -> None:
    batch = prompt_batch([4, 1, 6], seed=3)
    assert batch.keys() == ["input_ids", "attention_mask", "position_ids"]
    assert batch["attention_mask"].sum(-1).tolist() == [4, 1, 6]
    assert batch["attention_mask"][:, -1].all() and batch["position_ids"][:, -1].tolist() == [3, 0, 5]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()


def test_inconsistent_lengths_and_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="3 response lengths for 2 prompts x n=2"):
        rollout_batch([2, 3], [1, 1, 1], 2, n=2)
    with pytest.raises(ValueError, match="ref: a per-row value"):
        draw_fields(rollout_batch([2], [1], 2), 0, ref=Draw(-1.0, 0.0, masked=True, per_row=True))
