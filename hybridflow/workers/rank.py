"""What one rank of a worker group holds: its roles (colocated in one process), and their checkpoint I/O.

Locally the driver's process is the only rank; under Ray each rank is an actor process that builds its
roles from the config. Either way the driver reaches the roles only through these methods.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from hybridflow import checkpoint
from hybridflow.checkpoint import RoleState
from hybridflow.checkpoint.export import save_hf_model, write_hf_config
from hybridflow.checkpoint.manager import HF_CONFIG, user_errors_together
from hybridflow.models.adapters import target_suffixes
from hybridflow.protocol import Batch
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.dist import world_size
from hybridflow.utils.logging import rank as env_rank
from hybridflow.workers.dispatch import DataCoord
from hybridflow.workers.oom import out_of_memory

logger = logging.getLogger(__name__)

HF_DIR = "huggingface"  # verl's name for the HF copy inside a checkpoint's actor folder
ROLE_PREFIX = {"actor": "lm.", "critic": "model."}  # where the HF model sits inside each role's FSDP module


def lora_record(engine: Any) -> dict[str, Any] | None:
    """What a checkpoint records of a role's adapters (None without): rank, alpha, dropout, the adapted
    linears' layer-relative names (PEFT's ``target_modules``)."""
    spec = getattr(engine, "lora", None)
    if spec is None:
        return None
    names = [n for n, _ in engine.module.named_parameters()]
    targets = target_suffixes(names)
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "target_modules": targets}


class RankWorker:
    """The roles of this rank (``actor``, ``ref``, ``critic``), by name."""

    def __init__(
        self, roles: dict[str, Any], tokenizer: Any = None, group: str = "main", generates: bool = True
    ) -> None:
        """``generates=False``: the actor never samples (SFT), so it gets no multi-turn environment."""
        self.roles = {name: role for name, role in roles.items() if role is not None}
        self.tokenizer = tokenizer
        if generates and tokenizer is not None and "actor" in self.roles:
            self.roles["actor"].attach_tokenizer(tokenizer)  # multi-turn rollouts decode and render with it
        self.group = group
        self.eos_token_ids: list[int] = []  # set by the builder: the policy's stop tokens
        # A vision-language policy's processor (set by the builder): saved with the model in its place of the
        # tokenizer, so checkpoints and exports keep the image processor's files too.
        self.processor: Any = None
        self.peaks: dict[str, float] = {}

    def stop_tokens(self) -> list[int]:
        """The policy's stop token ids (the driver asks a rank instead of loading the model itself)."""
        return self.eos_token_ids

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``roles[role].method(*args, **kwargs)`` on this rank, noting the phase's peak device memory.

        Every phase the driver asks of a rank comes through here: an out-of-memory error in one becomes the
        ``DeviceOutOfMemory`` user error naming the phase (``workers.oom``).
        """
        try:
            return self._call(role, method, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            where = f" on rank {env_rank()} of {world_size()}" if world_size() > 1 else ""
            raise out_of_memory(exc, role, method, where) from exc

    def _call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if not cuda_in_use():
            return getattr(self.roles[role], method)(*args, **kwargs)
        torch.cuda.reset_peak_memory_stats()
        # What the phase found allocated (held between phases) beside its peak: the phase's own working set
        # is the difference (benchmarks/big_model.py sets the planner's estimates against both).
        self.peaks[f"memory/{role}.{method}_start_gib"] = torch.cuda.memory_allocated() / 2**30
        out = getattr(self.roles[role], method)(*args, **kwargs)
        peak = torch.cuda.max_memory_allocated() / 2**30
        self.peaks[f"memory/{role}.{method}_peak_gib"] = peak
        logger.debug("%s.%s: peak %.2f GiB allocated", role, method, peak)
        return out

    def call_share(self, role: str, method: str, share: Batch, source: bool, *args: Any) -> Any:
        """``call`` on this rank's replica's share of a batch; a rank that is not the replica's ``source``
        returns only its result's meta (a Batch of no rows: a rollout's statistics, an update's metrics) or
        None, so that each replica's rows travel back once."""
        out = self.call(role, method, share, *args)
        if source:
            return out
        return Batch(meta=out.meta) if isinstance(out, Batch) else None

    def data_coord(self, role: str, view: str = "train") -> DataCoord:
        """Where this rank stands in ``role``'s data: in its training view, or ("generate") in the actor's
        generation view."""
        worker = self.roles[role]
        return worker.rollout_coord() if view == "generate" else worker.data_coord()

    def memory_report(self) -> dict[str, float]:
        """The peak memory of each phase since the last report (empty on CPU)."""
        report, self.peaks = self.peaks, {}
        return report

    def has(self, role: str) -> bool:
        """Whether this rank holds ``role``."""
        return role in self.roles

    def world_size(self) -> int:
        """The size of this group's process group."""
        return world_size()

    # ----- checkpoints --------------------------------------------------------------------------------
    def _trainable(self) -> dict[str, Any]:
        return {name: self.roles[name] for name in ("actor", "critic") if name in self.roles}

    def _role_states(self) -> dict[str, RoleState]:
        return {
            name: RoleState(
                role.engine.module, role.engine.engine.optimizer, ROLE_PREFIX[name], lora_record(role.engine)
            )
            for name, role in self._trainable().items()
        }

    def _files(self) -> Any:
        """What is saved beside the policy's weights: its processor (image processor + tokenizer), else the
        tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    def _actor_state(self) -> dict[str, torch.Tensor]:
        """The actor's whole weights on CPU, its adapters merged (a collective: all ranks call it; offloaded
        shards gather on the device)."""
        return self.roles["actor"].hf_state()

    def save_checkpoint(self, tmp: str, save_hf: bool) -> dict[str, Any]:
        """Write this rank's shards (all ranks together) and, on rank 0, the export configs; returns meta."""
        tmp_dir = Path(tmp)
        role_meta = checkpoint.manager.write_roles(tmp_dir, self._role_states(), self.group)
        hf_state = self._actor_state() if save_hf and "actor" in self.roles else None
        engines = {}
        with user_errors_together():  # rank 0 writes; a full disk there stops every rank, none waits
            for name, role in self._trainable().items():
                engine = role.engine.engine
                engines[name] = {
                    "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
                    "skipped_steps": engine.skipped_steps,
                }
                if env_rank() == 0:
                    model = role.hf_model if name == "actor" else role.engine.module.model
                    write_hf_config(
                        tmp_dir / name / HF_CONFIG, model, self._files() if name == "actor" else None
                    )
            if hf_state is not None and env_rank() == 0:
                actor = self.roles["actor"]
                hf_dir = tmp_dir / "actor" / HF_DIR
                save_hf_model(
                    hf_state,
                    actor.hf_model.config,
                    self._files(),
                    hf_dir,
                    "lm.",
                    generation_config=getattr(actor.hf_model, "generation_config", None),
                )
        return {"roles": role_meta, "engines": engines, "world_size": world_size()}

    def load_checkpoint(self, path: str, engines: dict[str, Any]) -> None:
        """Load this rank's roles from a checkpoint (resharding as needed) and the schedulers' states.

        The roles load on the device and offload after: torch's ``Optimizer.load_state_dict`` puts every
        state tensor (and a fused AdamW's step counters) on its parameter's device, so loading into a role
        whose parameters sit on CPU would leave the moments there after the parameters come back.
        """
        with contextlib.ExitStack() as onloaded:
            for role in self._trainable().values():
                onloaded.enter_context(role.engine.engine.onloaded())
            checkpoint.manager.read_roles(path, self._role_states(), self.group)
        for name, role in self._trainable().items():
            engine, saved = role.engine.engine, engines[name]
            if engine.scheduler is not None and saved["scheduler"] is not None:
                engine.scheduler.load_state_dict(saved["scheduler"])
            engine.skipped_steps = int(saved["skipped_steps"])

    def check_checkpoint(self, path: str) -> None:
        """Raise when the checkpoint's roles do not fit this rank's models (before anything is loaded)."""
        checkpoint.manager.check_roles(path, checkpoint.read_meta(path), self._role_states())

    def save_hf_model(self, out_dir: str, staged: bool = True) -> str:
        """Write the actor's current weights as a Hugging Face directory (rank 0 writes; all ranks call).

        ``staged=False``: ``out_dir`` is the driver's own staging directory, written into directly (SFT puts
        its records beside the model there before renaming it into place)."""
        actor = self.roles["actor"]
        state = self._actor_state()
        with user_errors_together("the trained model"):  # a full disk on rank 0 stops every rank
            if env_rank() == 0:
                save_hf_model(
                    state,
                    actor.hf_model.config,
                    self._files(),
                    out_dir,
                    "lm.",
                    staged=staged,
                    what="the trained model",
                    generation_config=getattr(actor.hf_model, "generation_config", None),
                )
        return out_dir
