"""The VLM foundation: the tiny Qwen2.5-VL, the processor's token expansion and M-RoPE positions against HF."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from hybridflow.models.vision import (
    IMAGE_SLOT,
    VisionProcessor,
    build_tiny_vl_model_and_processor,
    image_token_count,
    is_vision_language,
    mrope_positions,
    text_config,
)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_vl")
    model, processor = build_tiny_vl_model_and_processor(out)
    return model, processor, out


def _prompt(processor: VisionProcessor, content: list[dict]) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor.tokenizer(text)["input_ids"]


def test_the_tiny_vlm_is_a_qwen2_5_vl_with_mrope_sections_of_half_a_head(tiny_vl):
    model, processor, _ = tiny_vl
    assert is_vision_language(model.config)
    text = text_config(model.config)
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_scaling["mrope_section"]) == head_dim // 2
    assert model.config.image_token_id == processor.image_token_id


@pytest.mark.parametrize(
    "sizes",
    [[(56, 56)], [(112, 84), (56, 84)], [(84, 112), (112, 112), (56, 56)]],
    ids=["one", "two", "three"],
)
def test_mrope_positions_equal_hf_get_rope_index_for_images_between_text(tiny_vl, sizes):
    model, processor, _ = tiny_vl
    content: list[dict] = [{"type": "text", "text": "Look:"}]
    for i, _ in enumerate(sizes):  # images of different shapes with text of different lengths between
        content += [{"type": "image"}, {"type": "text", "text": "and" + " more" * i}]
    ids = _prompt(processor, content)
    images = [Image.new("RGB", size, (40 * i, 200, 30)) for i, size in enumerate(sizes)]
    inputs = processor.images_to_inputs(images)
    expanded = processor.expand_image_tokens(ids, inputs["image_grid_thw"])
    image_tokens = sum(image_token_count(g, processor.merge_size) for g in inputs["image_grid_thw"])
    assert len(expanded) == len(ids) - len(sizes) + image_tokens
    ours, delta = mrope_positions(
        torch.tensor(expanded), processor.image_token_id, inputs["image_grid_thw"], 2
    )
    x = torch.tensor([expanded])
    theirs, their_delta = model.model.get_rope_index(
        x, (x == processor.image_token_id).int(), inputs["image_grid_thw"]
    )
    assert torch.equal(ours, theirs[:, 0])
    assert delta == int(their_delta) < 0


def test_text_only_positions_are_plain_and_have_no_delta(tiny_vl):
    _, processor, _ = tiny_vl
    ids = _prompt(processor, [{"type": "text", "text": "no image here"}])
    pos, delta = mrope_positions(torch.tensor(ids), processor.image_token_id, torch.zeros(0, 3), 2)
    assert torch.equal(pos, torch.arange(len(ids)).expand(3, -1)) and delta == 0


def test_expansion_refuses_a_count_mismatch(tiny_vl):
    _, processor, _ = tiny_vl
    ids = processor.tokenizer(IMAGE_SLOT + IMAGE_SLOT + "two?")["input_ids"]
    grid = processor.images_to_inputs([Image.new("RGB", (56, 56))])["image_grid_thw"]
    with pytest.raises(ValueError, match="more image slots than its 1 image"):
        processor.expand_image_tokens(ids, grid)


def test_processor_and_model_reload_from_the_saved_directory(tiny_vl):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from hybridflow.models.loader import load_tokenizer

    model, processor, out = tiny_vl
    tokenizer = load_tokenizer(out)
    again = VisionProcessor.from_pretrained(out, tokenizer)
    image = Image.new("RGB", (84, 56), (255, 0, 0))
    a, b = processor.images_to_inputs([image]), again.images_to_inputs([image])
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(
        a["image_grid_thw"], b["image_grid_thw"]
    )
    assert again.image_token_id == processor.image_token_id
    assert is_vision_language(AutoConfig.from_pretrained(out))
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_batch_positions_of_a_padded_batch_with_and_without_images(tiny_vl):
    from hybridflow.models.vision import batch_mrope_positions

    model, processor, _ = tiny_vl
    rows = [
        ([{"type": "image"}, {"type": "text", "text": "count"}], [Image.new("RGB", (84, 56))]),
        ([{"type": "text", "text": "just words, a longer prompt"}], None),
        ([{"type": "text", "text": "x"}, {"type": "image"}], [Image.new("RGB", (56, 112))]),
    ]
    seqs, mm = [], []
    for content, images in rows:
        ids = _prompt(processor, content)
        inputs = processor.images_to_inputs(images) if images else None
        seqs.append(processor.expand_image_tokens(ids, inputs["image_grid_thw"]) if inputs else ids)
        mm.append(inputs)
    width = max(map(len, seqs))
    pad = processor.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])  # (B, T) left-padded
    mask = (torch.arange(width) >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
    ours = batch_mrope_positions(ids, mask, mm, processor.image_token_id, 2)
    for b, inputs in enumerate(mm):
        if inputs is None:  # HF's get_rope_index wants a vision sequence; a text row is plain positions
            assert torch.equal(ours[:, b, mask[b].bool()], torch.arange(len(seqs[b])).expand(3, -1))
            continue
        x = ids[b : b + 1]
        theirs, _ = model.model.get_rope_index(
            x, (x == processor.image_token_id).int(), inputs["image_grid_thw"], attention_mask=mask[b : b + 1]
        )
        assert torch.equal(ours[:, b], theirs[:, 0])
