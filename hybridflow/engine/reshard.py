"""The hybrid engine's generation layout at data-parallel size > 1: a rollout replica refreshed from shards.

With FSDP2 over W ranks each rank holds 1/W of every parameter. The rollout engine needs whole weights, so
each rank keeps one replica of the policy in the rollout dtype (tensor-parallel size 1: W replicas, each
generating for its own share of the prompts). Before every generation the replica is refreshed in place,
one parameter at a time: all-gather the shards, copy into the replica's tensor, drop the gathered copy. So
at most one gathered parameter exists beside the replica, and the replica's tensors keep their addresses
(CUDA graphs captured on them stay valid). Between generations ``release()`` frees the replica's memory
(the worker does so with ``rollout.free_cache_engine``), so the update does not hold a whole bf16 copy of
the policy beside its shards; the next ``sync()`` allocates it again, under the same tensors, so the rollout
runner's bindings stay valid. At world size 1 none of this is needed: the rollout engine reads the training
module's own parameters.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _full(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of an FSDP2 parameter (a collective on every rank), or the tensor itself."""
    if not hasattr(param, "full_tensor"):
        return param
    if param.device != device:
        # NCCL gathers only device tensors and an offloaded shard (fsdp.param_offload) is on the host:
        # bring this one shard over, so the sync never holds more than one parameter's shard beside the replica.
        param = param.to(device, non_blocking=True)  # a DMA when the shard is pinned (offload pins it)
    return param.full_tensor()


class RolloutReplica:
    """A full copy of the policy in the rollout dtype, refreshed from the sharded training module."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, world: int) -> None:
        """``model`` is the unsharded policy (copied before FSDP2 shards it)."""
        self.module = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.params = dict(self.module.named_parameters())
        self._released: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes) freed by release()
        logger.info(
            "HybridEngine initialized: train_view=(fsdp=%d), generate_view=(tp=1, dp=%d), replica in %s",
            world,
            world,
            dtype,
        )

    def release(self) -> int:
        """Free the replica's parameter memory until the next ``sync()``; returns the bytes freed.

        Only the storage goes: every tensor (and every view or alias of it, such as the rollout runner's
        bindings or a q/k/v group the runner joined into one buffer) stays a valid object, and ``sync()``
        re-allocates the same storage objects, so nothing has to be bound again.
        """
        freed = 0
        for p in self.module.parameters():
            storage = p.untyped_storage()
            if storage.nbytes() == 0:  # tied, a view of a storage freed just now, or released already
                continue
            self._released.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    @torch.no_grad()
    def sync(self, sharded: nn.Module) -> None:
        """Refresh every replica tensor from ``sharded`` (the FSDP2 module of the same architecture)."""
        for storage, nbytes in self._released:  # released after the last generation: allocate again
            storage.resize_(nbytes)
        self._released = []
        copied = set()
        for name, param in sharded.named_parameters():
            target = self.params.get(name)
            assert target is not None, f"{name} has no replica tensor"
            target.copy_(_full(param.detach(), target.device))
            copied.add(name)
        # every replica tensor was written (a re-allocated one would otherwise hold garbage)
        assert copied == set(self.params), f"replica tensors not refreshed: {set(self.params) - copied}"
