"""The RL prompt dataset: validated rows, chat-templated and tokenized once, and the left-padding collate.

rows = load_rows("train.parquet")                      # or make_task("arithmetic", "train", 2000, 0)
ds = RLDataset(rows, tokenizer, max_prompt_length=128, filter_overlong_prompts=True)
batch = collate_prompts([ds[i] for i in idx], tokenizer.pad_token_id)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.data.images import (
    MULTI_MODAL_KEY,
    PLACEHOLDER,
    has_image_items,
    image_slot,
    process_images,
    prompt_with_slots,
    row_images,
)
from hybridflow.data.rows import (
    DataError,
    RowOrigin,
    check_extra_info,
    check_ground_truth,
    check_prompt,
    check_str_field,
    is_missing,
    lookup,
    origins_of,
    row_error,
    source_name,
)
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right", "middle")


def truncate(ids: list[int], max_length: int, side: str) -> list[int]:
    """Cut ``ids`` to ``max_length`` tokens: 'left' keeps the end, 'right' the start, 'middle' both ends."""
    if len(ids) <= max_length:
        return ids
    if side == "left":
        return ids[len(ids) - max_length :]
    if side == "right":
        return ids[:max_length]
    if side == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise UserError(f"truncation must be one of {TRUNCATIONS}, got {side!r}")


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]) -> str:
    """The prompt text the model sees: chat messages through the chat template with the generation prompt."""
    if isinstance(prompt, str):
        return prompt
    if not has_chat_template(tokenizer):
        raise UserError(
            "the prompts are chat messages but the tokenizer has no chat template; set "
            "model.custom_chat_template, or give text prompts"
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str | list[dict]], template_text: bool = False
) -> list[list[int]]:
    """Token ids of each prompt: chat prompts templated (specials come from the template), text as is.

    With ``template_text`` and a tokenizer that has a chat template, a text prompt is one user turn and is
    templated like chat messages (verl's behaviour; ``data.template_text_prompts``).
    """
    if template_text and has_chat_template(tokenizer):
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    chat = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    text = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    out: list[list[int]] = [[] for _ in prompts]
    if chat:
        rendered = [render_prompt(tokenizer, prompts[i]) for i in chat]
        # The template already holds the special tokens (BOS, turn markers): do not add them twice.
        for i, ids in zip(chat, tokenizer(rendered, add_special_tokens=False)["input_ids"]):
            out[i] = list(ids)
    if text:
        for i, ids in zip(text, tokenizer([prompts[i] for i in text])["input_ids"]):
            out[i] = list(ids)
    return out


def slot_images(
    row: Any, origin: RowOrigin, prompt_key: str, processor: Any, image_key: str = "images"
) -> tuple[Any, list[Any]]:
    """The row with its image placeholders as ``processor``'s image slots, and its (undecoded) images.

    Without a processor (a text model) a row with images is refused; its text items are joined.
    """
    if not isinstance(row, dict) or prompt_key not in row:
        return row, []  # the row's validation refuses it, naming the row
    images = row_images(row, image_key, origin)
    prompt = row[prompt_key]
    if processor is None:
        if images or has_image_items(prompt):
            raise row_error(
                origin,
                f"the row has images (column {image_key!r} or {{'type': 'image'}} items) but the "
                "model is text-only; use a vision-language model (Qwen2-VL / Qwen2.5-VL) or drop the "
                f"{image_key!r} column",
            )
        text, _ = prompt_with_slots(prompt, origin, prompt_key, PLACEHOLDER)  # text items joined
        return {**row, prompt_key: text}, []
    text, count = prompt_with_slots(prompt, origin, prompt_key, image_slot(processor))
    if count != len(images):
        raise row_error(
            origin,
            f"the prompt has {count} image placeholder(s) ({PLACEHOLDER} in the text or "
            f"{{'type': 'image'}} items) but column {image_key!r} holds {len(images)} image(s); "
            "give one placeholder per image, in the images' order",
        )
    return {**row, prompt_key: text}, images


def attach_images(
    ids: list[int], images: list[Any], origin: RowOrigin, processor: Any, image_key: str = "images"
) -> tuple[list[int], dict[str, Any] | None]:
    """The prompt ids with each image pad expanded and the row's ``multi_modal_inputs`` (its images processed
    once; None for a text row)."""
    if not images:
        if getattr(processor, "image_token_id", None) in ids:
            raise row_error(
                origin, "the prompt's text holds image pad tokens but the row has no images; remove them"
            )
        return ids, None
    return process_images(processor, ids, images, origin, image_key)


def has_images(row: Any, prompt_key: str = "prompt", image_key: str = "images") -> bool:
    """Whether a row holds images: a non-empty images column or ``{'type': 'image'}`` items in its prompt."""
    if not isinstance(row, dict):
        return False
    return bool(row_images(row, image_key, RowOrigin("row", 0))) or has_image_items(row.get(prompt_key))


def encode_image_prompt(
    tokenizer: PreTrainedTokenizerBase,
    processor: Any,
    row: dict[str, Any],
    origin: RowOrigin,
    prompt_key: str = "prompt",
    image_key: str = "images",
) -> tuple[list[int], dict[str, Any] | None]:
    """One row's prompt ids and ``multi_modal_inputs`` exactly as ``RLDataset`` (with ``processor``) encodes
    them: the image slots, the chat template (a text prompt is one user turn) and the expanded image pads."""
    row, images = slot_images(row, origin, prompt_key, processor, image_key)
    prompt = check_prompt(lookup(row, prompt_key), origin, prompt_key)
    (ids,) = encode_prompts(tokenizer, [prompt], template_text=True)
    return attach_images(ids, images, origin, processor, image_key)


class RLDataset:
    """Validated, tokenized RL prompts; ``ds[i]`` is a dict ready for ``collate_prompts``.

    Each item holds ``input_ids`` (list[int]), ``raw_prompt`` (the messages or text), ``data_source``,
    ``ground_truth``, ``extra_info`` and ``index`` (``extra_info["index"]`` when present, else the row's
    number in its source; ``ground_truth`` is None for a row without one when ``require_ground_truth`` is
    false, for rewards that do not read it). Prompts longer than ``max_prompt_length`` tokens are dropped when
    ``filter_overlong_prompts`` (the count is logged and kept in ``num_filtered``), otherwise truncated
    per ``truncation`` ('left', 'right', 'middle'; count in ``num_truncated``) or, for 'error', refused.
    Errors name the row's file, row and jsonl line as ``load_rows`` recorded them; rows given as a plain
    list are named ``source`` (default 'built-in') and their position. ``template_text_prompts``: text
    prompts go through the chat template as one user turn when the tokenizer has one (``raw_prompt`` keeps
    the text); false feeds them as they are.

    Images (``hybridflow.data.images``): with the model's ``processor``, a row's images (column
    ``image_key``) are decoded and processed once, here; the item's ``multi_modal_inputs`` is the processor's
    ``{"pixel_values", "image_grid_thw"}`` (None for a text row) and its ``input_ids`` hold each image's pad
    tokens expanded, which count toward ``max_prompt_length``. Without a processor a row with images is
    refused.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        source: str | None = None,
        reward_fn_key: str = "data_source",
        require_ground_truth: bool = True,
        template_text_prompts: bool = True,
        processor: Any = None,
        image_key: str = "images",
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise UserError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if max_prompt_length < 1:
            raise UserError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        origins = origins_of(rows, source)
        self.source = source_name(origins, source)
        if not rows:
            raise DataError(f"{self.source}: no rows; the dataset is empty", file=self.source)
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.processor, self.image_key = processor, image_key
        items, images = [], []
        for row, origin in zip(rows, origins):
            row, row_imgs = self._with_image_slots(row, origin, prompt_key)
            items.append(self._validate(row, origin, prompt_key, reward_fn_key, require_ground_truth))
            images.append(row_imgs)
        prompts = [it["raw_prompt"] for it in items]
        ids = encode_prompts(tokenizer, prompts, template_text=template_text_prompts)
        self._log_text_prompts(prompts, tokenizer, template_text_prompts)
        self.items: list[dict[str, Any]] = []
        self.origins: list[RowOrigin] = []
        self.num_filtered = self.num_truncated = 0
        for item, origin, prompt_ids, row_imgs in zip(items, origins, ids, images):
            prompt_ids = self._with_images(item, origin, prompt_ids, row_imgs)
            prompt_ids = self._fit(prompt_ids, origin, bool(row_imgs))
            if prompt_ids is None:
                continue
            item["input_ids"] = prompt_ids
            self.items.append(item)
            self.origins.append(origin)
        self._log_counts(len(rows))

    def _with_image_slots(self, row: Any, origin: RowOrigin, prompt_key: str) -> tuple[Any, list[Any]]:
        """The row with its image placeholders as the model's image slots, and its (undecoded) images."""
        return slot_images(row, origin, prompt_key, self.processor, self.image_key)

    def _with_images(
        self, item: dict[str, Any], origin: RowOrigin, ids: list[int], images: list[Any]
    ) -> list[int]:
        """Process the row's images once (into ``item``) and expand its image pads; text rows get None."""
        if self.processor is None:
            return ids
        ids, item[MULTI_MODAL_KEY] = attach_images(ids, images, origin, self.processor, self.image_key)
        return ids

    def _fit(self, ids: list[int], origin: RowOrigin, has_images: bool) -> list[int] | None:
        """The prompt within max_prompt_length: as it is, truncated, or None when filtered out."""
        if len(ids) <= self.max_prompt_length:
            return ids
        if self.filter_overlong_prompts:
            self.num_filtered += 1
            return None
        if self.truncation == "error" or has_images:
            cut = "" if has_images else ", or set data.truncation=left|right|middle"
            why = (
                " (a prompt with images is never truncated: it would cut an image's tokens)"
                if has_images
                else ""
            )
            raise row_error(
                origin,
                f"prompt has {len(ids)} tokens{' with its image tokens' if has_images else ''}, more than "
                f"max_prompt_length={self.max_prompt_length}{why}; raise data.max_prompt_length or set "
                f"data.filter_overlong_prompts=true{cut}",
            )
        self.num_truncated += 1
        return truncate(ids, self.max_prompt_length, self.truncation)

    @staticmethod
    def _validate(
        row: Any, origin: RowOrigin, prompt_key: str, reward_fn_key: str, require_ground_truth: bool = True
    ) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise row_error(origin, f"a row must be a dict, got {type(row).__name__}")
        extra_info = check_extra_info(row.get("extra_info"), origin)
        index = extra_info.get("index")
        truth = lookup(row, "reward_model.ground_truth")
        return {
            "raw_prompt": check_prompt(lookup(row, prompt_key), origin, prompt_key),
            "data_source": check_str_field(lookup(row, reward_fn_key), origin, reward_fn_key),
            "ground_truth": None
            if not require_ground_truth and is_missing(truth)
            else check_ground_truth(truth, origin),
            "extra_info": extra_info,
            "index": index if isinstance(index, int) else origin.row,
        }

    def _log_text_prompts(
        self, prompts: list[Any], tokenizer: PreTrainedTokenizerBase, template: bool
    ) -> None:
        """One line saying what text prompts become when the tokenizer has a chat template."""
        texts = sum(isinstance(p, str) for p in prompts)
        if not texts or not has_chat_template(tokenizer):
            return
        if template:
            logger.info(
                "%s: %d of %d prompts are text: each is one user turn through the chat template, as verl "
                "does (data.template_text_prompts=false feeds them as they are)",
                *(self.source, texts, len(prompts)),
            )
        else:
            logger.info(
                "%s: %d of %d prompts are text and go to the model as they are, without the chat template "
                "(data.template_text_prompts=false)",
                *(self.source, texts, len(prompts)),
            )

    def _log_counts(self, total: int) -> None:
        if self.num_filtered:
            logger.info(
                "%s: filtered out %d of %d prompts longer than %d tokens",
                self.source,
                self.num_filtered,
                total,
                self.max_prompt_length,
            )
        if self.num_truncated:
            logger.info(
                "%s: truncated %d of %d prompts to %d tokens",
                self.source,
                self.num_truncated,
                total,
                self.max_prompt_length,
            )
        if not self.items:
            raise DataError(
                f"{self.source}: all {total} prompts are longer than max_prompt_length="
                f"{self.max_prompt_length}; raise data.max_prompt_length",
                file=self.source,
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def data_sources(self) -> list[str]:
        """The distinct data sources present, sorted."""
        return sorted({it["data_source"] for it in self.items})

    def where(self, i: int) -> str:
        """Where item ``i`` came from, e.g. 'train.jsonl: row 3 (line 4)'."""
        return self.origins[i].describe()

    def require_data_sources(self, known: Collection[str] | Callable[[str], bool], hint: str = "") -> None:
        """Raise DataError naming the first row whose data_source is not ``known`` (a set or predicate)."""
        is_known = known if callable(known) else known.__contains__
        for item, origin in zip(self.items, self.origins):
            if not is_known(item["data_source"]):
                listed = "" if callable(known) else f" (known: {sorted(known)})"
                raise row_error(
                    origin,
                    f"no reward function for data_source {item['data_source']!r}{listed}. {hint}".rstrip(),
                )


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int) -> Batch:
    """Left-pad prompts to the longest in the batch: input_ids, attention_mask, position_ids (B, P)."""
    if not items:
        raise UserError("collate_prompts needs at least one item")
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)  # (B, P)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        if n:
            # Left padding: every prompt ends at the last column, where generation continues.
            input_ids[b, width - n :] = torch.as_tensor(it["input_ids"], dtype=torch.long)
            attention_mask[b, width - n :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, P), 0 on the left padding
    keys = ["data_source", "ground_truth", "extra_info", "raw_prompt", "index"]
    if any(MULTI_MODAL_KEY in it for it in items):  # a dataset built with a processor: None for text rows
        keys.append(MULTI_MODAL_KEY)
    non_tensors = {key: _objects([it.get(key) for it in items]) for key in keys}
    return Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, non_tensors
    )


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)  # filled one by one so lists/dicts stay single elements
    for i, v in enumerate(values):
        out[i] = v
    return out
