"""Tensors as this rank holds them: its part of a (DTensor) parameter, and memory freed and allocated in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind ``t``, detached: a DTensor's local shard, or ``t`` itself (same storage)."""
    # The DTensor's own attribute: ``to_local()`` dispatches through autograd, ~16 us a call on an H200 host,
    # which over the ~300 weights of a rollout refresh was most of the switch (benchmarks/RESULTS.md).
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach()


class Storages:
    """The memory behind some tensors, freed and allocated again in place.

    Only the storage goes: every tensor (and every view or alias of it, such as the rollout runner's bindings
    or a q/k/v group joined into one buffer) stays a valid object, and ``restore()`` re-allocates the same
    storage objects, so nothing has to be bound again. Contents are undefined until written.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._released: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes) freed by release()

    def release(self) -> int:
        """Free the tensors' memory until ``restore()``; returns the bytes freed."""
        freed = 0
        for t in self._tensors:
            storage = t.untyped_storage()  # looked up now: a tensor may have been re-laid out since
            if storage.nbytes() == 0:  # shared with one freed just now (tied), or released already
                continue
            self._released.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    def restore(self) -> None:
        """Allocate again what ``release()`` freed."""
        for storage, nbytes in self._released:
            storage.resize_(nbytes)
        self._released = []

    def released_bytes(self) -> int:
        """Bytes ``restore()`` will allocate."""
        return sum(nbytes for _, nbytes in self._released)
