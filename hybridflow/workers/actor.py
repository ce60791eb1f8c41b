"""The actor role: the FSDP2 training engine and the rollout engine on the same weights."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import (
    ActorEngine,
    BroadcastReplica,
    GenerateView,
    GroupState,
    HFRollout,
    InPlaceMerge,
    LoraSpec,
    PagedEngine,
    ParallelDims,
    RolloutGroup,
    RolloutShard,
    RolloutTP,
    SamplingParams,
    TrainEngine,
    check_tp,
    fallback_reason,
    follow_rollout_shards,
    full_state_dict,
    lora_modules,
    roll_partial,
    to_dtype,
    update_preference,
)
from hybridflow.models.adapters import is_adapter_name, merge_adapter_state
from hybridflow.models.families import check_lora_family, check_tensor_parallel, fallback_notice
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.errors import UserError, format_bytes
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.utils.progress import Progress
from hybridflow.workers.agent_env import MultiTurn
from hybridflow.workers.dispatch import DataCoord, generate_coord, train_coord
from hybridflow.workers.rollout_batch import build_rollout, max_model_len, sample_batch
from hybridflow.workers.rollout_fp8 import fp8_pays
from hybridflow.workers.rollout_pool import connect_pools

logger = logging.getLogger(__name__)


def make_sampling_params(
    cfg: Config,
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    do_sample: bool,
    eos_token_ids: list[int],
    seed: int | None,
) -> SamplingParams:
    """Sampling settings for a rollout of ``data.max_response_length`` tokens."""
    r = cfg.rollout
    greedy = not do_sample or temperature == 0
    return SamplingParams(
        n=n,
        max_new_tokens=cfg.data.max_response_length,
        temperature=0.0 if greedy else temperature,
        do_sample=not greedy,
        top_p=top_p,
        top_k=top_k,
        min_p=r.min_p,
        eos_token_ids=eos_token_ids,
        stop_token_ids=list(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        seed=seed,
    )


def lora_spec(cfg: Config, config: Any, dims: ParallelDims) -> LoraSpec | None:
    """The actor's adapters from ``model.lora_*`` (None at rank 0), checked against the family and the view."""
    m = cfg.model
    if m.lora_rank == 0:
        return None
    check_lora_family(config)
    for dim in (
        "tp",
        "pp",
        "sp",
        "ep",
    ):  # a planned view (null sizes) is checked here, a set one in the config
        if getattr(dims, dim) > 1:
            raise UserError(
                f"actor.parallel.{dim}={getattr(dims, dim)} with model.lora_rank={m.lora_rank}: LoRA runs on "
                f"FSDP2 views only so far; set actor.parallel.{dim}=1, or model.lora_rank=0"
            )
    return LoraSpec(m.lora_rank, m.lora_alpha, tuple(m.target_modules), m.lora_dropout)


