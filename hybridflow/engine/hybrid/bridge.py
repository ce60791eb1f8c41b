"""A process group across two worlds: the channel from a trainer pool into a separate rollout pool.

Under Ray each worker group has a ``torch.distributed`` world of its own (its training meshes and rollout
groups use the default group everywhere). The weight stream of ``trainer.async_mode=separate`` needs the
ranks of both pools in one group, so each rank also joins a ``Bridge``: a gloo (CPU) or NCCL (CUDA)
backend over a TCP store that the rollout pool's first rank hosts, numbered trainer pool first. The bridge is
not registered with ``torch.distributed`` (a process has one world), so its collectives are called on the
backend itself; ``Link`` gives the reshard code one interface over a registered group and a bridge.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Link:
    """The collectives the reshard plan runs, over a registered process group (None: the default one)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def rank(self) -> int:
        """This rank's number in the group."""
        return dist.get_rank(self.group)

    def size(self) -> int:
        """The group's size."""
        return dist.get_world_size(self.group)

    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ):
        """``all_to_all_single`` with explicit splits (flat tensors)."""
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        out: list[Any] = [None] * self.size()
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """``t`` becomes the elementwise maximum over the ranks, in place."""
        if self.size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)


class Bridge(Link):
    """A group of ``size`` ranks spanning worker groups with worlds of their own (see the module doc).

    Every member constructs it with the same ``address`` (host, port: the store's, hosted by rank 0 of the
    bridge) and its own ``rank``; the construction returns when all have joined (or ``timeout_s`` passes).
    """

    def __init__(
        self, address: tuple[str, int], rank: int, size: int, device: torch.device, timeout_s: float
    ):
        super().__init__(None)
        timeout = timedelta(seconds=timeout_s)
        host, port = address
        self.store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("hybridflow-bridge", self.store)
        self.device = device
        if device.type == "cuda":
            self.backend: Any = dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
        else:
            self.backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        self._rank, self._size = rank, size

    def rank(self) -> int:
        """This rank's number in the bridge (the trainer pool's ranks first)."""
        return self._rank

    def size(self) -> int:
        """Both pools' ranks."""
        return self._size

    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ):
        """``all_to_all_single`` on the backend: the same semantics as over a registered group."""
        self.backend.alltoall_base(recv, send, recv_splits, send_splits, dist.AllToAllOptions()).wait()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``: pickled, sizes gathered, the padded bytes gathered."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)  # (n,)
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self._size)]
        self.backend.allgather([sizes], [torch.tensor([data.numel()], device=self.device)]).wait()
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self._size)]
        self.backend.allgather([parts], [padded]).wait()
        return [pickle.loads(p[: int(s.item())].cpu().numpy().tobytes()) for p, s in zip(parts, sizes)]

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """``t`` becomes the elementwise maximum over both pools' ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.backend.allreduce([t], opts).wait()

    def close(self) -> None:
        """Drop the backend and the store (the pools' processes end with the run)."""
        self.backend = None
        self.store = None


def as_link(group: dist.ProcessGroup | Link | None) -> Link:
    """A ``Link`` for a registered group (None: the default one), or the bridge itself."""
    return group if isinstance(group, Link) else Link(group)
