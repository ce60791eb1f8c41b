"""Generations as JSON lines: per-step rollout dumps (``trainer.rollout_data_dir``) and validation outputs."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.protocol import Batch
from hybridflow.utils.storage import staged_file
from hybridflow.utils.text import batch_decode

logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """JSON-safe: numpy scalars and arrays become Python values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def decode_prompts(tokenizer: Any, prompts: Batch) -> list[str]:
    """The prompt texts (left padding removed, special tokens kept: they show the chat template)."""
    mask = prompts["attention_mask"].bool()
    return batch_decode(tokenizer, [row[m].tolist() for row, m in zip(prompts["input_ids"], mask)])


def decode_responses(tokenizer: Any, batch: Batch) -> list[str]:
    """The response texts without special tokens."""
    mask = batch["response_mask"].bool()
    rows = [row[m].tolist() for row, m in zip(batch["responses"], mask)]
    return batch_decode(tokenizer, rows, skip_special_tokens=True)


def generation_records(
    tokenizer: Any,
    prompts: Batch,
    samples: Batch,
    responses: Sequence[str],
    scores: Sequence[float],
    extras: dict[str, Sequence[Any]],
    n: int,
) -> list[dict[str, Any]]:
    """One record per sample: prompt, response, ground truth, data source, score and the scorer's extras."""
    texts = decode_prompts(tokenizer, prompts)
    out = []
    for i, response in enumerate(responses):
        record = {
            "data_source": samples["data_source"][i],
            "prompt": texts[i // n],
            "response": response,
            "ground_truth": samples["ground_truth"][i],
            "score": float(scores[i]),
        }
        if "finish_reason" in samples:
            record["finish_reason"] = samples["finish_reason"][i]
        record.update({k: v[i] for k, v in extras.items()})
        out.append(_plain(record))
    return out


def rollout_records(tokenizer: Any, batch: Batch, step: int) -> list[dict[str, Any]]:
    """One record per sample of a training step's batch (after the reward stage)."""
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    prompts = Batch(
        {
            "input_ids": batch["input_ids"][:, :prompt_len],
            "attention_mask": batch["attention_mask"][:, :prompt_len],
        }
    )
    scores = batch["token_level_scores"].sum(-1).tolist()
    extras = {"acc": list(batch["acc"])} if "acc" in batch else {}
    records = generation_records(
        tokenizer, prompts, batch, decode_responses(tokenizer, batch), scores, extras, 1
    )
    for record, uid in zip(records, batch["uid"]):
        record.update(step=step, uid=uid)
    return records


def write_jsonl(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write records as JSON lines (the folder is created; written beside and renamed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path) as tmp, tmp.open("w") as f:
        for record in records:
            f.write(json.dumps(_plain(record), ensure_ascii=False) + "\n")
    logger.debug("wrote %d generations to %s", len(records), path)
    return path