def routed(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``routed_experts`` of a pass's results, where it recorded them."""
    return {"routed_experts": out["routed_experts"]} if "routed_experts" in out else {}


class ActorWorker:
    """Holds the policy: ``generate`` reads the training module's parameters in place (a dtype cast at most)."""

    def __init__(
        self, model: nn.Module, cfg: Config, total_steps: int, pad_token_id: int, trainable: bool = True
    ) -> None:
        """``trainable=False``: generation and log-probs only (evaluation), without AdamW or float32 masters."""
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        init_distributed()
        r = cfg.rollout
        max_len = max_model_len(cfg)
        view = GenerateView(world_size(), r.tensor_model_parallel_size, r.expert_parallel_size)
        native = self._pick_engine(model, view, max_len)
        dims = ParallelDims.of(cfg, "actor", world_size(), dist_rank())
        dims.check_model(model.config)
        if view.tp > 1:
            check_tp(model.config, view.tp, view.ep)
            if dims.fsdp_only:  # a tensor-parallel training view has its own row split
                follow_rollout_shards(model, view.world, view.tp)  # row-parallel weights sharded on dim 1
        self.engine = ActorEngine(
            model,
            dims.budgets(cfg.actor),  # a token budget per replica
            rollout_n=cfg.rollout.n,
            use_remove_padding=cfg.model.use_remove_padding,
            gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
            total_steps=total_steps,
            trainable=trainable,
            dims=dims,
            lora=lora_spec(cfg, model.config, dims),
            freeze_vision_tower=cfg.model.freeze_vision_tower,
        )
        self.dims = self.engine.dims  # with its process groups
        device = self.engine.device
        # auto: generate in the training compute dtype on every device (actor.fsdp.param_dtype resolved:
        # bf16 on GPU, float32 on CPU), so the rollout's log-probs match the trainer's recomputation
        dtype = self.engine.compute_dtype if r.dtype == "auto" else to_dtype(r.dtype)
        self.group = RolloutGroup(view, dist_rank())  # collective: every rank builds every group
        self.fp8 = r.quantization == "fp8" and fp8_pays(cfg, model.config, device)
        self.weights = self._generation_weights(view, native, dtype, device)
        in_place = self.engine.lora is not None and r.lora_merge == "in_place" and self.weights is None
        self.in_place = InPlaceMerge(self.hf_model, device.type == "cuda") if in_place else None
        target = self.weights.module if self.weights is not None else self.hf_model
        tp = RolloutTP(self.group.group, model.config.vocab_size) if view.tp > 1 else None
        self.rollout = build_rollout(cfg, target, native, pad_token_id, dtype, device, tp)
        self.rollout_dtype = dtype
        self.pool_sync: Any = None  # trainer.async_mode=separate: the stream into the rollout pool
        self.switch_line = self._switch_line(dtype)
        self.multi_turn: MultiTurn | None = None  # attach_tokenizer builds it when rollout.multi_turn is on
        self._last_switch_line: str | None = None
        # Engines whose moments may leave the GPU for a rollout short of room (optimizer_offload=auto); the
        # builder adds a critic on the same devices.
        auto = trainable and cfg.actor.fsdp.optimizer_offload == "auto"
        self.room_donors: list[TrainEngine] = [self.engine.engine] if auto else []
        self._release_rollout_weights()

    def _pick_engine(self, model: nn.Module, view: GenerateView, max_len: int) -> bool:
        """Whether the built-in engine generates (else HF generate); refuses a layout the model cannot take.

        A family outside the built-in engine falls back to HF generate on a whole replica per rank, with one
        warning (rank 0) naming the family; a tensor-parallel rollout needs the built-in engine's shard rules.
        """
        r = self.cfg.rollout
        reason = fallback_reason(model, max_len) if r.engine == "native" else None
        if view.tp > 1:
            check_tensor_parallel(model.config, "rollout.tensor_model_parallel_size", view.tp)
            if reason is not None:
                raise UserError(
                    f"rollout.tensor_model_parallel_size={view.tp} needs the built-in rollout engine, which "
                    f"does not run this model ({reason}); set rollout.tensor_model_parallel_size=1 (HF "
                    "generate on a whole replica per rank)"
                )
        if reason is not None and r.quantization == "fp8":
            raise UserError(
                f"rollout.quantization=fp8 runs FP8 matmuls in the built-in rollout engine, which does not run "
                f"this model ({reason}); set rollout.quantization=null"
            )
        if reason is not None and r.kv_cache_dtype == "fp8":
            raise UserError(
                f"rollout.kv_cache_dtype=fp8 is the built-in rollout engine's paged KV cache, and that engine does "
                f"not run this model ({reason}); set rollout.kv_cache_dtype=auto"
            )
        if reason is not None and self.cfg.actor.router_replay == "r3":
            raise UserError(
                f"actor.router_replay=r3 needs the built-in rollout engine to record the experts, which does not "
                f"run this model ({reason}); set actor.router_replay=r2 (the old-log-prob pass's experts)"
            )
        if reason is not None and dist_rank() == 0:  # one warning per run, not one per rank
            logger.warning(fallback_notice(model.config, reason))
        return r.engine == "native" and reason is None

    def _switch_line(self, dtype: torch.dtype) -> str:
        """The log line of every train -> generate switch: what moves, from the reshard plan."""
        if self.weights is not None:
            return self.weights.switch_line()
        adapted = {id(m.weight) for m in lora_modules(self.hf_model)}
        cast = sum(  # the runner's cast buffers: weights whose dtype (or device) is not the rollout's
            p.numel() * dtype.itemsize
            for n, p in self.hf_model.named_parameters()
            if (p.dtype != dtype or p.device != self.engine.device)
            and not is_adapter_name(n)
            and id(p) not in adapted
        )
        line = "Stage switch: nothing copied, the rollout reads the training weights in place (one rank)"
        line += f"; {format_bytes(cast)} cast to {dtype} into its buffers" if cast else ""
        merged = sum(m.weight.numel() * dtype.itemsize for m in lora_modules(self.hf_model))
        if merged:
            how = (
                "in place (the base copied back from the host after)"
                if self.in_place
                else "into merge buffers"
            )
            line += f"; LoRA: {format_bytes(merged)} of adapted weights merged {how}"
        return line

    def _log_switch(self) -> None:
        """The switch line: INFO on the run's first switch and when its figure changes, DEBUG otherwise."""
        line = self.switch_line
        logger.log(logging.INFO if line != self._last_switch_line else logging.DEBUG, line)
        self._last_switch_line = line

    def _generation_weights(
        self, view: GenerateView, native: bool, dtype: torch.dtype, device: torch.device
    ) -> RolloutShard | BroadcastReplica | None:
        """The rollout's own weights: None where it reads the training module in place (one rank, built-in
        engine, hybrid engine), else a shard (or whole replica) from the reshard plan, or the baseline's copy.

        HF generate cannot run the FSDP2-wrapped module, and at data-parallel size > 1 no rank holds whole
        weights: both need weights of their own, refreshed from the shards before each generation.
        """
        if not self.cfg.actor.hybrid_engine:
            return BroadcastReplica(self.hf_model, dtype, device, self.dims.pp_group)
        fp8 = self.fp8  # the switch quantises: generation weights of its own
        if view.world == 1 and native and not fp8:
            logger.info(
                "HybridEngine initialized: train_view=(fsdp=1), generate_view=%s: the rollout reads the training "
                "weights in place (a cast buffer when the dtypes differ)",
                view,
            )
            return None
        bucket = self.cfg.rollout.update_weights_bucket_megabytes * 2**20
        return RolloutShard(self.hf_model, view, dist_rank(), dtype, device, bucket, str(self.dims), fp8)

    def _release_rollout_weights(self) -> int:
        """Free the rollout's own copy of the weights (a replica, or the engine's cast buffers); bytes freed.

        Every generation fills them again first, so until the first one, and in jobs that never generate
        (SFT, DPO, KTO), they would only hold a second copy of the policy beside the training state.
        """
        if self.weights is not None:
            return self.weights.release()
        if not isinstance(self.rollout, HFRollout):
            return self.rollout.runner.release()
        return 0

    def _make_room(self, ids: list[list[int]], params: SamplingParams) -> None:
        """``optimizer_offload=auto``: moments to the host for a rollout whose sequences would not all fit the
        KV cache at once.

        The engines of ``room_donors`` give up their moments in turn (the actor's first) until the KV cache
        holds every sequence at once; each gets them back at its next phase's ``onload()``.
        """
        if isinstance(self.rollout, HFRollout):
            return  # HF generate sizes nothing from memory
        short = self.rollout.memory_shortfall(ids, params)
        for donor in self.room_donors:
            if short <= 0:
                return
            freed = donor.make_room()
            logger.info(
                "optimizer_offload=auto: the KV cache was %.2f GiB short of every sequence at once; moved "
                "%.2f GiB of optimizer state to the host for this rollout",
                short / 2**30,
                freed / 2**30,
            )
            short = self.rollout.memory_shortfall(ids, params)

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model inside the FSDP2 wrapper (its parameters are the training weights)."""
        return self.engine.module.lm

    def data_coord(self) -> DataCoord:
        """This rank's model replica in the training view: the driver hands its ranks one share of a batch."""
        return train_coord(self.dims, dist_rank())

    def rollout_coord(self) -> DataCoord:
        """This rank's rollout group: the driver hands its ranks one share of the prompts."""
        return generate_coord(self.group.view, dist_rank())

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """The policy's tokenizer: multi-turn rollouts decode each turn and render tool turns with it."""
        if self.cfg.rollout.multi_turn.enable:
            self._need_built_in_engine("rollout.multi_turn runs episodes", "rollout.multi_turn.enable=false")
            self.multi_turn = MultiTurn(self.cfg, tokenizer)

    def _need_built_in_engine(self, what: str, fix: str) -> None:
        """UserError when this model generates with HF ``generate`` (a family the built-in engine lacks)."""
        if not isinstance(self.rollout, PagedEngine):
            raise UserError(
                f"{what} on the built-in paged engine; this model generates with {type(self.rollout).__name__} "
                f"(see the warning above): set {fix}"
            )

    def sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """``make_sampling_params`` with this worker's config."""
        return make_sampling_params(self.cfg, *args, **kwargs)

    def generate(self, prompts: Batch, params: SamplingParams, desc: str = "rollout") -> Batch:
        """Sample ``params.n`` responses per prompt; returns the training-layout batch, samples interleaved.

        Every rank of a rollout group is handed the group's prompts (the same on each) and generates them
        with the others; each returns the whole group's samples.

        Adds ``rollout_log_probs`` (B*n, R), the prompts' non-tensor fields repeated, ``uid`` (the prompt's
        group) and ``finish_reason``; ``meta["rollout_stats"]`` holds the engine's ``GenerationStats``.
        """
        reshard = self._switch_to_generation()
        self._log_switch()
        with self._merged():
            batch = sample_batch(
                self.rollout,
                self.group,
                prompts,
                params,
                self.cfg.data.max_response_length,
                self.pad_token_id,
                desc,
                self.multi_turn,
                self._make_room if self.room_donors else None,
            )
        if self.weights is not None and self.cfg.rollout.free_cache_engine:
            self.weights.release()  # the update needs its memory; the next sync() allocates it again
        if reshard is not None:
            batch.meta["reshard"] = reshard
        return batch

    def generate_partial(
        self,
        groups: list[GroupState],
        params: SamplingParams,
        quota: int,
        version: int,
        finish: frozenset[int],
    ) -> tuple[list[GroupState], dict[str, Any]]:
        """One phase of a partial rollout (``trainer.async_mode=colocate``, ``engine.rollout.partial``): this
        rollout group's ``groups`` until ``quota`` are done (and those keyed in ``finish``), the rest handed
        back unfinished. Every rank of a rollout group gets the same groups and returns the same states.
        Returns the groups and the phase's meta (``rollout_stats``, ``reshard``)."""
        self._need_built_in_engine(
            "trainer.async_mode=colocate continues partial samples", "trainer.async_mode=sync"
        )
        reshard = self._switch_to_generation()
        self._log_switch()
        params = dataclasses.replace(params, seed=self.group.seed(params.seed))
        with Progress("rollout (partial)"), self._merged():
            groups = roll_partial(self.rollout, groups, params, quota, version, finish)
        if self.weights is not None and self.cfg.rollout.free_cache_engine:
            self.weights.release()
        meta: dict[str, Any] = {"rollout_stats": dataclasses.asdict(self.rollout.last_stats)}
        if reshard is not None:
            meta["reshard"] = reshard
        return groups, meta

    def _merged(self) -> contextlib.AbstractContextManager:
        """``rollout.lora_merge=in_place``: the adapters merged into the base's storage while the rollout runs
        (the base restored after); otherwise nothing to do."""
        return self.in_place.merged() if self.in_place is not None else contextlib.nullcontext()

    def _switch_to_generation(self) -> dict[str, float] | None:
        """Refresh the rollout's own weights from the shards (every rank together); the switch's figures.

        ``seconds`` (device work included), ``bytes`` this rank received, and on CUDA the switch's peak
        allocated memory (``peak_gib``). None when the rollout reads the training module itself.
        """
        if self.weights is None:
            return None
        device = self.engine.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        received = self.weights.sync(self.hf_model)
        if cuda:
            torch.cuda.synchronize(device)
        out = {"seconds": time.perf_counter() - start, "bytes": float(received)}
        skipped = getattr(self.weights, "last_skipped_bytes", 0)  # a frozen vision tower, delivered once
        if skipped:
            out["skipped_bytes"] = float(skipped)
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return out

    def rollout_dtype_name(self) -> str:
        """The rollout's dtype (``rollout.dtype`` resolved): a separate rollout pool generates in it too."""
        return str(self.rollout_dtype).removeprefix("torch.")

    def join_rollout_pool(self, address: tuple[str, int], pool: int) -> None:
        """``trainer.async_mode=separate``: join the bridge to a rollout pool of ``pool`` ranks (this pool's
        ranks first) and plan the stream of the training shards into its generation shards."""
        self.pool_sync = connect_pools(
            self.hf_model,
            self.cfg,
            address,
            dist_rank(),
            world_size(),
            pool,
            self.rollout_dtype,
            self.engine.device,
            str(self.dims),
        )

    def push_weights(self) -> dict[str, float]:
        """Stream the current weights into the rollout pool (the collective with its ``receive``)."""
        start = time.perf_counter()
        with self.engine.engine.onloaded():  # offloaded shards come back to the device to be sent
            self.pool_sync.sync(self.hf_model)
        return {"seconds": time.perf_counter() - start}

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0's host, adapters merged into plain HF names (a collective: all ranks
        call it; offloaded shards gather on the device)."""
        engine = self.engine
        with engine.engine.onloaded():
            state = full_state_dict(engine.module, engine.engine.pp_group, engine.engine.optimizer)
        return state if engine.lora is None else merge_adapter_state(state, engine.lora.scaling)

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
