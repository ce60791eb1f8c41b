"""Images of RL prompt rows: the two row formats, decoding, and processing each row's images once.

Two formats are read (``data.image_key``, default ``images``, names the images column, as in verl):

  * verl's: the prompt's string contents hold one ``<image>`` placeholder per image, in order, and the
    images column lists the images;
  * TRL's / Hugging Face's conversational one: a message's content is a list of ``{"type": "image"}`` and
    ``{"type": "text", "text": ...}`` items, the images again in the images column.

Both become chat messages with string content in which each image is the processor's image slot
(``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL-family models), so the rest of the data
layer (validation, the chat template, length rules) treats them as text. An image is a file path (relative
paths are resolved against the data file's directory), raw bytes, a ``{"bytes": ..., "path": ...}`` dict
(how parquet and Hugging Face datasets store images) or a PIL image.

The processor is the model's (``hybridflow.models.vision.VisionProcessor``), taken duck-typed: this layer
may not import the models. It must offer ``images_to_inputs(list[PIL.Image]) -> {"pixel_values",
"image_grid_thw"}``, ``expand_image_tokens(ids, grid_thw) -> ids`` and optionally ``image_slot`` (the text of
one image in a prompt; Qwen2-VL's ``QWEN_IMAGE_SLOT`` otherwise).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.data.rows import RowOrigin, row_error

PLACEHOLDER = "<image>"  # verl's marker of one image in a prompt's text
# The rendered text of one image for the Qwen2-VL family: models.vision.IMAGE_SLOT (a test keeps them equal).
QWEN_IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
MULTI_MODAL_KEY = "multi_modal_inputs"  # the batch's non-tensor field (verl's name)


def image_slot(processor: Any) -> str:
    """The text that stands for one image in a rendered prompt of ``processor``'s model."""
    return getattr(processor, "image_slot", None) or QWEN_IMAGE_SLOT


def _as_list(value: Any) -> Any:
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()  # parquet through pandas / HF datasets gives numpy arrays
    return value


def row_images(row: Mapping[str, Any], image_key: str, origin: RowOrigin) -> list[Any]:
    """The row's images column as a list (empty when the row has none: absent, None or an empty list)."""
    value = _as_list(row.get(image_key))
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        value = [value]  # one image given without a list
    return list(value)


def _content_text(content: Any, origin: RowOrigin, where: str, slot: str) -> tuple[str, int]:
    """A message's content as text with ``slot`` for each image, and how many images it holds."""
    content = _as_list(content)
    if isinstance(content, str):
        return content.replace(PLACEHOLDER, slot), content.count(PLACEHOLDER)
    if not isinstance(content, (list, tuple)):
        return content, 0  # not ours to judge: check_prompt refuses it, naming the row
    parts, images = [], 0
    for i, item in enumerate(content):
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "text" and isinstance(item.get("text"), str):
            parts.append(item["text"].replace(PLACEHOLDER, slot))
            images += item["text"].count(PLACEHOLDER)
        elif kind == "image":
            if item.get("image") is not None or item.get("url") is not None:
                raise row_error(
                    origin,
                    f"{where}[{i}] holds its image inline; put the images in the row's images column "
                    "(data.image_key) and keep {'type': 'image'} as the placeholder",
                )
            parts.append(slot)
            images += 1
        else:
            raise row_error(
                origin,
                f"{where}[{i}] must be {{'type': 'image'}} or {{'type': 'text', 'text': str}}, got "
                f"{_short(item)}",
            )
    return "".join(parts), images


def prompt_with_slots(prompt: Any, origin: RowOrigin, prompt_key: str, slot: str) -> tuple[Any, int]:
    """The prompt with every image placeholder replaced by ``slot`` (contents as text), and the image count.

    A text prompt, or messages whose contents are strings or lists of image/text items; anything else is
    returned as it is for ``check_prompt`` to refuse.
    """
    if isinstance(prompt, str):
        return prompt.replace(PLACEHOLDER, slot), prompt.count(PLACEHOLDER)
    messages = _as_list(prompt)
    if not isinstance(messages, (list, tuple)):
        return prompt, 0
    out, count = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "content" not in m:
            return prompt, 0  # check_prompt names the bad message
        text, n = _content_text(m["content"], origin, f"{prompt_key}[{i}]['content']", slot)
        out.append({**m, "content": text})
        count += n
    return out, count


def has_image_items(prompt: Any) -> bool:
    """Whether chat messages hold Hugging Face image items (``{"type": "image"}``) in a list content."""
    messages = _as_list(prompt)
    if not isinstance(messages, (list, tuple)):
        return False
    for m in messages:
        content = _as_list(m.get("content")) if isinstance(m, Mapping) else None
        if isinstance(content, (list, tuple)) and any(
            isinstance(it, Mapping) and it.get("type") == "image" for it in content
        ):
            return True
    return False


def base_dir(origin: RowOrigin) -> Path:
    """Where a row's relative image paths start: its data file's directory, else the working directory."""
    path = Path(origin.file).expanduser()
    return path.parent if path.is_file() else Path.cwd()


def decode_image(value: Any, origin: RowOrigin, index: int, image_key: str) -> Any:
    """One image as an RGB PIL image; DataError naming the row and the image when it cannot be read."""
    from PIL import Image  # imported here so `import hybridflow.data` stays light

    where = f"{image_key}[{index}]"
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is None and path is None:
            raise row_error(origin, f"{where} is a dict without 'bytes' or 'path'; give one of them")
        value = data if data is not None else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(value))) as image:
                return image.convert("RGB")
        except Exception as e:  # PIL raises several types for bad data
            raise row_error(origin, f"{where}: the image bytes cannot be decoded ({e}); fix the data") from e
    if isinstance(value, (str, os.PathLike)):
        return _open_path(str(value), origin, where)
    raise row_error(
        origin,
        f"{where} must be a file path, bytes, a {{'bytes', 'path'}} dict or a PIL image, got "
        f"{type(value).__name__}",
    )


def _open_path(text: str, origin: RowOrigin, where: str) -> Any:
    from PIL import Image

    if text.startswith(("http://", "https://")):
        raise row_error(origin, f"{where} is a URL ({text}); download the image and give its path")
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        path = base_dir(origin) / path
    if not path.is_file():
        raise row_error(
            origin,
            f"{where}: image file {path} not found (relative paths start at the data file's directory); "
            "fix the path",
        )
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as e:
        raise row_error(origin, f"{where}: cannot read image file {path} ({e}); fix or replace it") from e


def process_images(
    processor: Any, ids: list[int], images: list[Any], origin: RowOrigin, image_key: str
) -> tuple[list[int], dict[str, Any]]:
    """Decode and process a row's images once: the ids with each image pad expanded, and the row's inputs."""
    pil = [decode_image(image, origin, i, image_key) for i, image in enumerate(images)]
    try:
        inputs = processor.images_to_inputs(pil)  # {"pixel_values": (P, D), "image_grid_thw": (I, 3)}
    except Exception as e:  # the image processor's own refusals (e.g. an image too small or too long)
        raise row_error(origin, f"the processor cannot process the images ({e}); fix the images") from e
    try:
        expanded = processor.expand_image_tokens(ids, inputs["image_grid_thw"])
    except ValueError as e:  # the text itself holds image pad tokens besides the placeholders
        raise row_error(
            origin, f"{e}: the prompt's text holds image tokens of its own; remove them, use {PLACEHOLDER}"
        ) from e
    return expanded, inputs


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
