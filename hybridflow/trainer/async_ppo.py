"""PPO-family training with partial rollouts on one pool (``trainer.async_mode=colocate``).

The step is the synchronous one (``PPOTrainer``'s dataflow) but for its rollout stage, which advances the
groups in flight (``async_rollout.ColocateRollout``) and hands on the done ones. Their tokens may come from
earlier weights, so the update is AReaL's decoupled PPO: the old-log-prob pass recomputes the proximal
policy (the weights before this update), and token-level truncated importance weights pi_prox / pi_behav
(``algorithm.rollout_correction.rollout_is=token``, threshold 2 unless set) weigh the clipped ratio
pi / pi_prox; the behaviour policy's log-probs are the rollout's. With ``bypass_old_logprob_for_rollout``
(verl's bypass mode) the rollout's log-probs are the old policy instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridflow.config.schema import Config
from hybridflow.protocol import Batch
from hybridflow.trainer.async_rollout import ColocateRollout
from hybridflow.trainer.ppo import PROMPT_KEYS, PPOTrainer
from hybridflow.trainer.tracking import Tracker

logger = logging.getLogger(__name__)


class AsyncPPOTrainer(PPOTrainer):
    """``PPOTrainer`` whose rollout stage draws its own prompts and may hand on samples of older weights."""

    @property
    def version(self) -> int:
        """The weights' version at this step's rollout: the actor updates before it (none in critic warm-up)."""
        return max(self.global_step - 1 - self.cfg.trainer.critic_warmup, 0)

    def _next_prompts(self) -> Batch:
        """No prompts up front: the rollout stage draws them itself (zero rows)."""
        empty = torch.zeros((0, 1), dtype=torch.long)
        return Batch({key: empty for key in PROMPT_KEYS})


class ColocatePPOTrainer(AsyncPPOTrainer):
    """``PPOTrainer`` whose rollout stage is a partial-rollout phase over the groups in flight."""

    def __init__(self, cfg: Config, components: Any, tracker: Tracker | None = None) -> None:
        super().__init__(cfg, components, tracker)
        self.inflight = ColocateRollout(cfg, components, self.sampler)

    def _generate(self, prompts: Batch, metrics: dict[str, float]) -> Batch:
        """One phase of the partial rollout; the done groups' samples."""
        return self.inflight.next_batch(self.version, self._sampling_params(), metrics)

    def step(self) -> dict[str, float]:
        """The synchronous step's metrics and ``async/rollout_idle_fraction``: on one pool the rollout is idle
        for every part of the step outside its phase."""
        metrics = super().step()
        busy = metrics.get("timing_s/wait_for_rollout", 0.0)
        metrics["async/rollout_idle_fraction"] = max(
            1.0 - busy / max(metrics["perf/time_per_step"], 1e-9), 0.0
        )
        return metrics
