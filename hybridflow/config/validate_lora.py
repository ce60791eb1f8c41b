"""LoRA's checks (``model.lora_rank`` > 0): what the adapters need, and what is not built with them yet."""

from __future__ import annotations

from hybridflow.config.errors import Problem
from hybridflow.config.parallel import size_key
from hybridflow.config.schema import Config

_VIEW_DIMS = ("tp", "pp", "sp", "ep")  # the training view's dimensions LoRA does not run with yet


def check_lora(cfg: Config, out: list[Problem]) -> None:
    """Problems of a LoRA run: empty targets, and each setting LoRA does not run with yet, by its key."""
    m = cfg.model
    if m.lora_rank == 0:
        return
    if not m.target_modules:
        out.append(
            Problem("model.target_modules", "is an empty list", "e.g. model.target_modules=all-linear")
        )
    off = f"set it back, or model.lora_rank=0 (LoRA with rank {m.lora_rank} runs on FSDP2 views only)"
    for dim in _VIEW_DIMS:
        for role in ("actor", "ref"):
            size = getattr(getattr(cfg, role).parallel, dim)
            if size is not None and size > 1:
                key = size_key(role, dim)
                out.append(Problem(key, f"is {size}: LoRA with it is not built yet", off))
    refusals = [
        (
            "actor.hybrid_engine",
            not cfg.actor.hybrid_engine,
            "is false: the baseline's broadcast copy does not merge the adapters",
            "set actor.hybrid_engine=true (the rollout generates with W + (alpha/r) B A)",
        ),
        (
            "trainer.async_mode",
            cfg.trainer.async_mode == "separate",
            "is separate: streaming merged adapters into a rollout pool is not built yet",
            "set trainer.async_mode=sync (or colocate), or model.lora_rank=0",
        ),
        (
            "actor.fsdp.optimizer_step_on_cpu",
            cfg.actor.fsdp.optimizer_step_on_cpu,
            "is true: the adapters' AdamW is small and stays on the device with LoRA",
            "set actor.fsdp.optimizer_step_on_cpu=false",
        ),
        (
            "actor.fsdp.param_offload",
            cfg.actor.fsdp.param_offload,
            "is true: offloading the frozen base with LoRA is not built yet",
            "set actor.fsdp.param_offload=false (the base is kept in the compute dtype, without moments)",
        ),
        (
            "ref.fsdp.param_offload",
            cfg.ref.fsdp.param_offload,
            "is true, but with LoRA the reference is the actor's own base (adapters off), not a copy",
            "remove it (ref.fsdp.param_offload=false)",
        ),
    ]
    out.extend(Problem(key, what, fix) for key, bad, what, fix in refusals if bad)
    in_place = cfg.rollout.lora_merge == "in_place"
    if in_place and (cfg.trainer.world_size > 1 or cfg.rollout.engine != "native"):
        out.append(
            Problem(
                "rollout.lora_merge",
                "is in_place, which merges into the weights the built-in engine reads at one rank; this run has "
                f"{cfg.trainer.world_size} rank(s) and rollout.engine={cfg.rollout.engine}",
                "set rollout.lora_merge=buffer (above one rank the merge goes into the generation shards)",
            )
        )
