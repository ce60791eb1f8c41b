"""Run directories of the Python APIs: a new one per run, resumed only when the user asks.

A run of ``RLTrainer(...).train()`` (or a step-wise ``Trainer``) writes to:

* the directory the user names: ``output_dir=`` (TRL's keyword), ``trainer.default_local_dir`` or
  ``trainer.experiment_name`` (``runs/{project_name}/{experiment_name}``). A directory holding a checkpoint
  is resumed from it, as ``hybridflow train`` does (the user pointed at it);
* otherwise a new one, ``runs/{project_name}/{model directory's name}-{YYYYmmdd-HHMMSS}``, so that running
  the cell again, or with another model, never picks up an earlier run's weights.

``resume_from_checkpoint`` (TRL's argument) asks for a resume: ``True`` continues the latest checkpoint of the
named directory, or else of the newest run of the same model under ``runs/{project_name}/``, in its
directory; a path (a ``global_step_N`` folder or a run directory) resumes from there into the run's own
directory; ``False`` starts afresh even in a named directory (``trainer.resume=disable``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hybridflow.checkpoint import complete_checkpoints
from hybridflow.config import Config
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

NAMED_BY = ("trainer.default_local_dir", "trainer.experiment_name")
RESUME_KEYS = ("trainer.resume", "trainer.resume_mode", "trainer.resume_from_path")
Resume = bool | str | os.PathLike | None


def model_label(model_path: str) -> str:
    """The model directory's name, as a file name (``/models/Qwen2.5-0.5B/`` -> ``Qwen2.5-0.5B``)."""
    name = Path(str(model_path).rstrip("/\\")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _pattern(label: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(label)}-\d{{8}}-\d{{6}}(-\d+)?$")


def new_run_name(root: Path, label: str, now: float | None = None) -> str:
    """``{label}-{YYYYmmdd-HHMMSS}``, with ``-2``, ``-3``... when a run of that second exists already."""
    base = f"{label}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    name, k = base, 1
    while (root / name).exists():
        k += 1
        name = f"{base}-{k}"
    return name


def _model_of(run: Path) -> str | None:
    """The ``model.path`` a run trained (its config.yaml), resolved; None when unreadable."""
    try:
        saved = yaml.safe_load((run / "config.yaml").read_text())
        return str(Path(saved["model"]["path"]).expanduser().resolve())
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def latest_run(root: Path, model_path: str) -> Path | None:
    """The newest run directory of the model at ``model_path`` under ``root`` holding a complete checkpoint.

    Runs are told apart by the model they trained (config.yaml's ``model.path``), not only by the name: two
    models in directories of the same name have runs of the same prefix.
    """
    if not root.is_dir():
        return None
    pattern = _pattern(model_label(model_path))
    model = str(Path(model_path).expanduser().resolve())
    runs = [p for p in root.iterdir() if p.is_dir() and pattern.match(p.name) and _model_of(p) == model]
    stamp = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")

    def order(p: Path) -> tuple[str, int]:
        m = stamp.search(p.name)
        return (m.group(1), int(m.group(2) or 1)) if m else ("", 0)

    for run in sorted(runs, key=order, reverse=True):
        if complete_checkpoints(run):
            return run
    return None


def run_dir_settings(cfg: Config, is_set: Callable[[str], bool], resume: Resume) -> dict[str, Any]:
    """The config values (by path) that give this run its directory and resume behaviour (see the module docstring).

    ``cfg`` is the config as the user set it; ``is_set(path)`` says whether the user set a key (keyword,
    override or config file).
    """
    t = cfg.trainer
    named = any(is_set(key) for key in NAMED_BY)
    asked = [key for key in RESUME_KEYS if is_set(key)]
    if resume is not None and asked:
        raise UserError(f"resume_from_checkpoint={resume!r} and {asked[0]} are both set; drop one of the two")
    if resume is not None and not isinstance(resume, (bool, str, os.PathLike)):
        raise UserError(
            f"resume_from_checkpoint={resume!r}: give True (the latest checkpoint), False (a fresh start) or "
            "the path of a checkpoint or run directory"
        )
    out: dict[str, Any] = {}
    root = Path("runs") / t.project_name
    label = model_label(cfg.model.path)
    if named:
        if resume is True and not complete_checkpoints(t.run_dir()):
            raise UserError(
                f"resume_from_checkpoint=True: the run directory {t.run_dir()} holds no complete checkpoint; "
                "drop resume_from_checkpoint to start there afresh, or name a checkpoint to resume from"
            )
    elif resume is True:
        run = latest_run(root, cfg.model.path)
        if run is None:
            raise UserError(
                f"resume_from_checkpoint=True: no run of {label} under {root}/ holds a checkpoint; name the "
                "run (output_dir=) or the checkpoint (resume_from_checkpoint=PATH), or drop it to start afresh"
            )
        out["trainer.experiment_name"] = run.name
    else:
        out["trainer.experiment_name"] = new_run_name(root, label)
    if resume is True:
        out["trainer.resume"] = "auto"
    elif resume is False:
        out["trainer.resume"] = "disable"
    elif resume is not None:
        target = Path(resume).expanduser()
        if not target.exists():
            raise UserError(f"resume_from_checkpoint={str(resume)!r}: no such checkpoint or run directory")
        out["trainer.resume"] = str(target)
    return out
