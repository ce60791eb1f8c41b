"""Whole runs: SFT to a model directory, PPO-family RL from one, and the built-in demo that chains them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hybridflow.checkpoint import load_role_model
from hybridflow.checkpoint.manager import HF_CONFIG
from hybridflow.checkpoint.rundir import is_complete, step_dir
from hybridflow.config import Config, check_start, save_config
from hybridflow.data import load_split_rows
from hybridflow.engine import enable_exact_kernels
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.trainer.async_ppo import ColocatePPOTrainer
from hybridflow.trainer.async_separate import SeparatePPOTrainer
from hybridflow.trainer.builder import (
    Components,
    build_components,
    build_eval_components,
    build_preference_components,
    build_sft_components,
    load_policy,
)
from hybridflow.trainer.dumps import write_jsonl
from hybridflow.trainer.loop import TrainingLoop
from hybridflow.trainer.oom import out_of_memory_errors
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.preference import PreferenceTrainer
from hybridflow.trainer.sft import SFTTrainer, check_sft_config
from hybridflow.trainer.summary import write_summary
from hybridflow.trainer.tracking import METRICS_FILE, PLOT_FILE, Tracker
from hybridflow.trainer.validation import validate
from hybridflow.utils.device import cap_gpu_memory, cuda_in_use, use_device_type
from hybridflow.utils.dirlock import lock_run_dir
from hybridflow.utils.errors import DiskFullError, UserError, disk_full_error, path_error
from hybridflow.utils.host import check_one_process
from hybridflow.utils.logging import rank as env_rank
from hybridflow.utils.progress import nice_every
from hybridflow.utils.seed import set_seed
from hybridflow.utils.storage import ensure_writable_dir, staged_dir, staging_path
from hybridflow.utils.threads import configure_cpu_threads, passive_wait_env

logger = logging.getLogger(__name__)


def start_job(cfg: Config, single_process: str | None = None) -> None:
    """What every job does first in its process: take the device type (``trainer.device``), size the CPU
    threads (``trainer.cpu_threads``, ``utils.threads``) and seed.

    ``single_process`` names a job that runs in one process only: launched on several ranks, every rank
    would repeat the whole job and write the same files, so it is refused.
    """
    if single_process is not None:
        check_one_process(single_process)
    use_device_type(cfg.trainer.device)
    # The processes this job starts (Ray ranks, reward workers) wait passively; a CPU run sizes its threads.
    passive_wait_env(os.environ)
    configure_cpu_threads(cfg.trainer.cpu_threads, on_cpu=not cuda_in_use())
    cap_gpu_memory(cfg.trainer.gpu_memory_gb)  # before anything is allocated on the GPU
    check_start(cfg, os.environ, cuda_in_use())  # the rollout dtype on this device; VERL_* variables
    set_seed(cfg.trainer.seed, cfg.trainer.deterministic)
    if cfg.rollout.exact:
        enable_exact_kernels()
        logger.info("rollout.exact: batch-invariant kernels (rollout log-probs bitwise equal to the trainer's)")
    if cfg.trainer.deterministic:
        logger.info("trainer.deterministic: deterministic kernels (same seed, same GPU: the same metrics and weights)")


def sft_job(
    cfg: Config,
    out_dir: Path,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    rows: list[dict] | None = None,
    processor: Any = None,
) -> dict[str, float]:
    """Supervised fine-tuning of ``model.path`` (or the given model) on the train rows; saves to ``out_dir``.

    It runs like RL (``trainer.sft``): on one rank, on torchrun's ranks, or on Ray actors
    (``trainer.backend=ray``: every rank loads ``model.path``, so pass no model), in the actor's training view
    (``actor.parallel``, LoRA), in the run directory (``config.yaml``, ``metrics.jsonl``, ``curves.png``,
    checkpoints every ``trainer.save_freq`` steps, resumed per ``trainer.resume``). ``out_dir`` receives the
    model with ``sft_config.yaml``, ``metrics.jsonl`` and ``curves.png`` beside it, written beside ``out_dir``
    and renamed into place once whole. Returns the last step's metrics.

    A vision-language model trains on image rows too (``processor``: its ``VisionProcessor``; None loads it
    from ``model.path`` when a row has images); its tower stays frozen unless ``model.freeze_vision_tower`` is
    false, and the saved directory holds the whole model and the image processor.
    """
    start_job(cfg)
    check_sft_config(cfg)  # before anything is written
    # The built-in tasks keep their images in "images" whatever data.image_key names in files.
    image_key = cfg.data.image_key if rows is None and cfg.data.train_files else "images"
    rows = rows if rows is not None else load_split_rows(cfg.data, "train", cfg.trainer.seed)
    run_dir = ensure_writable_dir(cfg.trainer.run_dir(), RUN_DIR)
    with lock_run_dir(run_dir):  # before anything is written there; until the model is in out_dir
        save_config(cfg, run_dir / "config.yaml")
        components, data = build_sft_components(cfg, rows, model, tokenizer, processor, image_key)
        try:
            trainer = SFTTrainer(cfg, components, data)
            # About ten console lines, each with the pace (the warm-up of the demos is hundreds of short steps).
            every = nice_every(trainer.total_steps)
            history = fit_tracked(trainer, run_dir, plot_every=0, console_every=every)
            _save_sft_model(trainer, run_dir, out_dir)
        finally:
            components.close()
    return history[-1] if history else dict(trainer.saved_metrics.get(trainer.global_step, {}))


def _save_sft_model(trainer: SFTTrainer, run_dir: Path, out_dir: Path) -> None:
    """The trained model into ``out_dir`` with the run's config, metrics and curves beside it, written into a
    staging directory that rank 0 renames into place once whole (every rank gathers the weights).

    A user error on any rank (a full disk) stops every rank together; a full disk names ``out_dir`` and where
    the trained weights still are (the run's last checkpoint, if any)."""
    cfg, group = trainer.cfg, trainer.c.groups[0]
    driver = env_rank() == 0
    staging = staged_dir(out_dir, SFT_MODEL) if driver else contextlib.nullcontext(staging_path(out_dir))
    error: UserError | None = None
    try:
        with staging as staged:
            group.run_all("save_hf_model", str(staged), False)  # into the staging directory as it is
            if driver:
                save_config(cfg, staged / "sft_config.yaml")
                for name in (METRICS_FILE, PLOT_FILE):
                    if (run_dir / name).is_file():
                        shutil.copyfile(run_dir / name, staged / name)
    except DiskFullError as exc:
        where = _trained_weights(run_dir, trainer.global_step, cfg.trainer.save_freq)
        error = DiskFullError(f"{disk_full_error(out_dir, None, SFT_MODEL)}; {where}")
        error.__cause__ = exc
    except UserError as exc:
        error = exc
    except OSError as exc:  # out_dir's place unwritable (its permissions, a read-only filesystem)
        error = path_error(exc, SFT_MODEL)
        error.__cause__ = exc
    group.raise_together(error)  # none waits for a rank that stopped


SFT_MODEL = "the SFT model"


def run_names(cfg: Config) -> dict[str, Any]:
    """What the experiment trackers (wandb) file a run under: project, experiment and the whole config."""
    t = cfg.trainer
    return {
        "project_name": t.project_name,
        "experiment_name": t.experiment_name,
        "config": dataclasses.asdict(cfg),
    }


def fit_tracked(trainer: TrainingLoop, run_dir: Path, **tracker_options: Any) -> list[dict[str, float]]:
    """Resume per ``trainer.resume``, then train with a ``Tracker`` writing ``run_dir``'s metrics (a resumed
    run's file kept up to its step); an out-of-memory error is one line naming the phase, on every rank."""
    cfg = trainer.cfg
    start = trainer.resume()
    with Tracker(
        run_dir,
        trainer.total_steps,
        loggers=cfg.trainer.logger,
        resume_step=start if start > 0 else None,
        saved_records=trainer.saved_metrics,
        **run_names(cfg),
        **tracker_options,
    ) as tracker:
        trainer.tracker = tracker
        with out_of_memory_errors(cfg):
            return trainer.fit()


def run_loop(
    trainer: TrainingLoop, run_dir: Path, close: bool, log_summary: bool = True
) -> list[dict[str, float]]:
    """Resume, train with the tracker, save ``final_model``; ``close`` stops the workers afterwards.

    ``summary.md`` is written at the end; ``log_summary=False`` leaves its table out of the log (a demo logs it
    after its own results, ``summary.log_summary``)."""
    cfg, components = trainer.cfg, trainer.c
    history = fit_tracked(trainer, run_dir)
    try:
        components.groups[0].run_all("save_hf_model", str(run_dir / "final_model"))
    except DiskFullError as exc:  # say where the trained weights still are, if anywhere
        raise DiskFullError(
            f"{exc}; {_trained_weights(run_dir, trainer.global_step, cfg.trainer.save_freq)}"
        ) from exc
    if close:
        components.close()
    if env_rank() == 0:  # under torchrun every rank runs the driver; one summary is enough
        write_summary(run_dir, log=log_summary)
    return history


def _trained_weights(run_dir: Path, step: int, save_freq: int) -> str:
    """Where a run's trained weights are when ``final_model`` could not be written: its last checkpoint."""
    ckpt = step_dir(run_dir, step)
    if is_complete(ckpt):
        return (
            f"the checkpoint {ckpt} holds the trained weights: hybridflow export {ckpt} --out DIR writes them"
        )
    return f"the trained weights are not kept elsewhere: no checkpoint holds step {step} (trainer.save_freq={save_freq})"


RUN_DIR = "the run directory (trainer.default_local_dir)"


def rl_job(
    cfg: Config, components: Components | None = None, reward_fn: Any = None, log_summary: bool = True
) -> list[dict[str, float]]:
    """PPO-family training as configured; writes config.yaml, metrics.jsonl, curves.png and summary.md to the
    run dir (``log_summary``: its table in the log too)."""
    start_job(cfg)
    run_dir = ensure_writable_dir(cfg.trainer.run_dir(), RUN_DIR)
    with lock_run_dir(run_dir):  # before anything is written there; until the run's last file
        save_config(cfg, run_dir / "config.yaml")
        owned = components is None  # close only what this job built: a caller may go on using its components
        components = components or build_components(cfg, reward_fn=reward_fn)
        drivers = {"colocate": ColocatePPOTrainer, "separate": SeparatePPOTrainer}
        trainer = drivers.get(cfg.trainer.async_mode, PPOTrainer)(cfg, components)
        history = run_loop(trainer, run_dir, close=owned, log_summary=log_summary)
    logger.info("saved the trained policy to %s", run_dir / "final_model")
    return history


def load_components_from(path: Path, cfg: Config, reward_fn: Any = None) -> Components:
    """Components with the policy loaded from a saved model directory."""
    model = load_causal_lm(str(path))
    tokenizer = load_tokenizer(str(path))
    return build_components(cfg, model, tokenizer, reward_fn=reward_fn)


def eval_job(cfg: Config, out: Path, checkpoint_dir: Path | None = None) -> dict[str, float]:
    """Validation only, with the policy of ``checkpoint_dir`` (else ``model.path``); generations to ``out``."""
    start_job(cfg, single_process="eval")
    if checkpoint_dir is not None:
        model = load_role_model(checkpoint_dir, "actor")
        tokenizer = load_tokenizer(str(checkpoint_dir / "actor" / HF_CONFIG))
    else:
        model, tokenizer = load_policy(cfg)
    components = build_eval_components(cfg, model, tokenizer)
    records: list[dict[str, Any]] = []
    metrics = validate(cfg, components, prefix="val-core", records=records)
    components.scorer.close()
    write_jsonl(records, out)
    logger.debug("wrote %d generations to %s", len(records), out)  # the eval command says where (once)
    return metrics


def preference_config(cfg: Config) -> Config:
    """The run's config with what offline preference training needs: a reference, no critic, temperature 1."""
    cfg = copy.deepcopy(cfg)
    cfg.ref.enable, cfg.critic.enable = True, False
    cfg.rollout.temperature = 1.0  # log-probs of the data under the model itself, not a sampling temperature
    return cfg


def preference_job(
    cfg: Config,
    kind: str,
    components: Components | None = None,
    rows: list[dict] | None = None,
    log_summary: bool = True,
) -> list[dict[str, float]]:
    """DPO/IPO (``kind="dpo"``) or KTO (``kind="kto"``) as configured, in the run directory like RL runs."""
    cfg = preference_config(cfg)
    start_job(cfg)
    run_dir = ensure_writable_dir(cfg.trainer.run_dir(), RUN_DIR)
    with lock_run_dir(run_dir):  # one run per directory (``utils.dirlock``)
        save_config(cfg, run_dir / "config.yaml")
        owned = components is None
        components = components or build_preference_components(cfg, kind, rows=rows)
        history = run_loop(
            PreferenceTrainer(cfg, components, kind), run_dir, close=owned, log_summary=log_summary
        )
    return history
