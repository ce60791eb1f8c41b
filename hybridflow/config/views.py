"""How each role's parallel sizes fit the world: the one check of the sizes against the ranks.

``world_problems`` is the check: tp x pp must divide the ranks, sp must divide them and (for now) come with
tp = pp = 1, ep must divide the data-parallel ranks (its groups are sub-groups of dp) and, for now, come with
pp = sp = 1. The config's validation runs it for every role (``check_train_views``),
the engine's ``ParallelDims`` when it is built, and the rollout's tensor-parallel size uses its
``not_dividing`` message. Each problem names the field that breaks it (by the long spelling, ``size_key``)
and a fix that works. What the sizes need of the model (heads, KV heads, layers) is checked once the model
config is known (``ParallelDims.check_model``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from hybridflow.config.errors import Problem
from hybridflow.config.parallel import DIMS, ROLES, own_dims, role_sizes, size_key


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def ranks_text(world: int) -> str:
    """'the 4 ranks (trainer.nnodes x trainer.n_gpus_per_node)': where a message names the world."""
    return f"the {world} rank{'s' if world > 1 else ''} (trainer.nnodes x trainer.n_gpus_per_node)"


def not_dividing(
    path: str, size: int, world: int, times: str = "", left: int | None = None, whole: int | None = None
) -> Problem:
    """``path``'s ``size`` (``times``: x the other sizes it multiplies) does not divide the ranks. The fix
    offers the sizes that do (those dividing ``left`` ranks: what the other sizes leave) or a world of a
    multiple of ``whole`` ranks (the product of the sizes)."""
    whole = size if whole is None else whole
    more = f"or run on a multiple of {whole} ranks (trainer.n_gpus_per_node={whole} on one node)"
    options = divisors(world if left is None else left)
    return Problem(
        path, f"{size}{times} does not divide {ranks_text(world)}", f"use one of {options}, {more}"
    )


def _tp_pp(role: str, tp: int, pp: int, world: int, own: Collection[str]) -> list[Problem]:
    """tp x pp against the ranks, each problem under the size that breaks it.

    A size that alone does not divide the world is that size's problem (pp=2 on one rank is a pipeline
    problem, never a tensor-parallel one); when each divides it but not their product, the pipeline size's,
    whose fix is then bounded by what the tensor-parallel size leaves.
    """
    if world % (tp * pp) == 0:
        return []
    sizes = {"tp": tp, "pp": pp}
    bad = [dim for dim, size in sizes.items() if world % size] or ["pp" if "pp" in own else "tp"]
    out = []
    for dim in (d for d in bad if d in own):
        other = "pp" if dim == "tp" else "tp"
        left = world // sizes[other] if world % sizes[other] == 0 else world
        times = f" x {size_key(role, other)}={sizes[other]}" if sizes[other] > 1 else ""
        out.append(not_dividing(size_key(role, dim), sizes[dim], world, times, left, tp * pp))
    return out


def _sp(role: str, sizes: Mapping[str, int], world: int, own: Collection[str]) -> list[Problem]:
    """sp divides the ranks and, for now, comes with tp = pp = 1 (only the sizes the role sets are its)."""
    sp, path = sizes["sp"], size_key(role, "sp")
    out = []
    if "sp" in own and world % sp:
        out.append(not_dividing(path, sp, world))
    for dim in ("tp", "pp"):
        if sizes[dim] > 1 and ("sp" in own or dim in own):
            name = size_key(role, dim)
            out.append(
                Problem(
                    path,
                    f"is {sp} with {name}={sizes[dim]}: sequence parallelism does not compose with "
                    "tensor- or pipeline-parallel training views yet",
                    f"set {name}=1 (FSDP2 over every rank), or {path}=1",
                )
            )
    return out


def _ep(role: str, sizes: Mapping[str, int], world: int, own: Collection[str]) -> list[Problem]:
    """ep divides the data-parallel ranks (each expert group is ep of them) and, for now, comes without pp
    and sp (tp splits the attention beside it)."""
    ep, tp, path = sizes["ep"], sizes["tp"], size_key(role, "ep")
    others = [d for d in ("pp", "sp") if sizes[d] > 1 and ("ep" in own or d in own)]
    out = []
    for dim in others:
        name = size_key(role, dim)
        message = f"is {ep} with {name}={sizes[dim]}: expert parallelism does not compose with {dim} yet"
        out.append(
            Problem(path, message, f"set {name}=1 (experts over FSDP2's data-parallel ranks), or {path}=1")
        )
    if "ep" in own and not others and world % tp == 0 and (world // tp) % ep:
        if tp == 1:
            out.append(not_dividing(path, ep, world))
        else:
            dp, tp_key = world // tp, size_key(role, "tp")
            message = (
                f"{ep} does not divide the {dp} data-parallel ranks ({ranks_text(world)} / {tp_key}={tp})"
            )
            out.append(
                Problem(path, message, f"use one of {divisors(dp)}, or run on a multiple of {ep * tp} ranks")
            )
    return out


def world_problems(
    role: str, sizes: Mapping[str, int], world: int, own: Collection[str] = DIMS, with_sp: bool = True
) -> list[Problem]:
    """Every way a role's sizes do not fit ``world`` ranks (sizes below 1 are the range check's to report).

    ``own``: the sizes the role sets itself (the reference's null ones are the actor's, reported there);
    ``with_sp``: whether to judge sp (a role the run does not use is judged on tp and pp only).
    """
    if any(sizes[d] < 1 for d in DIMS):
        return []
    out = _tp_pp(role, sizes["tp"], sizes["pp"], world, own)
    if with_sp and sizes["sp"] > 1:
        out += _sp(role, sizes, world, own)
    if sizes["ep"] > 1:
        out += _ep(role, sizes, world, own)
    return out


def _values(cfg: Any, role: str, out: list[Problem]) -> bool:
    """Each size the role sets is at least 1, and only the reference's may be null; whether all are."""
    ok = True
    for dim in own_dims(cfg, role) if role == "ref" else DIMS:
        value, path = getattr(getattr(cfg, role).parallel, dim), size_key(role, dim)
        if value is None:
            out.append(
                Problem(
                    path, "is null, which only the reference's sizes may be (the actor's)", f"e.g. {path}=1"
                )
            )
        elif value < 1:
            out.append(Problem(path, f"must be at least 1, got {value!r}", f"e.g. {path}=1 (the default)"))
        ok = ok and value is not None and value >= 1
    return ok


