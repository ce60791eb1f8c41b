"""The driver's side of checkpoints: which roles and trainer state go in, where to resume from, HF copies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow import checkpoint
from hybridflow.checkpoint import CheckpointError, RoleState
from hybridflow.checkpoint.export import save_hf_model, write_hf_config
from hybridflow.checkpoint.rundir import incomplete_saves, is_complete
from hybridflow.config.schema import Config
from hybridflow.engine.fsdp import full_state_dict
from hybridflow.utils.dist import world_size

logger = logging.getLogger(__name__)

HF_DIR = "huggingface"  # verl's name for the HF copy inside a checkpoint's actor folder


def resume_target(cfg: Config) -> Path | None:
    """The checkpoint a run starts from, per ``trainer.resume`` (or verl's resume_mode/resume_from_path).

    ``auto`` takes the latest complete checkpoint in the run directory (none: a fresh start); a path may be
    a ``global_step_N`` folder or a run directory (its latest). Interrupted saves are skipped, with a warning.
    """
    t = cfg.trainer
    mode = t.resume or t.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        found = checkpoint.find_latest(t.run_dir())
        _report_skipped(Path(t.run_dir()), found)
        return found
    path = Path(t.resume_from_path if mode == "resume_path" else mode).expanduser()
    if is_complete(path):
        return path
    found = checkpoint.find_latest(path)
    if found is None:
        raise CheckpointError(
            f"trainer.resume={str(path)!r} is neither a complete global_step_N checkpoint nor a run directory "
            "holding one; point it to a checkpoint folder, or use trainer.resume=auto or disable"
        )
    _report_skipped(path, found)
    return found


def _report_skipped(run_dir: Path, chosen: Path | None) -> None:
    """Say which interrupted save was passed over, and which checkpoint is used instead."""
    for path in incomplete_saves(run_dir):
        logger.warning(
            "the save in %s was interrupted before it completed; resuming from %s instead",
            path.name,
            chosen.name if chosen is not None else "the start (no complete checkpoint)",
        )


def roles_of(components: Any) -> dict[str, RoleState]:
    """The trainable roles a checkpoint holds (the reference is the initial policy, rebuilt on resume)."""
    roles = {
        "actor": RoleState(components.actor.engine.module, components.actor.engine.engine.optimizer, "lm.")
    }
    if components.critic is not None:
        engine = components.critic.engine
        roles["critic"] = RoleState(engine.module, engine.engine.optimizer, "model.")
    return roles


def _engines(components: Any) -> dict[str, Any]:
    out = {"actor": components.actor.engine.engine}
    if components.critic is not None:
        out["critic"] = components.critic.engine.engine
    return out


def trainer_state(trainer: Any) -> dict[str, Any]:
    """Everything besides the weights that a resumed run needs to continue exactly."""
    return {
        "global_step": trainer.global_step,
        "sampler": trainer.sampler.state_dict(),
        "kl_ctrl": trainer.kl_ctrl.state_dict() if trainer.kl_ctrl is not None else None,
        "engines": {
            name: {
                "scheduler": e.scheduler.state_dict() if e.scheduler is not None else None,
                "skipped_steps": e.skipped_steps,
            }
            for name, e in _engines(trainer.c).items()
        },
    }


def restore_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Put back what ``trainer_state`` saved."""
    trainer.global_step = int(state["global_step"])
    trainer.sampler.load_state_dict(state["sampler"])
    if trainer.kl_ctrl is not None and state.get("kl_ctrl") is not None:
        trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    for name, engine in _engines(trainer.c).items():
        saved = state["engines"][name]
        if engine.scheduler is not None and saved["scheduler"] is not None:
            engine.scheduler.load_state_dict(saved["scheduler"])
        engine.skipped_steps = int(saved["skipped_steps"])


def _write_extras(trainer: Any, tmp: Path) -> None:
    """Config and tokenizer for export, and with ``trainer.save_hf`` a full HF copy of the actor."""
    c, rank0 = trainer.c, trainer.rank == 0
    if rank0:
        write_hf_config(tmp / "actor" / checkpoint.manager.HF_CONFIG, c.actor.hf_model, c.tokenizer)
        if c.critic is not None:
            write_hf_config(tmp / "critic" / checkpoint.manager.HF_CONFIG, c.critic.engine.module.model, None)


def save_checkpoint(trainer: Any) -> Path:
    """Write ``global_step_{N}`` for the trainer's current step (all ranks call it)."""
    cfg: Config = trainer.cfg
    t = cfg.trainer
    hf_state = full_state_dict(trainer.c.actor.engine.module) if t.save_hf else None  # a collective
    layout = {
        "world_size": world_size(),
        "nnodes": t.nnodes,
        "n_gpus_per_node": t.n_gpus_per_node,
        "fsdp": world_size(),
        "backend": t.backend,
    }

    def extras(tmp: Path) -> None:
        _write_extras(trainer, tmp)
        if hf_state is not None and trainer.rank == 0:
            c = trainer.c
            save_hf_model(
                hf_state, c.actor.hf_model.config, c.tokenizer, tmp / "actor" / HF_DIR, prefix="lm."
            )

    path = checkpoint.save(
        t.run_dir(),
        trainer.global_step,
        roles_of(trainer.c),
        trainer_state(trainer),
        layout,
        extras,
        keep=t.max_ckpt_to_keep,
    )
    logger.info("saved checkpoint %s", path)
    return path


def load_checkpoint(trainer: Any, path: Path) -> None:
    """Load weights, optimizer, schedulers, sampler, KL controller and RNG from ``path`` into the trainer."""
    state = checkpoint.load(path, roles_of(trainer.c))
    restore_trainer_state(trainer, state)
    logger.info("resumed from %s at step %d", path, trainer.global_step)
