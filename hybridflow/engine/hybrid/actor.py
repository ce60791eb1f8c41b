"""The hybrid actor: one policy, two views of its weights, and the switch between them (the 3D-HybridEngine).

``HybridActor`` owns what the actor role is made of on one rank:

- the training engine (``ActorEngine``: FSDP2 and the training view's tensor, pipeline, sequence and expert
  parallelism, the optimizer, LoRA adapters) over the training view ``ParallelDims``;
- the generation view ``GenerateView`` and this rank's rollout group;
- the generation weights: none at one rank (the rollout reads the training module's parameters in place, a
  cast buffer at most), else this rank's generation shard refreshed from the training shards by the reshard
  plan (``RolloutShard``), or the baseline's whole copy refreshed by a broadcast (``BroadcastReplica``); with
  LoRA the adapters merged into them, or into the base's own storage for the rollout (``InPlaceMerge``);
- the rollout engine (the built-in paged engine, or HF ``generate`` for a family it does not run);
- the switch: ``to_generation()`` before a rollout, ``after_generation()`` and ``release()`` after it,
  ``make_room()`` for a rollout that would otherwise run in waves, and the switch's log line.

It reads no config: ``HybridSettings`` holds the plain values it needs, and ``BUILT_IN_NEEDS`` is the one
table of what asks for the built-in engine, checked once when the engine is picked.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridflow.engine.hybrid.fp8_choice import fp8_pays
from hybridflow.engine.hybrid.switch import BroadcastReplica, RolloutShard
from hybridflow.engine.ops.dtypes import to_dtype
from hybridflow.engine.ops.exact_model import prepare_exact
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.fsdp import full_state_dict
from hybridflow.engine.parallel.layout import check_tp, follow_rollout_shards
from hybridflow.engine.parallel.lora import InPlaceMerge, LoraSpec, lora_modules
from hybridflow.engine.parallel.rollout_group import RolloutGroup
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.engine.roles.actor import ActorEngine
from hybridflow.engine.rollout.expert_exchange import ExpertExchange
from hybridflow.engine.rollout.factory import make_rollout
from hybridflow.engine.rollout.hf_fallback import HFRollout
from hybridflow.engine.rollout.partial import GroupState, roll_partial
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.support import fallback_reason
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.engine.train.train_engine import TrainEngine
from hybridflow.models.adapters import is_adapter_name, merge_adapter_state
from hybridflow.models.families import check_tensor_parallel, fallback_notice
from hybridflow.models.moe import num_experts
from hybridflow.utils.errors import UserError, format_bytes

logger = logging.getLogger(__name__)

# What asks for the built-in engine: need -> (the setting, in the user's words; what it does there; the fix).
# A family the engine does not run generates with HF generate instead; each need set is then refused here.
BUILT_IN_NEEDS: dict[str, tuple[str, str, str]] = {
    "tp": (
        "rollout.tensor_model_parallel_size>1",
        "shards the rollout with the built-in engine's rules",
        "set rollout.tensor_model_parallel_size=1 (HF generate on a whole replica per rank)",
    ),
    "fp8": (
        "rollout.quantization=fp8",
        "runs FP8 matmuls in the built-in engine",
        "set rollout.quantization=null",
    ),
    "kv_fp8": (
        "rollout.kv_cache_dtype=fp8",
        "is the built-in engine's paged KV cache",
        "set rollout.kv_cache_dtype=auto",
    ),
    "r3": (
        "actor.router_replay=r3",
        "needs the built-in engine to record the experts",
        "set actor.router_replay=r2 (the old-log-prob pass's experts)",
    ),
    "multi_turn": (
        "rollout.multi_turn.enable=true",
        "runs episodes on the built-in engine's step API",
        "set rollout.multi_turn.enable=false",
    ),
    "harness": (
        "rollout.harness",
        "serves its endpoint on the built-in engine's step API",
        "train this family without rollout.harness (the built-in loop or rollout.multi_turn), or pick a family "
        "the engine runs",
    ),
    "exact": (
        "rollout.exact=true",
        "matches the trainer's numbers in the built-in engine",
        "set rollout.exact=false",
    ),
    "partial": (
        "trainer.async_mode=colocate",
        "continues partial samples on the built-in engine",
        "set trainer.async_mode=sync",
    ),
}


@dataclass(frozen=True)
class HybridSettings:
    """The plain values a ``HybridActor`` is built from (the worker reads them off the run's config)."""

    update_section: Any  # the actor section the training engine reads (token budgets per replica)
    total_steps: int
    rollout_n: int = 1
    use_remove_padding: bool = False
    gradient_checkpointing: bool = False
    trainable: bool = True  # False: generation and log-probs only, no optimizer state
    generates: bool = True  # False: training only (SFT): no generation weights, no rollout engine
    lora: LoraSpec | None = None
    freeze_vision_tower: bool = True
    offload_for_room: bool = (
        False  # optimizer_offload=auto: moments leave the GPU for a rollout short of room
    )
    engine: str = "native"  # rollout.engine: native (the built-in engine where it runs the family) or hf
    dtype: str = "auto"  # rollout.dtype; auto: the training compute dtype
    hybrid_engine: bool = True  # False: the baseline, a whole copy refreshed by a broadcast
    fp8: bool = False  # rollout.quantization=fp8 asked for
    fp8_kernel: str = "auto"
    fp8_force: bool = False
    lora_merge: str = "buffers"  # or in_place
    free_cache_engine: bool = True
    bucket_bytes: int = 512 << 20
    max_model_len: int = 2048
    rollout_options: dict[str, Any] = field(default_factory=dict)  # make_rollout's limits
    needs: tuple[str, ...] = ()  # keys of BUILT_IN_NEEDS this run asks for
    exact: bool = False  # rollout.exact: the trainer computes as the rollout (``exact_model.prepare_exact``)


class HybridActor:
    """One rank's actor: the training engine, the generation weights, the rollout, and the switch."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        view: GenerateView,
        settings: HybridSettings,
        rank: int,
        pad_token_id: int,
    ) -> None:
        s = self.settings = settings
        self.view, self.rank = view, rank
        native = self._pick_engine(model) if s.generates else False
        dims.check_model(model.config)
        if view.exchanges and s.generates:
            self._check_exchange(model)
        if (view.tp > 1 or view.ep > 1) and s.generates:
            check_tp(model.config, view.tp, view.ep)
            if dims.fsdp_only:  # a tensor-parallel training view has its own row split
                follow_rollout_shards(model, view.world, view.tp)  # row-parallel weights sharded on dim 1
        if s.exact:  # before FSDP2 wraps it: the trainer's forward computes as the rollout's
            prepare_exact(model)
        self.train = ActorEngine(
            model, s.update_section, rollout_n=s.rollout_n, use_remove_padding=s.use_remove_padding,
            gradient_checkpointing=s.gradient_checkpointing, total_steps=s.total_steps, trainable=s.trainable,
            dims=dims, lora=s.lora, freeze_vision_tower=s.freeze_vision_tower,
        )  # fmt: skip
        self.dims = self.train.dims  # with its process groups
        # auto: generate in the training compute dtype (bf16 on GPU, float32 on CPU), so that the rollout's
        # log-probs match the trainer's recomputation
        self.dtype = self.train.compute_dtype if s.dtype == "auto" else to_dtype(s.dtype)
        self.group = RolloutGroup(view, rank)  # collective: every rank builds every group
        self.weights: RolloutShard | BroadcastReplica | None = None
        self.in_place: InPlaceMerge | None = None
        self.rollout: Any = None
        self.fp8 = False
        self.room_donors: list[TrainEngine] = []
        self._last_switch_line: str | None = None
        self.switch_line = ""
        if s.generates:
            self._build_generation(model, native, pad_token_id)

    def _build_generation(self, model: nn.Module, native: bool, pad_token_id: int) -> None:
        """The generation side: the weights the rollout reads, the LoRA merge, the rollout engine."""
        s, view, device = self.settings, self.view, self.train.device
        compiled = bool(s.rollout_options.get("compile_decode"))
        self.fp8 = s.fp8 and fp8_pays(
            model.config, device, s.fp8_kernel, s.fp8_force, view.tp, compiled, self.rank
        )
        self.weights = self._generation_weights(native, device)
        in_place = self.train.lora is not None and s.lora_merge == "in_place" and self.weights is None
        self.in_place = InPlaceMerge(self.hf_model, device.type == "cuda") if in_place else None
        target = self.weights.module if self.weights is not None else self.hf_model
        tp = RolloutTP(self.group.group, model.config.vocab_size) if view.tp > 1 else None
        parallel: dict[str, Any] = {"tp": tp} if tp is not None else {}
        if view.exchanges:  # experts split across rollout groups: their tokens meet at every MoE layer
            parallel["ep"] = ExpertExchange(
                self.group.exchange_group, num_experts(model.config), self.group.ep_rank
            )
        self.rollout = make_rollout(
            target, "native" if native else "hf", pad_token_id=pad_token_id, dtype=self.dtype, device=device,
            max_model_len=s.max_model_len, **(s.rollout_options if native else _hf_options(s.rollout_options)),
            **parallel,
        )  # fmt: skip
        self.switch_line = self._switch_line()
        # Engines whose moments may leave the GPU for a rollout short of room; the worker adds a critic on
        # the same devices.
        if s.offload_for_room and s.trainable:
            self.room_donors.append(self.train.engine)
        self.release()

    # --- the two views ------------------------------------------------------------------------------------

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model inside the FSDP2 wrapper (its parameters are the training weights)."""
        return self.train.module.lm

    @property
    def built_in(self) -> bool:
        """Whether the built-in engine generates (else HF ``generate``, or nothing: ``generates=False``)."""
        return self.rollout is not None and not isinstance(self.rollout, HFRollout)

    def _check_exchange(self, model: nn.Module) -> None:
        """Expert parallelism across rollout groups (ep > tp) needs the hybrid engine's shards, the built-in
        engine's ``generate`` (the groups settle together at its end): refused otherwise, naming the setting
        and the fix (the runner refuses a GPU, ``expert_exchange.check_device``)."""
        s, tp = self.settings, self.view.tp
        fix = f"set rollout.expert_parallel_size={tp if tp > 1 else 1}"
        if not s.hybrid_engine:
            raise UserError(
                f"rollout.expert_parallel_size={self.view.ep} needs actor.hybrid_engine=true; {fix}"
            )
        for need in ("multi_turn", "partial"):
            if need in s.needs:
                setting = BUILT_IN_NEEDS[need][0]
                raise UserError(
                    f"rollout.expert_parallel_size={self.view.ep} (experts across rollout groups) runs with whole "
                    f"generate calls only, not with {setting}; {fix}"
                )

    def _pick_engine(self, model: nn.Module) -> bool:
        """Whether the built-in engine generates; a family it does not run falls back to HF generate on a
        whole replica per rank, with one warning (rank 0), unless the run needs the built-in engine
        (``BUILT_IN_NEEDS``: refused, naming the setting and the fix)."""
        s, view = self.settings, self.view
        reason = fallback_reason(model, s.max_model_len) if s.engine == "native" else None
        if view.tp > 1:
            check_tensor_parallel(model.config, "rollout.tensor_model_parallel_size", view.tp)
        if reason is not None:
            split = view.tp > 1 or view.ep > 1
            for need in (n for n in BUILT_IN_NEEDS if n in s.needs or (n == "tp" and split)):
                setting, what, fix = BUILT_IN_NEEDS[need]
                raise UserError(f"{setting} {what}, which does not run this model ({reason}); {fix}")
            if self.rank == 0:  # one warning per run, not one per rank
                logger.warning(fallback_notice(model.config, reason))
        return s.engine == "native" and reason is None

    def _generation_weights(
        self, native: bool, device: torch.device
    ) -> RolloutShard | BroadcastReplica | None:
        """The rollout's own weights: None where it reads the training module in place (one rank, built-in
        engine, hybrid engine, no FP8), else a shard (or whole replica) from the reshard plan, or the baseline's
        copy. HF generate cannot run the FSDP2-wrapped module, and at data-parallel size > 1 no rank holds whole
        weights: both need weights of their own, refreshed from the shards before each generation."""
        if not self.settings.hybrid_engine:
            return BroadcastReplica(self.hf_model, self.dtype, device, self.dims.pp_group)
        if self.view.world == 1 and native and not self.fp8:
            logger.info(
                "HybridEngine initialized: train_view=(fsdp=1), generate_view=%s: the rollout reads the training "
                "weights in place (a cast buffer when the dtypes differ)",
                self.view,
            )
            return None
        bucket = self.settings.bucket_bytes
        return RolloutShard(
            self.hf_model, self.view, self.rank, self.dtype, device, bucket, str(self.dims), self.fp8
        )

    # --- the switch ---------------------------------------------------------------------------------------

    def to_generation(self) -> dict[str, float] | None:
        """Train -> generate: refresh the rollout's own weights from the shards (every rank together) and log
        the switch line. Returns the figures: ``seconds`` (device work included), ``bytes`` this rank received
        and on CUDA the switch's peak allocated memory (``peak_gib``); None when the rollout reads the training
        module itself."""
        self._log_switch()
        if self.weights is None:
            return None
        device = self.train.device
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

    def merged(self) -> contextlib.AbstractContextManager:
        """``rollout.lora_merge=in_place``: the adapters merged into the base's storage while the rollout runs
        (the base restored after); otherwise nothing to do."""
        return self.in_place.merged() if self.in_place is not None else contextlib.nullcontext()

    def after_generation(self) -> None:
        """Generate -> train: the update needs the memory of the generation weights (``free_cache_engine``);
        the next ``to_generation()`` allocates the same storages again."""
        if self.weights is not None and self.settings.free_cache_engine:
            self.weights.release()

    def release(self) -> int:
        """Free the rollout's own copy of the weights (a shard or replica, or the engine's cast buffers);
        bytes freed. Until the first generation, and in jobs that never generate (SFT, DPO, KTO), they would
        only hold a second copy of the policy beside the training state."""
        if self.weights is not None:
            return self.weights.release()
        if self.built_in:
            return self.rollout.runner.release()
        return 0

    def roll_partial(
        self,
        groups: list[GroupState],
        params: SamplingParams,
        quota: int,
        version: int,
        finish: frozenset[int],
    ) -> list[GroupState]:
        """One phase of a partial rollout on the built-in engine (``rollout.partial.roll_partial``)."""
        assert self.built_in, "BUILT_IN_NEEDS refused a partial rollout on HF generate at start"
        return roll_partial(self.rollout, groups, params, quota, version, finish)

    def push(self, pool_sync: Any) -> dict[str, float]:
        """Stream the current weights into a rollout pool of its own (``PoolSync``; the collective with the
        pool's receive); offloaded shards come back to the device to be sent."""
        start = time.perf_counter()
        with self.train.engine.onloaded():
            pool_sync.sync(self.hf_model)
        return {"seconds": time.perf_counter() - start}

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0's host, adapters merged into plain HF names (a collective: all ranks
        call it; offloaded shards gather on the device)."""
        train = self.train
        with train.engine.onloaded():
            state = full_state_dict(train.module, train.engine.pp_group, train.engine.optimizer)
        return state if train.lora is None else merge_adapter_state(state, train.lora.scaling)

    def make_room(self, ids: list[list[int]], params: SamplingParams) -> None:
        """``optimizer_offload=auto``: moments to the host for a rollout that would otherwise run in waves.

        The engines of ``room_donors`` give up their moments in turn (the actor's first) until the KV cache
        holds every sequence at once; each gets them back at its next phase's ``onload()``."""
        if not self.built_in:
            return  # HF generate sizes nothing from memory
        short = self.rollout.memory_shortfall(ids, params)
        for donor in self.room_donors:
            if short <= 0:
                return
            freed = donor.make_room()
            logger.info(
                "optimizer_offload=auto: the KV cache was %.2f GiB short of one wave; moved %.2f GiB of "
                "optimizer state to the host for this rollout",
                short / 2**30,
                freed / 2**30,
            )
            short = self.rollout.memory_shortfall(ids, params)

    def _switch_line(self) -> str:
        """The log line of every train -> generate switch: what moves, from the reshard plan."""
        if self.weights is not None:
            return self.weights.switch_line()
        dtype, adapted = self.dtype, {id(m.weight) for m in lora_modules(self.hf_model)}
        cast = sum(  # the runner's cast buffers: weights whose dtype (or device) is not the rollout's
            p.numel() * dtype.itemsize
            for n, p in self.hf_model.named_parameters()
            if (p.dtype != dtype or p.device != self.train.device)
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


def _hf_options(options: dict[str, Any]) -> dict[str, Any]:
    """The rollout limits HF generate takes (the KV cache's dtype and routing records are the built-in
    engine's)."""
    return {k: v for k, v in options.items() if k not in ("kv_cache_dtype", "record_routing")}
