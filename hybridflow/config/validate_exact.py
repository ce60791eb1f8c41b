"""``rollout.exact``: what the exact mode runs with, and what it refuses (docs/algorithms.md, Exact mode)."""

from __future__ import annotations

from hybridflow.config.errors import Problem
from hybridflow.config.schema import Config

KEY = "rollout.exact"


def check_exact(cfg: Config, out: list[Problem]) -> None:
    """Exact mode runs one rollout replica per rank on the built-in engine, in the training dtype, with the
    trainer in FSDP2 alone; each setting that would reduce a token's numbers in another order is refused."""
    if not cfg.rollout.exact:
        return
    before = len(out)
    r, a, t = cfg.rollout, cfg.actor, cfg.trainer
    refusals = [
        (r.engine != "native", "rollout.engine", "HF generate computes its own way", "native"),
        (r.quantization is not None, "rollout.quantization", "FP8 weights are not the trainer's", "null"),
        (r.kv_cache_dtype == "fp8", "rollout.kv_cache_dtype", "an FP8 cache rounds K and V", "auto"),
        (
            r.tensor_model_parallel_size > 1,
            "rollout.tensor_model_parallel_size",
            "a sharded rollout sums partial products the trainer never forms",
            "1",
        ),
        (r.expert_parallel_size > 1, "rollout.expert_parallel_size", "experts across ranks", "1"),
        (r.allow_dtype_mismatch, "rollout.allow_dtype_mismatch", "another dtype cannot match", "false"),
        (
            t.async_mode == "separate",
            "trainer.async_mode",
            "a separate rollout pool is not covered yet",
            "sync or colocate",
        ),
    ]
    refusals += [
        (
            cfg.model.lora_rank > 0,
            "model.lora_rank",
            "the rollout merges the adapters into the weights, the trainer adds their product apart",
            "0",
        ),
        (r.compile_decode, "rollout.compile_decode", "Inductor fuses and reorders the ops", "false"),
        (
            a.use_torch_compile is True,
            "actor.use_torch_compile",
            "Inductor fuses and reorders the ops",
            "null",
        ),
    ]
    for bad, key, why, fix in refusals:
        if bad:
            out.append(Problem(key, f"with {KEY}=true: {why}", f"set {key}={fix}, or {KEY}=false"))
    for dim in ("tp", "pp", "sp", "ep"):
        size = getattr(a.parallel, dim)
        if size is not None and size > 1:
            out.append(
                Problem(
                    f"actor.parallel.{dim}",
                    f"is {size} with {KEY}=true: a split training view reduces a token's numbers across ranks",
                    f"set actor.parallel.{dim}=1 (FSDP2 alone), or {KEY}=false",
                )
            )
    if len(out) == before:
        exact_settings(cfg)


def exact_settings(cfg: Config) -> None:
    """What exact mode sets for you: no compile of the actor, and packed sequences (whose attention is the
    exact one; ``check_exact`` refuses an explicit ``actor.use_torch_compile=true``)."""
    if cfg.rollout.exact:
        cfg.actor.use_torch_compile = False
        cfg.model.use_remove_padding = True
