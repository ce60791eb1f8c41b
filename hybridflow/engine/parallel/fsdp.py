"""FSDP2 sharding of a wrapped model, parameter/optimizer offload between phases, and full state dicts."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from hybridflow.engine.ops.tensors import local_shard
from hybridflow.utils.dist import init_distributed

logger = logging.getLogger(__name__)


# A parameter carrying this attribute is sharded by FSDP2 on that dim instead of dim 0 (set by a layout
# function before sharding, e.g. ``engine.parallel.layout.follow_rollout_shards``).
FSDP_SHARD_DIM = "_hybridflow_fsdp_shard_dim"


def _marked_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's ``shard_placement_fn``: the dim a layout function marked, else FSDP2's default (dim 0)."""
    dim = getattr(param, FSDP_SHARD_DIM, None)
    return None if dim is None else Shard(dim)


def shard_model(
    root: nn.Module,
    layers: list[nn.Module],
    device: torch.device,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    mesh: DeviceMesh | None = None,
    experts: list[nn.Module] | None = None,
    experts_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer, then to the root, over ``mesh`` (None: all ranks of the
    default group; a training view passes its data-parallel mesh).

    ``experts``: modules sharded first, each on its own over ``experts_mesh`` (expert parallelism: the ranks
    holding the same experts); the layers around them then leave their parameters alone.

    Parameters are sharded on dim 0, or on the dim a layout function marked them with (``FSDP_SHARD_DIM``).

    Master weights stay in the dtype the module was created in (fp32 for training); ``param_dtype`` is the
    compute dtype FSDP2 casts to when it gathers a layer (bf16 on GPU), and gradients are reduced in
    ``reduce_dtype`` (fp32) so the sum over ranks does not lose precision.
    """
    init_distributed()
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root.to(device)
    place = _marked_placement
    for module in experts or []:
        fully_shard(module, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=place,
        )
    # The root (embeddings, final norm, LM head) is needed again at the start of backward: keep it gathered.
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)
    # FSDP2 picks its root lazily, at the first forward: a unit called on its own first (a VLM's vision tower,
    # which the rollout engine runs at prefill on the trainer's weights) would make itself a root and break
    # the real root's forward later. Initialise from the real root now.
    root._get_fsdp_state()._lazy_init()
    logger.info(
        "FSDP2: %d layers sharded over %d ranks, compute %s, reduce %s",
        len(layers),
        mesh.size(),
        param_dtype,
        reduce_dtype,
    )
    return root


def set_reshard_after_forward(module: nn.Module, reshard: bool) -> None:
    """Whether each FSDP2 layer of ``module`` frees its gathered parameters after its forward (the root,
    holding the embeddings and the head, stays gathered as ``shard_model`` made it)."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule) and sub is not module:
            sub.set_reshard_after_forward(reshard, recurse=False)


def set_accumulation(
    module: nn.Module, *, last: bool, defer_grad_sync: bool, keep_params_gathered: bool
) -> None:
    """Set up FSDP2 for the next backward of a gradient-accumulation loop (call before each backward).

    ``defer_grad_sync``: inner micro-batches accumulate unsharded gradients (in the fp32 reduce dtype) and
    skip the reduce-scatter; the last one reduces the sum once. ``keep_params_gathered``: inner
    micro-batches keep the gathered compute-dtype parameters after backward, so the next forward does not
    gather and cast them again (costs one unsharded copy of the parameters). The last micro-batch always
    syncs and reshards, which leaves FSDP2 in its default state for the optimizer step.
    """
    if not isinstance(module, FSDPModule):
        return
    module.set_requires_gradient_sync(last or not defer_grad_sync)
    module.set_reshard_after_backward(last or not keep_params_gathered)


def reshard_fsdp(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` in its sharded state, freeing the gathered compute-dtype params.

    A forward without backward (a log-prob or value pass) under ``reshard_after_forward=False`` leaves its
    modules gathered: FSDP2 keeps them for a backward that never comes, so a frozen reference would hold its
    weights twice until the process ends. Resharding also makes module attributes the persistent sharded
    params, which is what the rollout runner must bind (a gathered parameter's storage is freed later).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state that ``move_optimizer`` moves (the moments' local shards)."""
    return local_bytes(
        v
        for state in optimizer.state.values()
        for k, v in state.items()
        if torch.is_tensor(v) and k != "step"
    )


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's share of ``tensors`` (the local shard of a DTensor, or the tensor itself)."""
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def full_state_dict(
    model: nn.Module, pp_group: dist.ProcessGroup | None = None, optimizer: Any = None
) -> dict[str, torch.Tensor]:
    """The unsharded state dict on rank 0's host (a collective; for export, the baseline switch and tests).

    ``pp_group``: the ranks holding the other pipeline stages of this rank's model replica, when the model
    is one stage of a pipeline. Each stage gathers its own parameters, and rank 0 receives the others'.
    ``optimizer``: one that keeps float32 host masters (the CPU optimizer step) gives them in place of the
    compute-dtype device weights.
    """
    single_stage = pp_group is None or dist.get_world_size(pp_group) == 1
    if single_stage and hasattr(optimizer, "model_state"):
        return _full_masters(model, optimizer)
    if hasattr(optimizer, "model_state"):
        logger.warning(
            "an export of pipeline stages holds the device weights (the CPU step's masters rounded)"
        )
    if single_stage:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # cpu_offload gathers onto global rank 0 only, which holds no other stage: each stage gathers in place.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().cpu() for k, v in state.items()}
    first = dist.get_global_rank(pp_group, 0)
    stages: list | None = [None] * dist.get_world_size(pp_group) if dist.get_rank() == first else None
    dist.gather_object(state, stages, dst=first, group=pp_group)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in stages:
        merged.update(part)  # a tied head's weight comes from two stages: the same values
    return merged


def _full_masters(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The unsharded state with the host masters for the trained weights, on rank 0's host: one tensor at a
    time through the mesh's device (a collective), so the device never holds more than one full tensor."""
    state = optimizer.model_state(get_model_state_dict(model))  # sharded; masters are host DTensors
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if isinstance(t, DTensor) and t.device_mesh.size() == 1:
            t = t.to_local()  # the whole tensor already: the master itself, no host copy (7B: 30 GB saved)
        elif isinstance(t, DTensor):
            mesh = t.device_mesh
            device = (
                torch.device(mesh.device_type, torch.cuda.current_device())
                if mesh.device_type == "cuda"
                else None
            )
            local = t.to_local() if device is None else t.to_local().to(device)
            t = DTensor.from_local(local, mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()
        if dist.get_rank() == 0:
            out[name] = t.detach().cpu()
    return out


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient 2-norm across all shards and ranks, clipping in place when ``max_norm`` > 0."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
