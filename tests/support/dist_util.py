"""Run a function on N real processes joined by a gloo process group (for multi-rank CPU tests).

``run_world`` spawns fresh processes for each call. ``run_world_kept`` runs the call on ``world`` processes
kept for the whole test session (one set per world size): a process start (an interpreter importing torch,
transformers and hybridflow) costs seconds, more than most tiny runs. Each call still gets its own process
group (on a fresh port, destroyed afterwards, and torch's DTensor caches of its meshes with it:
``forget_meshes``), the environment the processes started with, one torch thread, and the test process's
``sys.path``; a call that fails on any rank ends the set (the next call starts a new one), so a rank left in
a collective never serves another test.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue as queue_module
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hybridflow.utils.dist import forget_meshes, free_port


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


def _serve(rank: int, world: int, tasks: Any, results: Any) -> None:
    """A kept process: run each task ``(pickled (fn, args), port, sys_path)`` as ``_entry`` would, until None.

    The call is unpickled after ``sys.path`` is the test process's, so that its test module imports here.
    """
    import torch
    import torch.distributed as dist

    started_env = dict(os.environ)
    while (task := tasks.get()) is not None:
        call, port, path = task
        sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
        os.environ.clear()
        os.environ.update(started_env)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        try:
            fn, args = pickle.loads(call)
            results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_meshes()  # the next call's groups reuse these names: no cached spec may keep our meshes


class _KeptWorld:
    """``world`` spawned processes that serve one call after another (``run_world_kept``)."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results)) for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        """``fn(rank, *args)`` on every process; the results by rank (RuntimeError naming a failed rank)."""
        task = (pickle.dumps((fn, args)), free_port(), list(sys.path))
        for q in self.tasks:
            q.put(task)
        results: dict[int, Any] = {}
        waited = 0.0
        while len(results) < self.world:
            try:
                rank, status, payload = self.results.get(timeout=1.0)
            except queue_module.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or waited > timeout:
                    why = f"rank {dead[0]} died" if dead else f"no result after {timeout} s"
                    raise RuntimeError(f"{why} (a kept world of {self.world})") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop the processes (kill those that do not end by themselves)."""
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


_kept: dict[int, _KeptWorld] = {}


def run_world_kept(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
    """``run_world``, on processes kept between calls of the session (module docstring).

    On a machine with CUDA each call gets fresh processes, as with ``run_world``: a process that touched
    CUDA cannot be made to forget it, and GPU tests pick devices per process.
    """
    import torch

    if torch.cuda.is_available():
        return run_world(world, fn, *args, timeout=timeout)
    for other in [w for w in _kept if w != world and w > 2]:  # few tests use large worlds: free them
        _kept.pop(other).close()
    kept = _kept.get(world)
    if kept is None or not all(p.is_alive() for p in kept.procs):
        if kept is not None:
            kept.close()
        kept = _kept[world] = _KeptWorld(world)
    try:
        return kept.call(fn, args, timeout)
    except BaseException:
        kept.close()  # a rank may be stuck in a collective: this world serves no other call
        del _kept[world]
        raise


@atexit.register
def _close_kept() -> None:
    for kept in _kept.values():
        kept.close()
