"""Every rank's result of a call on every process, when every process runs the driver (torchrun, SPMD).

A call on the replicas' shares returns one whole result per replica, from its source rank; every other rank
returns only its result's meta (``RankWorker.call_share``). Each process runs the driver and needs them all.
The small parts travel in one all-gather of headers (each Batch's field names, shapes and dtypes, its non-tensor
fields and meta; any other result, e.g. metrics, whole); the tensors then travel as tensors: one broadcast per
source rank and dtype of a flat buffer, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.protocol import Batch


@dataclass
class Header:
    """What a rank's result looks like: a Batch's layout and small fields, or a result that is not a Batch."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] | None  # a Batch's tensors; None: not a Batch
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]
    other: Any = None  # the result itself when it is not a Batch


def _header(result: Any) -> Header:
    if not isinstance(result, Batch):
        return Header(None, {}, {}, result)
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in result.tensors.items()]
    return Header(specs, result.non_tensors, result.meta)


def _comm_device() -> torch.device:
    """Where a collective's tensors must be: the GPU under NCCL, the host under gloo."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def _by_dtype(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[torch.dtype, list[int]]:
    """The indices of the specs per dtype, in field order (each dtype travels as one flat buffer)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(specs):
        groups.setdefault(dtype, []).append(i)
    return groups


def _broadcast_tensors(result: Batch | None, header: Header, src: int) -> dict[str, torch.Tensor]:
    """Send (``result``: rank ``src``'s Batch, on ``src``) or receive (None, elsewhere) its tensors; the
    received ones, on the host."""
    device, specs = _comm_device(), header.specs or []
    out: dict[str, torch.Tensor] = {}
    for dtype, index in _by_dtype(specs).items():
        wire = torch.uint8 if dtype == torch.bool else dtype  # collectives take no bool buffers everywhere
        sizes = [int(np.prod(specs[i][2])) for i in index]
        if result is not None:
            parts = [result.tensors[specs[i][0]].reshape(-1).to(device, wire) for i in index]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()  # (sum of sizes,)
        else:
            flat = torch.empty(sum(sizes), dtype=wire, device=device)  # (sum of sizes,)
        dist.broadcast(flat, src=src)
        if result is not None:
            continue
        for i, part in zip(index, flat.split(sizes)):
            key, _, shape = specs[i]
            out[key] = part.view(shape).to("cpu", dtype)
    return out


def share_results(result: Any) -> list[Any]:
    """Every rank's ``result`` (in rank order) on every rank; all ranks of the default group call it together."""
    headers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(headers, _header(result))
    rank = dist.get_rank()
    out: list[Any] = []
    for src, header in enumerate(headers):
        if header.specs is None:
            out.append(result if src == rank else header.other)
        elif not header.specs:  # a Batch without tensors (a result's meta): nothing more to send
            out.append(result if src == rank else Batch(non_tensors=header.non_tensors, meta=header.meta))
        elif src == rank:
            _broadcast_tensors(result, header, src)
            out.append(result)
        else:
            out.append(Batch(_broadcast_tensors(None, header, src), header.non_tensors, header.meta))
    return out
