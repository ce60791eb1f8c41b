"""Validation: generate on the held-out prompts with the ``rollout.val_kwargs`` settings and score them."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.data import collate_prompts

logger = logging.getLogger(__name__)


def validate(cfg: Config, c: Any, prefix: str = "val-core") -> dict[str, float]:
    """``{prefix}/{data_source}/reward/mean@N`` and ``.../acc/mean@N`` over the validation set."""
    v = cfg.rollout.val_kwargs
    params = c.actor.sampling_params(
        v.n, v.temperature, v.top_p, v.top_k, v.do_sample, c.eos_token_ids, seed=cfg.trainer.seed
    )
    size = cfg.data.val_batch_size or len(c.val)
    rewards: dict[str, list[float]] = defaultdict(list)
    accs: dict[str, list[float]] = defaultdict(list)
    for start in range(0, len(c.val), size):
        prompts = collate_prompts(
            [c.val[i] for i in range(start, min(start + size, len(c.val)))], c.pad_token_id
        )
        batch = c.actor.generate(
            prompts.select(["input_ids", "attention_mask", "position_ids"], non_tensor_keys=[]), params
        )
        for key in ("data_source", "ground_truth", "extra_info"):
            batch[key] = prompts[key].repeat(v.n)
        scores, extras = c.scorer.score(batch)
        for ds, s, a in zip(batch["data_source"], scores.tolist(), extras["acc"]):
            rewards[ds].append(s)
            accs[ds].append(float(a))
    metrics = {}
    for ds in rewards:
        metrics[f"{prefix}/{ds}/reward/mean@{v.n}"] = sum(rewards[ds]) / len(rewards[ds])
        metrics[f"{prefix}/{ds}/acc/mean@{v.n}"] = sum(accs[ds]) / len(accs[ds])
    return metrics
