"""Exact-size host homes for tensors that leave the GPU between phases (parameter shards, optimizer moments).

A ``non_blocking`` device-to-host copy takes its pinned destination from torch's caching host allocator,
which rounds every block up to a power of two and keeps it: the 0.5B actor's shards and moments pinned
10.4 GiB for 5.5 GiB on the H200 (``benchmarks/RESULTS.md``, tenth and eleventh sessions), and the first
two offloads of a run spent ~8 s growing that pool. A ``HostStore`` instead allocates one flat host buffer
of the tensors' exact size, pins it once with ``cudaHostRegister`` (as torch's own checkpoint stager does),
and every offload copies into the same place.
"""

from __future__ import annotations

import logging
import weakref

import torch

from hybridflow.engine.ops.tensors import local_shard

logger = logging.getLogger(__name__)

_ALIGN = 256  # bytes: each home starts on a DMA-friendly boundary (and any dtype's element size divides it)


def _pin(flat: torch.Tensor) -> bool:
    """Page-lock ``flat`` for DMA copies; False (with a warning) when the driver refuses."""
    code = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0))
    if code != 0:
        logger.warning(
            "could not pin %.2f GiB of host memory for offload (cudaHostRegister error %d); offloading "
            "through pageable memory, which is slower. Free host memory or set fsdp.pin_memory=false",
            flat.numel() / 2**30,
            code,
        )
    return code == 0


def _unpin(flat: torch.Tensor) -> None:
    """Undo ``_pin`` before ``flat``'s memory goes back to the host allocator."""
    torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


def host_home(like: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A host tensor of ``like``'s kind whose data is ``view``: for a DTensor, the same spec over ``view``.

    The wrapper comes from ``empty_like`` (its own local shard is never touched, so never faulted in) and
    then takes ``view`` as its local tensor, the way torch's state-dict utilities build CPU DTensors.
    """
    if not hasattr(like, "to_local"):
        return view
    home = torch.empty_like(like, device="cpu")
    home._local_tensor = view
    return home


class HostStore:
    """Host copies of a fixed list of tensors in one exact-size buffer, pinned once when ``pin`` (and CUDA)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.flat: torch.Tensor | None = None  # (bytes,) uint8
        self.homes: list[torch.Tensor] = []
        self._layout: list[tuple[torch.Size, torch.dtype]] = []
        self._unpin: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes the store holds (0 before the first ``stash``)."""
        return 0 if self.flat is None else self.flat.numel()

    @torch.no_grad()
    def stash(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``tensors`` (on the device) into their host homes; returns the homes, in order.

        Pinned homes are filled by DMA without waiting: the caller synchronises before reading them. A new
        list of shapes or dtypes (another optimizer state) re-allocates the buffer.
        """
        locals_ = [local_shard(t) for t in tensors]
        layout = [(t.shape, t.dtype) for t in locals_]
        if layout != self._layout:
            self._allocate(tensors, layout)
        for home, src in zip(self.homes, locals_):
            local_shard(home).copy_(src, non_blocking=self.pin)
        return list(self.homes)

    def _allocate(self, tensors: list[torch.Tensor], layout: list[tuple[torch.Size, torch.dtype]]) -> None:
        """One buffer for ``layout``, each tensor's home a view of it at an aligned offset."""
        self.release()
        sizes = [shape.numel() * dtype.itemsize for shape, dtype in layout]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        flat = torch.empty(total, dtype=torch.uint8)
        if self.pin and total > 0 and torch.cuda.is_available() and _pin(flat):
            self._unpin = weakref.finalize(self, _unpin, flat)
            self._unpin.atexit = False  # at exit the process's pages go back with it
        else:
            self.pin = False
        views = [
            flat[o : o + size].view(dtype).view(shape)
            for o, size, (shape, dtype) in zip(offsets, sizes, layout)
        ]
        self.homes = [host_home(t, v) for t, v in zip(tensors, views)]
        self.flat, self._layout = flat, layout
        logger.debug("host store: %.2f GiB for %d tensors (pinned: %s)", total / 2**30, len(views), self.pin)

    def release(self) -> None:
        """Free the buffer (unpinning it first); the next ``stash`` allocates again."""
        if self._unpin is not None:
            self._unpin()  # runs once; drops its reference to the buffer
            self._unpin = None
        self.flat, self.homes, self._layout = None, [], []
