"""Vision-language models (the Qwen2-VL / Qwen2.5-VL family): the processor, M-RoPE positions and a tiny model.

A Qwen2.5-VL prompt holds each image as ``<|vision_start|><|image_pad|><|vision_end|>``; the processor cuts
the image into 14-pixel patches (``pixel_values`` (P, C * 2 * 14 * 14), the temporal patch of 2 repeating a
still image) and reports the patch grid (``image_grid_thw`` (I, 3)); the vision tower merges 2 x 2 patches
into one token, so the one ``<|image_pad|>`` is expanded to t * h * w / 4 copies whose embeddings the merged
image features replace.

``VisionProcessor`` is that processor built from two parts we can load offline: the model's image processor
(the PIL variant: the CPU torch has no torchvision) and its tokenizer. transformers' ``Qwen2_5_VLProcessor``
also insists on a video processor, which needs torchvision; we do the token expansion ourselves instead, on
token ids, so nothing is re-tokenised.

M-RoPE (``mrope_positions``): text tokens take one position on all three rows (time, height, width); an
image's tokens take (start, start + row, start + column) over its merged grid, and the text after it resumes
at start + max(rows, columns). A sequence's rope delta is (last position + 1) - length: a decoded token at
index i sits at position i + delta on all three rows, so decode needs only the delta.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.models.family import family_names

logger = logging.getLogger(__name__)

# The vision-language families: those whose entry names a language model (``models.family``).
VISION_FAMILIES = tuple(family_names(lambda s: s.text is not None))
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IMAGE_SLOT = VISION_START + IMAGE_PAD + VISION_END  # what one image is in a rendered prompt

# ChatML that also renders HF's conversational image format: content as a list of {"type": "image"} and
# {"type": "text", "text": ...} items (strings pass through, so verl's rows, whose "<image>" markers the data
# layer has already replaced by IMAGE_SLOT, render too).
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '" + IMAGE_SLOT + "' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def is_vision_language(config: Any) -> bool:
    """Whether a model config is a vision-language model this package knows (Qwen2-VL / Qwen2.5-VL)."""
    return getattr(config, "model_type", None) in VISION_FAMILIES


def text_config(config: Any) -> Any:
    """The language model's config of a VLM (its ``text_config``), or the config itself for a text model."""
    return getattr(config, "text_config", None) or config if is_vision_language(config) else config


def image_token_count(grid_thw: torch.Tensor, merge_size: int) -> int:
    """How many ``<|image_pad|>`` tokens one image of patch grid (t, h, w) becomes after the 2-D merge."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge_size * merge_size)


def mrope_positions(
    input_ids: torch.Tensor,  # (T,) one sequence, no padding
    image_token_id: int,
    grid_thw: torch.Tensor,  # (I, 3) the images of this sequence, in order
    merge_size: int,
    image_positions: torch.Tensor | None = None,  # (T,) bool: the image tokens (else every image_token_id)
) -> tuple[torch.Tensor, int]:
    """The (3, T) M-RoPE positions of one sequence and its rope delta (last position + 1 - T).

    ``image_positions`` marks which tokens are images' when not every ``image_token_id`` is (a response may
    hold one the policy sampled: it is text)."""
    if image_positions is not None:  # the image tokens only keep the id the walk below looks for
        input_ids = torch.where(
            image_positions, image_token_id, torch.where(input_ids == image_token_id, -1, input_ids)
        )
    ids = input_ids.tolist()
    rows: list[torch.Tensor] = []
    pos, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            j = i
            while j < len(ids) and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))  # text: one position on all rows
            pos, i = pos + j - i, j
            continue
        t, h, w = (int(x) for x in grid_thw[image])
        h, w = h // merge_size, w // merge_size
        grid = torch.stack(  # (3, t * h * w): time, row, column of each merged patch, row-major
            [
                torch.arange(t).repeat_interleave(h * w),
                torch.arange(h).repeat_interleave(w).repeat(t),
                torch.arange(w).repeat(t * h),
            ]
        )
        rows.append(grid + pos)
        pos, i, image = pos + max(t, h, w), i + t * h * w, image + 1
    if image != (0 if grid_thw is None else len(grid_thw)):
        raise ValueError(f"the sequence has {image} images but {len(grid_thw)} grids were given")
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)  # (3, T)
    last = int(positions.max()) + 1 if positions.numel() else 0
    return positions, last - len(ids)


def batch_mrope_positions(
    input_ids: torch.Tensor,  # (B, T) padded
    attention_mask: torch.Tensor,  # (B, T) 1 on real tokens
    mm_inputs: list[dict[str, torch.Tensor] | None],  # per row: {"image_grid_thw": (I, 3), ...} or None
    image_token_id: int,
    merge_size: int,
    image_mask: torch.Tensor | None = None,  # (B, T) bool: the image tokens (else every image_token_id)
) -> torch.Tensor:
    """(3, B, T) M-RoPE positions of a padded batch (padding at position 0); a row without images is plain."""
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)  # (3, B, T)
    for b, mm in enumerate(mm_inputs):
        valid = attention_mask[b].bool()
        ids = input_ids[b][valid].cpu()
        grid = mm["image_grid_thw"] if mm is not None else torch.zeros(0, 3, dtype=torch.long)
        where = None if image_mask is None else image_mask[b][valid].cpu()
        positions, _ = mrope_positions(ids, image_token_id, grid, merge_size, where)  # (3, T_b)
        out[:, b, valid] = positions.to(out.device)
    return out


class VisionProcessor:
    """A VLM's image processor and tokenizer: images to patches, one image token to as many as it needs."""

    def __init__(self, image_processor: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.image_token_id = self._token_id(IMAGE_PAD)
        self.vision_start_id = self._token_id(VISION_START)

    def _token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token!r} token: it is not a Qwen2-VL-family tokenizer")
        return int(tid)

    def images_to_inputs(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """Patches of PIL images: ``pixel_values`` (P, D) float32 and ``image_grid_thw`` (I, 3) int64."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {
            "pixel_values": out["pixel_values"].float(),
            "image_grid_thw": out["image_grid_thw"].long(),
        }

    def expand_image_tokens(self, ids: list[int], grid_thw: torch.Tensor) -> list[int]:
        """Token ids with each ``<|image_pad|>`` repeated to its image's merged-patch count."""
        out: list[int] = []
        image = 0
        for tid in ids:
            if tid != self.image_token_id:
                out.append(tid)
                continue
            if image >= len(grid_thw):
                raise ValueError(f"the prompt has more image slots than its {len(grid_thw)} image(s)")
            out.extend([tid] * image_token_count(grid_thw[image], self.merge_size))
            image += 1
        if image != len(grid_thw):
            raise ValueError(f"the prompt has {image} image slot(s) but {len(grid_thw)} image(s)")
        return out

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write the image processor's and the tokenizer's files to ``out_dir``."""
        self.image_processor.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase) -> VisionProcessor:
        """Load the image processor saved in ``path`` (its PIL variant) beside an already loaded tokenizer."""
        from transformers import Qwen2VLImageProcessorPil

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no preprocessor_config.json (the image processor's settings)"
            )
        return cls(Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True), tokenizer)


def build_tiny_vl_model_and_processor(
    out_dir: str | os.PathLike | None = None,
    extra_chars: str = "",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    vision_depth: int = 2,
    max_position_embeddings: int = 1024,
    max_pixels: int = 112 * 112,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, VisionProcessor]:
    """A randomly initialised tiny Qwen2.5-VL with the char tokenizer and a PIL image processor; saved if asked.

    Text: 4 heads of 16 (2 KV heads), M-RoPE sections (2, 3, 3) summing to head_dim / 2. Vision: 32 wide,
    2 heads, 14-pixel patches merged 2 x 2, so a 56 x 56 image is 4 tokens and 112 x 112 (the most
    ``max_pixels`` allows by default) is 16.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from hybridflow.models.tiny import IM_END_TOKEN, build_char_tokenizer

    tokenizer = build_char_tokenizer(extra_chars, model_max_length=max_position_embeddings)
    # Added as special tokens (never split, kept by decode(skip_special_tokens=False)); add_tokens keeps the
    # ChatML tokens already listed as additional special tokens.
    tokenizer.add_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in VISION_TOKENS], special_tokens=True
    )
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    heads = 4
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=2,
            intermediate_size=2 * hidden_size,
            max_position_embeddings=max_position_embeddings,
            rope_scaling={"type": "mrope", "mrope_section": _mrope_section(hidden_size // heads)},
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=eos_ids[0],
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):  # weights depend on the seed only
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos_ids
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)
    processor = VisionProcessor(image_processor, tokenizer)
    if out_dir is not None:
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        processor.save_pretrained(out)
        logger.info("saved a tiny Qwen2.5-VL, its char tokenizer and image processor to %s", out)
    return model, processor


def _mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's (time, height, width) split of head_dim / 2 rotary pairs, Qwen2.5-VL's 16:24:24 ratio."""
    half = head_dim // 2
    time = max(1, half // 4)
    height = (half - time) // 2
    return [time, height, half - time - height]
