"""Worker groups and the role handles the driver holds; the driver code is the same for every backend.

A ``WorkerGroup`` runs a ``RankWorker`` method on each of its ranks (``run_each``) with per-rank arguments
and returns the results in rank order. ``LocalGroup`` is this very process: one rank, or rank r of a world
started by ``torchrun`` in which every process runs the driver (SPMD). ``RayGroup``
(``hybridflow.workers.ray_group``) drives Ray actors. The handles below turn the driver's calls into
dispatches by data-parallel coordinate (``workers.dispatch``): a batch is split into one share per model
replica of the role, every rank of a replica computes on the same share, and each replica's result comes
back once; other calls go to every rank alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch.distributed as dist

from hybridflow.engine import layout_padding
from hybridflow.protocol import Batch
from hybridflow.utils.dist import raise_together
from hybridflow.workers.dispatch import SINGLE, DataLayout, merge_batches, split_batch
from hybridflow.workers.exchange import share_results
from hybridflow.workers.rank import RankWorker


class WorkerError(RuntimeError):
    """A rank of a worker group failed; the message names the group, its roles, the rank and the cause."""


class WorkerGroup(ABC):
    """N ranks of one or more colocated roles."""

    name: str = "main"
    world: int = 1

    def __init__(self) -> None:
        self.layouts: dict[tuple[str, str], DataLayout] = {}

    @abstractmethod
    def run_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]:
        """Call ``RankWorker.method(*per_rank_args[r], **kwargs)`` on every rank r; results in rank order."""

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Broadcast: every rank gets the same arguments."""
        return self.run_each(method, [args] * self.world, **kwargs)

    def layout(self, role: str, view: str = "train") -> DataLayout:
        """How ``role``'s ranks share data in ``view`` ("train", or the actor's "generate"): asked of the
        ranks on first use, then kept (the views are fixed for the run)."""
        key = (role, view)
        if key not in self.layouts:
            coords = [SINGLE] if self.world == 1 else self.run_all("data_coord", role, view)
            self.layouts[key] = DataLayout.of(coords)
        return self.layouts[key]

    @abstractmethod
    def call_shares(
        self, role: str, method: str, shares: list[Batch], layout: DataLayout, *args: Any
    ) -> list[Any]:
        """Call ``roles[role].method(shares[d], *args)`` on every rank of replica d; every rank's result in
        rank order, where only each replica's source rank returns a whole result (``RankWorker.call_share``:
        the others return a Batch's meta alone, or None)."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every process that runs the driver got here (only SPMD runs have more than one)."""

    def raise_together(self, error: BaseException | None) -> None:
        """A barrier that raises on every driver process when any brings a user error (``error`` here)."""
        if error is not None:
            raise error

    @abstractmethod
    def shutdown(self) -> None:
        """Release the group's processes."""


class LocalGroup(WorkerGroup):
    """This process as the only rank, or as rank r of a torchrun world where every rank runs the driver."""

    def __init__(self, worker: RankWorker, name: str = "main") -> None:
        super().__init__()
        self.worker = worker
        self.name = name
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def run_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]:
        """Run this rank's share, then gather every rank's result (all ranks call this together)."""
        mine = per_rank_args[self.rank]
        result = getattr(self.worker, method)(*mine, **kwargs) if mine is not None else None
        if self.world == 1:
            return [result]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, result)
        return gathered

    def call_shares(
        self, role: str, method: str, shares: list[Batch], layout: DataLayout, *args: Any
    ) -> list[Any]:
        """Every process holds the whole batch and takes its replica's share; the sources' results then
        reach every process as tensors (``exchange.share_results``), since each runs the driver."""
        replica = layout.replica_of[self.rank]
        source = layout.sources[replica] == self.rank
        result = self.worker.call_share(role, method, shares[replica], source, *args)
        return [result] if self.world == 1 else share_results(result)

    def barrier(self) -> None:
        """Every rank runs the driver under torchrun: line them up."""
        if self.world > 1:
            dist.barrier()

    def raise_together(self, error: BaseException | None) -> None:
        """Under torchrun every rank raises the first rank's user error, none waits for a rank that stopped."""
        raise_together(error)

    def shutdown(self) -> None:
        """Nothing to release: the roles live in this process."""


