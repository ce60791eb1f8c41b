"""Image prompts for the rollout engine's vision-language tests: a tiny Qwen2.5-VL with large weights (so greedy
outputs vary), chat-templated prompts with images of different sizes and a text-only one, and HF references."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from hybridflow.models.vision import VisionProcessor, build_tiny_vl_model_and_processor


def lively_vl_model(seed: int = 0) -> tuple[torch.nn.Module, VisionProcessor]:
    """The tiny Qwen2.5-VL (float32) with weights scaled up, text and vision, so images change the outputs."""
    model, processor = build_tiny_vl_model_and_processor(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "visual" in name else 0.2))
    return model.eval(), processor


def image(width: int, height: int, seed: int) -> Image.Image:
    """A picture of a few coloured squares on a grey ground (different per seed)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 3), 128, dtype=np.uint8)
    for _ in range(3):
        x, y = rng.integers(0, width - 14), rng.integers(0, height - 14)
        pixels[y : y + 14, x : x + 14] = rng.integers(0, 255, 3)
    return Image.fromarray(pixels)


def chat_prompt(
    processor: VisionProcessor, text: str, images: list[Image.Image]
) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    """A user turn with ``images`` then ``text``, chat-templated with the generation prompt; image pads
    expanded. Returns the ids and the images' inputs (None without images)."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if not images:
        return ids, None
    mm = processor.images_to_inputs(images)
    return processor.expand_image_tokens(ids, mm["image_grid_thw"]), mm


def prompts(processor: VisionProcessor) -> tuple[list[list[int]], list[dict[str, torch.Tensor] | None]]:
    """Three prompts of one call: one 56 x 56 image, two images (112 x 56 and 56 x 84), text only."""
    cases = [
        chat_prompt(processor, "How many red squares?", [image(56, 56, 0)]),
        chat_prompt(processor, "Which is bigger?", [image(112, 56, 1), image(56, 84, 2)]),
        chat_prompt(processor, "Say hello in a short sentence, please.", []),
    ]
    return [ids for ids, _ in cases], [mm for _, mm in cases]


def hf_inputs(
    processor: VisionProcessor, ids: list[int], mm: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """HF forward's arguments for one unpadded sequence."""
    x = torch.tensor([ids])
    out = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    out["mm_token_type_ids"] = (x == processor.image_token_id).int()
    if mm is not None:
        out.update(pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
    return out


@torch.no_grad()
def hf_logits(model: torch.nn.Module, processor: VisionProcessor, ids: list[int], mm) -> torch.Tensor:
    """HF's float32 logits (T, V) of a whole sequence (prompt and response) in one forward."""
    return model(**hf_inputs(processor, ids, mm)).logits[0].float()


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, processor: VisionProcessor, ids: list[int], mm, max_new: int, eos
) -> list[int]:
    """HF generate's greedy continuation of one prompt (stops at ``eos``)."""
    out = model.generate(
        **hf_inputs(processor, ids, mm),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def lively_qwen2_vl_model(seed: int = 0) -> tuple[torch.nn.Module, VisionProcessor]:
    """A tiny Qwen2-VL (its own vision tower, Qwen2.5-VL's language model shape) with the same processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    base, processor = lively_vl_model(seed)
    c = base.config
    text = {k: v for k, v in c.text_config.to_dict().items() if k != "model_type"}
    vision = dict(depth=2, embed_dim=32, hidden_size=c.text_config.hidden_size, mlp_ratio=2, num_heads=2)
    ids = {k: getattr(c, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id")}
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, vision_end_token_id=c.vision_end_token_id, **ids
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "visual" in name else 0.2))
    return model.eval(), processor
