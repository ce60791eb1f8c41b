"""The generation view: W ranks as W/tp rollout groups of tp tensor-parallel ranks.

HybridFlow's ordering: rank r is tensor-parallel rank ``r // dp`` of rollout group ``r % dp`` (dp = W/tp).
FSDP2 gives rank r the r-th of W equal slices of every weight (along its shard dim); tensor-parallel rank t
holds the t-th of tp slices along the same dim, which is the union of the FSDP slices of ranks t*dp .. t*dp +
dp - 1. So each rank's generation shard contains its own training shard, and the rest of it comes from the dp
ranks of the same tensor-parallel rank: small gathers, no rank ever holding more than its generation shard.

A view may also sit on a pool of ranks beside the trainer's (``trainer.async_mode=separate``): ``first`` is the
pool's first rank, the same ordering holds inside the pool (rank r is tensor-parallel rank ``(r - first) //
dp``), and a rank outside the pool generates nothing (``generates``). Ranks are those of the process group the
plan runs over (the default group: global ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridflow.config.errors import ConfigError
from hybridflow.config.views import expert_sizes, not_dividing
from hybridflow.utils.errors import UserError


@dataclass(frozen=True)
class GenerateView:
    """``world`` ranks generating in ``world // tp`` groups of ``tp`` (tp = 1: a whole replica per rank).

    ``ep``: a mixture of experts' experts split whole over ep ranks rather than each expert sliced over a
    group (ep = 1). ep = tp: over the ranks of one group. ep = tp x k (k > 1 groups, k dividing dp): over the
    ranks of k consecutive groups, an *expert group*, independent of tp (the write-ups' TP=8, EP=2 -> TP=4).
    Rank (group g, tensor-parallel rank t) then holds the experts of expert rank ``(g - g0) + k * t`` (g0 its
    expert group's first group), so tensor-parallel rank t of the k groups together holds the experts rank t
    holds at ep = tp, split k ways; at each MoE layer those k ranks (``exchange_ranks``) exchange their
    groups' tokens (``rollout.ep.ExpertExchange``) before the group's all-reduce as at ep = tp.

    ``first``: the rank the view starts at, so that it covers ranks ``first .. first + world - 1`` (a rollout
    pool beside a trainer pool; 0: the colocated view of every rank)."""

    world: int
    tp: int = 1
    ep: int = 1
    first: int = 0

    @classmethod
    def of(cls, cfg: Any, world: int, first: int = 0) -> GenerateView:
        """The view ``rollout.tensor_model_parallel_size`` / ``rollout.expert_parallel_size`` give over ``world``
        ranks (a pool's, from rank ``first``); beside ``ParallelDims.of`` for the training view."""
        r = cfg.rollout
        return cls(world, r.tensor_model_parallel_size, r.expert_parallel_size, first)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise UserError(f"rollout.tensor_model_parallel_size must be at least 1, got {self.tp}")
        if self.world % self.tp:
            raise ConfigError([not_dividing("rollout.tensor_model_parallel_size", self.tp, self.world)])
        if self.ep < 1:
            raise UserError(f"rollout.expert_parallel_size must be at least 1, got {self.ep}")
        if self.ep > 1 and (self.ep % self.tp or self.dp % (self.ep // self.tp)):
            raise UserError(
                f"rollout.expert_parallel_size={self.ep} with rollout.tensor_model_parallel_size={self.tp} on "
                f"{self.world} ranks: experts split whole over tp x k ranks, k dividing the {self.dp} rollout "
                f"groups; set rollout.expert_parallel_size to one of {expert_sizes(self.world, self.tp)} "
                "(1: each expert sliced over its group)"
            )
        if self.first < 0:
            raise ValueError(f"a generation view's first rank must be at least 0, got {self.first}")

    @property
    def dp(self) -> int:
        """The number of rollout groups (data parallelism of the generation view)."""
        return self.world // self.tp

    @property
    def end(self) -> int:
        """One past the view's last rank."""
        return self.first + self.world

    def generates(self, rank: int) -> bool:
        """Whether ``rank`` is one of the view's ranks (False: a rank of another pool, the trainer's)."""
        return self.first <= rank < self.end

    def _local(self, rank: int) -> int:
        """``rank``'s place inside the view (ValueError for a rank outside it: it has no rollout group)."""
        if not self.generates(rank):
            raise ValueError(
                f"rank {rank} is not one of the generation view's ranks {self.first}..{self.end - 1}"
            )
        return rank - self.first

    def tp_rank(self, rank: int) -> int:
        """The tensor-parallel rank of ``rank`` inside its rollout group."""
        return self._local(rank) // self.dp

    def dp_rank(self, rank: int) -> int:
        """The rollout group of ``rank`` (its sampling stream and its share of the prompts)."""
        return self._local(rank) % self.dp

    @property
    def ep_span(self) -> int:
        """The rollout groups of one expert group (k = ep / tp; 1 at ep in (1, tp): no exchange)."""
        return max(self.ep // self.tp, 1)

    @property
    def exchanges(self) -> bool:
        """Whether rollout groups meet at every MoE layer (ep > tp: experts split across groups)."""
        return self.ep_span > 1

    def ep_rank(self, rank: int) -> int:
        """``rank``'s expert rank: it holds experts ``ep_rank * E / ep`` onward (the tp rank at ep <= tp)."""
        k = self.ep_span
        return self.dp_rank(rank) % k + k * self.tp_rank(rank)

    def exchange_ranks(self, rank: int) -> list[int]:
        """The k ranks ``rank`` exchanges tokens with at each MoE layer: the same tensor-parallel rank of each
        group of its expert group, in group order (``rank`` is the ``dp_rank % k``-th)."""
        k, t = self.ep_span, self.tp_rank(rank)
        g0 = self.dp_rank(rank) - self.dp_rank(rank) % k
        return [self.first + g + t * self.dp for g in range(g0, g0 + k)]

    def group_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of rollout group ``dp_rank``, in tensor-parallel order."""
        return [self.first + dp_rank + t * self.dp for t in range(self.tp)]

    def __str__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        pool = f", ranks {self.first}-{self.end - 1}" if self.first else ""
        return f"(tp={self.tp}{ep}, dp={self.dp}{pool})"


def rollout_group(view: GenerateView, rank: int) -> dist.ProcessGroup | None:
    """This rank's rollout-group process group (None at tp = 1, or for a rank outside the view); every rank
    must call it, in the same order.

    ``dist.new_group`` is collective over the whole world, so each rank creates every group and keeps its own.
    """
    if view.tp == 1:
        return None
    mine = None
    for g in range(view.dp):
        group = dist.new_group(view.group_ranks(g))
        if view.generates(rank) and g == view.dp_rank(rank):
            mine = group
    return mine


def exchange_group(view: GenerateView, rank: int) -> dist.ProcessGroup | None:
    """This rank's expert-exchange process group (``GenerateView.exchange_ranks``; None unless ep > tp, or for
    a rank outside the view); collective like ``rollout_group``: every rank creates every group, in order."""
    if not view.exchanges:
        return None
    mine = None
    seen: set[tuple[int, ...]] = set()
    for r in range(view.first, view.end):
        ranks = tuple(view.exchange_ranks(r))
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine
