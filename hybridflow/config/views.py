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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _view_problems(role: str, tp: int, pp: int, world: int, own: tuple[str, ...]) -> list[Problem]:
    """The problems of a view whose tp x pp does not divide the world, each under the field that breaks it.

    A size that alone does not divide the world is that size's problem (pp=2 on one rank is a pipeline
    problem, never a tensor-parallel one); when each divides it but not their product, the pipeline size's,
    whose fix is then bounded by what the tensor-parallel size leaves. ``own``: the fields the role sets
    itself (the reference's null ones are the actor's, reported there).
    """
    sizes = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    bad = [name for name, size in sizes.items() if world % size]
    if not bad:
        bad = ["pipeline_parallel_size" if "pipeline_parallel_size" in own else "tensor_parallel_size"]
    ranks = f"the {world} rank{'s' if world > 1 else ''} (trainer.nnodes x trainer.n_gpus_per_node)"
    more = f"or run on a multiple of {tp * pp} ranks (trainer.n_gpus_per_node={tp * pp} on one node)"
    out = []
    for name in (b for b in bad if b in own):
        (other,) = [n for n in sizes if n != name]
        left = world // sizes[other] if world % sizes[other] == 0 else world
        times = f" x {role}.{other}={sizes[other]}" if sizes[other] > 1 else ""
        message = f"{sizes[name]}{times} does not divide {ranks}"
        out.append(Problem(f"{role}.{name}", message, f"use one of {_divisors(left)}, {more}"))
    return out


def check_train_views(cfg: Config, out: list[Problem]) -> None:
    """Each trained or frozen role's tp x pp divides its ranks (the model's own limits: the builder)."""
    world = cfg.trainer.world_size
    for role in ("actor", "ref", "critic"):
        tp, pp = train_view_sizes(cfg, role)
        if tp < 1 or pp < 1 or world % (tp * pp) == 0:
            continue  # fine, or a range problem reported elsewhere
        own = ("tensor_parallel_size", "pipeline_parallel_size")
        if role == "ref":
            own = tuple(name for name in own if getattr(cfg.ref, name) is not None)
        out.extend(_view_problems(role, tp, pp, world, own))
