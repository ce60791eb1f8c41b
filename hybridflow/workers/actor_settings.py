"""What the actor role takes from a run's config: the ``HybridSettings`` its ``HybridActor`` is built from, the
adapters, the rollout engine's limits and the sampling settings of a rollout."""

from __future__ import annotations

from typing import Any

from hybridflow.config.schema import Config
from hybridflow.engine import HybridSettings, LoraSpec, ParallelDims, SamplingParams
from hybridflow.models.families import check_lora_family
from hybridflow.utils.errors import UserError


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


def max_model_len(cfg: Any) -> int:
    """The longest sequence the rollout holds: ``rollout.max_model_len``, else prompt + response limits."""
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def rollout_options(cfg: Any) -> dict[str, Any]:
    """``make_rollout``'s limits from ``rollout.*`` (the built-in engine's; HF generate takes what it uses)."""
    r = cfg.rollout
    options = {
        "max_num_seqs": r.max_num_seqs,
        "max_num_batched_tokens": r.max_num_batched_tokens,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "enforce_eager": r.enforce_eager,
        "compile_decode": r.compile_decode,
        "free_cache_engine": r.free_cache_engine,
        "kv_cache_dtype": r.kv_cache_dtype,
    }
    if cfg.actor.router_replay == "r3":  # router replay: the rollout records the experts it routed to
        options["record_routing"] = True
    return options


def built_in_needs(cfg: Config) -> tuple[str, ...]:
    """The keys of ``BUILT_IN_NEEDS`` this run sets (what only the built-in rollout engine can do)."""
    r = cfg.rollout
    asked = {
        "fp8": r.quantization == "fp8",
        "kv_fp8": r.kv_cache_dtype == "fp8",
        "r3": cfg.actor.router_replay == "r3",
        "multi_turn": r.multi_turn.enable,
        "harness": r.harness.enabled,
        "exact": r.exact,
        "partial": cfg.trainer.async_mode == "colocate",
    }
    return tuple(k for k, on in asked.items() if on)


def hybrid_settings(
    cfg: Config, dims: ParallelDims, config: Any, total_steps: int, trainable: bool, generates: bool = True
) -> HybridSettings:
    """The ``HybridSettings`` of the actor of ``cfg`` over the training view ``dims`` (``config``: the model's)."""
    r = cfg.rollout
    return HybridSettings(
        update_section=dims.budgets(cfg.actor),  # a token budget per replica
        total_steps=total_steps,
        rollout_n=r.n,
        use_remove_padding=cfg.model.use_remove_padding,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        trainable=trainable,
        generates=generates,
        lora=lora_spec(cfg, config, dims),
        freeze_vision_tower=cfg.model.freeze_vision_tower,
        offload_for_room=cfg.actor.fsdp.optimizer_offload == "auto",
        engine=r.engine,
        dtype=r.dtype,
        hybrid_engine=cfg.actor.hybrid_engine,
        fp8=r.quantization == "fp8",
        fp8_kernel=r.quantization_kernel,
        fp8_force=r.quantization_force,
        lora_merge=r.lora_merge,
        free_cache_engine=r.free_cache_engine,
        bucket_bytes=r.update_weights_bucket_megabytes * 2**20,
        max_model_len=max_model_len(cfg),
        rollout_options=rollout_options(cfg),
        needs=built_in_needs(cfg),
        exact=r.exact,
    )
