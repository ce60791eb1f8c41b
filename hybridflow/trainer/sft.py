"""Supervised fine-tuning on prompt/response pairs, on the same engine (the loss is on the response only)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridflow.data import PromptSampler
from hybridflow.data.rows import RowOrigin
from hybridflow.data.sft_turns import check_conversation, encode_conversation, is_conversation
from hybridflow.engine import pack_prompt_response, pad_rows
from hybridflow.utils.errors import UserError
from hybridflow.workers.actor import ActorWorker

logger = logging.getLogger(__name__)


def encode_pairs(
    tokenizer: Any, rows: list[dict], end_token_id: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Chat-template prompt ids, response ids (ending with the chat end token) and loss masks of each row.

    A row has ``prompt`` (chat messages or text) and ``response`` (text), or the built-in tasks' reference
    answer in ``extra_info.answer``; its mask is all ones. A row whose ``messages`` hold tool turns and that has
    no ``response`` is a conversation (``data.sft_turns``): the response runs to the end of its last assistant turn and the mask
    is 1 on the assistant turns only (tool results and headers between them are 0).
    """
    prompts, responses, masks = [], [], []
    origins = getattr(rows, "origins", None) or [RowOrigin("SFT rows", i) for i in range(len(rows))]
    for i, row in enumerate(rows):
        if is_conversation(row):
            turns = check_conversation(row["messages"], origins[i])
            ids, response, mask = encode_conversation(tokenizer, turns, origins[i])
            prompts.append(ids)
            responses.append(response)
            masks.append(mask)
            continue
        prompt = row.get("prompt")
        response = row.get("response") or (row.get("extra_info") or {}).get("answer")
        if not prompt or not isinstance(response, str) or not response:
            raise UserError(
                f"SFT row {i} needs a non-empty 'prompt' and a 'response' (or extra_info.answer), or "
                "'messages' with tool and assistant turns"
            )
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        prompts.append(list(ids))
        responses.append([*tokenizer.encode(response, add_special_tokens=False), end_token_id])
        masks.append([1] * len(responses[-1]))
    return prompts, responses, masks


def run_sft(
    actor: ActorWorker,
    prompts: list[list[int]],
    responses: list[list[int]],
    steps: int,
    batch_size: int,
    pad_token_id: int,
    seed: int = 0,
    on_step: Any = None,
    masks: list[list[int]] | None = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of NLL on the responses, ``batch_size`` pairs each, seeded order.

    ``masks`` (one per response, 1 where trained) leave out the tokens of a conversation's other turns.
    """
    sampler = PromptSampler(len(prompts), batch_size, seed, shuffle=True)
    width = max(len(r) for r in responses)
    history = []
    for step in range(1, steps + 1):
        idx = sampler.next_batch()
        batch = pack_prompt_response(
            [prompts[i] for i in idx], [responses[i] for i in idx], width, pad_token_id
        )
        if masks is not None:  # tool results and turn headers inside a response are never trained on
            trained, _ = pad_rows([masks[i] for i in idx], width, 0, torch.float32)  # (b, R)
            batch["response_mask"] = batch["response_mask"] * trained
        metrics = actor.update_sft(batch)
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