# The tensors each call reads: only these travel to the ranks (the batch holds many more by then).
SEQ_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
# The policy's passes (old log-probs, reference, update) replay a MoE rollout's experts when it recorded them.
POLICY_KEYS = (*SEQ_KEYS, "routed_experts")
ACTOR_UPDATE_KEYS = (*POLICY_KEYS, "advantages", "old_log_probs", "ref_log_prob", "rollout_is_weights")
CRITIC_UPDATE_KEYS = (*SEQ_KEYS, "values", "returns")
PREFERENCE_KEYS = (*SEQ_KEYS, "ref_seq_logps", "labels")
# The non-tensor fields that travel with the rows: a vision-language policy's images (one dict per row, None
# for a text-only row; each pass feeds its micro-batches' rows' images to the model).
ROW_NON_TENSORS = ("multi_modal_inputs",)
HARNESS_ROW_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "index")


def prompt_fields(prompts: Batch, rows: bool = False) -> Batch:
    """What a rollout reads of a prompt batch: its tensors and, for a VLM, each row's images; ``rows``: the
    dataset rows' fields too (a harness reads them, ``rollout.harness``)."""
    keys = ROW_NON_TENSORS + (HARNESS_ROW_KEYS if rows else ())
    rows = [k for k in keys if k in prompts.non_tensors]
    return prompts.select(["input_ids", "attention_mask", "position_ids"], rows)


def _row_fields(batch: Batch, keys: tuple[str, ...]) -> Batch:
    """The tensors ``keys`` of ``batch`` that it has, and its row-aligned non-tensors (``ROW_NON_TENSORS``)."""
    present = [k for k in keys if k in batch.tensors]
    return batch.select(present, [k for k in ROW_NON_TENSORS if k in batch.non_tensors])


def merge_rollout(
    pieces: list[Batch], results: list[Any], pad: int, prompts: int, n: int, widths: dict[str, Any]
) -> Batch:
    """One batch from the rollout groups' samples (``pieces``, by group; ``results``: every rank's, whose
    metas are taken): ``uid`` numbers the ``prompts`` of the whole batch, ``meta["rollout_stats"]`` is rank
    0's, ``meta["reshard"]`` every rank's switch and ``meta["multi_turn"]`` the groups' episode metrics."""
    turns = [p.meta.get("multi_turn") for p in pieces]  # per rollout group (multi-turn rollouts)
    for r in results:
        r.meta.pop("multi_turn", None)
    stats = [r.meta.pop("rollout_stats", None) for r in results]  # per rank: they differ, so not merged
    reshard = [r.meta.pop("reshard", None) for r in results]
    out = merge_batches(pieces, pad * n, widths)  # each group pads to its longest prompt
    if stats[0] is not None:
        out.meta["rollout_stats"] = stats[0]  # rank 0's, like the memory report
    if reshard[0] is not None:
        out.meta["reshard"] = reshard  # every rank's switch: its time, bytes received and peak
    out["uid"] = np.repeat(np.array([str(i) for i in range(prompts)], dtype=object), n)
    if turns[0] is not None:  # equal shares: means average, the bounds take the extremes, counts add up
        out.meta["multi_turn"] = {k: _merge_turn_metric(k)([t[k] for t in turns]) for k in turns[0]}
    return out


def _merge_turn_metric(key: str) -> Any:
    """How one episode metric of several rollout groups combines: ``tool/*`` are counts."""
    if key.startswith("tool/"):
        return sum
    return min if key.endswith("/min") else max if key.endswith("/max") else np.mean


