"""torch.distributed helpers: start a process group (gloo on CPU, NCCL on GPU) and small collectives."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.errors import DiskFullError, UserError
from hybridflow.utils.peers import record_peers

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on localhost that is free right now (for single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """NCCL when this process computes on CUDA, gloo otherwise."""
    return "nccl" if cuda_in_use() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join (or create) the default process group and return ``(rank, world_size)``.

    Reads the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` variables; without them it makes
    a one-rank group on localhost, so FSDP2 code runs unchanged in a single process.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count()
        )
    forget_meshes()  # a default group made again in this process: no cached spec may hold the last one's
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    record_peers()  # so that a rank whose peer dies can name it
    logger.info("process group: backend=%s rank=%d world=%d", backend, dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def forget_meshes() -> None:
    """Drop torch's DTensor sharding-propagation caches, whose results hold the device meshes they were made on.

    A cached op's output spec keeps the mesh of the first call that computed it, and meshes compare by their
    ranks and dimensions, not by their process groups. Within one default process group that is harmless (the
    same ranks, groups that still exist). But ``destroy_process_group`` ends every group, and a default group
    made again in the same process hands out the same group names anew, in the order of creation: a spec
    cached before then names a group that no longer exists, or another one (a grad-norm all-reduce over the
    wrong ranks). Call it whenever the default group is made again (``init_distributed`` does).
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without the public DTensor module: nothing of ours caches through it
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    clear = getattr(propagator.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if native is not None:
        native()


def world_size() -> int:
    """The default group's size, or 1 outside torch.distributed."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return x.clone()
    # NCCL only reduces CUDA tensors; gloo takes CPU ones. The result comes back on x's device.
    comm_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    y = x.to(comm_device, copy=True)
    dist.all_reduce(y, op=op, group=group)
    return y.to(x.device)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` (None: all ranks; a copy of ``x`` outside torch.distributed)."""
    return _all_reduce(x, dist.ReduceOp.SUM, group)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum of ``x`` over all ranks (a copy of ``x`` outside torch.distributed)."""
    return _all_reduce(x, dist.ReduceOp.MAX)


def raise_together(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """A collective in place of a barrier: when any rank brings a user error, every rank raises it.

    A rank that hits a full disk (or another ``UserError``) where the others go on would leave them waiting
    in the next collective until it breaks, an internal error with a traceback (exit 1). Called by every
    rank at the same point instead, each raises the first failing rank's message as a user error (exit 2).
    ``error`` is this rank's user error or None; outside torch.distributed it is simply raised.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, DiskFullError), str(error))
    gathered: list[tuple[bool, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, g) for r, g in enumerate(gathered) if g is not None]
    if failed:
        rank, (disk_full, message) = failed[0]
        logger.debug("rank %d raised a user error; this rank stops with it", rank)
        raise (DiskFullError if disk_full else UserError)(message)
