"""Supervised fine-tuning on prompt/response pairs, on the same engine (the loss is on the response only)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from hybridflow.data import PromptSampler
from hybridflow.data.images import MULTI_MODAL_KEY
from hybridflow.data.rl_dataset import encode_image_prompt, has_images
from hybridflow.data.rows import RowOrigin
from hybridflow.data.sft_turns import check_conversation, encode_conversation, is_conversation
from hybridflow.engine import pack_prompt_response, pad_rows
from hybridflow.utils.errors import UserError
from hybridflow.workers.actor import ActorWorker

logger = logging.getLogger(__name__)

TEXT_MODEL_FIX = (
    "SFT on images needs a vision-language model (Qwen2-VL / Qwen2.5-VL) with its processor; point model.path "
    "to one, or drop the rows' 'images' column"
)


def encode_pairs(
    tokenizer: Any,
    rows: list[dict],
    end_token_id: int,
    processor: Any = None,
    image_fix: str = TEXT_MODEL_FIX,
    image_key: str = "images",
) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[dict | None]]:
    """Chat-template prompt ids, response ids (ending with the chat end token), loss masks and images of each row.

    A row has ``prompt`` (chat messages or text) and ``response`` (text), or the built-in tasks' reference
    answer in ``extra_info.answer``; its mask is all ones. A row whose ``messages`` hold tool turns and that has
    no ``response`` is a conversation (``data.sft_turns``): the response runs to the end of its last assistant turn and the mask
    is 1 on the assistant turns only (tool results and headers between them are 0).

    A row with images (an ``images`` column with ``<image>`` placeholders, or Hugging Face's ``{"type":
    "image"}`` items) needs a vision-language model's ``processor``: its prompt is encoded exactly as the RL
    dataset encodes it (image pads expanded) and its images (``{"pixel_values", "image_grid_thw"}``, processed
    once) are the row's entry in the fourth list, None for text rows. Without a processor such a row is refused
    with ``image_fix`` as the way out. ``image_key``: the images column (``data.image_key`` for files).
    """
    prompts, responses, masks, images = [], [], [], []
    origins = getattr(rows, "origins", None) or [RowOrigin("SFT rows", i) for i in range(len(rows))]
    for i, row in enumerate(rows):
        if isinstance(row, dict) and has_images(row, image_key=image_key):
            if processor is None or is_conversation(row):
                why = "the model has no image processor" if processor is None else "it is a tool conversation"
                raise UserError(
                    f"SFT row {i} ({origins[i].describe()}) has images but {why}; "
                    + (image_fix if processor is None else "SFT on tool conversations takes text rows only")
                )
            ids, mm = encode_image_prompt(tokenizer, processor, row, origins[i], image_key=image_key)
            prompts.append(ids)
            responses.append(
                [*tokenizer.encode(_response_of(row, i), add_special_tokens=False), end_token_id]
            )
            masks.append([1] * len(responses[-1]))
            images.append(mm)
            continue
        images.append(None)
        if is_conversation(row):
            turns = check_conversation(row["messages"], origins[i])
            ids, response, mask = encode_conversation(tokenizer, turns, origins[i])
            prompts.append(ids)
            responses.append(response)
            masks.append(mask)
            continue
        response = _response_of(row, i)
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        prompts.append(list(ids))
        responses.append([*tokenizer.encode(response, add_special_tokens=False), end_token_id])
        masks.append([1] * len(responses[-1]))
    return prompts, responses, masks, images


def row_objects(values: list[Any]) -> np.ndarray:
    """A 1-D object array of ``values`` (filled one by one so each dict stays one element)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _response_of(row: Any, i: int) -> str:
    """The row's target: ``response``, else the built-in tasks' ``extra_info.answer``; refused when missing."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    response = (row.get("response") or (row.get("extra_info") or {}).get("answer")) if prompt else None
    if not isinstance(response, str) or not response:
        raise UserError(
            f"SFT row {i} needs a non-empty 'prompt' and a 'response' (or extra_info.answer), or "
            "'messages' with tool and assistant turns"
        )
    return response


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
    images: list[dict | None] | None = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of NLL on the responses, ``batch_size`` pairs each, seeded order.

    ``masks`` (one per response, 1 where trained) leave out the tokens of a conversation's other turns.
    ``images`` (one per row, None for a text row; ``encode_pairs``' fourth list) go into each step's batch as
    the non-tensor ``multi_modal_inputs``, which the actor's forward feeds to a vision-language model.
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
        if images is not None and any(images[i] is not None for i in idx):
            batch[MULTI_MODAL_KEY] = row_objects(
                [images[i] for i in idx]
            )  # (b,) dicts or None, aligned with rows
        metrics = actor.update_sft(batch)
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
