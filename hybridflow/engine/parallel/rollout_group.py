"""A rank's place in the generation view: the rollout group it generates with and its sampling seed.

The driver splits the prompts by the generation view's data-parallel size and hands every rank of a rollout
group the group's share (``workers.dispatch``). The tp ranks of the group generate it together from one
sampling stream per group (seeded from the group's index, so groups differ and a group's ranks agree), and
one of them returns the samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engine.parallel.view import GenerateView, exchange_group, rollout_group

# Rollout groups sample with distinct seeds: seed + stride * group (the stride keeps streams far apart).
GROUP_SEED_STRIDE = 1_000_003


def canonical(x: Any) -> Any:
    """``x`` with every tensor as (dtype, shape, bytes): pickling a tensor is not byte-stable between
    processes (equal router-replay records hashed apart), its contents are."""
    if isinstance(x, torch.Tensor):
        flat = x.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(x.dtype), tuple(x.shape), flat.view(torch.uint8).numpy().tobytes())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, [(f.name, canonical(getattr(x, f.name))) for f in dataclasses.fields(x)])
    if isinstance(x, (list, tuple)):
        return [canonical(v) for v in x]
    if isinstance(x, dict):
        return sorted((k, canonical(v)) for k, v in x.items())
    return x


class RolloutGroup:
    """This rank's rollout group of the ``GenerateView`` (creating its process group is collective)."""

    def __init__(self, view: GenerateView, rank: int) -> None:
        self.view, self.rank = view, rank
        self.tp_rank, self.dp_rank = view.tp_rank(rank), view.dp_rank(rank)
        self.group = rollout_group(view, rank)
        self.exchange_group = exchange_group(view, rank)  # ep > tp: the ranks pooling tokens per MoE layer
        self.ep_rank = view.ep_rank(rank) if view.generates(rank) else 0

    def seed(self, seed: int | None) -> int | None:
        """The group's sampling seed (the run's at one group, so a single rank samples as before)."""
        if seed is None or self.view.dp == 1:
            return seed
        return seed + GROUP_SEED_STRIDE * self.dp_rank

    def check_agreement(self, outputs: Any, prompts: Any = None) -> None:
        """Raise when the ranks of the group were not handed the same ``prompts`` (a dispatch bug) or did not
        sample the same tokens (their collectives would part)."""
        if self.group is None:
            return
        mine = tuple(hashlib.sha1(pickle.dumps(canonical(x))).hexdigest() for x in (prompts, outputs))
        digests: list[Any] = [None] * self.view.tp
        dist.all_gather_object(digests, mine, group=self.group)
        ranks = self.view.group_ranks(self.dp_rank)
        if len({d[0] for d in digests}) > 1:
            raise RuntimeError(
                f"the ranks {ranks} of rollout group {self.dp_rank} were handed different prompts; every rank "
                "of a group must be given the group's share (the driver's dispatch by data-parallel coordinate)"
            )
        if len({d[1] for d in digests}) > 1:
            raise RuntimeError(
                f"the ranks {ranks} of rollout group {self.dp_rank} generated "
                "different tokens from the same prompts and seed; their logits differ (a bug in the "
                "tensor-parallel rollout: please report it with the model and config)"
            )
