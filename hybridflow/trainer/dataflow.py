"""A training step as a list of stages over one Batch: dependency order, timing and the tensor lifecycle.

Each stage names the batch keys it reads and writes. ``Dataflow`` orders the stages so every read is
written earlier (or comes with the input), times each one into ``timing_s/<stage>``, and drops every key
right after its last reader, so a step never holds tensors nobody will read again.

A ``background`` stage (the reward function with ``reward.launch_async``, as verl's
``launch_reward_fn_async``) runs in a thread on a shallow copy of the batch while the stages after it
go on; the first stage that reads one of its writes waits for it (``timing_s/<stage>_wait``), and so does
the end of the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridflow.protocol import Batch

logger = logging.getLogger(__name__)

StageFn = Callable[[Batch, dict[str, float]], Batch | None]


@dataclass(frozen=True)
class Stage:
    """One step of the dataflow: ``run(batch, metrics)`` returns the keys it writes (as a Batch) or None.

    ``replaces_batch`` marks a stage whose output becomes the whole batch (rollout: B prompts in, B * n
    samples out, carrying the prompts' fields along). ``background`` runs it in a thread beside the later
    stages until one of them reads what it writes; it must not call the worker groups (their collectives
    would interleave with the foreground's).
    """

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: StageFn
    replaces_batch: bool = False
    background: bool = False

    def __post_init__(self) -> None:
        if self.background and self.replaces_batch:
            raise ValueError(f"stage {self.name!r}: a background stage cannot replace the batch")


def order_stages(stages: Sequence[Stage], available: set[str]) -> list[Stage]:
    """Stable topological order: repeatedly take the first stage whose reads are all available."""
    pending, ordered, have = list(stages), [], set(available)
    while pending:
        ready = next((s for s in pending if set(s.reads) <= have), None)
        if ready is None:
            missing = {s.name: sorted(set(s.reads) - have) for s in pending}
            raise ValueError(f"stages wait for keys that no stage writes: {missing}")
        pending.remove(ready)
        ordered.append(ready)
        have |= set(ready.writes)
    return ordered


class Dataflow:
    """Runs stages in dependency order over a batch, timing them and freeing keys after their last reader."""

    def __init__(self, stages: Sequence[Stage], inputs: Sequence[str], keep: Sequence[str] = ()) -> None:
        self.stages = order_stages(stages, set(inputs))
        self.keep = set(keep)
        last: dict[str, int] = {}
        for i, stage in enumerate(self.stages):
            for key in stage.reads:
                last[key] = i
        self.release_after = {
            i: [k for k, j in last.items() if j == i and k not in self.keep] for i in range(len(self.stages))
        }

    @property
    def names(self) -> list[str]:
        """Stage names in execution order."""
        return [s.name for s in self.stages]

    def run(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        """Run every stage; adds ``timing_s/<stage>`` and ``perf/lifecycle_freed_bytes`` to ``metrics``."""
        freed = 0
        pending: dict[int, Future] = {}  # background stages in flight, by index
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dataflow") as pool:
            for i, stage in enumerate(self.stages):
                for j in [j for j in pending if set(self.stages[j].writes) & set(stage.reads)]:
                    batch, freed = self._join(j, pending.pop(j), batch, metrics, freed, stage.name)
                missing = [k for k in stage.reads if k not in batch]
                if missing:
                    raise ValueError(f"stage {stage.name!r} needs {missing}, which the batch lacks")
                if stage.background:  # on a shallow copy of the batch: later drops and writes do not touch it
                    pending[i] = pool.submit(_timed, stage, batch.select())
                    continue
                start = time.perf_counter()
                with torch.profiler.record_function(f"stage/{stage.name}"):  # names the stage in a profile
                    out = stage.run(batch, metrics)
                metrics[f"timing_s/{stage.name}"] = time.perf_counter() - start
                if stage.replaces_batch:
                    freed += batch.nbytes()
                    batch = out
                elif out is not None:
                    _merge(batch, out)
                freed += batch.drop([k for k in self.release_after[i] if k in batch])
            for j in list(pending):
                batch, freed = self._join(j, pending.pop(j), batch, metrics, freed, "end")
        metrics["perf/lifecycle_freed_bytes"] = float(freed)
        return batch

    def _join(
        self, j: int, future: Future, batch: Batch, metrics: dict[str, float], freed: int, waiter: str
    ) -> tuple[Batch, int]:
        """Wait for background stage ``j`` (for ``waiter``), merge its output and metrics, and drop the keys
        it read last (kept while it ran)."""
        stage = self.stages[j]
        start = time.perf_counter()
        out, own_metrics, seconds = future.result()  # re-raises the stage's exception here
        metrics[f"timing_s/{stage.name}_wait"] = time.perf_counter() - start
        metrics.update(own_metrics)
        metrics[f"timing_s/{stage.name}"] = seconds
        logger.debug("background stage %s joined before %s", stage.name, waiter)
        if out is not None:
            _merge(batch, out)
        return batch, freed + batch.drop([k for k in self.release_after[j] if k in batch])


def _merge(batch: Batch, out: Batch) -> None:
    for key in out.keys():  # noqa: SIM118 (a Batch is not iterable)
        batch[key] = out[key]


def _timed(stage: Stage, view: Batch) -> tuple[Batch | None, dict[str, float], float]:
    """Run a background stage on its view, with metrics of its own (merged at the join) and its seconds."""
    own: dict[str, float] = {}
    start = time.perf_counter()
    out = stage.run(view, own)
    return out, own, time.perf_counter() - start
