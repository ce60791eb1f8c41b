"""Rows with images (hybridflow/data/images.py through RLDataset): both formats, processed once, the batch."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hybridflow.data import DataError, RLDataset, collate_prompts, load_rows
from hybridflow.data.images import MULTI_MODAL_KEY, QWEN_IMAGE_SLOT
from hybridflow.data.user_rows import as_rows
from hybridflow.models.vision import IMAGE_SLOT, image_token_count


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A noisy RGB image (so two images never process alike)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _row(prompt, images=None, truth="1", **extra) -> dict:
    row = {"data_source": "shapes", "prompt": prompt, "reward_model": {"ground_truth": truth}, **extra}
    if images is not None:
        row["images"] = images
    return row


def _user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


class CountingProcessor:
    """The real processor, counting its image calls (to prove each row's images are processed once)."""

    def __init__(self, processor) -> None:
        self.inner, self.calls = processor, 0
        self.image_token_id, self.merge_size = processor.image_token_id, processor.merge_size

    def images_to_inputs(self, images):
        self.calls += 1
        return self.inner.images_to_inputs(images)

    def expand_image_tokens(self, ids, grid_thw):
        return self.inner.expand_image_tokens(ids, grid_thw)


def _mixed_rows() -> tuple[list[dict], list[list[Image.Image]]]:
    """verl and HF rows, several images of different sizes, text rows in between, prompts of many lengths."""
    a, b, c, d = _image(56, 56, 0), _image(84, 56, 1), _image(112, 84, 2), _image(56, 112, 3)
    rows = [
        _row(_user("<image>How many red squares?"), [{"bytes": _png(a)}]),
        _row(_user("What is 2 + 3?")),  # a text row among image rows
        _row(_user("Compare <image> with <image>, then say which is larger, and by how much."), [b, _png(c)]),
        _row(_user([{"type": "image"}, {"type": "text", "text": "Describe it."}]), [d]),
        _row("A plain text prompt of some length, without any image at all."),
        _row(
            [
                {"role": "system", "content": "Be brief."},
                *_user(
                    [
                        {"type": "text", "text": "Left:"},
                        {"type": "image"},
                        {"type": "text", "text": " right:"},
                        {"type": "image"},
                    ]
                ),
            ],
            [a, {"bytes": _png(b), "path": None}],
        ),
    ]
    return rows, [[a], [], [b, c], [d], [], [a, b]]


def test_mixed_rows_collate_with_their_images(vl_processor) -> None:
    """Each image row's inputs equal the processor's on its images; image tokens = merged patches; None for text."""
    rows, images = _mixed_rows()
    ds = RLDataset(rows, vl_processor.tokenizer, processor=vl_processor)
    batch = collate_prompts([ds[i] for i in range(len(ds))], vl_processor.tokenizer.pad_token_id)
    mm = batch.non_tensors[MULTI_MODAL_KEY]
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]  # (B, P)
    assert len(set(mask.sum(1).tolist())) == len(rows)  # every prompt has its own length
    merge = vl_processor.merge_size
    for b, row_images in enumerate(images):
        n_image_tokens = int((ids[b] == vl_processor.image_token_id).sum())
        if not row_images:
            assert mm[b] is None and n_image_tokens == 0
            continue
        assert mm[b] is ds[b][MULTI_MODAL_KEY]  # the dataset's dict travels, not a copy
        want = vl_processor.images_to_inputs([im.convert("RGB") for im in row_images])
        assert torch.equal(mm[b]["image_grid_thw"], want["image_grid_thw"])
        assert torch.equal(mm[b]["pixel_values"], want["pixel_values"])
        assert mm[b]["pixel_values"].dtype == torch.float32 and mm[b]["image_grid_thw"].dtype == torch.int64
        grids = want["image_grid_thw"]
        assert len(grids) == len(row_images) and len({tuple(g.tolist()) for g in grids}) == len(row_images)
        assert n_image_tokens == sum(image_token_count(g, merge) for g in grids)
        assert mm[b]["pixel_values"].shape[0] == int(grids.prod(dim=1).sum())
    repeated = batch.repeat(3)
    assert repeated.non_tensors[MULTI_MODAL_KEY][0] is mm[0]  # the n samples share the prompt's images


def test_formats_give_the_same_ids(vl_processor) -> None:
    """verl's '<image>' text and HF's image items render to the same token ids and the same raw prompt."""
    image = _image(84, 84, 5)
    verl = _row(_user("<image>How many <image> blue?"), [image, image])
    hf = _row(
        _user(
            [
                {"type": "image"},
                {"type": "text", "text": "How many "},
                {"type": "image", "text": None},
                {"type": "text", "text": " blue?"},
            ]
        ),
        [image, image],
    )
    ds = RLDataset([verl, hf], vl_processor.tokenizer, processor=vl_processor)
    assert ds[0]["input_ids"] == ds[1]["input_ids"]
    assert ds[0]["raw_prompt"] == ds[1]["raw_prompt"] == _user(f"{IMAGE_SLOT}How many {IMAGE_SLOT} blue?")
    assert QWEN_IMAGE_SLOT == IMAGE_SLOT  # the data layer's copy of the slot agrees with the model's


def test_images_are_processed_once(vl_processor) -> None:
    """One processor call per image row at build time; reading items and collating never process again."""
    rows, images = _mixed_rows()
    counting = CountingProcessor(vl_processor)
    ds = RLDataset(rows, vl_processor.tokenizer, processor=counting)
    assert counting.calls == sum(bool(im) for im in images)
    for _ in range(3):
        collate_prompts([ds[i] for i in range(len(ds))], vl_processor.tokenizer.pad_token_id)
    assert counting.calls == sum(bool(im) for im in images)


