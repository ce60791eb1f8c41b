"""The rollout's dtype against the training compute dtype: they must match unless the user opts in.

"Match" means the rollout's dtype (``rollout.dtype``; auto: the training compute dtype) is the dtype the
actor's forward computes in (``actor.fsdp.param_dtype``; auto: bfloat16 on GPU, float32 on CPU), not the
master weights' dtype: float32 masters computing and generating in bfloat16 (the default on GPU) match. A
rollout in another dtype samples from a slightly different policy than the one the trainer scores, so its
log-probs differ from the recomputation and the importance weights drift: refused, naming both keys, unless
``rollout.allow_dtype_mismatch=true`` (then one warning). Where the config leaves the device to the machine
(``trainer.device=auto``), the check is finished at start, once the device is known.
"""

from __future__ import annotations

import dataclasses
import logging

from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.schema import Config

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPT_IN = "rollout.allow_dtype_mismatch"


def actor_compute_dtypes(cfg: Config, on_gpu: bool | None = None) -> tuple[set[str], str]:
    """The dtypes the actor may compute in and how to say so (``on_gpu``: the device, when known)."""
    param = cfg.actor.fsdp.param_dtype
    if param != "auto":
        name = _DTYPE_NAMES.get(param, param)
        return {name}, name
    device = cfg.trainer.device if on_gpu is None else ("cuda" if on_gpu else "cpu")
    if device == "cuda":
        return {"bfloat16"}, "bfloat16 on GPU"
    if device == "cpu":
        return {"float32"}, "float32 on CPU"
    return {"bfloat16", "float32"}, "bfloat16 on GPU, float32 on CPU"


def _mismatch(cfg: Config, on_gpu: bool | None) -> Problem | None:
    """The problem of a rollout dtype off the training compute dtype, or None when they match."""
    rollout = cfg.rollout.dtype
    compute, described = actor_compute_dtypes(cfg, on_gpu)
    if rollout == "auto" or _DTYPE_NAMES.get(rollout, rollout) in compute:
        return None
    param = cfg.actor.fsdp.param_dtype
    return Problem(
        "rollout.dtype",
        f"{rollout} is not the training compute dtype (actor.fsdp.param_dtype={param}: {described}): the "
        "rollout's log-probs would differ from the trainer's recomputation, so the importance weights and the "
        "rollout/trainer mismatch metrics (rollout_corr/*) grow",
        f"leave rollout.dtype=auto to generate in the training compute dtype, or set actor.fsdp.param_dtype="
        f"{rollout}; {OPT_IN}=true runs them apart",
    )


def check_rollout_dtype(cfg: Config, out: list[Problem], on_gpu: bool | None = None) -> None:
    """Refuse a rollout dtype off the training compute dtype (one warning with the opt-in)."""
    problem = _mismatch(cfg, on_gpu)
    if problem is None:
        return
    if not cfg.rollout.allow_dtype_mismatch:
        out.append(problem)
        return
    logger.warning("rollout.dtype=%s (accepted: %s=true)", problem.message, OPT_IN)


def check_rollout_dtype_on(cfg: Config, on_gpu: bool) -> None:
    """At start, with the device known: refuse (raise ConfigError) a mismatch the config alone left open."""
    undecided = cfg.trainer.device == "auto" and cfg.actor.fsdp.param_dtype == "auto"
    if not undecided or _mismatch(cfg, None) is not None:
        return  # decided, and refused or warned about, when the config was validated
    if cfg.trainer.backend == "ray" and cfg.trainer.ray_address:
        return  # the workers run on another cluster's machines, whose devices this process cannot see
    problems: list[Problem] = []
    check_rollout_dtype(cfg, problems, on_gpu)
    here = f" (trainer.device=auto computes on {'a GPU' if on_gpu else 'the CPU'} here)"
    if problems:
        raise ConfigError([dataclasses.replace(p, message=p.message + here) for p in problems])
