"""The SFT dataset: prompt + response token ids with a loss mask on the response, and its collate.

The response is where the chat template puts the assistant's turn: for a chat prompt the whole
conversation (prompt + assistant reply) is rendered, and the response tokens are what follows the prompt
rendering (the reply and the template's end-of-turn token, e.g. ``<|im_end|>``), so SFT teaches the model
to stop exactly as the rollout engine expects. Text prompts get ``response + eos_token``.

Rows can be prompt/response files or verl-schema rows (built-in tasks, the GSM8K conversion): when
``response_key`` is absent the reference answer in ``extra_info.answer`` is used. A row whose ``messages``
hold tool turns (user, assistant calls, tool results, the answer) and that has no ``response_key`` column is
a conversation: every assistant turn is trained on and every other token is masked out (``sft_turns``:
rendered turn by turn, as a rollout is).

Rows with images (an ``images`` column with ``<image>`` placeholders, or Hugging Face's ``{"type": "image"}``
items; ``hybridflow.data.images``) need a vision-language model's ``processor``: the prompt is encoded as
``RLDataset`` encodes it (``encode_image_prompt``: image pads expanded) and the item carries the row's
``multi_modal_inputs`` (processed once), which ``collate_sft`` keeps as the batch's non-tensor field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.data.conversations import MESSAGES_KEY
from hybridflow.data.images import MULTI_MODAL_KEY
from hybridflow.data.rl_dataset import (
    encode_image_prompt,
    encode_prompts,
    has_images,
    render_prompt,
    slot_images,
    truncate,
)
from hybridflow.data.rows import (
    DataError,
    RowOrigin,
    check_prompt,
    is_missing,
    lookup,
    origins_of,
    row_error,
    source_name,
)
from hybridflow.data.sft_turns import check_conversation, encode_conversation, is_conversation
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SFT_TRUNCATIONS = ("error", "left", "right")
FALLBACK_RESPONSE_KEY = "extra_info.answer"


def render_response(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]], response: str
) -> str:
    """The text after the prompt rendering: the reply plus the chat end token (or EOS for text prompts)."""
    if not isinstance(prompt, str):
        prompt_text = render_prompt(tokenizer, prompt)
        messages = [*prompt, {"role": "assistant", "content": response}]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if full.startswith(prompt_text):
            tail = full[len(prompt_text) :]
            stripped = tail.rstrip()
            # Drop the whitespace a template puts between turns after the end token: the rollout stops
            # at the end token, so the model never needs to produce what follows it.
            if stripped != tail and any(stripped.endswith(t) for t in tokenizer.all_special_tokens):
                return stripped
            return tail
        # Templates that rewrite earlier turns (e.g. strip reasoning) do not extend the prompt: fall back.
    return response + (tokenizer.eos_token or "")


class SFTDataset:
    """Tokenized prompt/response pairs or conversations; ``ds[i]`` has ``input_ids`` and ``loss_mask`` (1 on the
    tokens trained on: the response, or a conversation's assistant turns).

    With a vision-language model's ``processor`` every item also has ``multi_modal_inputs`` (None for a text
    row); without one a row with images (column ``image_key``) is refused. An image row is never truncated
    into its prompt (that would cut an image's tokens).
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        response_key: str = "response",
        max_length: int = 512,
        truncation: str = "error",
        source: str | None = None,
        processor: Any = None,
        image_key: str = "images",
    ) -> None:
        if truncation not in SFT_TRUNCATIONS:
            raise UserError(f"SFT truncation must be one of {SFT_TRUNCATIONS}, got {truncation!r}")
        if max_length < 2:
            raise UserError(f"max_length must be >= 2, got {max_length}")
        origins = origins_of(rows, source)
        self.source = source_name(origins, source)
        if not rows:
            raise DataError(f"{self.source}: no rows; the dataset is empty", file=self.source)
        self.processor, self.image_key = processor, image_key
        visual = {i for i, r in enumerate(rows) if has_images(r, prompt_key, image_key)}
        chats = {i for i, r in enumerate(rows) if i not in visual and is_conversation(r, response_key)}
        pairs = {
            i: self._validate(r, o, prompt_key, response_key)
            for i, (r, o) in enumerate(zip(rows, origins))
            if i not in chats and i not in visual
        }
        encoded = dict(zip(pairs, self._encode_pairs(tokenizer, list(pairs.values()))))
        images = {
            i: self._encode_images(tokenizer, rows[i], origins[i], prompt_key, response_key) for i in visual
        }
        for i in sorted(chats):
            turns = check_conversation(rows[i][MESSAGES_KEY], origins[i])
            encoded[i] = encode_conversation(tokenizer, turns, origins[i])
        self.items: list[dict[str, Any]] = []
        self.num_truncated = 0
        for i, origin in enumerate(origins):
            if i in images:
                p_ids, r_ids, mm = images[i]
                # Cutting into the prompt would cut an image's tokens: only the response's end may go.
                cut = "right" if truncation == "right" and len(p_ids) < max_length else "error"
                item = self._item(origin, p_ids, r_ids, [1] * len(r_ids), max_length, cut)
            else:
                item, mm = self._item(origin, *encoded[i], max_length, truncation), None
            if processor is not None:
                item[MULTI_MODAL_KEY] = mm
            self.items.append(item)

    def _encode_images(
        self,
        tokenizer: PreTrainedTokenizerBase,
        row: dict[str, Any],
        origin: RowOrigin,
        prompt_key: str,
        response_key: str,
    ) -> tuple[list[int], list[int], dict[str, Any] | None]:
        """An image row's prompt ids (encoded as ``RLDataset`` encodes them), response ids and images."""
        if self.processor is None:
            raise row_error(
                origin,
                f"the row has images (column {self.image_key!r} or {{'type': 'image'}} items) but no image "
                "processor was given; SFT on images needs a vision-language model (Qwen2-VL / Qwen2.5-VL) "
                f"and its processor, or drop the {self.image_key!r} column",
            )
        slotted, _ = slot_images(row, origin, prompt_key, self.processor, self.image_key)
        prompt, response = self._validate(slotted, origin, prompt_key, response_key)
        p_ids, mm = encode_image_prompt(tokenizer, self.processor, row, origin, prompt_key, self.image_key)
        r_ids = tokenizer(render_response(tokenizer, prompt, response), add_special_tokens=False)["input_ids"]
        return p_ids, list(r_ids), mm

    @staticmethod
    def _encode_pairs(
        tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[Any, str]]
    ) -> list[tuple[list[int], list[int], list[int]]]:
        """Prompt ids, response ids and an all-ones response mask of each prompt/response pair."""
        if not pairs:
            return []
        prompt_ids = encode_prompts(tokenizer, [p for p, _ in pairs])
        tails = [render_response(tokenizer, p, r) for p, r in pairs]
        response_ids = tokenizer(tails, add_special_tokens=False)["input_ids"]
        return [(list(p), list(r), [1] * len(r)) for p, r in zip(prompt_ids, response_ids)]

    @staticmethod
    def _validate(row: Any, origin: RowOrigin, prompt_key: str, response_key: str) -> tuple[Any, str]:
        if not isinstance(row, dict):
            raise row_error(origin, f"a row must be a dict, got {type(row).__name__}")
        prompt = check_prompt(lookup(row, prompt_key), origin, prompt_key)
        response = lookup(row, response_key)
        if is_missing(response):
            response = lookup(row, FALLBACK_RESPONSE_KEY)
        if is_missing(response):
            raise row_error(
                origin,
                f"missing column {response_key!r} (and no {FALLBACK_RESPONSE_KEY}); set data.response_key "
                "to the column holding the target response",
            )
        if not isinstance(response, str) or not response.strip():
            raise row_error(origin, f"the response must be a non-empty str, got {type(response).__name__}")
        return prompt, response

    def _item(
        self,
        origin: RowOrigin,
        p_ids: list[int],
        r_ids: list[int],
        r_mask: list[int],
        max_length: int,
        truncation: str,
    ) -> dict[str, Any]:
        ids, mask = p_ids + r_ids, [0] * len(p_ids) + r_mask
        if len(ids) > max_length:
            if truncation == "error":
                raise row_error(
                    origin,
                    f"prompt + response is {len(ids)} tokens, more than max_length={max_length}; raise "
                    "max_length or set truncation=left|right",
                )
            ids, mask = truncate(ids, max_length, truncation), truncate(mask, max_length, truncation)
            self.num_truncated += 1
            if not any(mask):
                raise row_error(origin, f"no response token is left after truncation to {max_length} tokens")
        return {"input_ids": ids, "loss_mask": mask}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def collate_sft(items: Sequence[dict[str, Any]], pad_id: int) -> Batch:
    """Right-pad to the longest sequence: input_ids, attention_mask, position_ids, loss_mask (B, L).

    ``loss_mask[b, t] == 1`` where ``input_ids[b, t]`` is a response token (aligned with the inputs, not
    with the logits: the logit at t - 1 predicts token t, so a trainer shifts both by one). Items of a dataset
    built with a processor add the non-tensor ``multi_modal_inputs`` (None for a text row).
    """
    if not items:
        raise UserError("collate_sft needs at least one item")
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)  # (B, L)
    loss_mask = torch.zeros((len(items), width), dtype=torch.long)  # (B, L)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        input_ids[b, :n] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(it["loss_mask"], dtype=torch.long)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, L)
    non_tensors = {}
    if any(MULTI_MODAL_KEY in it for it in items):
        images = np.empty(len(items), dtype=object)  # filled one by one so each dict stays one element
        for b, it in enumerate(items):
            images[b] = it.get(MULTI_MODAL_KEY)
        non_tensors[MULTI_MODAL_KEY] = images
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
        },
        non_tensors,
    )