def test_image_sources_from_files(tmp_path, vl_processor) -> None:
    """Relative paths (from the data file's directory), bytes, {bytes, path} dicts; parquet and jsonl."""
    image = _image(56, 84, 7)
    (tmp_path / "img").mkdir()
    image.save(tmp_path / "img" / "a.png")
    jsonl = tmp_path / "data" / "train.jsonl"
    jsonl.parent.mkdir()
    lines = [
        _row(_user("<image>Count."), ["../img/a.png"]),
        _row(_user("<image>Count."), [str(tmp_path / "img/a.png")]),
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines))
    parquet = tmp_path / "train.parquet"
    table = pa.Table.from_pylist(
        [
            _row(_user("<image>Count."), [{"bytes": _png(image), "path": None}]),
            _row(_user("<image>Count."), [{"bytes": None, "path": "img/a.png"}]),
            _row(_user("No image here, a longer text row."), []),
        ]
    )
    pq.write_table(table, parquet)
    for path in (jsonl, parquet):
        rows, _ = as_rows(load_rows(path))
        ds = RLDataset(rows, vl_processor.tokenizer, processor=vl_processor)
        want = vl_processor.images_to_inputs([image])["pixel_values"]
        for item in ds.items:
            if item[MULTI_MODAL_KEY] is not None:
                assert torch.equal(item[MULTI_MODAL_KEY]["pixel_values"], want)
    assert ds[2][MULTI_MODAL_KEY] is None  # an empty images list in parquet is a text row


def test_image_key_is_configurable(vl_processor) -> None:
    """data.image_key names the column (here 'image'); the default column is then not read."""
    row = _row(_user("<image>Count."), image=[_image(56, 56, 1)])
    ds = RLDataset([row], vl_processor.tokenizer, processor=vl_processor, image_key="image")
    assert ds[0][MULTI_MODAL_KEY]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_overlong_image_prompts_count_their_image_tokens(vl_processor) -> None:
    """The expanded length decides: a short text with a large image is filtered, never truncated."""
    tok = vl_processor.tokenizer
    rows = [_row(_user("<image>Hi"), [_image(112, 112, 0)]), _row(_user("<image>Hi"), [_image(56, 56, 0)])]
    small = len(RLDataset(rows[1:], tok, processor=vl_processor)[0]["input_ids"])
    ds = RLDataset(rows, tok, processor=vl_processor, max_prompt_length=small, filter_overlong_prompts=True)
    assert (
        len(ds) == 1 and ds.num_filtered == 1 and ds[0]["input_ids"].count(vl_processor.image_token_id) == 4
    )
    with pytest.raises(DataError, match=r"never truncated.*filter_overlong_prompts"):
        RLDataset(rows, tok, processor=vl_processor, max_prompt_length=small, truncation="left")


def test_text_model_reads_text_items_and_refuses_images(tok) -> None:
    """Without a processor, HF text items join into text; a row with images says to use a VLM or drop them."""
    ds = RLDataset([_row(_user([{"type": "text", "text": "What is 2 + 3?"}]))], tok)
    assert ds[0]["raw_prompt"] == _user("What is 2 + 3?") and MULTI_MODAL_KEY not in ds[0]
    batch = collate_prompts([ds[0]], tok.pad_token_id)
    assert MULTI_MODAL_KEY not in batch.non_tensors  # text datasets' batches are as before
    for bad in (_row(_user("<image>Count."), [_image(56, 56, 0)]), _row(_user([{"type": "image"}]))):
        with pytest.raises(
            DataError, match=r"row 0: .*text-only; use a vision-language model.*drop the 'images'"
        ):
            RLDataset([bad], tok)


BAD_ROWS = [
    (_row(_user("<image> and <image>"), [_image(56, 56, 0)]), "2 image placeholder.*holds 1 image"),
    (_row(_user("Count."), [_image(56, 56, 0)]), "0 image placeholder.*holds 1 image"),
    (_row(_user("<image>"), []), "1 image placeholder.*holds 0 image"),
    (_row(_user("<image>"), [b"not a png"]), r"images\[0\]: the image bytes cannot be decoded"),
    (_row(_user("<image>"), ["missing/x.png"]), r"images\[0\]: image file .*missing/x.png not found"),
    (_row(_user("<image>"), ["https://x.org/a.png"]), "is a URL"),
    (_row(_user("<image>"), [{"path": None, "bytes": None}]), "without 'bytes' or 'path'"),
    (_row(_user("<image>"), [3]), "must be a file path, bytes"),
    (_row(_user([{"type": "image", "image": "a.png"}])), "holds its image inline"),
    (_row(_user([{"type": "video"}])), r"prompt\[0\]\['content'\]\[0\] must be \{'type': 'image'\}"),
    (_row(_user("<|image_pad|> text"), []), "image pad tokens but the row has no images"),
    (_row(_user("<image><|image_pad|>"), [_image(56, 56, 0)]), "holds image tokens of its own"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_image_rows_are_refused(row, message, vl_processor) -> None:
    """Each bad input names the row (after a good one) and what to fix."""
    good = _row(_user("<image>Fine."), [_image(56, 56, 1)])
    with pytest.raises(DataError, match="row 1: .*" + message):
        RLDataset([good, row], vl_processor.tokenizer, processor=vl_processor)
