"""A CUDA out-of-memory error in a role's phase, as one line the user can act on.

``RankWorker.call`` runs every phase a driver asks of a rank (generate, log-probs, values, updates), so it
is the one place that turns ``torch.OutOfMemoryError`` into ``DeviceOutOfMemory``: a ``UserError`` (exit 2,
one ``error:`` line) naming the phase and role, the bytes the allocator asked for, the device's free and total
memory then, and the config keys that shrink that phase. The driver adds the plan's estimate for the phase
(``hybridflow.trainer.oom``), which needs the config and the layout planner the ranks do not hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridflow.utils.errors import UserError, format_bytes

_UPDATE = (
    "set model.enable_gradient_checkpointing=true, or lower actor.ppo_micro_batch_size_per_gpu (with "
    "actor.use_dynamic_bsz=true: actor.ppo_max_token_len_per_gpu), or set actor.fsdp.optimizer_offload=true "
    "and actor.fsdp.param_offload=true, or add GPUs"
)


@dataclass(frozen=True)
class Phase:
    """What a role's method is to the user: its name, the planner's estimate key (if any) and the fix."""

    name: str
    estimate: str | None
    fix: str


# (role, RankWorker method) -> the phase. The planner (plan/search.py) estimates the actor's phases of an
# RL step; the reference's forward is estimated as the actor's log-prob pass (the same weights and micro-
# batches), the critic and the SFT/preference updates not at all.
PHASES: dict[tuple[str, str], Phase] = {
    ("actor", "generate"): Phase(
        "generate (rollout)",
        "generate",
        "lower rollout.gpu_memory_utilization (the KV cache's share) or rollout.max_num_seqs, or raise "
        "rollout.tensor_model_parallel_size",
    ),
    ("actor", "compute_log_prob"): Phase(
        "old log-prob",
        "log_prob",
        "lower rollout.log_prob_micro_batch_size_per_gpu (with rollout.log_prob_use_dynamic_bsz=true: "
        "rollout.log_prob_max_token_len_per_gpu), or set actor.fsdp.optimizer_offload=true",
    ),
    ("ref", "compute_ref_log_prob"): Phase(
        "reference log-prob",
        "log_prob",
        "lower ref.log_prob_micro_batch_size_per_gpu (with ref.log_prob_use_dynamic_bsz=true: "
        "ref.log_prob_max_token_len_per_gpu), or set ref.fsdp.param_offload=true",
    ),
    ("critic", "compute_values"): Phase(
        "values",
        None,
        "lower critic.ppo_micro_batch_size_per_gpu (with critic.use_dynamic_bsz=true: "
        "critic.ppo_max_token_len_per_gpu), or set critic.fsdp.param_offload=true",
    ),
    ("actor", "update_actor"): Phase("actor update", "update_actor", _UPDATE),
    ("critic", "update_critic"): Phase(
        "critic update",
        None,
        "set critic.model.enable_gradient_checkpointing=true, or lower critic.ppo_micro_batch_size_per_gpu "
        "(with critic.use_dynamic_bsz=true: critic.ppo_max_token_len_per_gpu), or set "
        "critic.fsdp.optimizer_offload=true and critic.fsdp.param_offload=true",
    ),
    ("actor", "update_sft"): Phase("SFT update", None, _UPDATE),
    ("actor", "update_preference"): Phase("preference (DPO/KTO) update", None, _UPDATE),
    # the driver's own work on the device between the roles' phases (rewards, advantages, metrics)
    ("driver", "step"): Phase("driver", None, "lower data.train_batch_size or rollout.n"),
}
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ASKED = re.compile(r"Tried to allocate ([\d.]+) ?(TiB|GiB|MiB|KiB|bytes|B)\b")


def requested_bytes(message: str) -> int | None:
    """The bytes an OOM message says were asked for ("Tried to allocate 2.00 GiB"), or None."""
    found = _ASKED.search(message)
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


def phase_of(role: str, method: str) -> Phase:
    """The phase ``role.method`` is (a method outside the table is named as it is, with no fix to offer)."""
    return PHASES.get((role, method), Phase(f"{role}.{method}", None, "lower that phase's micro-batch size"))


class DeviceOutOfMemory(UserError):
    """The device ran out of memory in a phase; ``str()`` is the whole line (``estimate`` filled later)."""

    def __init__(
        self,
        role: str,
        method: str,
        requested: int | None,
        free_total: tuple[int, int] | None,
        where: str = "",
        estimate: str | None = None,
    ) -> None:
        super().__init__(role, method, requested, free_total, where, estimate)
        self.role, self.method, self.requested = role, method, requested
        self.free_total, self.where, self.estimate = free_total, where, estimate
        self.values: dict[str, object] = {}  # the run's values of the keys the fix names (set by the driver)

    @property
    def phase(self) -> Phase:
        """The phase it happened in."""
        return phase_of(self.role, self.method)

    def __str__(self) -> str:
        phase = self.phase
        asked = "an unknown size" if self.requested is None else format_bytes(self.requested)
        memory = ""
        if self.free_total is not None:
            free, total = self.free_total
            memory = f" ({format_bytes(free)} free of {format_bytes(total)})"
        estimate = self.estimate or (
            "the layout planner has no estimate for this phase" if phase.estimate is None else "no estimate"
        )
        fix = phase.fix
        for key, value in self.values.items():  # "lower actor.ppo_micro_batch_size_per_gpu (now 8)"
            fix = re.sub(rf"\b{re.escape(key)}(?![=\w.])", f"{key} (now {value})", fix, count=1)
        return (
            f"out of device memory in the {phase.name} phase ({self.role}.{self.method}{self.where}): it asked "
            f"for {asked}{memory}; {estimate}. To make it fit, {fix}"
        )


def fix_keys(phase: Phase) -> list[str]:
    """The config keys ``phase``'s fix says to change by a value of the user's choice (not ``key=value``)."""
    return re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)\b(?![=\w.])", phase.fix)


def free_and_total() -> tuple[int, int] | None:
    """The current device's free and total bytes (``torch.cuda.mem_get_info``), or None without CUDA."""
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
    except RuntimeError:  # the device is in a bad state after the failure: the line goes without it
        return None
    return int(free), int(total)


def out_of_memory(exc: BaseException, role: str, method: str, where: str = "") -> DeviceOutOfMemory:
    """``DeviceOutOfMemory`` for ``exc`` (a ``torch.OutOfMemoryError``) raised in ``role.method``."""
    return DeviceOutOfMemory(role, method, requested_bytes(str(exc)), free_and_total(), where)
