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
        inherited = role == "ref" and cfg.ref.ulysses_sequence_parallel_size is None
        if inherited:  # the actor's size: its ranks and packing are reported once, under the actor
            _check_views(cfg, role, sp, path, out, own_only=True)
            continue
        if world % sp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            ranks = f"the {world} rank{'s' if world > 1 else ''} (trainer.nnodes x trainer.n_gpus_per_node)"
            more = f"or run on a multiple of {sp} ranks (trainer.n_gpus_per_node={sp} on one node)"
            out.append(Problem(path, f"{sp} does not divide {ranks}", f"use one of {divisors}, {more}"))
        packing = _packing_field(role)
        if not (cfg.critic.model.use_remove_padding if role == "critic" else cfg.model.use_remove_padding):
            message = f"is {sp}, but {packing} is false: Ulysses splits packed sequences"
            out.append(Problem(path, message, f"set {packing}=true"))
        _check_views(cfg, role, sp, path, out)


def _check_views(
    cfg: Config, role: str, sp: int, path: str, out: list[Problem], own_only: bool = False
) -> None:
    """sp > 1 with a tensor- or pipeline-parallel view of the same role: not composed yet.

    ``own_only``: only the sizes the role sets itself (the reference's null ones are the actor's).
    """
    tp, pp = train_view_sizes(cfg, role)
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if own_only and getattr(getattr(cfg, role), name) is None:
            continue
        if size > 1:
            out.append(
                Problem(
                    path,
                    f"is {sp} with {role}.{name}={size}: sequence parallelism does not compose with "
                    "tensor- or pipeline-parallel training views yet",
                    f"set {role}.{name}=1 (FSDP2 over every rank), or {path}=1",
                )
            )
