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


def begin(run_dir: str | os.PathLike, step: int) -> Path:
    """Make the empty temporary folder the checkpoint of ``step`` is written into (the driver calls it)."""
    rundir.remove_stale_temp(run_dir)
    tmp = rundir.temp_dir(run_dir, step)
    (tmp / "rng").mkdir(parents=True)
    return tmp


def write_roles(
    tmp: str | os.PathLike, roles: Mapping[str, RoleState], group: str = "main"
) -> dict[str, Any]:
    """Every rank of one worker group writes its roles' shards and its RNG; returns the roles' metadata.

    ``group`` names the worker group, so several groups (split placement) write their RNG side by side.
    """
    tmp = Path(tmp)
    rank, _ = _rank_world()
    role_meta = {}
    for name, role in roles.items():
        with_optim = save_sharded(tmp / name / SHARDS, role.module, role.optimizer)
        role_meta[name] = {
            "optimizer": with_optim,
            "prefix": role.prefix,
            "shapes": parameter_shapes(role.module),
        }
    torch.save(capture_rng(), tmp / "rng" / f"{group}_rank_{rank}.pt")
    _barrier()
    return role_meta


def finish(
    run_dir: str | os.PathLike,
    step: int,
    tmp: Path,
    role_meta: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    layout: Mapping[str, Any],
    keep: int | None = None,
) -> Path:
    """Write the trainer state and ``meta.json`` (last), move the folder into place, prune (the driver)."""
    torch.save(dict(trainer_state), tmp / TRAINER_STATE)
    _test_delay(step)
    meta = {
        "format": FORMAT_VERSION,
        "global_step": step,
        "world_size": int(layout.get("world_size", 1)),
        "layout": dict(layout),
        "roles": dict(role_meta),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (tmp / rundir.META_FILE).write_text(json.dumps(meta, indent=1))
    final = rundir.step_dir(run_dir, step)
    rundir.commit(tmp, final)
    rundir.prune(run_dir, keep)
    return final


def save(
    run_dir: str | os.PathLike,
    step: int,
    roles: Mapping[str, RoleState],
    trainer_state: Mapping[str, Any],
    layout: Mapping[str, Any],
    write_extras: Callable[[Path], None] | None = None,
    keep: int | None = None,
) -> Path:
    """All ranks of one group: write the checkpoint of ``step`` atomically, keep the newest ``keep``."""
    rank, world = _rank_world()
    tmp = rundir.temp_dir(run_dir, step)
    if rank == 0:
        begin(run_dir, step)
    _barrier()
    role_meta = write_roles(tmp, roles)
    if rank == 0:
        if write_extras is not None:
            write_extras(tmp)
        finish(run_dir, step, tmp, role_meta, trainer_state, {"world_size": world, **layout}, keep)
    _barrier()
    return rundir.step_dir(run_dir, step)


def check_roles(path: str | os.PathLike, meta: Mapping[str, Any], roles: Mapping[str, RoleState]) -> None:
    """Refuse roles that the checkpoint lacks or whose parameters differ from the saved ones."""
    for name, role in roles.items():
        if name not in meta["roles"]:
            raise CheckpointError(
                f"checkpoint {path} has no {name} (it holds {sorted(meta['roles'])}); the run that saved it "
                f"was configured differently"
            )
        check_shapes(meta["roles"][name]["shapes"], parameter_shapes(role.module), f"the {name} in {path}")


def read_roles(path: str | os.PathLike, roles: Mapping[str, RoleState], group: str = "main") -> None:
    """Every rank of one worker group loads its roles (resharding as needed) and, same world size, its RNG."""
    path = Path(path)
    meta = read_meta(path)
    rank, world = _rank_world()
    check_roles(path, meta, roles)
    for name, role in roles.items():
        load_sharded(path / name / SHARDS, role.module, role.optimizer, meta["roles"][name]["optimizer"])
    rng_file = path / "rng" / f"{group}_rank_{rank}.pt"
    saved_world = meta["layout"].get("groups", {}).get(group, meta["world_size"])
    if saved_world == world and rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=False))
    elif rank == 0:
        logger.warning(
            "checkpoint saved with %d rank(s), loading into %d: weights and optimizer are resharded, the random "
            "generators start from the seed",
            saved_world,
            world,
        )


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """The driver's state saved with a checkpoint."""
    return torch.load(Path(path) / TRAINER_STATE, weights_only=False)


def load(path: str | os.PathLike, roles: Mapping[str, RoleState]) -> dict[str, Any]:
    """All ranks of one group: load a complete checkpoint into the roles; returns the trainer state."""
    read_roles(path, roles)
    return read_trainer_state(path)
