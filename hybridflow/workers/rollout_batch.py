"""A rollout group's samples packed as the training-layout batch: what the actor's ``generate`` returns, also
from a rollout pool of its own (``trainer.async_mode=separate``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridflow.engine import (
    RolloutGroup,
    SamplingParams,
    pack_prompt_response,
    pack_routing,
    pad_rows,
)
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError
from hybridflow.utils.progress import Progress
from hybridflow.workers.agent_env import MultiTurn
from hybridflow.workers.harness_rollout import HarnessRollout


def sample_batch(
    rollout: Any,
    group: RolloutGroup,
    prompts: Batch,
    params: SamplingParams,
    max_response_length: int,
    pad_token_id: int,
    desc: str = "rollout",
    multi_turn: MultiTurn | None = None,
    before: Callable[[list[list[int]], SamplingParams], None] | None = None,
    harness: HarnessRollout | None = None,
) -> Batch:
    """Sample ``params.n`` responses per prompt with ``rollout``; samples interleaved, responses padded to
    ``max_response_length``.

    Every rank of a rollout group is handed the group's prompts and returns the whole group's samples. Adds
    ``rollout_log_probs`` (B*n, R), the prompts' non-tensor fields repeated, ``uid`` (the prompt's group),
    ``finish_reason`` and ``meta["rollout_stats"]`` (the built-in engine's ``GenerationStats``). ``before``
    sees the prompts' ids and the group's params first (the actor makes room for the KV cache there).
    ``harness`` (``rollout.harness``): the episodes of a user harness instead, as ``HarnessRollout`` packs them.
    """
    params = dataclasses.replace(params, seed=group.seed(params.seed))
    mask = prompts["attention_mask"].bool()
    ids = [row[m].tolist() for row, m in zip(prompts["input_ids"], mask)]
    images = prompt_images(prompts)
    if before is not None:
        before(ids, params)
    masks, turn_metrics = None, None
    if harness is not None:
        with Progress(desc, total=len(ids) * params.n, unit="episode") as bar:
            batch = harness.generate(rollout, prompts, params, pad_token_id, bar.update)
        return _with_prompt_fields(batch, prompts, rollout)
    with Progress(desc, total=len(ids) * params.n, unit="sample") as bar:
        if multi_turn is not None:  # episodes of turns and tool outputs (rollout.multi_turn)
            if images is not None:
                raise UserError(
                    "rollout.multi_turn does not carry images yet; turn it off for image prompts "
                    "(data rows with multi_modal_inputs)"
                )
            outputs, masks, turn_metrics = multi_turn.generate(rollout, ids, params, group, bar.update)
        elif images is not None:  # a vision-language model's image prompts (text-only rows: None)
            outputs = rollout.generate(ids, params, progress=bar.update, mm_inputs=images)
        else:
            outputs = rollout.generate(ids, params, progress=bar.update)
    group.check_agreement(outputs, ids)
    flat = [s for samples in outputs for s in samples]
    R = max_response_length
    batch = pack_prompt_response(
        [p for p in ids for _ in range(params.n)], [s.token_ids for s in flat], R, pad_token_id
    )
    logps, _ = pad_rows([s.logprobs for s in flat], R, 0.0, torch.float32)  # (B*n, R)
    batch["rollout_log_probs"] = logps
    if masks is not None:  # a tool's output is never trained on
        sampled, _ = pad_rows(masks, R, 0, torch.float32)  # (B*n, R)
        batch["response_mask"] = batch["response_mask"] * sampled
        batch.meta["multi_turn"] = turn_metrics
    routed = [getattr(s, "routed_experts", None) for s in flat]
    if flat and all(r is not None for r in routed):  # MoE router replay (r3): the rollout's experts
        P = batch["input_ids"].shape[1] - R
        batch["routed_experts"] = pack_routing([len(p) for p in ids for _ in range(params.n)], routed, P, R)
    for key, values in prompts.non_tensors.items():
        batch[key] = np.repeat(values, params.n)
    batch["uid"] = np.repeat(np.array([f"{i}" for i in range(len(ids))], dtype=object), params.n)
    batch["finish_reason"] = np.array([s.finish_reason for s in flat], dtype=object)
    stats = getattr(rollout, "last_stats", None)  # the built-in engine's; HF generate keeps none
    if stats is not None:
        batch.meta["rollout_stats"] = dataclasses.asdict(stats)
    return batch


def _with_prompt_fields(batch: Batch, prompts: Batch, rollout: Any) -> Batch:
    """A harness batch with its prompts' non-tensor fields repeated by each prompt's rows, and the engine's
    figures."""
    counts = batch.meta["rows_per_prompt"]
    for key, values in prompts.non_tensors.items():
        batch[key] = np.repeat(values, counts)
    stats = getattr(rollout, "last_stats", None)
    if stats is not None:
        batch.meta["rollout_stats"] = dataclasses.asdict(stats)
    return batch


def prompt_images(prompts: Batch) -> list[dict[str, torch.Tensor] | None] | None:
    """Each prompt row's images (the non-tensor field ``multi_modal_inputs``: None for a text-only row), or None
    when no row has any (a text model's batch)."""
    if "multi_modal_inputs" not in prompts.non_tensors:
        return None
    images = list(prompts.non_tensors["multi_modal_inputs"])
    return images if any(mm is not None for mm in images) else None
