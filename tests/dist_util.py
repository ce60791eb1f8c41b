"""Run a function on N real processes joined by a gloo process group (for multi-rank CPU tests)."""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hybridflow.utils.dist import free_port


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
        # Plain pickle copies tensors into the message; torch's shared-memory handles would die with us.
        queue.put((rank, "ok", pickle.dumps(result)))
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world`` spawned processes; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    for _ in range(world):
        rank, status, payload = queue.get()
        if status == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    for p in procs:
        p.join(timeout)
    return [results[r] for r in range(world)]
