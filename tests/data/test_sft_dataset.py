"""SFTDataset: prompt + response ids with the loss mask exactly on the response; collate_sft; truncation."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import DataError, SFTDataset, collate_sft, make_task


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_loss_mask_covers_the_response(tok) -> None:
    rows = [{"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "response": "#### 3"}]
    item = SFTDataset(rows, tok, max_length=128)[0]
    prompt = _ids(tok, "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    response = [*_ids(tok, "#### 3"), tok.convert_tokens_to_ids("<|im_end|>")]  # ends at the end of turn
    assert item["input_ids"] == prompt + response
    assert item["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    trained = [t for t, m in zip(item["input_ids"], item["loss_mask"]) if m]
    assert tok.decode(trained) == "#### 3<|im_end|>"


def test_text_prompt_gets_eos(tok) -> None:
    item = SFTDataset([{"q": "2+2=", "a": "4"}], tok, prompt_key="q", response_key="a", max_length=16)[0]
    assert item["input_ids"] == [*_ids(tok, "2+2="), *_ids(tok, "4"), tok.eos_token_id]
    assert item["loss_mask"] == [0, 0, 0, 0, 1, 1]


def test_built_in_rows_use_extra_info_answer(tok) -> None:
    rows = make_task("arithmetic", "train", 3, seed=0)
    ds = SFTDataset(rows, tok, max_length=128)
    for row, item in zip(rows, ds):
        trained = [t for t, m in zip(item["input_ids"], item["loss_mask"]) if m]
        assert tok.decode(trained) == row["extra_info"]["answer"] + "<|im_end|>"
    nested = [{"prompt": "p", "meta": {"reply": "r"}}]
    assert SFTDataset(nested, tok, response_key="meta.reply", max_length=8)[0]["loss_mask"] == [0, 1, 1]


def test_collate_sft_right_pads(tok) -> None:
    items = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 0, 1, 1]},
    ]
    batch = collate_sft(items, pad_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    assert torch.equal(batch["loss_mask"], torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]))
    assert batch["position_ids"][0, :3].tolist() == [0, 1, 2] and batch["position_ids"][1].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_truncation(tok) -> None:
    rows = [{"prompt": "abcd", "response": "xyz"}]  # 4 prompt + 3 response + EOS = 8 tokens
    right = SFTDataset(rows, tok, max_length=6, truncation="right")
    assert right[0]["input_ids"] == _ids(tok, "abcdxy") and right[0]["loss_mask"] == [0, 0, 0, 0, 1, 1]
    left = SFTDataset(rows, tok, max_length=6, truncation="left")
    assert left[0]["input_ids"] == [*_ids(tok, "cdxyz"), tok.eos_token_id]
    assert left[0]["loss_mask"] == [0, 0, 1, 1, 1, 1] and left.num_truncated == 1
    with pytest.raises(DataError, match=r"^sft\.jsonl: row 0: prompt \+ response is 8 tokens"):
        SFTDataset(rows, tok, max_length=6, source="sft.jsonl")
    with pytest.raises(DataError, match="no response token is left"):
        SFTDataset(rows, tok, max_length=4, truncation="right")


def test_sft_row_errors(tok) -> None:
    with pytest.raises(DataError, match=r"^built-in: row 1: missing column 'response'"):
        SFTDataset([{"prompt": "a", "response": "b"}, {"prompt": "a"}], tok, max_length=8)
    with pytest.raises(DataError, match=r"row 0: the response must be a non-empty str, got int"):
        SFTDataset([{"prompt": "a", "response": 3}], tok, max_length=8)
    with pytest.raises(DataError, match=r"row 0: empty prompt"):
        SFTDataset([{"prompt": "", "response": "b"}], tok, max_length=8)


def test_rows_with_images_need_a_processor(tok) -> None:
    """Without a VLM's processor a row's images cannot reach the model: such a row (the squares task's) is refused,
    naming the row and the fix, not read as text."""
    rows = [*make_task("arithmetic", "train", 2, seed=0), *make_task("squares", "train", 1, seed=0)]
    with pytest.raises(
        DataError, match=r"row 2: the row has images .* no image processor was given; SFT on images"
    ):
        SFTDataset(rows, tok, max_length=128)


def test_image_rows_with_a_processor_carry_their_images() -> None:
    """With a VLM's processor: the RL dataset's prompt ids, the loss on the reply only, the images kept with the
    item (None for a text row) and collated as the non-tensor ``multi_modal_inputs``; never cut into the prompt."""
    from hybridflow.data import RLDataset
    from hybridflow.models.vision import build_tiny_vl_model_and_processor

    _, processor = build_tiny_vl_model_and_processor()
    tok = processor.tokenizer
    text = {"prompt": [{"role": "user", "content": "how many?"}], "response": "none at all"}
    rows = [*make_task("squares", "train", 3, seed=0, style="short"), text]
    ds = SFTDataset(rows, tok, max_length=128, processor=processor)
    rl = RLDataset(rows[:3], tok, max_prompt_length=128, processor=processor)
    for item, want in zip(ds, rl):
        n = len(want["input_ids"])
        assert item["input_ids"][:n] == want["input_ids"] and item["loss_mask"] == [0] * n + [1, 1]
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(item["multi_modal_inputs"][key], want["multi_modal_inputs"][key])
    assert ds[3]["multi_modal_inputs"] is None and processor.image_token_id not in ds[3]["input_ids"]
    batch = collate_sft(list(ds), pad_id=tok.pad_token_id)
    images = batch["multi_modal_inputs"]
    assert images.shape == (4,) and images[0] is ds[0]["multi_modal_inputs"] and images[3] is None
    width = len(rl[0]["input_ids"]) + 1  # the whole prompt and one response token
    assert (
        SFTDataset(rows[:1], tok, max_length=width, truncation="right", processor=processor).num_truncated
        == 1
    )
    with pytest.raises(DataError, match=r"row 0: prompt \+ response is"):
        SFTDataset(rows[:1], tok, max_length=width, truncation="left", processor=processor)
