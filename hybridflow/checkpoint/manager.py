"""Saving and loading whole checkpoints: sharded roles, trainer state, per-rank RNG, metadata, atomically.

Layout of ``{run_dir}/global_step_{N}/``::

    meta.json              step, world size and layout, each role's parameter shapes, the model each role
                           started from (``identity.py``), and the size and SHA-256 of every other file
                           (written last; verified before any load)
    trainer_state.pt       plain Python state from the driver: data sampler, KL controller, schedulers, ...
    rng/rank_{r}.pt        each rank's generator states
    {role}/model_optim/    the role's model and optimizer shards (torch.distributed.checkpoint)
    {role}/hf_config/      config, generation config and tokenizer: what export needs to rebuild the model

All ranks call ``save`` and ``load`` together; rank 0 writes the shared files and commits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api as dcp_api
from torch import nn

from hybridflow.checkpoint import integrity, rundir
from hybridflow.checkpoint.identity import check_adapters
from hybridflow.checkpoint.rng import capture_rng, restore_rng
from hybridflow.checkpoint.sharded import (
    CheckpointError,
    check_shapes,
    load_sharded,
    parameter_shapes,
    save_sharded,
)
from hybridflow.utils.dist import raise_together
from hybridflow.utils.errors import UserError, disk_full_error, is_disk_full, looks_like_full_disk, path_error
from hybridflow.utils.faults import kill_point
from hybridflow.utils.storage import fsync_tree

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
    lora: dict[str, Any] | None = (
        None  # the adapters (rank, alpha, dropout, target_modules); only they are saved
    )


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is damaged") from e


def required_files(meta: Mapping[str, Any]) -> list[str]:
    """The files every checkpoint has: the trainer state and each role's DCP metadata."""
    roles = meta.get("roles") or {}
    return [TRAINER_STATE, *(f"{name}/{SHARDS}/.metadata" for name in sorted(roles))]


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of a checkpoint whose files all match their saved checksums; else ``CheckpointError``."""
    meta = read_meta(path)
    if not isinstance(meta, dict) or not isinstance(meta.get("roles", {}), dict):
        raise CheckpointError(
            f"{Path(path) / rundir.META_FILE} is not a checkpoint's metadata; it is damaged"
        )
    integrity.verify(path, meta, required_files(meta))
    return meta


def _saved_bytes(run_dir: str | os.PathLike) -> int | None:
    """The size of the newest complete checkpoint: about what the next save needs."""
    complete = rundir.complete_checkpoints(run_dir)
    if not complete:
        return None
    return sum(p.stat().st_size for p in complete[-1][1].rglob("*") if p.is_file())


def _state_bytes(roles: Mapping[str, RoleState]) -> int:
    """Parameter bytes of the roles (three times that with an optimizer: AdamW's two moments)."""
    total = 0
    for role in roles.values():
        size = sum(p.numel() * p.element_size() for p in role.module.parameters())
        total += size * (3 if role.optimizer is not None else 1)
    return total


@contextlib.contextmanager
def disk_full_guard(
    run_dir: str | os.PathLike, tmp: Path, needed: int | None = None, remove: bool = True
) -> Iterator[None]:
    """Turn a full disk during a save into ``DiskFullError`` (path, bytes needed); the partial save is removed.

    The previous checkpoints are untouched: nothing is renamed or pruned before the save is complete.
    ``remove=False`` leaves the partial save to the caller (other ranks may still be writing into it).
    """
    try:
        yield
    except (Exception, dcp_api.CheckpointException) as exc:  # DCP's exception is a BaseException
        if not looks_like_full_disk(exc):
            raise
        needed = _saved_bytes(run_dir) or needed
        if remove:
            shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full_error(
            run_dir, needed, f"the checkpoint {tmp.name.strip('.').removesuffix('.tmp')}"
        ) from exc


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
    error = None
    # Before any write can fail on one rank: a pipeline stage's shapes are a collective over its stages.
    shapes = {name: parameter_shapes(role.module) for name, role in roles.items()}
    try:
        for name, role in roles.items():
            # DCP fails on every rank at once; the partial save is removed once all ranks stopped writing
            with disk_full_guard(tmp.parent, tmp, _state_bytes(roles), remove=False):
                with_optim = save_sharded(tmp / name / SHARDS, role.module, role.optimizer)
            role_meta[name] = {
                "optimizer": with_optim,
                "prefix": role.prefix,
                "shapes": shapes[name],
                **({"lora": role.lora} if role.lora is not None else {}),
            }
        with disk_full_guard(tmp.parent, tmp, remove=False):
            torch.save(capture_rng(), tmp / "rng" / f"{group}_rank_{rank}.pt")
    except UserError as exc:  # this rank's own write failed: the others must not wait for it
        error = exc
    try:
        raise_together(error)  # the barrier
    except UserError:
        # Every rank removes it (the removals tolerate each other): under Ray the driver may stop the
        # other ranks as soon as the first one reports, so only the reporting rank surely gets this far.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return role_meta


def finish(
    run_dir: str | os.PathLike,
    step: int,
    tmp: Path,
    role_meta: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    layout: Mapping[str, Any],
    keep: int | None = None,
    models: Mapping[str, Any] | None = None,
) -> Path:
    """Write the trainer state and ``meta.json`` (last, with every file's checksum), fsync, commit, prune.

    Every file and folder is fsynced before the rename that commits, so a committed checkpoint survives a
    power loss; the rename and the marker are fsynced by ``rundir.commit``. ``models``: which model each
    role started from (``identity.model_identity``), checked when a run resumes.
    """
    kill_point("save_shards", step)
    with disk_full_guard(run_dir, tmp):
        torch.save(dict(trainer_state), tmp / TRAINER_STATE)
        _test_delay(step)
        meta = {
            "format": FORMAT_VERSION,
            "global_step": step,
            "world_size": int(layout.get("world_size", 1)),
            "layout": dict(layout),
            "roles": dict(role_meta),
            **({"models": dict(models)} if models is not None else {}),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            integrity.FILES_KEY: integrity.build_manifest(tmp, skip=rundir.META_FILE),
        }
        (tmp / rundir.META_FILE).write_text(json.dumps(meta, indent=1))
        fsync_tree(tmp)
    kill_point("save_commit", step)
    final = rundir.step_dir(run_dir, step)
    rundir.commit(tmp, final)
    kill_point("save_committed", step)
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
    with user_errors_together():
        if rank == 0:
            begin(run_dir, step)
    role_meta = write_roles(tmp, roles)
    with user_errors_together():
        if rank == 0:
            if write_extras is not None:
                write_extras(tmp)
            finish(run_dir, step, tmp, role_meta, trainer_state, {"world_size": world, **layout}, keep)
    return rundir.step_dir(run_dir, step)


@contextlib.contextmanager
def user_errors_together(
    what: str = "the checkpoint", together: Callable[[BaseException | None], None] = raise_together
) -> Iterator[None]:
    """Run the block on every rank, then ``together`` (a barrier that raises any rank's user error).

    A full disk, or an ``OSError`` of a path, while writing ``what`` inside the block is a user error;
    ``together`` raises it on every rank, so a rank that stopped leaves none waiting for it.
    """
    error = None
    try:
        yield
    except UserError as exc:
        error = exc
    except OSError as exc:
        if exc.filename is None and not is_disk_full(exc):
            raise
        error = path_error(exc, what)
        error.__cause__ = exc
    together(error)


def check_roles(path: str | os.PathLike, meta: Mapping[str, Any], roles: Mapping[str, RoleState]) -> None:
    """Refuse roles that the checkpoint lacks, whose LoRA settings differ (``identity.check_adapters``) or
    whose parameters differ from the saved ones."""
    for name, role in roles.items():
        if name not in meta["roles"]:
            raise CheckpointError(
                f"checkpoint {path} has no {name} (it holds {sorted(meta['roles'])}); the run that saved it "
                f"was configured differently"
            )
        check_adapters(Path(path), name, meta["roles"][name].get("lora"), role.lora)
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
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint is damaged; resume from an earlier one")
    try:
        return torch.load(file, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read ({e}); the checkpoint is damaged") from e


def load(path: str | os.PathLike, roles: Mapping[str, RoleState]) -> dict[str, Any]:
    """All ranks of one group: load a complete, verified checkpoint into the roles; returns the trainer state."""
    verify_checkpoint(path)
    read_roles(path, roles)
    return read_trainer_state(path)
