"""Image prompts of a vision-language model (Qwen2-VL / Qwen2.5-VL) in the paged engine: what a sequence keeps
of its images, the vision tower at prefill, and the M-RoPE positions of a prefill chunk.

A prompt's images live on its ``Sequence`` (``MMPrompt``) for as long as it runs, so a sequence preempted or
re-prefilled under new weights runs the vision tower again. The tower runs at prefill only, once per prompt
group (the n samples fork the prompt's blocks), on HF's own module (``model.model.visual``, called as HF's
``get_image_features`` calls it), and its merged features replace the embeddings of the image-pad tokens
(``masked_scatter``, as HF's forward). Decode needs only each sequence's rope delta (generated tokens are text:
all three M-RoPE rows equal index + delta), kept in a device buffer per seat (``DecodeState.rope_delta``).

Prefix reuse: the pad tokens of two different images are the same ids, so a sequence with images keys its
blocks by ``MMPrompt.digest`` too (``hash_keys``): equal prompts with different images never share blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Protocol

import torch
from torch import nn

from hybridflow.models.vision import mrope_positions
from hybridflow.utils.errors import UserError

# Patches the vision tower sees per call: bounds its activations when a round admits many image prompts
# (64 prompts of a 448 x 448 image are 65k patches).
MAX_PATCHES_PER_CALL = 16384


@dataclasses.dataclass(eq=False)
class MMPrompt:
    """A prompt's images: the processor's inputs, its (3, T) M-RoPE positions and rope delta, a content digest."""

    inputs: dict[str, torch.Tensor]  # {"pixel_values": (P, D), "image_grid_thw": (I, 3)}
    positions: torch.Tensor  # (3, prompt_len) on the host
    delta: int  # a token at index i >= prompt_len sits at position i + delta on all three rows
    digest: str  # of the pixels and grids: keys the prompt's blocks for prefix reuse
    num_image_tokens: int

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[1]


class Sequence(Protocol):
    """What these helpers read of a paged-engine sequence (``sequence.Sequence``, which imports this module)."""

    id: int
    tokens: list[int]
    mm: MMPrompt | None


def mm_prompt(
    prompt: list[int], inputs: dict[str, Any] | None, image_token_id: int | None, merge_size: int | None
) -> MMPrompt | None:
    """The ``MMPrompt`` of a prompt with images (None for a text-only prompt); checks the pad-token count.
    ``image_token_id`` None: the model is a text model, which refuses images."""
    if inputs is None:
        return None
    if image_token_id is None or merge_size is None:
        raise UserError(
            "a prompt carries images (multi_modal_inputs) but the model is a text model; use a "
            "vision-language model (Qwen2-VL / Qwen2.5-VL) or drop the images from the data"
        )
    grid = torch.as_tensor(inputs["image_grid_thw"]).long().reshape(-1, 3)  # (I, 3)
    pixels = torch.as_tensor(inputs["pixel_values"])  # (P, D)
    ids = torch.tensor(prompt)
    want = int((grid.prod(-1) // merge_size**2).sum())
    got = int((ids == image_token_id).sum())
    if got != want:
        raise ValueError(
            f"a prompt has {got} image tokens but its {len(grid)} image(s) merge to {want}: expand each image "
            "pad with VisionProcessor.expand_image_tokens"
        )
    if int(grid.prod(-1).sum()) != pixels.shape[0]:
        raise ValueError(
            f"pixel_values has {pixels.shape[0]} patches; image_grid_thw implies {grid.prod(-1).sum()}"
        )
    positions, delta = mrope_positions(ids, image_token_id, grid, merge_size)  # (3, T)
    # SHA-1 over the pixels in place (no copy): ~2 ms for a 448 x 448 image's 4.8 MB, once per prompt group.
    h = hashlib.sha1(grid.numpy().tobytes())
    h.update(memoryview(pixels.detach().float().contiguous().cpu().numpy()).cast("B"))
    return MMPrompt({"pixel_values": pixels, "image_grid_thw": grid}, positions, delta, h.hexdigest(), want)


def hash_keys(s: Sequence) -> list:
    """What the block pool hashes for ``s``: its tokens, the first one paired with its images' digest."""
    if s.mm is None:
        return s.tokens
    return [(s.tokens[0], s.mm.digest), *s.tokens[1:]]


def image_features(
    visual: nn.Module, prompts: list[MMPrompt], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each prompt's merged image features (its image tokens, hidden) from HF's vision tower, batched over
    prompts within ``MAX_PATCHES_PER_CALL`` patches a call."""
    out: list[torch.Tensor] = []
    batch: list[MMPrompt] = []

    def run() -> None:
        pixels = torch.cat([p.inputs["pixel_values"] for p in batch])  # (P, D)
        grid = torch.cat([p.inputs["image_grid_thw"] for p in batch])  # (I, 3)
        param = next(visual.parameters())
        result = visual(pixels.to(param.device, param.dtype), grid_thw=grid.to(param.device))
        merged = getattr(result, "pooler_output", result)  # transformers >= 5: an output with the merged
        merged = merged[0] if isinstance(merged, tuple) else merged  # features as pooler_output
        feats = merged.to(device, dtype)  # (image tokens, hidden)
        out.extend(feats.split([p.num_image_tokens for p in batch]))
        batch.clear()

    patches = 0
    for p in prompts:
        n = p.inputs["pixel_values"].shape[0]
        if batch and patches + n > MAX_PATCHES_PER_CALL:
            run()
            patches = 0
        batch.append(p)
        patches += n
    if batch:
        run()
    return out


def rope_positions(s: Sequence, start: int, end: int) -> torch.Tensor:
    """(3, end - start) M-RoPE positions of ``s``'s tokens [start, end): the prompt's own, then index + delta."""
    if s.mm is None:
        return torch.arange(start, end).expand(3, -1)
    p = s.mm.prompt_len
    head = s.mm.positions[:, start : min(end, p)]  # (3, prompt part)
    tail = torch.arange(max(start, p), max(end, p)).expand(3, -1) + s.mm.delta  # generated or extended text
    return torch.cat([head, tail], dim=1)


def chunk_inputs(
    call: list[tuple[Sequence, int, int]],
    features: dict[int, torch.Tensor],
    image_token_id: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A prefill call's (3, b, t) M-RoPE positions, its (b, t) image-token mask and the features that fill it
    in row-major order (n, hidden), or None when the call holds no image token."""
    rows, mask, feats = [], torch.zeros(len(call), width, dtype=torch.bool), []
    for r, (s, b, e) in enumerate(call):
        pos = rope_positions(s, b, e)  # (3, e - b)
        rows.append(torch.nn.functional.pad(pos, (0, width - (e - b))))
        if s.mm is None or b >= s.mm.prompt_len:
            continue
        ids = torch.tensor(s.tokens[b : min(e, s.mm.prompt_len)])
        here = ids == image_token_id  # image tokens of this chunk, within the prompt
        if not bool(here.any()):
            continue
        before = sum(t == image_token_id for t in s.tokens[:b])  # the prompt's image tokens cached already
        mask[r, : len(ids)] = here
        feats.append(features[s.id][before : before + int(here.sum())])
    positions = torch.stack(rows, dim=1)  # (3, b, t)
    return positions, mask, torch.cat(feats) if feats else None
