"""A rank's place in the generation view: the rollout group it generates with, its seed, its prompts.

Every rank is handed its own share of the prompts by the driver. The tp ranks of a rollout group generate
together for the union of their shares (gathered inside the group, in tensor-parallel order), from one
sampling stream per group (seeded from the group's index, so groups differ and a group's ranks agree), then
each rank keeps the samples of its own share: the driver's split and merge stay the same for any tp.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch.distributed as dist

from hybridflow.engine.parallel.view import GenerateView, rollout_group

# Rollout groups sample with distinct seeds: seed + stride * group (the stride keeps streams far apart).
GROUP_SEED_STRIDE = 1_000_003


class RolloutGroup:
    """This rank's rollout group of the ``GenerateView`` (creating its process group is collective)."""

    def __init__(self, view: GenerateView, rank: int) -> None:
        self.view, self.rank = view, rank
        self.tp_rank, self.dp_rank = view.tp_rank(rank), view.dp_rank(rank)
        self.group = rollout_group(view, rank)

    def seed(self, seed: int | None) -> int | None:
        """The group's sampling seed (the run's at one group, so a single rank samples as before)."""
        if seed is None or self.view.dp == 1:
            return seed
        return seed + GROUP_SEED_STRIDE * self.dp_rank

    def gather(self, prompts: list[list[int]]) -> tuple[list[list[int]], slice]:
        """The group's prompts (every rank's share, in tensor-parallel order) and this rank's slice of them."""
        if self.group is None:
            return prompts, slice(0, len(prompts))
        shares: list[Any] = [None] * self.view.tp
        dist.all_gather_object(shares, prompts, group=self.group)
        start = sum(len(s) for s in shares[: self.tp_rank])
        return [p for share in shares for p in share], slice(start, start + len(prompts))

    def check_agreement(self, outputs: Any) -> None:
        """Raise when the ranks of the group did not sample the same tokens (their collectives would part)."""
        if self.group is None:
            return
        digest = hashlib.sha1(pickle.dumps(outputs)).hexdigest()
        digests: list[Any] = [None] * self.view.tp
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"the ranks {self.view.group_ranks(self.dp_rank)} of rollout group {self.dp_rank} generated "
                "different tokens from the same prompts and seed; their logits differ (a bug in the "
                "tensor-parallel rollout: please report it with the model and config)"
            )
