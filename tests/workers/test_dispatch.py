"""Dispatch: split by rank with padding, merge in order without it; the local group of one rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.workers.dispatch import merge_batches, split_batch
from hybridflow.workers.group import CriticHandle, LocalGroup
from hybridflow.workers.rank import RankWorker


def rows(n: int) -> Batch:
    return Batch(
        {"x": torch.arange(n)[:, None].float()}, {"tag": np.array([f"r{i}" for i in range(n)], dtype=object)}
    )


def test_split_pads_to_the_world_and_merge_strips_it() -> None:
    chunks, pad = split_batch(rows(5), 2)
    assert pad == 1 and [len(c) for c in chunks] == [3, 3]
    assert chunks[0]["x"].flatten().tolist() == [0, 1, 2]  # contiguous chunks, in rank order
    assert chunks[1]["x"].flatten().tolist() == [3, 4, 0]  # the pad repeats rows from the start
    merged = merge_batches([c for c in chunks], pad)
    assert merged["x"].flatten().tolist() == [0, 1, 2, 3, 4]
    assert list(merged["tag"]) == ["r0", "r1", "r2", "r3", "r4"]
    same, none = split_batch(rows(4), 1)
    assert none == 0 and len(same) == 1 and len(same[0]) == 4


class Doubler:
    """A stand-in role with the critic's method names (the handle is under test, not a model)."""

    def compute_values(self, batch: Batch) -> Batch:
        assert set(batch.keys()) == {"input_ids", "responses"}  # only the keys the call reads travel
        return Batch({"values": batch["responses"] * 2.0})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return {"critic/vf_loss": float(batch["returns"].sum())}


def test_local_group_of_one_rank_calls_the_role_directly() -> None:
    group = LocalGroup(RankWorker({"critic": Doubler()}))
    handle = CriticHandle(group, "critic", 0)
    batch = Batch(
        {"input_ids": torch.ones(3, 2), "responses": torch.arange(3.0)[:, None], "other": torch.zeros(3)}
    )
    assert handle.compute_values(batch)["values"].flatten().tolist() == [0.0, 2.0, 4.0]
    batch["returns"] = torch.ones(3, 1)
    assert handle.update_critic(batch) == {"critic/vf_loss": 3.0}
    assert group.world == 1 and group.run_all("has", "critic") == [True]


def test_shares_of_different_widths_merge_into_the_one_batch_layout() -> None:
    """Each rank lays out its samples with its own longest prompt; merged, they equal one rank's layout."""
    from hybridflow.engine.ops.sequences import layout_padding, pack_prompt_response

    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17]]  # rank 0 gets the long one
    responses = [[1, 2], [3], [4, 4, 4], [2]]  # end at different places; R = 3
    whole = pack_prompt_response(prompts, responses, 3, pad_token_id=0)
    shares = [pack_prompt_response(prompts[i : i + 2], responses[i : i + 2], 3, 0) for i in (0, 2)]
    for share in shares:
        share["rollout_log_probs"] = -share["response_mask"] * share["responses"]  # a per-token value
    whole["rollout_log_probs"] = -whole["response_mask"] * whole["responses"]
    assert shares[0]["input_ids"].shape[1] == 9 and shares[1]["input_ids"].shape[1] == 7
    merged = merge_batches(shares, 0, layout_padding(0))
    assert merged.keys() == whole.keys()
    for key in whole.keys():  # noqa: SIM118 (a Batch is not iterable)
        assert torch.equal(merged[key], whole[key]), key
    with pytest.raises(ValueError, match=r"different trailing shapes.*pad="):
        merge_batches(shares, 0)  # without the layout the widths cannot join
    assert merge_batches(shares, 1, layout_padding(0))["input_ids"].shape == (3, 9)  # pad rows still go
