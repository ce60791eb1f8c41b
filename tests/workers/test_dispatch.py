"""Dispatch: split by rank with padding, merge in order without it; the local group of one rank."""

from __future__ import annotations

import numpy as np
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
    handle = CriticHandle(group, "critic")
    batch = Batch(
        {"input_ids": torch.ones(3, 2), "responses": torch.arange(3.0)[:, None], "other": torch.zeros(3)}
    )
    assert handle.compute_values(batch)["values"].flatten().tolist() == [0.0, 2.0, 4.0]
    batch["returns"] = torch.ones(3, 1)
    assert handle.update_critic(batch) == {"critic/vf_loss": 3.0}
    assert group.world == 1 and group.run_all("has", "critic") == [True]
