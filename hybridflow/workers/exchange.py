"""Every rank's result of a call on every process, when every process runs the driver (torchrun, SPMD).

A call on the replicas' shares returns one whole result per replica, from its source rank; every other rank
returns only its result's meta (``RankWorker.call_share``). Each process runs the driver and needs them all.
Each rank describes its result in a small header (a Batch's field names, shapes and dtypes, its non-tensor
fields and meta; any other result, e.g. metrics, whole), pickled; the tensors travel as raw bytes, never
pickled. When every rank sends tensors (dp = W) header and tensors go in one buffer through one all-gather;
otherwise the headers are all-gathered and each sender's tensors follow in one broadcast, so each replica's
rows travel once. Either way an all-gather of the byte counts goes first.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.protocol import Batch

ALIGN = 16  # bytes: each tensor starts at a multiple of this in a packed buffer, so it views as any dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Header:
    """What a rank's result looks like: a Batch's layout and small fields, or a result that is not a Batch."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] | None  # a Batch's tensors; None: not a Batch
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]
    other: Any = None  # the result itself when it is not a Batch

    def offsets(self) -> list[tuple[int, int]]:
        """(start, bytes) of each tensor in the packed tensor bytes."""
        out, start = [], 0
        for _, dtype, shape in self.specs or []:
            size = int(np.prod(shape)) * dtype.itemsize
            out.append((start, size))
            start += _aligned(size)
        return out

    @property
    def nbytes(self) -> int:
        """The packed tensors' length in bytes (0: no tensor to send)."""
        spans = self.offsets()
        return spans[-1][0] + spans[-1][1] if spans else 0

    def rebuild(self, data: torch.Tensor | None) -> Any:
        """The result this header describes, its tensors read from the packed bytes ``data``."""
        if self.specs is None:
            return self.other
        tensors = {}
        for (key, dtype, shape), (start, size) in zip(self.specs, self.offsets()):
            if data is None:  # nothing was sent: every tensor is empty
                tensors[key] = torch.empty(shape, dtype=dtype)
            else:
                tensors[key] = data[start : start + size].cpu().view(dtype).view(shape)
        return Batch(tensors, self.non_tensors, self.meta)


def _header(result: Any) -> Header:
    if not isinstance(result, Batch):
        return Header(None, {}, {}, result)
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in result.tensors.items()]
    return Header(specs, result.non_tensors, result.meta)


def _comm_device() -> torch.device:
    """Where a collective's tensors must be: the GPU under NCCL, the host under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(blob: bytes, result: Any, header: Header, tensors_at: int, length: int) -> torch.Tensor:
    """A buffer of ``length`` bytes: the pickled header ``blob`` first, the result's tensors from ``tensors_at``."""
    buf = torch.zeros(length, dtype=torch.uint8)  # (length,)
    if blob:
        buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    for (key, _, _), (start, size) in zip(header.specs or [], header.offsets()):
        data = result.tensors[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # (size,)
        buf[tensors_at + start : tensors_at + start + size] = data
    return buf.to(_comm_device())


def _all_gather(buf: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(out, buf)
    return out


def share_results(result: Any) -> list[Any]:
    """Every rank's ``result`` (in rank order) on every rank; all ranks of the default group call it together."""
    rank, device = dist.get_rank(), _comm_device()
    header = _header(result)
    blob = pickle.dumps(header)
    counts = torch.tensor([len(blob), header.nbytes], dtype=torch.int64, device=device)
    table = [tuple(t.tolist()) for t in _all_gather(counts)]  # (header bytes, tensor bytes) per rank
    top = max(_aligned(h) for h, _ in table)
    if all(n > 0 for _, n in table):  # every rank sends tensors: one buffer each, one all-gather
        bufs = _all_gather(_pack(blob, result, header, top, top + max(n for _, n in table)))
        headers = [pickle.loads(b[:h].cpu().numpy().tobytes()) for b, (h, _) in zip(bufs, table)]
        data = [b[top:] for b in bufs]
    else:  # the headers to all, then each sender's tensors from it alone
        bufs = _all_gather(_pack(blob, None, Header([], {}, {}), 0, top))
        headers = [pickle.loads(b[:h].cpu().numpy().tobytes()) for b, (h, _) in zip(bufs, table)]
        data = []
        for src, (_, n) in enumerate(table):
            if n == 0:
                data.append(None)
                continue
            mine = src == rank
            buf = (
                _pack(b"", result, header, 0, n) if mine else torch.empty(n, dtype=torch.uint8, device=device)
            )
            dist.broadcast(buf, src=src)
            data.append(buf)
    return [result if src == rank else h.rebuild(data[src]) for src, h in enumerate(headers)]
