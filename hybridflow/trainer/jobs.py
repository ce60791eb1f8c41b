"""Whole runs: SFT to a model directory, PPO-family RL from one, and the built-in demo that chains them."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hybridflow.checkpoint import load_role_model
from hybridflow.checkpoint.export import save_hf_model as write_hf_model
from hybridflow.checkpoint.manager import HF_CONFIG
from hybridflow.checkpoint.rundir import is_complete, step_dir
from hybridflow.config import Config, check_start, save_config
from hybridflow.data import load_split_rows
from hybridflow.data.rl_dataset import has_images
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.vision import is_vision_language
from hybridflow.models.vision_tower import check_vision_training, load_vision_processor
from hybridflow.trainer.async_ppo import ColocatePPOTrainer
from hybridflow.trainer.async_separate import SeparatePPOTrainer
from hybridflow.trainer.builder import (
    Components,
    build_components,
    build_eval_components,
    build_preference_components,
    eos_ids_of,
    load_policy,
)
from hybridflow.trainer.dumps import write_jsonl
from hybridflow.trainer.loop import TrainingLoop
from hybridflow.trainer.oom import out_of_memory_errors
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.preference import PreferenceTrainer
from hybridflow.trainer.sft import TEXT_MODEL_FIX, encode_pairs, run_sft
from hybridflow.trainer.summary import write_summary
from hybridflow.trainer.tracking import Tracker
from hybridflow.trainer.validation import validate
from hybridflow.utils.device import cap_gpu_memory, cuda_in_use, use_device_type
from hybridflow.utils.dirlock import lock_run_dir
from hybridflow.utils.errors import DiskFullError
from hybridflow.utils.host import check_one_process
from hybridflow.utils.logging import rank as env_rank
from hybridflow.utils.progress import nice_every
from hybridflow.utils.seed import set_seed
from hybridflow.utils.storage import ensure_writable_dir, staged_dir
from hybridflow.utils.threads import configure_cpu_threads, passive_wait_env
from hybridflow.workers.actor import ActorWorker

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
    set_seed(cfg.trainer.seed)


def save_hf_model(actor: ActorWorker, tokenizer: Any, base: torch.nn.Module | None, staged: Path) -> Path:
    """Write the actor's current weights as a Hugging Face model (with the tokenizer) into ``staged``, a
    staging directory of the caller's (``staged_dir``), which renames it into place.

    ``base`` is a module of the same architecture to receive the weights; None builds one from the config.
    """
    state = actor.hf_state()  # adapters merged
    return write_hf_model(
        state, actor.hf_model.config, tokenizer, staged, prefix="lm.", base=base, staged=False
    )


def sft_job(
    cfg: Config,
    out_dir: Path,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    rows: list[dict] | None = None,
    processor: Any = None,
) -> dict[str, float]:
    """Supervised fine-tuning of ``model.path`` (or the given model) on the train rows; saves to ``out_dir``.

    A vision-language model trains on image rows too (``processor``: its ``VisionProcessor``; None loads it
    from ``model.path`` when a row has images); its tower stays frozen unless ``model.freeze_vision_tower`` is
    false, and the saved directory holds the whole model and the image processor.
    """
    start_job(cfg, single_process="sft")
    if model is None:
        model, tokenizer = load_policy(cfg)
    check_vision_training(cfg, model.config, "sft")
    base = copy.deepcopy(model)  # a clean module to receive the trained weights for saving
    # The built-in tasks keep their images in "images" whatever data.image_key names in files.
    image_key = cfg.data.image_key if rows is None and cfg.data.train_files else "images"
    rows = rows if rows is not None else load_split_rows(cfg.data, "train", cfg.trainer.seed)
    processor = processor or _sft_processor(cfg, model, tokenizer, rows, image_key)
    end = eos_ids_of(model, tokenizer)[-1]  # the chat end token for chat models (last of the stop ids)
    fix = VLM_PROCESSOR_FIX if is_vision_language(model.config) else TEXT_MODEL_FIX
    prompts, responses, masks, images = encode_pairs(tokenizer, rows, end, processor, fix, image_key)
    steps = (
        cfg.trainer.total_training_steps
        or max(1, len(rows) // cfg.data.train_batch_size) * cfg.trainer.total_epochs
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor = ActorWorker(model, cfg, steps, pad)  # applies model.freeze_vision_tower
    # everything goes beside out_dir, renamed into place at the end (a full disk: one line, out_dir as it was)
    with staged_dir(out_dir, "the SFT model") as staged:
        # About ten console lines, each with the pace (the warm-up of the demos is hundreds of short steps).
        every = nice_every(steps)
        tracker = Tracker(
            staged, steps, loggers=cfg.trainer.logger, plot_every=0, console_every=every, **run_names(cfg)
        )
        with out_of_memory_errors(cfg, "actor", "update_sft"):  # SFT calls its actor directly
            history = run_sft(
                actor,
                prompts,
                responses,
                steps,
                cfg.data.train_batch_size,
                pad,
                cfg.trainer.seed,
                on_step=tracker.log,
                masks=masks,
                images=images,
            )
        tracker.close()
        save_hf_model(actor, tokenizer, base, staged)
        if processor is not None:  # a VLM's image processor beside it: the directory loads as a whole VLM
            processor.image_processor.save_pretrained(staged)
        save_config(cfg, staged / "sft_config.yaml")
    return history[-1]


VLM_PROCESSOR_FIX = (
    "pass the model's processor (sft_job(..., processor=...)), or save its image processor "
    "(preprocessor_config.json) in model.path"
)


def _sft_processor(
    cfg: Config, model: torch.nn.Module, tokenizer: Any, rows: list[dict], image_key: str
) -> Any:
    """A VLM's processor from ``model.path`` when some row has images (None otherwise: text rows need none)."""
    if not is_vision_language(model.config) or not any(has_images(r, image_key=image_key) for r in rows):
        return None
    return load_vision_processor(cfg.model.path, tokenizer, model.config)


