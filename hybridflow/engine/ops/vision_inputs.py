"""A vision-language model's scoring inputs: each micro-batch's images and M-RoPE positions.

A batch row carries its images as the non-tensor ``multi_modal_inputs`` (None for a text-only row, else
``{"pixel_values": (P, D), "image_grid_thw": (I, 3)}``, computed once by the processor) and its prompt holds one
image token per merged patch. Micro-batches are rows of the batch, so a micro-batch's images are the
concatenation of its rows', in row order: the order of their image tokens in the flattened (or packed)
sequence, which is the order the model's ``masked_scatter`` fills them in.

The positions are M-RoPE's three rows (time, height, width), computed on the host from the valid tokens and
the grids (``models.vision.batch_mrope_positions``); a response continues its prompt's positions, and a
text-only row's are its plain positions on all three rows. Packed (remove-padding) inputs take each kept
token's positions, (3, 1, S): the packed attention finds the sequences from the bounds, not the positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.engine.ops.packing import ScoringInputs
from hybridflow.models.vision import batch_mrope_positions
from hybridflow.models.vision_tower import VisionSpec

MM_KEY = "multi_modal_inputs"  # the batch's non-tensor field of per-row images (verl's name)


def row_images(mb: Any) -> list[dict[str, torch.Tensor] | None]:
    """Each row's image dict (None: text only); all None when the batch has no ``multi_modal_inputs``."""
    if MM_KEY not in mb:
        return [None] * len(mb)
    return [_checked(row, i) for i, row in enumerate(mb[MM_KEY])]


def _checked(row: Any, index: int) -> dict[str, torch.Tensor] | None:
    if row is None:
        return None
    if not isinstance(row, dict) or "pixel_values" not in row or "image_grid_thw" not in row:
        raise TypeError(
            f"{MM_KEY}[{index}] must be None or a dict with pixel_values and image_grid_thw (the processor's "
            f"images_to_inputs), got {type(row).__name__}"
        )
    return row


def concat_images(
    rows: Sequence[dict[str, torch.Tensor] | None],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' ``pixel_values`` (P, D) and ``image_grid_thw`` (I, 3) concatenated in row order (None, None
    when no row has an image)."""
    images = [r for r in rows if r is not None and len(r["image_grid_thw"])]
    if not images:
        return None, None
    pixels = torch.cat([torch.as_tensor(r["pixel_values"]) for r in images])  # (P, D)
    grids = torch.cat([torch.as_tensor(r["image_grid_thw"]).long() for r in images])  # (I, 3)
    return pixels, grids


def with_images(inputs: ScoringInputs, mb: Any, spec: VisionSpec) -> ScoringInputs:
    """``inputs`` (built on the host from micro-batch ``mb``) with its images and M-RoPE positions."""
    rows = row_images(mb)
    ids, mask = mb["input_ids"], mb["attention_mask"]  # (b, T) each
    prompt_len = ids.shape[1] - mb["responses"].shape[1]
    # The prompts' image tokens: one the policy sampled in its response is text.
    image = (ids == spec.image_token_id) & (torch.arange(ids.shape[1]) < prompt_len)  # (b, T)
    positions = batch_mrope_positions(
        ids, mask, rows, spec.image_token_id, spec.merge_size, image
    )  # (3, b, T)
    image_mask = image
    if inputs.token_index is not None:  # packed: the kept tokens' positions
        positions = positions.reshape(3, -1)[:, inputs.token_index][:, None]  # (3, 1, S)
        image_mask = image.reshape(-1)[inputs.token_index][None]  # (1, S)
    pixels, grids = concat_images(rows)
    expected = 0 if grids is None else int((grids.prod(-1) // spec.merge_size**2).sum())
    found = int(image.sum())
    if found != expected:
        raise ValueError(
            f"the micro-batch holds {found} image tokens but its images make {expected}: each prompt's image "
            "pads must be expanded (VisionProcessor.expand_image_tokens) and its multi_modal_inputs kept with it"
        )
    return dataclasses.replace(
        inputs, position_ids=positions, pixel_values=pixels, image_grid_thw=grids, image_mask=image_mask
    )
