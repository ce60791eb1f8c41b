"""Checks of the parallel views a config asks for: the training view of each role and how it fits the world.

What a view needs of the model (heads and MLP rows that tp divides) is checked by the builder once the model
config is known (``trainer.builder.check_views``); here only what the config alone decides.
"""

from __future__ import annotations

from hybridflow.config.errors import Problem
from hybridflow.config.schema import Config


def train_view_sizes(cfg: Config, role: str) -> tuple[int, int]:
    """``(tensor_parallel_size, pipeline_parallel_size)`` of a role's training view (the reference's null: the actor's)."""
    section = getattr(cfg, role)
    tp, pp = section.tensor_parallel_size, section.pipeline_parallel_size
    if role == "ref":
        tp = cfg.actor.tensor_parallel_size if tp is None else tp
        pp = cfg.actor.pipeline_parallel_size if pp is None else pp
    return tp, pp


def check_train_views(cfg: Config, out: list[Problem]) -> None:
    """Each trained or frozen role's tp x pp divides its ranks (the model's own limits: the builder)."""
    world = cfg.trainer.world_size
    for role in ("actor", "ref", "critic"):
        tp, pp = train_view_sizes(cfg, role)
        if tp < 1 or pp < 1:
            continue  # the range checks report it
        if world % (tp * pp):
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            out.append(
                Problem(
                    f"{role}.tensor_parallel_size",
                    f"{tp} x {role}.pipeline_parallel_size={pp} does not divide the {world} ranks "
                    "(trainer.nnodes x trainer.n_gpus_per_node)",
                    f"use a tensor-parallel size among {divisors}",
                )
            )