def run_names(cfg: Config) -> dict[str, Any]:
    """What the experiment trackers (wandb) file a run under: project, experiment and the whole config."""
    t = cfg.trainer
    return {
        "project_name": t.project_name,
        "experiment_name": t.experiment_name,
        "config": dataclasses.asdict(cfg),
    }


def run_loop(
    trainer: TrainingLoop, run_dir: Path, close: bool, log_summary: bool = True
) -> list[dict[str, float]]:
    """Resume, train with the tracker, save ``final_model``; ``close`` stops the workers afterwards.

    ``summary.md`` is written at the end; ``log_summary=False`` leaves its table out of the log (a demo logs it
    after its own results, ``summary.log_summary``)."""
    cfg, components = trainer.cfg, trainer.c
    start = trainer.resume()
    with Tracker(
        run_dir,
        components.total_steps,
        loggers=cfg.trainer.logger,
        resume_step=start if start > 0 else None,
        saved_records=trainer.saved_metrics,
        **run_names(cfg),
    ) as tracker:
        trainer.tracker = tracker
        with out_of_memory_errors(cfg):  # one line naming the phase, on every rank
            history = trainer.fit()
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


def rl_job(
    cfg: Config, components: Components | None = None, reward_fn: Any = None, log_summary: bool = True
) -> list[dict[str, float]]:
    """PPO-family training as configured; writes config.yaml, metrics.jsonl, curves.png and summary.md to the
    run dir (``log_summary``: its table in the log too)."""
    start_job(cfg)
    run_dir = ensure_writable_dir(cfg.trainer.run_dir(), "the run directory (trainer.default_local_dir)")
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
    run_dir = ensure_writable_dir(cfg.trainer.run_dir(), "the run directory (trainer.default_local_dir)")
    with lock_run_dir(run_dir):  # one run per directory (``utils.dirlock``)
        save_config(cfg, run_dir / "config.yaml")
        owned = components is None
        components = components or build_preference_components(cfg, kind, rows=rows)
        history = run_loop(
            PreferenceTrainer(cfg, components, kind), run_dir, close=owned, log_summary=log_summary
        )
    return history
