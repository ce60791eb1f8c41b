"""Parameters and optimizer state handed to the host between phases, and back (``fsdp.param_offload`` /
``optimizer_offload``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridflow.config.schema import FSDPConfig
from hybridflow.engine.ops.tensors import local_shard
from hybridflow.engine.parallel.fsdp import local_bytes, optimizer_state_bytes
from hybridflow.engine.train.host_store import HostStore

logger = logging.getLogger(__name__)


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
    local = local_shard(param)
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