class RoleHandle:
    """The driver's view of one role in a group; ``pad_token_id`` fills token ids when shares widen."""

    def __init__(self, group: WorkerGroup, role: str, pad_token_id: int) -> None:
        self.group = group
        self.role = role
        self.widths = layout_padding(pad_token_id)

    @property
    def dp_size(self) -> int:
        """The role's data-parallel size in its training view: the shares a batch is split into."""
        return self.group.layout(self.role).dp

    def _call(
        self, method: str, batch: Batch, *args: Any, view: str = "train"
    ) -> tuple[list[Any], list[Any], int]:
        """``method`` on each replica's share of ``batch``: the replicas' results in order, every rank's result
        (only the meta of a Batch off the replicas' sources) and the count of padding rows."""
        layout = self.group.layout(self.role, view)
        shares, pad = split_batch(batch, layout.dp)
        results = self.group.call_shares(self.role, method, shares, layout, *args)
        return [results[s] for s in layout.sources], results, pad

    def _split(self, method: str, batch: Batch, keys: tuple[str, ...] = SEQ_KEYS) -> Any:
        pieces, _, pad = self._call(method, _row_fields(batch, keys))
        if isinstance(pieces[0], Batch):
            return merge_batches(pieces, pad, self.widths)
        return pieces[0]  # metrics: already reduced over the ranks


class ActorHandle(RoleHandle):
    """Rollout, log-probs and updates of the actor, each model replica on its share of the batch."""

    def __init__(self, group: WorkerGroup, sampling: Any, pad_token_id: int) -> None:
        super().__init__(group, "actor", pad_token_id)
        self.sampling_params = sampling  # a plain function of the config: no rank needed

    def generate(self, prompts: Batch, params: Any, desc: str = "rollout") -> Batch:
        """``params.n`` samples per prompt, interleaved; ``uid`` numbers the prompts of the whole batch.

        Each rollout group generates for its share of the prompts. ``meta["rollout_stats"]`` carries rank
        0's generation stats when the engine keeps them, and ``meta["reshard"]`` every rank's train ->
        generate switch when the rollout has weights of its own.
        """
        pieces, results, pad = self._call("generate", prompts, params, desc, view="generate")
        return merge_rollout(pieces, results, pad, len(prompts), params.n, self.widths)

    def generate_partial(
        self, groups: list[list[Any]], params: Any, quotas: list[int], version: int, finish: frozenset[int]
    ) -> list[tuple[list[Any], dict[str, Any]]]:
        """One partial-rollout phase (``trainer.async_mode=colocate``): rollout group d runs ``groups[d]``
        until ``quotas[d]`` are done; per rollout group, its updated groups and the phase's meta."""
        layout = self.group.layout(self.role, "generate")
        assert len(groups) == len(quotas) == layout.dp, "one list of groups and one quota per rollout group"
        per_rank = [
            (self.role, "generate_partial", groups[d], params, quotas[d], version, finish)
            for d in layout.replica_of
        ]
        results = self.group.run_each("call", per_rank)
        return [results[s] for s in layout.sources]

    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropys``."""
        return self._split("compute_log_prob", batch, POLICY_KEYS)

    def update_actor(self, batch: Batch) -> tuple[dict[str, float], Batch | None]:
        """One PPO-family update: its metrics (reduced over the ranks), and, when ``batch`` has no
        ``old_log_probs`` (on-policy), the update's own log-probs as ``old_log_probs``, else None."""
        pieces, _, pad = self._call("update_actor", _row_fields(batch, ACTOR_UPDATE_KEYS))
        metrics = pieces[0].meta["metrics"]  # reduced over the ranks: the same on every one
        if "old_log_probs" not in pieces[0]:
            return metrics, None
        for piece in pieces:
            del piece.meta["metrics"]
        return metrics, merge_batches(pieces, pad, self.widths)

    def update_sft(self, batch: Batch) -> dict[str, float]:
        """Supervised step(s) on the response tokens."""
        return self._split("update_sft", batch)

    def update_preference(self, batch: Batch) -> dict[str, float]:
        """One DPO/IPO/KTO step (the kind is in ``batch.meta``); pairs are adjacent rows."""
        return self._split("update_preference", batch, PREFERENCE_KEYS)

    def memory(self) -> dict[str, float]:
        """Peak device memory (GiB) of each phase on rank 0 since the last call, as metrics."""
        return self.group.run_all("memory_report")[0]


class RefHandle(RoleHandle):
    """Reference log-probs."""

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` (B, R)."""
        return self._split("compute_ref_log_prob", batch, POLICY_KEYS)


class CriticHandle(RoleHandle):
    """Values and the critic update."""

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, R)."""
        return self._split("compute_values", batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss update; metrics reduced over the ranks."""
        return self._split("update_critic", batch, CRITIC_UPDATE_KEYS)
