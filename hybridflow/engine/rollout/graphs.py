"""CUDA graphs for the decode step: one graph per batch-size bucket, replayed with no launch overhead.

Without graphs a decode step of a 0.5B-7B model costs 9-16 ms whatever the batch: the CPU cannot launch the
kernels fast enough (benchmarks/RESULTS.md, measured anchors). A graph records the whole step (model, sampling and the
bookkeeping in ``DecodeState``) once and replays it. The step reads and writes persistent tensors only,
so replays need no input copies. Batches are padded up to a bucket; the padding rows are free seats whose
state says "done", so they write only scratch columns and stale cache positions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, ... and ``max_batch``.

    Few buckets keep capture (and, with torch.compile, compilation) cheap; padding costs at most a third.
    """
    sizes, b = [1, 2, 4, 8, 16], 16
    while b < max_batch:
        sizes += [2 * b, 3 * b]
        b *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    """One side stream per device for every capture in the process.

    Capture cannot run on the legacy default stream. A new stream per ``generate`` would also cost memory
    for good: cuBLAS keeps a workspace per stream it has run on.
    """
    return torch.cuda.Stream(device_index)


class DecodeGraphs:
    """Runs ``step(b)`` (one decode step over seats [0, b)) through a CUDA graph per bucket.

    The first step at a bucket runs eagerly (it warms up kernels, cuBLAS workspaces and any compilation)
    unless ``warm`` says an earlier call already did; the next one captures the graph and every later one
    replays it. Graphs hold the cache and state tensors, so they live for one session of the engine.
    """

    def __init__(
        self,
        step: Callable[[int], None],
        max_batch: int,
        generator: torch.Generator | None,
        warm: set[int] | None = None,
    ) -> None:
        self.step = step
        self.sizes = buckets(max_batch)
        self.generator = generator
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Buckets already run eagerly once; pass the caller's set to share it across calls (it is updated).
        self.warm: set[int] = set() if warm is None else warm
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, batch: int) -> int:
        """The smallest bucket that holds ``batch`` rows."""
        return next(b for b in self.sizes if b >= batch)

    def prepare(self, batch: int) -> None:
        """Capture ``batch``'s bucket now if an earlier step warmed it and it has no graph yet.

        Called right after prefill is queued: the host records the graph while the GPU still runs prefill,
        instead of at the first decode step, where the GPU would sit idle for the capture (~11 ms at batch
        256 on an H200).
        """
        b = self.bucket(batch)
        if b in self.warm and b not in self.graphs:
            self._capture(b)

    def run(self, batch: int) -> None:
        """One decode step for ``batch`` running sequences."""
        b = self.bucket(batch)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return
        if b not in self.warm:
            self.warm.add(b)
            self.step(b)
            return
        self._capture(b).replay()  # capture records without running: run the step now

    def _capture(self, b: int) -> torch.cuda.CUDAGraph:
        """Record ``step(b)`` into a new graph. No device sync first: queued work (prefill) keeps running.

        Not ``torch.cuda.graph(...)``: it synchronizes and empties the allocator's cache before each capture,
        which hands this call's prefill blocks back to the driver only for the next generate to cudaMalloc
        them again.
        """
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        with torch.cuda.stream(_capture_stream(torch.cuda.current_device())):
            graph.capture_begin(pool=self.pool)
            try:
                self.step(b)
            finally:
                graph.capture_end()
        self.graphs[b] = graph
        logger.debug("captured a decode graph for batch %d", b)
        return graph
