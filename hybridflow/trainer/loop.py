"""The training loop every driver shares: resume, steps, validation, checkpoints and logging."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.trainer.checkpointing import load_checkpoint, resume_target, run_models, save_checkpoint
from hybridflow.trainer.dumps import write_jsonl
from hybridflow.trainer.tracking import Tracker
from hybridflow.trainer.validation import validate
from hybridflow.utils.errors import UserError
from hybridflow.utils.faults import kill_point
from hybridflow.utils.logging import rank as env_rank
from hybridflow.utils.progress import Progress

logger = logging.getLogger(__name__)


class TrainingLoop:
    """Base of the drivers: subclasses set ``sampler``, ``kl_ctrl``, ``total_steps`` and define ``step``."""

    def __init__(self, cfg: Config, components: Any, tracker: Tracker | None = None) -> None:
        self.cfg = cfg
        self.c = components  # tokenizer, role handles, datasets, scorer, worker groups
        self.tracker = tracker
        self.total_steps = components.total_steps
        self.global_step = 0
        self.rank = env_rank()
        self.kl_ctrl: Any = None  # the checkpoint saves it when a driver has one
        self.saved_metrics: dict[int, dict[str, float]] = {}  # the resumed checkpoint's step record
        self.model_identity: dict[str, Any] | None = None  # the models the run started from (checkpointing)

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics."""
        raise NotImplementedError

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names (if any); returns the step the run continues from."""
        run_models(self)  # at the start, while model.path is surely there: every checkpoint records it
        path = resume_target(self.cfg)
        if path is not None:
            load_checkpoint(self, path)
        return self.global_step

    def fit(self) -> list[dict[str, float]]:
        """Train from the current step to ``total_steps``, validating and saving as configured."""
        history = []
        t = self.cfg.trainer
        if t.val_only:
            return [self._validate_only()]
        if self.global_step >= self.total_steps:
            logger.warning(
                "the run is already complete at step %d of %d; nothing to train (start a fresh run with "
                "trainer.resume=disable or a new trainer.experiment_name)",
                self.global_step,
                self.total_steps,
            )
        elif t.val_before_train and self.c.val is not None and self.global_step == 0:
            self._log(0, self.validate())
        while self.global_step < self.total_steps:
            self.global_step += 1
            kill_point("step_start", self.global_step)
            metrics = self.step()
            last = self.global_step == self.total_steps
            if self.c.val is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                start = time.perf_counter()
                metrics.update(self.validate())
                metrics["timing_s/testing"] = time.perf_counter() - start  # verl's name
            if (last and t.save_freq != 0) or (t.save_freq > 0 and self.global_step % t.save_freq == 0):
                with Progress(f"save global_step_{self.global_step}") as bar:
                    save_checkpoint(self, metrics)
                metrics["timing_s/save_checkpoint"] = bar.close()  # closed already: its duration
            self._log(self.global_step, metrics)
            kill_point("metrics_written", self.global_step)
            history.append(metrics)
        return history

    def _validate_only(self) -> dict[str, float]:
        """``trainer.val_only``: validate the current policy (after any resume), log it, train nothing."""
        if self.c.val is None:
            raise UserError(
                "trainer.val_only=true but there is no validation set; set data.val_files (or, for the "
                "built-in task, data.task_val_size > 0)"
            )
        metrics = self.validate()
        self._log(self.global_step, metrics)
        return metrics

    def validate(self) -> dict[str, float]:
        """Validation metrics; the generations go to ``trainer.validation_data_dir/{step}.jsonl`` if set.

        ``trainer.log_val_generations`` > 0 also writes that many of them to the log (rank 0).
        """
        t = self.cfg.trainer
        records: list[dict[str, Any]] | None = [] if t.validation_data_dir or t.log_val_generations else None
        metrics = validate(self.cfg, self.c, prefix="val-core", records=records)
        if records is not None and self.rank == 0:
            if t.validation_data_dir:
                write_jsonl(records, Path(t.validation_data_dir) / f"{self.global_step}.jsonl")
            for i, r in enumerate(records[: t.log_val_generations]):
                logger.info(
                    "validation sample %d at step %d (score %s): %r -> %r",
                    i,
                    self.global_step,
                    r.get("score"),
                    r.get("prompt"),
                    r.get("response"),
                )
        return metrics

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.tracker is not None:
            self.tracker.log(step, metrics)
