"""Prompt + response batches with images for the tiny Qwen2.5-VL (``models.vision``), in the training layout.

Rows as the data layer hands them on (the issue-47 contract): each prompt's image pads expanded to one token
per merged patch, the row's images as the non-tensor ``multi_modal_inputs`` (None for a text-only row), plain
(B, T) text ``position_ids``. Images of different sizes (one to sixteen tokens, two in one prompt), text-only
rows, left-padded prompts and right-padded responses of different lengths.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from hybridflow.models.vision import IMAGE_SLOT
from hybridflow.protocol import Batch
from support.batches import NORMAL, draw_fields, grouped_batch

R = 7  # response width
# Per row: image sizes (width, height) in its prompt, the prompt's text, the response's text (<= R chars).
ROWS = [
    ([(56, 56)], "how many red?", "2 red"),
    ([], "what is 3+4?", "7"),
    ([(84, 56)], "colour?", "blue!!"),
    ([(56, 56), (56, 112)], "same?", "no, 3"),
    ([], "say hi", "hi"),
    ([], "2*3=", "6 yes"),
    ([(112, 112)], "count", "4"),
    ([], "ok?", "okay ok"),
]


def image(size: tuple[int, int], seed: int) -> Image.Image:
    """A random RGB image of ``size`` (width, height)."""
    g = np.random.default_rng(seed)
    return Image.fromarray(g.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def vision_batch(processor, rows=ROWS, seed: int = 0) -> Batch:
    """The rows in the training layout with ``multi_modal_inputs``, and advantages drawn from ``seed``."""
    tok = processor.tokenizer
    prompts, responses, mm = [], [], []
    for i, (sizes, text, answer) in enumerate(rows):
        ids = tok.encode(IMAGE_SLOT * len(sizes) + text, add_special_tokens=False)
        inputs = None
        if sizes:
            inputs = processor.images_to_inputs(
                [image(s, 100 * seed + 10 * i + k) for k, s in enumerate(sizes)]
            )
            ids = processor.expand_image_tokens(ids, inputs["image_grid_thw"])
        prompts.append(ids)
        responses.append(tok.encode(answer, add_special_tokens=False)[:R])
        mm.append(inputs)
    batch = grouped_batch(prompts, responses, R, pad_token_id=tok.pad_token_id)
    mm_array = np.empty(len(mm), dtype=object)
    mm_array[:] = mm
    batch["multi_modal_inputs"] = mm_array
    return draw_fields(batch, torch.Generator().manual_seed(seed), advantages=NORMAL)


def hf_log_probs(model, batch: Batch, image_token_id: int) -> torch.Tensor:
    """Each row's response log-probs (B, R) from a plain HF forward of its valid tokens alone (0 past the end)."""
    B, R_ = batch["responses"].shape
    out = torch.zeros(B, R_)
    for b in range(B):
        valid = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][valid][None]  # (1, t)
        mm = batch["multi_modal_inputs"][b]
        extra = (
            {} if mm is None else {"pixel_values": mm["pixel_values"], "image_grid_thw": mm["image_grid_thw"]}
        )
        with torch.no_grad():
            logits = model(
                input_ids=ids, mm_token_type_ids=(ids == image_token_id).int(), use_cache=False, **extra
            ).logits[0]  # (t, V)
        n = int(batch["response_mask"][b].sum())
        t = ids.shape[1]
        logp = torch.log_softmax(logits.float(), -1)[t - n - 1 : t - 1]  # (n, V)
        out[b, :n] = logp.gather(-1, ids[0, t - n :, None])[:, 0]
    return out
