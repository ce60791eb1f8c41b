"""Batch sizes against each other and the data-parallel size (verl's normalisation), with the nearest valid values.

``ppo_mini_batch_size`` counts prompts: one optimizer step sees ``ppo_mini_batch_size * rollout.n`` samples,
split over the ``dp = nnodes * n_gpus_per_node`` data-parallel ranks; each rank runs micro-batches of
``ppo_micro_batch_size_per_gpu`` samples, which must divide its share. A step's batch
(``data.train_batch_size`` prompts) must be a whole number of mini-batches: a short last mini-batch would be
an optimizer step on fewer samples than the others, taken without a word, so it is refused with the nearest
sizes that divide evenly (rounding the batch down instead would train on prompts other than the ones asked for).
"""

from __future__ import annotations

from hybridflow.config.errors import Problem
from hybridflow.config.schema import Config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mini_batch_size(cfg: Config, role: str) -> int:
    """A role's prompts per optimizer step (the critic's null: the actor's)."""
    mini = getattr(cfg, role).ppo_mini_batch_size
    return cfg.actor.ppo_mini_batch_size if mini is None else mini


def _nearest_minis(cfg: Config, bsz: int, mini: int) -> list[int]:
    """The divisors of ``bsz`` nearest ``mini`` below and above whose samples split over the ranks."""
    n, dp = cfg.rollout.n, cfg.trainer.world_size
    fits = [d for d in _divisors(bsz) if (d * n) % dp == 0]
    below = [d for d in fits if d < mini][-1:]
    above = [d for d in fits if d > mini][:1]
    return below + above


def _check_whole_mini_batches(cfg: Config, role: str, out: list[Problem]) -> None:
    """``data.train_batch_size`` is a whole number of the role's mini-batches (no short last one)."""
    bsz, mini = cfg.data.train_batch_size, _mini_batch_size(cfg, role)
    whole, rest = divmod(bsz, mini)
    if rest == 0:
        return
    key = f"{role}.ppo_mini_batch_size"
    given = "" if getattr(cfg, role).ppo_mini_batch_size is not None else " (null: actor.ppo_mini_batch_size)"
    sizes = " or ".join(str(s) for s in (whole * mini, (whole + 1) * mini) if s >= mini)
    minis = _nearest_minis(cfg, bsz, mini)
    other = f", or {key}={' or '.join(map(str, minis))} (divisors of {bsz})" if minis else ""
    out.append(
        Problem(
            "data.train_batch_size",
            f"{bsz} prompts is not a whole number of mini-batches of {key}={mini}{given}: the last "
            f"optimizer step would see {rest} prompt{'s' if rest > 1 else ''} instead of {mini}",
            f"set data.train_batch_size={sizes} (whole mini-batches of {mini}){other}",
        )
    )


def check_batches(cfg: Config, role: str, out: list[Problem]) -> None:
    """verl's normalisation of one role's mini- and micro-batch against the batch and the data-parallel size."""
    section = getattr(cfg, role)
    mini, micro = _mini_batch_size(cfg, role), section.ppo_micro_batch_size_per_gpu
    world, n, bsz = cfg.trainer.world_size, cfg.rollout.n, cfg.data.train_batch_size
    if mini > bsz:
        out.append(
            Problem(
                f"{role}.ppo_mini_batch_size",
                f"{mini} prompts is larger than the batch (data.train_batch_size={bsz})",
                f"set {role}.ppo_mini_batch_size <= {bsz}",
            )
        )
        return
    dp = world  # as the engines split a mini-batch: over every rank
    if (mini * n) % dp:
        out.append(
            Problem(
                f"{role}.ppo_mini_batch_size",
                f"{mini} prompts x rollout.n={n} = {mini * n} samples do not split over the data-parallel "
                f"size {dp}",
                f"make {role}.ppo_mini_batch_size * rollout.n a multiple of {dp}",
            )
        )
        return
    if role == "actor" or section.ppo_mini_batch_size is not None:  # a null critic's is the actor's
        _check_whole_mini_batches(cfg, role, out)
    per_gpu = mini * n // dp
    if not section.use_dynamic_bsz and per_gpu % micro:
        largest = max(d for d in range(1, min(micro, per_gpu) + 1) if per_gpu % d == 0)
        out.append(
            Problem(
                f"{role}.ppo_micro_batch_size_per_gpu",
                f"{micro} does not divide the per-GPU mini-batch of {per_gpu} samples "
                f"({role}.ppo_mini_batch_size={mini} x rollout.n={n} / data-parallel size {dp})",
                f"use a divisor of {per_gpu}, e.g. {role}.ppo_micro_batch_size_per_gpu={largest}",
            )
        )


def check_train_batch(cfg: Config, out: list[Problem]) -> None:
    """The step's samples split over the ranks, and each trained role's mini- and micro-batches fit it."""
    world, n, bsz = cfg.trainer.world_size, cfg.rollout.n, cfg.data.train_batch_size
    if (bsz * n) % world:
        out.append(
            Problem(
                "data.train_batch_size",
                f"{bsz} prompts x rollout.n={n} = {bsz * n} samples do not split over the data-parallel size "
                f"{world} (trainer.nnodes * trainer.n_gpus_per_node)",
                f"make data.train_batch_size * rollout.n a multiple of {world}",
            )
        )
    for role in ["actor", "critic"] if cfg.use_critic else ["actor"]:
        check_batches(cfg, role, out)
