"""Saving and loading whole checkpoints: sharded roles, trainer state, per-rank RNG, metadata, atomically.

Layout of ``{run_dir}/global_step_{N}/``::

    meta.json              step, world size and layout, each role's parameter shapes (written last)
    trainer_state.pt       plain Python state from the driver: data sampler, KL controller, schedulers, ...
    rng/rank_{r}.pt        each rank's generator states
    {role}/model_optim/    the role's model and optimizer shards (torch.distributed.checkpoint)
    {role}/hf_config/      config, generation config and tokenizer: what export needs to rebuild the model

All ranks call ``save`` and ``load`` together; rank 0 writes the shared files and commits.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.checkpoint import rundir
from hybridflow.checkpoint.rng import capture_rng, restore_rng
from hybridflow.checkpoint.sharded import (
    CheckpointError,
    check_shapes,
    load_sharded,
    parameter_shapes,
    save_sharded,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TRAINER_STATE = "trainer_state.pt"
SHARDS = "model_optim"
HF_CONFIG = "hf_config"
# For tests only: "STEP:SECONDS" pauses the save of STEP after its shards are written and before meta.json,
# so that a test can kill the process in the middle of a save.
DELAY_ENV = "HYBRIDFLOW_TEST_SAVE_DELAY"


@dataclass
class RoleState:
    """One trainable role as the checkpoint sees it: the sharded module and its optimizer."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    prefix: str = ""  # where the Hugging Face model sits inside ``module`` ("lm." in the actor's wrapper)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _test_delay(step: int) -> None:
    spec = os.environ.get(DELAY_ENV)
    if spec and int(spec.split(":")[0]) == step:
        logger.warning("%s=%s: pausing the save of step %d (tests only)", DELAY_ENV, spec, step)
        time.sleep(float(spec.split(":")[1]))


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; a clear error when the folder is not a complete checkpoint."""
    meta_path = Path(path) / rundir.META_FILE
    if not Path(path).is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {rundir.META_FILE}): it is not a global_step_N folder, or "
            "its save was interrupted; point to a complete global_step_N folder"
        )
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is damaged") from e


def save(
    run_dir: str | os.PathLike,
    step: int,
    roles: Mapping[str, RoleState],
    trainer_state: Mapping[str, Any],
    layout: Mapping[str, Any],
    write_extras: Callable[[Path], None] | None = None,
    keep: int | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the newest ``keep``; returns its folder."""
    rank, world = _rank_world()
    tmp, final = rundir.temp_dir(run_dir, step), rundir.step_dir(run_dir, step)
    if rank == 0:
        rundir.remove_stale_temp(run_dir)
        tmp.mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    role_meta = {}
    for name, role in roles.items():
        with_optim = save_sharded(tmp / name / SHARDS, role.module, role.optimizer)
        role_meta[name] = {
            "optimizer": with_optim,
            "prefix": role.prefix,
            "shapes": parameter_shapes(role.module),
        }
    torch.save(capture_rng(), tmp / "rng" / f"rank_{rank}.pt")
    _barrier()
    if rank == 0:
        torch.save(dict(trainer_state), tmp / TRAINER_STATE)
        if write_extras is not None:
            write_extras(tmp)
        _test_delay(step)
        meta = {
            "format": FORMAT_VERSION,
            "global_step": step,
            "world_size": world,
            "layout": dict(layout),
            "roles": role_meta,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (tmp / rundir.META_FILE).write_text(json.dumps(meta, indent=1))
        rundir.commit(tmp, final)
        rundir.prune(run_dir, keep)
    _barrier()
    return final


def load(path: str | os.PathLike, roles: Mapping[str, RoleState]) -> dict[str, Any]:
    """Load a complete checkpoint into the given roles; returns the trainer state saved with it.

    The roles' parameters must match the checkpoint's names and shapes (any world size). Each rank's RNG
    comes back when the world size is the one saved; otherwise the generators keep their seeded state.
    """
    path = Path(path)
    meta = read_meta(path)
    rank, world = _rank_world()
    for name, role in roles.items():
        if name not in meta["roles"]:
            raise CheckpointError(
                f"checkpoint {path} has no {name} (it holds {sorted(meta['roles'])}); the run that saved it "
                f"was configured differently"
            )
        check_shapes(meta["roles"][name]["shapes"], parameter_shapes(role.module), f"the {name} in {path}")
    for name, role in roles.items():
        load_sharded(path / name / SHARDS, role.module, role.optimizer, meta["roles"][name]["optimizer"])
    rng_file = path / "rng" / f"rank_{rank}.pt"
    if meta["world_size"] == world and rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=False))
    elif rank == 0:
        logger.warning(
            "checkpoint saved with %d rank(s), loading into %d: weights and optimizer are resharded, the random "
            "generators start from the seed",
            meta["world_size"],
            world,
        )
    return torch.load(path / TRAINER_STATE, weights_only=False)