def check_train_views(cfg: Any, out: list[Problem]) -> None:
    """Each role's sizes against the world, and Ulysses' packing, for the roles the run uses."""
    used = {"actor", *(["ref"] if cfg.use_reference else []), *(["critic"] if cfg.use_critic else [])}
    world = cfg.trainer.world_size
    for role in ROLES:
        if not _values(cfg, role, out):
            continue
        sizes, own = role_sizes(cfg, role), own_dims(cfg, role)
        out.extend(world_problems(role, sizes, world, own, with_sp=role in used))
        if role in used and "sp" in own and sizes["sp"] > 1:
            packing = "critic.model.use_remove_padding" if role == "critic" else "model.use_remove_padding"
            packed = cfg.critic.model.use_remove_padding if role == "critic" else cfg.model.use_remove_padding
            if not packed:
                message = f"is {sizes['sp']}, but {packing} is false: Ulysses splits packed sequences"
                out.append(Problem(size_key(role, "sp"), message, f"set {packing}=true"))


def expert_sizes(world: int, tp: int) -> list[int]:
    """The rollout.expert_parallel_size values a view of ``world`` ranks at ``tp`` takes."""
    dp = world // tp if tp and world % tp == 0 else 1
    return [1, *(tp * k for k in range(1, dp + 1) if dp % k == 0 and tp * k > 1)]
