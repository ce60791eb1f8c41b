"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own FSDP2 shards; DCP's metadata records the global shape of every tensor, so the same
folder loads into any world size (2 ranks save, 1 loads, and the reverse): each rank reads the slices its
current sharding owns. The state dicts are keyed by parameter names (no FSDP prefixes), the optimizer's too.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hybridflow.models.vision_tower import is_vision_param
from hybridflow.utils.errors import UserError
from hybridflow.utils.optim_state import zero_state

logger = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint that cannot be used here: missing, incomplete, damaged, or from a different model."""


# What torch.distributed.checkpoint raises on a damaged folder: its own exception (per-rank failures), and
# from the readers underneath, truncated or garbled files and pickles.
_DCP_FAILURES = (dcp.api.CheckpointException, RuntimeError, OSError, EOFError, pickle.UnpicklingError)


# DCP's notice at every one-process load (``no_dist=True`` or not): export and eval read whole tensors in one
# process on purpose, so it would only be noise on their console
_ONE_PROCESS_NOTICE = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"
)


def _dcp_load(state: dict[str, Any], path: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.load`` with a damaged folder reported as ``CheckpointError`` naming it."""
    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"{Path(path) / '.metadata'} is missing: the checkpoint is damaged")
    try:
        with warnings.catch_warnings():
            if kwargs.get("no_dist"):  # DCP warns even when a one-process load is asked for: not news
                warnings.filterwarnings("ignore", message=_ONE_PROCESS_NOTICE, category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), **kwargs)
    except CheckpointError:
        raise
    except _DCP_FAILURES as e:
        raise CheckpointError(
            f"the shards in {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}); the "
            "checkpoint is damaged: resume from or export an earlier one"
        ) from e


def _global_shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)  # a DTensor's .shape is already the global (unsharded) shape


def parameter_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Every parameter's name and global shape: the fingerprint a checkpoint is checked against.

    Those of the whole model: a pipeline stage (a module with a ``stage_group``, see
    ``engine.parallel.pipeline``) holds only its own layers, so its stages' shapes are joined (a collective
    over that group)."""
    shapes = {name: _global_shape(p) for name, p in module.named_parameters()}
    group = getattr(module, "stage_group", None)
    if group is None:
        return shapes
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, shapes, group=group)
    return {name: shape for stage in stages for name, shape in stage.items()}


def check_shapes(saved: dict[str, list[int]], current: dict[str, list[int]], what: str) -> None:
    """Raise ``CheckpointError`` naming the differences when the checkpoint's parameters do not fit."""
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    differ = sorted(n for n in set(saved) & set(current) if list(saved[n]) != list(current[n]))
    if not (missing or extra or differ):
        return
    lines = []
    if differ:
        lines.append(
            f"{len(differ)} parameter shape(s) differ, e.g. "
            + "; ".join(f"{n}: checkpoint {tuple(saved[n])} vs model {tuple(current[n])}" for n in differ[:3])
        )
    if missing:
        lines.append(
            f"{len(missing)} parameter(s) of the model are not in the checkpoint, e.g. {missing[:3]}"
        )
    if extra:
        lines.append(f"{len(extra)} parameter(s) of the checkpoint are not in the model, e.g. {extra[:3]}")
    raise CheckpointError(f"{what} does not match this model: " + "; ".join(lines))


def _model_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The module's sharded state dict without its frozen parameters (a LoRA base: the run's model.path holds
    them, and the checkpoint records which one, ``identity``), but with a frozen vision tower's (a VLM's
    checkpoint exports and resumes whole, whatever model.path holds later); under the CPU optimizer step, its
    trained weights are the float32 host masters (``HostAdamW.model_state``), so every checkpoint holds
    float32 weights whatever the run kept on the device."""
    state = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=True))
    tower = [name for name, p in module.named_parameters() if not p.requires_grad and is_vision_param(name)]
    if tower:  # shards of the live parameters: no copies
        every = get_model_state_dict(module)
        state.update({name: every[name] for name in tower})
    return optimizer.model_state(state) if hasattr(optimizer, "model_state") else state


def _set_weights(module: nn.Module, optimizer: torch.optim.Optimizer | None, model: dict[str, Any]) -> None:
    """Load the read weights into ``module``; host masters were read in place and are cast into their device
    weights by the optimizer (no host-to-device DTensor copies through the state-dict API)."""
    masters = getattr(optimizer, "masters", None)
    if not masters:
        every = all(p.requires_grad for p in module.parameters())  # else the frozen base is not in the state
        set_model_state_dict(module, model, options=StateDictOptions(strict=every))
        return
    optimizer.masters_to_weights()
    held = {id(m) for m in masters.values()}
    rest = {name: t for name, t in model.items() if id(t) not in held}  # frozen weights, buffers
    set_model_state_dict(module, rest, options=StateDictOptions(strict=False))


def save_sharded(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Write ``module``'s (and ``optimizer``'s) sharded state under ``path``; all ranks call it together.

    An optimizer without state has nothing to save (and asking DCP for its state dict would initialise it
    with a step, changing the run); returns whether optimizer state was written. The engines allocate
    AdamW's state when they build it, so a trained role's state (zero moments at step 0 before its first
    update) is written from the start.
    """
    state: dict[str, Any] = {"model": _model_state(module, optimizer)}
    with_optim = optimizer is not None and bool(optimizer.state)
    if with_optim:
        state["optim"] = get_optimizer_state_dict(module, optimizer)
    dcp.save(state, checkpoint_id=str(path))
    return with_optim


def load_sharded(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    with_optim: bool,
) -> None:
    """Read the state ``save_sharded`` wrote into ``module`` (and ``optimizer``), resharding as needed."""
    if not Path(path).is_dir():
        raise CheckpointError(f"{path} is missing from the checkpoint")
    state: dict[str, Any] = {"model": _model_state(module, optimizer)}
    if optimizer is not None and with_optim:
        state["optim"] = get_optimizer_state_dict(module, optimizer)
    _dcp_load(state, path)  # fails naming the folder when a requested tensor is not in it
    _set_weights(module, optimizer, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(module, optimizer, state["optim"])
    elif optimizer is not None and optimizer.state:
        zero_state(optimizer)  # the saved run had not stepped this optimizer yet: neither have we


def load_full_state(path: str | os.PathLike, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read the full (unsharded) model tensors of a DCP folder into ``template``'s tensors, in one process."""
    state = {"model": template}
    _dcp_load(state, path, no_dist=True)
    return state["model"]
