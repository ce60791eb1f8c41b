"""Validation: generate on the held-out prompts with the ``rollout.val_kwargs`` settings and score them."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hybridflow.config.schema import Config
from hybridflow.data import collate_prompts
from hybridflow.trainer.dumps import decode_responses, generation_records
from hybridflow.trainer.val_metrics import validation_metrics
from hybridflow.workers.group import prompt_fields

logger = logging.getLogger(__name__)


def validate(
    cfg: Config, c: Any, prefix: str = "val-core", records: list[dict[str, Any]] | None = None
) -> dict[str, float]:
    """Per data source: ``reward/mean@N``, ``acc/mean@N`` and, with N > 1, best/worst/maj@N and pass@k.

    ``records`` (a list) receives one dict per generation: prompt, response, ground truth, score and acc.
    With ``rollout.multi_turn`` the episodes' metrics come too, as ``val-aux/num_turns/mean``,
    ``val-aux/tool_call_counts/mean`` and the others (means over the chunks weighted by their samples).
    """
    v = cfg.rollout.val_kwargs
    params = c.actor.sampling_params(
        v.n, v.temperature, v.top_p, v.top_k, v.do_sample, c.eos_token_ids, seed=cfg.trainer.seed
    )
    size = cfg.data.val_batch_size or len(c.val)
    sources: list[str] = []
    rewards: list[float] = []
    answers: list[str] = []
    accs: list[bool] = []
    turns: list[tuple[int, dict[str, float]]] = []  # (samples, multi-turn metrics) per chunk
    for start in range(0, len(c.val), size):
        prompts = collate_prompts(
            [c.val[i] for i in range(start, min(start + size, len(c.val)))], c.pad_token_id
        )
        batch = c.actor.generate(
            prompt_fields(prompts, rows=cfg.rollout.harness.enabled),
            params,
            desc="validation",
        )
        rows = batch.meta.pop("rows_per_prompt", v.n)  # a harness's episodes may leave several rows, or none
        for key in ("data_source", "ground_truth", "extra_info"):
            batch[key] = np.repeat(prompts[key], rows)
        if "multi_turn" in batch.meta:
            turns.append((len(batch), batch.meta["multi_turn"]))
        scores, extras = c.scorer.score(batch)
        texts = decode_responses(c.tokenizer, batch)
        if records is not None:
            records += generation_records(c.tokenizer, prompts, batch, texts, scores.tolist(), extras, v.n)
        sources += list(batch["data_source"])
        rewards += scores.tolist()
        answers += [t.strip() for t in texts]  # the majority vote counts identical responses
        accs += [bool(a) for a in extras["acc"]]
    metrics = validation_metrics(sources, rewards, answers, accs, v.n, prefix)
    return metrics | episode_summary(turns, prefix.replace("core", "aux"))


def episode_summary(turns: list[tuple[int, dict[str, float]]], prefix: str) -> dict[str, float]:
    """The multi-turn metrics of several rollouts as one: means weighted by samples, extremes of the bounds,
    sums of the ``tool/*`` counts."""
    if not turns:
        return {}
    total = sum(n for n, _ in turns)
    out = {}
    for key in turns[0][1]:
        values = [m[key] for _, m in turns]
        if key.endswith("/min") or key.endswith("/max"):
            out[f"{prefix}/{key}"] = float((min if key.endswith("/min") else max)(values))
        elif key.startswith("tool/"):  # counts
            out[f"{prefix}/{key}"] = float(sum(values))
        else:
            out[f"{prefix}/{key}"] = float(sum(n * m[key] for n, m in turns) / total)
    return out
