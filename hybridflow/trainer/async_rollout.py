"""Asynchronous RL on one pool (``trainer.async_mode=colocate``): partial rollouts with bounded staleness.

Each step keeps ``2 x data.train_batch_size`` prompt groups in flight (this batch's and the next one's) and
generates until ``data.train_batch_size`` of them are done; the long tail does not hold the step: unfinished
groups are aborted with their tokens, the trainer trains on the done ones, the weights refresh through the
hybrid engine, and at the next step the unfinished groups continue under the new weights (re-prefilled,
``engine.rollout.partial``). Every token keeps the version of the weights that sampled it (the number of
updates before it), so a trained group's staleness is the policy's version minus its oldest token's.

``trainer.max_staleness`` (S) bounds it: a group that could not be carried one more step without its oldest
token lagging more than S versions is finished in this phase (``staleness_policy=wait``: the phase waits
for it) or dropped with every sample (``drop``: counted in ``async/dropped``; its prompt is not drawn again).
Done groups are trained oldest first. The groups in flight are the driver's state: a checkpoint saves them
(``state_dict``), so a resumed run continues them and never trains a sample twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.data import collate_prompts
from hybridflow.engine import GroupState, SampleState, new_group, pack_prompt_response, pad_rows
from hybridflow.protocol import Batch
from hybridflow.trainer.metrics import add_reshard_stats, add_rollout_stats

logger = logging.getLogger(__name__)


@dataclass
class Flight:
    """A group in flight: its dataset row and its state."""

    index: int  # the training set's row
    group: GroupState


class ColocateRollout:
    """The groups in flight of a ``colocate`` run and the phase that advances them (see the module doc)."""

    mode = "colocate"

    def __init__(self, cfg: Any, components: Any, sampler: Any) -> None:
        self.cfg, self.c, self.sampler = cfg, components, sampler
        self.batch = cfg.data.train_batch_size
        self.n = cfg.rollout.n
        self.max_staleness = cfg.trainer.max_staleness
        self.drop = cfg.trainer.staleness_policy == "drop"
        self.flights: list[Flight] = []
        self.next_key = 0

    # ---- a step's batch ----------------------------------------------------------------------------------

    def next_batch(self, version: int, params: Any, metrics: dict[str, float]) -> Batch:
        """The samples of the next ``data.train_batch_size`` done groups (the gen stage's output), after one
        rollout phase under weights of ``version`` (the updates so far)."""
        self._top_up(2 * self.batch)
        finish = self._must_finish(version) if not self.drop else frozenset()
        self._run_phase(version, params, finish, metrics)
        dropped = self._drop_stale(version) if self.drop else 0
        chosen = self._choose(version)
        metrics.update(self._metrics(chosen, version, dropped))
        return self._samples(chosen)

    def _top_up(self, target: int) -> None:
        """Draw prompts (whole sampler batches, as the synchronous trainer does) until ``target`` are in flight."""
        while len(self.flights) < target:
            for i in self.sampler.next_batch():
                row = self.c.train[i]
                prompt = [int(t) for t in row["input_ids"]]
                self.flights.append(Flight(int(i), new_group(self.next_key, prompt, self.n)))
                self.next_key += 1

    def _must_finish(self, version: int) -> frozenset[int]:
        """Groups whose oldest token would lag more than S versions if carried to the next step."""
        out = set()
        for f in self.flights:
            oldest = f.group.oldest_version()
            if oldest is not None and not f.group.done and version + 1 - oldest > self.max_staleness:
                out.add(f.group.key)
        return frozenset(out)

    def _run_phase(
        self, version: int, params: Any, finish: frozenset[int], metrics: dict[str, float]
    ) -> None:
        """Hand each rollout group its share of the unfinished groups and of the quota; take back the states."""
        done = sum(f.group.done for f in self.flights)
        quota = max(self.batch - done, 0)
        if quota == 0 and not finish:  # the batch is done already: no phase (and no rollout figures)
            return
        todo = [f for f in self.flights if not f.group.done]
        dp = self.c.actor.group.layout("actor", "generate").dp
        shares = [[f.group for f in todo[d::dp]] for d in range(dp)]
        quotas = [min(len(share), quota // dp + (d < quota % dp)) for d, share in enumerate(shares)]
        if sum(quotas) < quota:  # a share too small for its part: the others take the rest
            for d in range(dp):
                quotas[d] = min(len(shares[d]), quotas[d] + quota - sum(quotas))
        start = time.perf_counter()
        results = self.c.actor.generate_partial(shares, params, quotas, version, finish)
        metrics["timing_s/wait_for_rollout"] = (
            time.perf_counter() - start
        )  # one pool: the trainer waits it all
        by_key = {g.key: g for groups, _ in results for g in groups}
        for f in self.flights:
            f.group = by_key.get(f.group.key, f.group)
        meta = results[0][1]
        add_rollout_stats(metrics, meta.get("rollout_stats"))
        add_reshard_stats(metrics, [m.get("reshard") for _, m in results] if "reshard" in meta else None)
        if "timing_s/reshard" in metrics:  # the weights' refresh is the hybrid engine's switch
            metrics["timing_s/weight_sync"] = metrics["timing_s/reshard"]

    def _drop_stale(self, version: int) -> int:
        """``drop``: discard the unfinished groups that would be too stale at the next step; how many."""
        stale = self._must_finish(version)
        self.flights = [f for f in self.flights if f.group.key not in stale]
        return len(stale)

    def _choose(self, version: int) -> list[Flight]:
        """The step's done groups, oldest first (they are out of the flights afterwards)."""
        done = [f for f in self.flights if f.group.done]
        done.sort(key=lambda f: (f.group.oldest_version() if f.group.started else version, f.group.key))
        chosen = done[: self.batch]
        taken = {f.group.key for f in chosen}
        self.flights = [f for f in self.flights if f.group.key not in taken]
        return chosen

    # ---- the batch the dataflow trains on ----------------------------------------------------------------

    def _samples(self, chosen: list[Flight]) -> Batch:
        """The gen stage's output for the chosen groups: as ``ActorWorker.generate`` packs a rollout."""
        samples = [(f, s) for f in chosen for s in f.group.samples]
        R = self.cfg.data.max_response_length
        batch = pack_prompt_response(
            [f.group.prompt for f, _ in samples], [s.tokens for _, s in samples], R, self.c.pad_token_id
        )
        batch["rollout_log_probs"], _ = pad_rows([s.logprobs for _, s in samples], R, 0.0, torch.float32)
        rows = collate_prompts([self.c.train[f.index] for f in chosen], self.c.pad_token_id)
        for key, values in rows.non_tensors.items():
            batch[key] = np.repeat(values, self.n)
        batch["uid"] = np.repeat(np.array([str(f.group.key) for f in chosen], dtype=object), self.n)
        batch["finish_reason"] = np.array([s.finish_reason for _, s in samples], dtype=object)
        return batch

    def _metrics(self, chosen: list[Flight], version: int, dropped: int) -> dict[str, float]:
        """Staleness (versions behind the trained policy) of the trained samples, how many span versions,
        and the groups dropped and still in flight."""
        samples = [s for f in chosen for s in f.group.samples]
        lags = [version - min(s.versions) for s in samples if s.versions]
        spanning = [len(set(s.versions)) > 1 for s in samples]
        return {
            "async/staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "async/staleness_max": float(max(lags, default=0)),
            "async/partial_fraction": float(np.mean(spanning)) if spanning else 0.0,
            "async/dropped": float(dropped),
            "async/in_flight": float(len(self.flights)),
        }

    # ---- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The groups in flight (plain lists: the checkpoint's JSON), and the next group key."""
        return {
            "mode": self.mode,
            "next_key": self.next_key,
            "flights": [
                {
                    "index": f.index,
                    "key": f.group.key,
                    "prompt": f.group.prompt,
                    "samples": [[s.tokens, s.logprobs, s.versions, s.finish_reason] for s in f.group.samples],
                }
                for f in self.flights
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what ``state_dict`` saved."""
        self.next_key = int(state["next_key"])
        self.flights = [
            Flight(
                int(d["index"]),
                GroupState(
                    int(d["key"]), list(d["prompt"]), [SampleState(*map(_copy, s)) for s in d["samples"]]
                ),
            )
            for d in state["flights"]
        ]


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
