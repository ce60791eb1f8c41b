"""The driver of offline preference training (DPO, IPO, cDPO, KTO): the same dataflow, workers and run dir.

A step samples a batch of pairs, lays the two rows of each pair side by side (so a split by rank or by
micro-batch never separates them), computes the reference's per-sequence log-probs (once per batch, or once
for the whole dataset with ``ref.precompute``), and takes one optimizer step of the chosen loss.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from hybridflow.config.schema import Config
from hybridflow.data import PromptSampler, collate_kto, collate_pairs
from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import Dataflow, Stage
from hybridflow.trainer.loop import TrainingLoop
from hybridflow.trainer.tracking import Tracker
from hybridflow.utils.errors import UserError
from hybridflow.utils.progress import Progress

logger = logging.getLogger(__name__)

SEQ_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
KINDS = ("dpo", "kto")


def interleave_pairs(batch: Batch) -> Batch:
    """``[a0..aP-1, b0..bP-1]`` (the collate layout) to ``[a0, b0, a1, b1, ...]``."""
    P = len(batch) // 2
    return batch[np.stack([np.arange(P), np.arange(P, 2 * P)], axis=1).reshape(-1)]


class PreferenceTrainer(TrainingLoop):
    """Drives DPO/IPO (``kind="dpo"``) or KTO (``kind="kto"``) over a preference dataset."""

    def __init__(self, cfg: Config, components: Any, kind: str, tracker: Tracker | None = None) -> None:
        if kind not in KINDS:
            raise UserError(f"unknown preference algorithm {kind!r}; use one of {', '.join(KINDS)}")
        if kind == "kto" and cfg.ref.precompute:
            raise UserError(
                "ref.precompute caches each DPO pair's reference values; KTO's KL pairs change with every "
                "batch, so set ref.precompute=false for kto"
            )
        super().__init__(cfg, components, tracker)
        self.kind = kind
        self.sampler = PromptSampler(len(components.train), cfg.data.train_batch_size, cfg.trainer.seed)
        self.ref_cache: dict[int, torch.Tensor] | None = None
        self.dataflow = Dataflow(
            [
                Stage("ref", (*SEQ_KEYS, "index"), ("ref_seq_logps",), self._ref_log_probs),
                Stage("update_actor", (*SEQ_KEYS, "ref_seq_logps"), (), self._update),
            ],
            inputs=(*SEQ_KEYS, "index", "labels"),
        )

    # ----- the recipe -------------------------------------------------------------------------------------
    def collate(self, indices: list[int]) -> Batch:
        """The rows of ``indices`` (DPO: chosen and rejected; KTO: example and KL partner), pairs adjacent."""
        items = [self.c.train[i] for i in indices]
        batch = (
            collate_pairs(items, self.c.pad_token_id)
            if self.kind == "dpo"
            else collate_kto(items, self.c.pad_token_id)
        )
        batch["index"] = torch.tensor(indices * 2)  # the pair's dataset row, for the reference cache
        return interleave_pairs(batch)

    def step(self) -> dict[str, float]:
        """One optimizer step on a fresh batch of pairs."""
        start = time.perf_counter()
        batch = self.collate(self.sampler.next_batch())
        metrics: dict[str, float] = {"training/global_step": float(self.global_step)}
        self.dataflow.run(batch, metrics)
        metrics["perf/time_per_step"] = time.perf_counter() - start
        return metrics

    def fit(self) -> list[dict[str, float]]:
        """With ``ref.precompute``, the reference values of the whole dataset first; then the loop."""
        if self.cfg.ref.precompute and self.ref_cache is None:
            self.ref_cache = self._precompute_reference()
        return super().fit()

    # ----- stages -----------------------------------------------------------------------------------------
    def _sequence_sums(self, batch: Batch) -> torch.Tensor:
        token = self.c.ref.compute_ref_log_prob(batch)["ref_log_prob"]  # (B, R)
        mask = batch["response_mask"]
        sums = (token * mask).sum(-1)
        if self.kind == "dpo" and self.cfg.preference.loss_type == "ipo":  # IPO compares mean log-probs
            return sums / mask.sum(-1).clamp(min=1)
        return sums

    def _ref_log_probs(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        if self.ref_cache is None:
            return Batch({"ref_seq_logps": self._sequence_sums(batch)})
        # The cache holds each dataset row's (chosen, rejected) values; rows alternate chosen/rejected.
        rows = batch["index"].tolist()
        values = [self.ref_cache[r][j % 2] for j, r in enumerate(rows)]
        return Batch({"ref_seq_logps": torch.stack(values)})

    def _precompute_reference(self) -> dict[int, torch.Tensor]:
        """``ref.precompute``: the reference values of every dataset row, computed once."""
        cache: dict[int, torch.Tensor] = {}
        size = self.cfg.data.train_batch_size
        order = list(range(len(self.c.train)))
        with Progress("reference log-probs", total=len(order), unit="pair") as bar:
            for start in range(0, len(order), size):
                idx = order[start : start + size]
                batch = self.collate(idx)
                sums = self._sequence_sums(batch)  # (2b,) pairs adjacent
                for j, r in enumerate(idx):
                    cache[r] = sums[2 * j : 2 * j + 2].clone()
                bar.update(len(idx))
        return cache

    def _update(self, batch: Batch, metrics: dict[str, float]) -> None:
        batch.meta["preference_kind"] = self.kind
        with Progress("update actor", unit="step") as bar:
            metrics.update(self.c.actor.update_preference(batch))
            bar.update()
