"""The driver's side of checkpoints: which roles and trainer state go in, where to resume from, HF copies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow import checkpoint
from hybridflow.checkpoint import CheckpointError
from hybridflow.checkpoint.identity import check_identity, model_identity
from hybridflow.checkpoint.manager import user_errors_together, verify_checkpoint
from hybridflow.checkpoint.rundir import is_complete, step_dir, temp_dir
from hybridflow.config.schema import Config
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.threads import current_cpu_threads, keep_resumed_threads

logger = logging.getLogger(__name__)


def resume_target(cfg: Config) -> Path | None:
    """The checkpoint a run starts from, per ``trainer.resume`` (or verl's resume_mode/resume_from_path).

    ``auto`` takes the latest complete checkpoint in the run directory (none: a fresh start); a path may be
    a ``global_step_N`` folder or a run directory (its latest). Interrupted saves and damaged checkpoints
    (files that fail their checksums) are skipped, with a warning naming each and why; a damaged checkpoint
    named by its own folder is refused, and so is a run directory whose every checkpoint is damaged
    (``trainer.resume=disable`` is how to start over there).
    """
    t = cfg.trainer
    mode = t.resume or t.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        return checkpoint.find_latest(t.run_dir(), verify=verify_checkpoint)
    path = Path(t.resume_from_path if mode == "resume_path" else mode).expanduser()
    if is_complete(path):
        verify_checkpoint(path)  # the one asked for: a damaged one is refused, naming the file
        return path
    found = checkpoint.find_latest(path, verify=verify_checkpoint)
    if found is None:
        raise CheckpointError(
            f"trainer.resume={str(path)!r} is neither a complete global_step_N checkpoint nor a run directory "
            "holding one; point it to a checkpoint folder, or use trainer.resume=auto or disable"
        )
    return found


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The driver's state that a resumed run needs to continue exactly (the ranks add their engines')."""
    return {
        "global_step": trainer.global_step,
        "sampler": trainer.sampler.state_dict() if trainer.sampler is not None else None,  # step-wise: none
        "kl_ctrl": trainer.kl_ctrl.state_dict() if trainer.kl_ctrl is not None else None,
        # trainer.async_mode=colocate: the groups in flight, continued after a resume (never trained twice);
        # separate: where the sampler stood before the batches in flight (drawn again after a resume)
        "in_flight": trainer.inflight.state_dict() if getattr(trainer, "inflight", None) else None,
        "cpu_threads": current_cpu_threads(),  # a CPU run's automatic count, kept by a resume (utils.threads)
    }


def restore_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Put back what ``trainer_state`` saved."""
    trainer.global_step = int(state["global_step"])
    keep_resumed_threads(state.get("cpu_threads"), trainer.cfg.trainer.cpu_threads, on_cpu=not cuda_in_use())
    if trainer.sampler is not None and state.get("sampler") is not None:  # the step-wise API saves none
        trainer.sampler.load_state_dict(state["sampler"])
    if trainer.kl_ctrl is not None and state.get("kl_ctrl") is not None:
        trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    flights = state.get("in_flight")
    mode = (flights or {}).get("mode", "colocate")
    if (
        getattr(trainer, "inflight", None) is not None
        and flights is not None
        and trainer.inflight.mode == mode
    ):
        trainer.inflight.load_state_dict(flights)
    elif flights and flights.get("sampler") is not None and trainer.sampler is not None:
        trainer.sampler.load_state_dict(flights["sampler"])  # separate's batches in flight: drawn again
    elif flights and flights["flights"]:
        logger.warning(
            "the checkpoint holds %d prompt groups in flight (trainer.async_mode=colocate); this run does "
            "not carry partial groups, so they are not continued (their prompts come round again next epoch)",
            len(flights["flights"]),
        )


def save_checkpoint(trainer: Any, metrics: dict[str, float] | None = None) -> Path:
    """Write ``global_step_{N}``: every group writes its shards, the driver commits (all SPMD ranks call).

    ``metrics`` (the step's record) is saved inside the checkpoint and metrics.jsonl is fsynced first, so
    the step's line survives a kill between the commit and its write (``Tracker`` puts it back on resume).
    """
    t = trainer.cfg.trainer
    groups, driver = trainer.c.groups, trainer.rank == 0
    run_dir, step = t.run_dir(), trainer.global_step
    tmp = temp_dir(run_dir, step)
    # A user error (a full disk) on one SPMD rank is raised on every rank: none waits for one that stopped.
    with user_errors_together(together=groups[0].raise_together):
        if driver:
            checkpoint.manager.begin(run_dir, step)
    with user_errors_together(together=groups[0].raise_together):
        _save_groups(trainer, run_dir, step, tmp, metrics)
    return step_dir(run_dir, step)


def _save_groups(trainer: Any, run_dir: Path, step: int, tmp: Path, metrics: dict[str, float] | None) -> None:
    """Every group writes its shards into ``tmp``; the driver adds the trainer state and commits."""
    t, groups, driver = trainer.cfg.trainer, trainer.c.groups, trainer.rank == 0
    metas = {g.name: g.run_all("save_checkpoint", str(tmp), t.save_hf)[0] for g in groups}
    if driver:
        state = trainer_state(trainer)
        state["metrics"] = {step: dict(metrics)} if metrics is not None else {}
        if trainer.tracker is not None:
            trainer.tracker.sync()
        state["engines"] = {k: v for m in metas.values() for k, v in m["engines"].items()}
        roles = {k: v for m in metas.values() for k, v in m["roles"].items()}
        layout = {
            "world_size": metas["main"]["world_size"],
            "groups": {name: m["world_size"] for name, m in metas.items()},
            "nnodes": t.nnodes,
            "n_gpus_per_node": t.n_gpus_per_node,
            "backend": t.backend,
            "placement": t.placement,
        }
        models = run_models(trainer)
        checkpoint.manager.finish(run_dir, step, tmp, roles, state, layout, t.max_ckpt_to_keep, models)
        logger.info("saved checkpoint %s", step_dir(run_dir, step))


def run_models(trainer: Any) -> dict[str, Any]:
    """The models this run started from, by role (computed once; ``identity.model_identity``).

    The actor's is ``model.path`` with ``model.override_config``; the critic's only when it has a directory
    of its own (``critic.model.path``), else it starts from the actor's model too.
    """
    if getattr(trainer, "model_identity", None) is None:
        cfg = trainer.cfg
        models = {"actor": model_identity(cfg.model.path, cfg.model.override_config)}
        if cfg.use_critic and cfg.critic.model.path:
            models["critic"] = model_identity(cfg.critic.model.path)
        trainer.model_identity = {role: found for role, found in models.items() if found is not None}
    return trainer.model_identity


def load_checkpoint(trainer: Any, path: Path) -> None:
    """Load every group's roles, the schedulers, sampler, KL controller and RNG from ``path``.

    A checkpoint trained from another model than this run's (another config, other initial weights) is
    refused naming both, before anything is loaded.
    """
    check_identity(path, checkpoint.read_meta(path).get("models"), run_models(trainer))
    state = checkpoint.manager.read_trainer_state(path)
    for group in trainer.c.groups:  # refuse a mismatch before anything is overwritten
        group.run_all("check_checkpoint", str(path))
    for group in trainer.c.groups:
        group.run_all("load_checkpoint", str(path), state["engines"])
    restore_trainer_state(trainer, state)
    trainer.saved_metrics = dict(state.get("metrics") or {})
    logger.info("resumed from %s at step %d", path, trainer.global_step)
