"""Checks of Ulysses sequence parallelism (``<role>.ulysses_sequence_parallel_size``) that the config alone decides.

What it needs of the model (heads and KV heads that sp splits) is checked once the model config is known
(``trainer.builder.check_rollout_view``).
"""

from __future__ import annotations

from hybridflow.config.errors import Problem
from hybridflow.config.schema import Config
from hybridflow.config.views import train_view_sizes

SP_KEY = "ulysses_sequence_parallel_size"


def sequence_parallel_size(cfg: Config, role: str) -> int:
    """The Ulysses size of a role (``actor``, ``ref``, ``critic``); the reference's null is the actor's."""
    sp = getattr(cfg, role).ulysses_sequence_parallel_size
    if role == "ref" and sp is None:
        sp = cfg.actor.ulysses_sequence_parallel_size
    return sp


def _packing_field(role: str) -> str:
    return "critic.model.use_remove_padding" if role == "critic" else "model.use_remove_padding"


def check_sequence_parallel(cfg: Config, out: list[Problem]) -> None:
    """Each role's sp divides the ranks, runs on packed sequences and, for now, with tp = pp = 1."""
    roles = ["actor"] + (["ref"] if cfg.use_reference else []) + (["critic"] if cfg.use_critic else [])
    world = cfg.trainer.world_size
    for role in roles:
        sp = sequence_parallel_size(cfg, role)
        path = f"{role}.{SP_KEY}"
        if sp is None or sp <= 1:
            continue  # 1, or a range problem reported elsewhere
        if world % sp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            out.append(
                Problem(
                    path,
                    f"{sp} does not divide the {world} ranks (trainer.nnodes x trainer.n_gpus_per_node)",
                    f"use one of {divisors}",
                )
            )
        packing = _packing_field(role)
        if not (cfg.critic.model.use_remove_padding if role == "critic" else cfg.model.use_remove_padding):
            message = f"is {sp}, but {packing} is false: Ulysses splits packed sequences"
            out.append(Problem(path, message, f"set {packing}=true"))
        tp, pp = train_view_sizes(cfg, role)
        for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if size > 1:
                out.append(
                    Problem(
                        path,
                        f"is {sp} with {role}.{name}={size}: sequence parallelism does not compose with "
                        "tensor- or pipeline-parallel training views yet",
                        f"set {role}.{name}=1 (FSDP2 over every rank), or {path}=1",
                    )
                )
