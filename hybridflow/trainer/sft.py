"""Supervised fine-tuning on prompt/response pairs, on the same engine (the loss is on the response only)."""

from __future__ import annotations

import logging
from typing import Any

from hybridflow.data import PromptSampler
from hybridflow.engine import pack_prompt_response
from hybridflow.utils.errors import UserError
from hybridflow.workers.actor import ActorWorker

logger = logging.getLogger(__name__)


def encode_pairs(
    tokenizer: Any, rows: list[dict], end_token_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-template prompt ids and response ids (ending with the chat end token) of each row.

    A row has ``prompt`` (chat messages or text) and ``response`` (text), or the built-in tasks' reference
    answer in ``extra_info.answer``.
    """
    prompts, responses = [], []
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        response = row.get("response") or (row.get("extra_info") or {}).get("answer")
        if not prompt or not isinstance(response, str) or not response:
            raise UserError(f"SFT row {i} needs a non-empty 'prompt' and a 'response' (or extra_info.answer)")
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        prompts.append(list(ids))
        responses.append([*tokenizer.encode(response, add_special_tokens=False), end_token_id])
    return prompts, responses


def run_sft(
    actor: ActorWorker,
    prompts: list[list[int]],
    responses: list[list[int]],
    steps: int,
    batch_size: int,
    pad_token_id: int,
    seed: int = 0,
    on_step: Any = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of NLL on the responses, ``batch_size`` pairs each, seeded order."""
    sampler = PromptSampler(len(prompts), batch_size, seed, shuffle=True)
    width = max(len(r) for r in responses)
    history = []
    for step in range(1, steps + 1):
        idx = sampler.next_batch()
        batch = pack_prompt_response(
            [prompts[i] for i in idx], [responses[i] for i in idx], width, pad_token_id
        )
        metrics = actor.update_sft(batch)
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
