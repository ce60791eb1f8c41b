"""A role's parallel section (``actor.parallel``, ``critic.parallel``, ``ref.parallel``) and its sizes.

One dataclass for the three roles: tensor parallelism (``tp``), pipeline stages (``pp``), Ulysses sequence
parallelism (``sp``) and expert parallelism (``ep``: a mixture of experts' experts split over groups of ep
data-parallel ranks). The reference's null sizes are the actor's. Each size keeps its older flat spelling as an accepted key
(``actor.tensor_parallel_size`` is ``actor.parallel.tp``; verl's ``megatron.*`` and
``ulysses_sequence_parallel_size`` map onto the same fields, and ``megatron.expert_model_parallel_size``
onto ``ep``), and messages name the sizes by those long
spellings, which every verl user knows. How the sizes fit the world is checked in ``views``; how they fit the
model (heads, KV heads, layers) once the model config is known, by the engine (``ParallelDims.check_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.schema_base import option

ROLES = ("actor", "ref", "critic")
DIMS = ("tp", "pp", "sp", "ep")
# the long (flat) spelling of each size, the name messages use; ep has none: it is new
LONG_NAMES = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "sp": "ulysses_sequence_parallel_size",
}


@dataclass
class ParallelConfig:
    """A role's training view: its ranks as pp stages x tp ranks x dp replicas (sp: Ulysses inside dp)."""

    tp: int | None = option(
        1, "Tensor parallelism: each decoder layer split over tp ranks, FSDP2 over the rest."
    )
    pp: int | None = option(1, "Pipeline parallelism: the decoder layers split into this many stages.")
    sp: int | None = option(
        1, "Ulysses sequence parallelism: groups of sp ranks split each packed micro-batch."
    )
    ep: int | None = option(
        1, "Expert parallelism (MoE): each group of ep data-parallel ranks splits every layer's experts."
    )


class ParallelSizes:
    """The sizes of a role section's ``parallel`` under their long names (read-only)."""

    @property
    def tensor_parallel_size(self) -> int | None:
        """``parallel.tp``."""
        return self.parallel.tp  # type: ignore[attr-defined]

    @property
    def pipeline_parallel_size(self) -> int | None:
        """``parallel.pp``."""
        return self.parallel.pp  # type: ignore[attr-defined]

    @property
    def ulysses_sequence_parallel_size(self) -> int | None:
        """``parallel.sp``."""
        return self.parallel.sp  # type: ignore[attr-defined]


def size_key(role: str, dim: str) -> str:
    """The key messages name a size by: ``actor.tensor_parallel_size``, ..., ``actor.parallel.ep``."""
    return f"{role}.{LONG_NAMES[dim]}" if dim in LONG_NAMES else f"{role}.parallel.{dim}"


def role_sizes(cfg: Any, role: str) -> dict[str, int]:
    """``{tp, pp, sp, ep}`` of a role's training view: the reference's nulls are the actor's."""
    own = getattr(cfg, role).parallel
    actor = cfg.actor.parallel
    return {
        d: getattr(actor, d) if getattr(own, d) is None and role == "ref" else getattr(own, d) for d in DIMS
    }


def own_dims(cfg: Any, role: str) -> tuple[str, ...]:
    """The sizes a role sets itself (the reference's null ones are the actor's, reported there)."""
    section = getattr(cfg, role).parallel
    return tuple(d for d in DIMS if role != "ref" or getattr(section, d) is not None)


def sequence_parallel_size(cfg: Any, role: str) -> int:
    """The Ulysses size of a role (``actor``, ``ref``, ``critic``); the reference's null is the actor's."""
    return role_sizes(cfg, role)["sp"]


def flat_aliases() -> dict[str, str]:
    """The flat spellings of every role's sizes -> the section's fields (``actor.tensor_parallel_size``)."""
    return {f"{role}.{long}": f"{role}.parallel.{dim}" for role in ROLES for dim, long in LONG_NAMES.items()}
