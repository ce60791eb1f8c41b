"""FSDP2 sharding of a wrapped model, parameter/optimizer offload between phases, and full state dicts."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from hybridflow.config.schema import FSDPConfig
from hybridflow.engine.host_store import HostStore, local_tensor
from hybridflow.models.loader import resolve_dtype
from hybridflow.utils.dist import init_distributed

logger = logging.getLogger(__name__)


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name from the config ('bfloat16', 'bf16', 'float32', ...) to a torch dtype."""
    return resolve_dtype(name)


# A parameter carrying this attribute is sharded by FSDP2 on that dim instead of dim 0 (set by a layout
# function before sharding, e.g. ``engine.parallel.tp_rollout.follow_rollout_shards``).
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
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer, then to the root, over ``mesh`` (None: all ranks of the
    default group; a training view passes its data-parallel mesh).

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
    logger.info(
        "FSDP2: %d layers sharded over %d ranks, compute %s, reduce %s",
        len(layers),
        mesh.size(),
        param_dtype,
        reduce_dtype,
    )
    return root


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


def move_model(
    model: nn.Module, device: torch.device | str, pin: bool = True, store: HostStore | None = None
) -> None:
    """Move the (sharded) parameters and gradients of ``model`` to ``device`` in place.

    With ``pin`` the host copies are pinned and both directions are DMA copies (see ``_host_sync``): on an
    H200 the 0.5B actor's float32 shards and AdamW moments (5.9 GB) went out in ~0.15 s and back in ~0.11 s,
    against ~0.97 s and ~0.38 s through pageable memory (``benchmarks/RESULTS.md``, tenth session). With
    ``store``, moves to the host copy each shard into its exact-size home there, except shards that FSDP2
    keeps padded (a dimension 0 that the ranks do not divide evenly): FSDP2 re-pads those into memory of its
    own whatever they are given, so they take fresh host memory as without a store.
    """
    if store is None or torch.device(device).type != "cpu":
        model.to(device, non_blocking=pin)
    else:
        params = [p for p in model.parameters() if not _padded(p)]
        homes = {id(p): home for p, home in zip(params, store.stash(params))}

        def to_host(t: torch.Tensor) -> torch.Tensor:
            home = homes.get(id(t))
            return home if home is not None else t.to(device, non_blocking=pin)

        model._apply(to_host)  # what Module.to does, with the homes as the moved tensors (FSDP2 re-registers)
    _host_sync(device)


def _padded(param: torch.Tensor) -> bool:
    """Whether FSDP2 holds this shard inside a larger, padded buffer (an uneven split over the ranks)."""
    local = local_tensor(param)
    return local.untyped_storage().nbytes() > local.numel() * local.element_size()


def move_optimizer(
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    pin: bool = True,
    store: HostStore | None = None,
) -> None:
    """Move every optimizer state tensor (Adam moments) to ``device`` in place (host copies pinned with ``pin``).

    With ``store``, moves to the host copy into its exact-size buffer (pinned or not as the store is)
    instead of taking fresh host memory each time.
    """
    entries = [
        (state, key)
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    ]
    if store is not None and torch.device(device).type == "cpu":
        homes = store.stash([state[key] for state, key in entries])
        for (state, key), home in zip(entries, homes):
            state[key] = home
    else:
        for state, key in entries:
            state[key] = state[key].to(device, non_blocking=pin)
    _host_sync(device)


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
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def pinned_pool_fits(pinned_bytes: int, ranks: int, available: int | None, share: float = 0.8) -> bool:
    """Whether pinning ``pinned_bytes`` on each of ``ranks`` processes fits in ``share`` of ``available``.

    Pinned pages cannot be swapped out, so a pool that outgrows the host fails the allocation or starves
    the rest of the job. Unknown ``available``: fits.
    """
    return available is None or pinned_bytes * ranks <= share * available


def pinned_param_bytes(module: nn.Module) -> int:
    """Host memory offloading ``module``'s shards may pin: their bytes, twice for padded shards.

    Shards go to a ``HostStore`` of their exact size, except padded ones (``move_model``), which take
    torch's pinned pool: its caching host allocator rounds each block up to a power of two.
    """
    return sum(local_bytes([p]) * (2 if _padded(p) else 1) for p in module.parameters())


def choose_pinning(
    fsdp: FSDPConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ranks: int,
    available: int | None,
) -> bool:
    """``fsdp.pin_memory``, unless the worst-case pinned pool of ``ranks`` like this one would not fit the host.

    ``available``: the host's available memory in bytes (None: unknown, assume room).
    """
    moves = fsdp.param_offload or fsdp.optimizer_offload  # "auto" moves the moments too
    if not (fsdp.pin_memory and moves):
        return fsdp.pin_memory
    pinned = pinned_param_bytes(module) if fsdp.param_offload else 0
    if fsdp.optimizer_offload and optimizer is not None:
        pinned += optimizer_state_bytes(optimizer)  # a HostStore of their exact size
    if pinned_pool_fits(pinned, ranks, available):
        return True
    logger.warning(
        "fsdp.pin_memory: offloading on each of %d ranks of this host could pin up to %.1f GiB, more than "
        "80%% of the %.1f GiB available; offloading through pageable memory instead, which is slower. Free "
        "host memory, or set fsdp.pin_memory=false to choose this yourself",
        ranks,
        pinned * ranks / 2**30,
        available / 2**30,
    )
    return False


def _host_sync(device: torch.device | str) -> None:
    """Wait for device-to-host copies issued with ``non_blocking=True``, so the host tensors hold their values.

    Such a copy into pinned memory (a ``HostStore``'s, or what torch's caching host allocator hands out)
    returns before the DMA is done. Host-to-device copies need no wait: the stream orders them before the
    kernels that read them and before the next offload's copies into the same homes, and a pinned block of
    torch's freed meanwhile is not reused until its copy completes.
    """
    if torch.device(device).type == "cpu" and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def full_state_dict(model: nn.Module, pp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state dict on rank 0's host (a collective; for export, the baseline switch and tests).

    ``pp_group``: the ranks holding the other pipeline stages of this rank's model replica, when the model
    is one stage of a pipeline. Each stage gathers its own parameters, and rank 0 receives the others'.
    """
    if pp_group is None or dist.get_world_size(pp_group) == 1:
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


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient 2-norm across all shards and ranks, clipping in place when ``max_norm`` > 0."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
