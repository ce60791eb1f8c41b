"""The actor role on one rank: a ``HybridActor`` built from the run's config, and the calls the driver makes
(generate, log-probs, the updates, the weights for a checkpoint or a rollout pool)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import GenerateView, HybridActor, ParallelDims, SamplingParams, update_preference
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.utils.progress import Progress
from hybridflow.workers.actor_settings import hybrid_settings, make_sampling_params
from hybridflow.workers.agent_env import MultiTurn
from hybridflow.workers.dispatch import DataCoord, generate_coord, train_coord
from hybridflow.workers.harness_rollout import HarnessRollout
from hybridflow.workers.rollout_batch import sample_batch
from hybridflow.workers.rollout_pool import connect_pools

__all__ = ["ActorWorker", "make_sampling_params"]


def routed(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``routed_experts`` of a pass's results, where it recorded them."""
    return {"routed_experts": out["routed_experts"]} if "routed_experts" in out else {}


class ActorWorker:
    """Holds the policy: ``generate`` reads the training module's parameters in place (a dtype cast at most)
    at one rank, a generation shard refreshed from the training shards on several (``HybridActor``)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        total_steps: int,
        pad_token_id: int,
        trainable: bool = True,
        generates: bool = True,
    ) -> None:
        """``trainable=False``: generation and log-probs only (evaluation), without AdamW or float32 masters;
        ``generates=False``: training only (SFT), no generation weights or rollout engine at all."""
        self.cfg, self.pad_token_id = cfg, pad_token_id
        init_distributed()
        dims = ParallelDims.of(cfg, "actor", world_size(), dist_rank())
        settings = hybrid_settings(cfg, dims, model.config, total_steps, trainable, generates)
        view = GenerateView.of(cfg, world_size())
        self.hybrid = HybridActor(model, dims, view, settings, dist_rank(), pad_token_id)
        self.engine = self.hybrid.train  # the training engine: log-probs and updates
        self.dims = self.hybrid.dims  # with its process groups
        self.multi_turn: MultiTurn | None = None  # attach_tokenizer builds it when rollout.multi_turn is on
        self.harness: HarnessRollout | None = None  # and this one with rollout.harness
        self.pool_sync: Any = None  # trainer.async_mode=separate: the stream into the rollout pool

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model inside the FSDP2 wrapper (its parameters are the training weights)."""
        return self.hybrid.hf_model

    @property
    def room_donors(self) -> list[Any]:
        """Engines whose optimizer moments may leave the GPU for a rollout short of room (the builder adds a
        critic on the same devices)."""
        return self.hybrid.room_donors

    def data_coord(self) -> DataCoord:
        """This rank's model replica in the training view: the driver hands its ranks one share of a batch."""
        return train_coord(self.dims, dist_rank())

    def rollout_coord(self) -> DataCoord:
        """This rank's rollout group: the driver hands its ranks one share of the prompts."""
        return generate_coord(self.hybrid.group.view, dist_rank())

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """The policy's tokenizer: multi-turn rollouts decode each turn and render tool turns with it."""
        if self.cfg.rollout.multi_turn.enable:
            self.multi_turn = MultiTurn(self.cfg, tokenizer)
        if self.cfg.rollout.harness.enabled:
            self.harness = HarnessRollout(self.cfg, tokenizer)

    def sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """``make_sampling_params`` with this worker's config."""
        return make_sampling_params(self.cfg, *args, **kwargs)

    def generate(self, prompts: Batch, params: SamplingParams, desc: str = "rollout") -> Batch:
        """Sample ``params.n`` responses per prompt; returns the training-layout batch, samples interleaved.

        Every rank of a rollout group is handed the group's prompts (the same on each) and generates them
        with the others; each returns the whole group's samples. Adds ``rollout_log_probs`` (B*n, R), the
        prompts' non-tensor fields repeated, ``uid`` (the prompt's group) and ``finish_reason``;
        ``meta["rollout_stats"]`` holds the engine's ``GenerationStats`` and ``meta["reshard"]`` the switch's.
        """
        h = self.hybrid
        reshard = h.to_generation()
        with h.merged():
            batch = sample_batch(
                h.rollout, h.group, prompts, params, self.cfg.data.max_response_length, self.pad_token_id, desc,
                self.multi_turn, h.make_room if h.room_donors else None, self.harness,
            )  # fmt: skip
        h.after_generation()
        if reshard is not None:
            batch.meta["reshard"] = reshard
        return batch

    def generate_partial(
        self, groups: list[Any], params: SamplingParams, quota: int, version: int, finish: frozenset[int]
    ) -> tuple[list[Any], dict[str, Any]]:
        """One phase of a partial rollout (``trainer.async_mode=colocate``): this rollout group's ``groups``
        until ``quota`` are done (and those keyed in ``finish``), the rest handed back unfinished. Every rank of
        a rollout group gets the same groups and returns the same states. Returns the groups and the phase's
        meta (``rollout_stats``, ``reshard``)."""
        h = self.hybrid
        reshard = h.to_generation()
        params = dataclasses.replace(params, seed=h.group.seed(params.seed))
        with Progress("rollout (partial)"), h.merged():
            groups = h.roll_partial(groups, params, quota, version, finish)
        h.after_generation()
        meta: dict[str, Any] = {"rollout_stats": dataclasses.asdict(h.rollout.last_stats)}
        if reshard is not None:
            meta["reshard"] = reshard
        return groups, meta

    def rollout_dtype_name(self) -> str:
        """The rollout's dtype (``rollout.dtype`` resolved): a separate rollout pool generates in it too."""
        return str(self.hybrid.dtype).removeprefix("torch.")

    def join_rollout_pool(self, address: tuple[str, int], pool: int) -> None:
        """``trainer.async_mode=separate``: join the bridge to a rollout pool of ``pool`` ranks (this pool's
        ranks first) and plan the stream of the training shards into its generation shards."""
        self.pool_sync = connect_pools(
            self.hf_model, self.cfg, address, dist_rank(), world_size(), pool, self.hybrid.dtype,
            self.engine.device, str(self.dims),
        )  # fmt: skip

    def push_weights(self) -> dict[str, float]:
        """Stream the current weights into the rollout pool (the collective with its ``receive``)."""
        return self.hybrid.push(self.pool_sync)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0's host, adapters merged into plain HF names (a collective: all ranks
        call it; offloaded shards gather on the device)."""
        return self.hybrid.hf_state()

    def compute_log_prob(self, batch: Batch) -> Batch:
        """Trainer log-probs (``old_log_probs``) and entropies of the responses under the current weights."""
        r = self.cfg.rollout
        out = self.engine.compute_log_prob(
            batch,
            temperature=r.temperature,
            micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=r.log_prob_use_dynamic_bsz,
            max_token_len=self.dims.token_budget(r.log_prob_max_token_len_per_gpu),
            with_entropy=True,
            with_routing=self.cfg.actor.router_replay == "r2",  # the update replays the old policy's experts
        )
        return Batch({"old_log_probs": out["log_probs"], "entropys": out["entropys"]} | routed(out))

    def update_actor(self, batch: Batch) -> Batch:
        """PPO-family update over the batch (mini-batches, epochs); its metrics in ``meta["metrics"]``.

        Without ``old_log_probs`` in ``batch`` (an on-policy update, see ``ActorEngine.update_policy``) the
        result also carries the update's own log-probs as ``old_log_probs``; otherwise it has no rows.
        """
        metrics = self.engine.update_policy(batch, temperature=self.cfg.rollout.temperature)
        if "old_log_probs" in batch:
            return Batch(meta={"metrics": metrics})
        return Batch({"old_log_probs": self.engine.last_log_probs}, meta={"metrics": metrics})

    def update_preference(self, batch: Batch) -> dict[str, float]:
        """One DPO/IPO/KTO optimizer step over this replica's pairs (``batch.meta["preference_kind"]``); pairs
        stay adjacent: each share holds whole pairs."""
        micro_pairs = max(1, self.cfg.actor.ppo_micro_batch_size_per_gpu // 2)
        kind = batch.meta["preference_kind"]
        return update_preference(self.engine, batch, self.cfg.preference, kind, micro_pairs)

    def update_sft(self, batch: Batch) -> dict[str, float]:
        """Supervised step(s) on the response tokens."""
        return self.engine.update_sft(batch)
