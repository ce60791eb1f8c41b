"""RLDataset tokenization, truncation and filtering; collate_prompts padding and positions; the builder."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.config import DataConfig
from hybridflow.data import DataError, RLDataset, build_rl_dataset, collate_prompts, save_rows

RAW = {"template_text_prompts": False}  # text prompts as they are: one token per char, whatever the template


def _row(prompt, index: int | None = None, source: str = "arithmetic", truth=None) -> dict:
    row = {"data_source": source, "prompt": prompt, "reward_model": {"ground_truth": truth or "1"}}
    if index is not None:
        row["extra_info"] = {"index": index}
    return row


def test_chat_and_text_prompts(tok) -> None:
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    rows = [_row(messages, index=7), _row("2+2=")]
    ds = RLDataset(rows, tok, max_prompt_length=64, template_text_prompts=False)
    templated = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert ds[0]["input_ids"] == tok(templated, add_special_tokens=False)["input_ids"]
    assert ds[1]["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "2+2="]  # one token per char
    assert ds[0]["raw_prompt"] == messages and ds[1]["raw_prompt"] == "2+2="
    assert (ds[0]["index"], ds[1]["index"]) == (7, 1)  # extra_info.index, else the row number
    assert ds[0]["ground_truth"] == "1" and ds[1]["extra_info"] == {}


def _char_ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


@pytest.mark.parametrize(
    ("side", "kept"), [("left", "ghij"), ("right", "abcd"), ("middle", "abij"), ("error", None)]
)
def test_truncation_modes(tok, caplog, side: str, kept: str | None) -> None:
    rows = [_row("abcdefghij"), _row("xyz")]
    if kept is None:
        with pytest.raises(DataError, match=r"^data\.jsonl: row 0: prompt has 10 tokens, more than .*=4"):
            RLDataset(rows, tok, max_prompt_length=4, truncation=side, source="data.jsonl", **RAW)
        return
    with caplog.at_level(logging.INFO, logger="hybridflow.data"):
        ds = RLDataset(rows, tok, max_prompt_length=4, truncation=side, **RAW)
    assert ds[0]["input_ids"] == _char_ids(tok, kept)
    assert ds[1]["input_ids"] == _char_ids(tok, "xyz")
    assert ds.num_truncated == 1 and ds.num_filtered == 0
    assert "truncated 1 of 2 prompts to 4 tokens" in caplog.text


def test_middle_truncation_odd_length(tok) -> None:
    ds = RLDataset([_row("abcdefghij")], tok, max_prompt_length=5, truncation="middle", **RAW)
    assert ds[0]["input_ids"] == _char_ids(tok, "ab" + "hij")  # 5 // 2 from the start, the rest from the end


def test_filter_overlong(tok, caplog) -> None:
    rows = [_row("abc"), _row("abcdefghij"), _row("abcde"), _row("abcdefghijkl"), _row("abcdef")]
    with caplog.at_level(logging.INFO, logger="hybridflow.data"):
        ds = RLDataset(
            rows, tok, max_prompt_length=6, filter_overlong_prompts=True, source="f.parquet", **RAW
        )
    assert len(ds) == 3 and ds.num_filtered == 2 and ds.num_truncated == 0
    assert [it["index"] for it in ds] == [0, 2, 4]
    assert [ds.where(i) for i in range(3)] == ["f.parquet: row 0", "f.parquet: row 2", "f.parquet: row 4"]
    assert "f.parquet: filtered out 2 of 5 prompts longer than 6 tokens" in caplog.text
    with pytest.raises(DataError, match="all 2 prompts are longer than max_prompt_length=2"):
        RLDataset(rows[1:3], tok, max_prompt_length=2, filter_overlong_prompts=True, **RAW)


def test_no_chat_template(tok) -> None:
    bare = tok.__class__(tokenizer_object=tok.backend_tokenizer, pad_token=tok.pad_token)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        RLDataset([_row([{"role": "user", "content": "hi"}])], bare, max_prompt_length=64)
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset([_row("hi")], tok, truncation="both")


def test_data_sources_and_require(tok) -> None:
    rows = [_row("a", source="gsm8k"), _row("b"), _row("c", source="mystery"), _row("d")]
    ds = RLDataset(rows, tok, max_prompt_length=8, source="mix.jsonl", **RAW)
    assert ds.data_sources() == ["arithmetic", "gsm8k", "mystery"]
    ds.require_data_sources({"arithmetic", "gsm8k", "mystery"})
    with pytest.raises(
        DataError, match=r"^mix\.jsonl: row 2: no reward function for data_source 'mystery'"
    ) as e:
        ds.require_data_sources({"arithmetic", "gsm8k"}, hint="Set reward.custom_function.path.")
    assert "Set reward.custom_function.path." in str(e.value) and e.value.row == 2
    with pytest.raises(DataError, match="row 1: no reward function for data_source 'arithmetic'"):
        ds.require_data_sources(lambda s: s.startswith("g"))


def test_collate_prompts_left_pads(tok) -> None:
    items = [
        {
            "input_ids": [5, 6],
            "data_source": "a",
            "ground_truth": "1",
            "extra_info": {},
            "raw_prompt": "x",
            "index": 0,
        },
        {
            "input_ids": [7, 8, 9, 10],
            "data_source": "b",
            "ground_truth": [1, 2],
            "extra_info": {"k": 1},
            "raw_prompt": [{"role": "user", "content": "y"}],
            "index": 4,
        },
        {
            "input_ids": [11],
            "data_source": "a",
            "ground_truth": {"target": 3},
            "extra_info": {},
            "raw_prompt": "z",
            "index": 9,
        },
    ]
    batch = collate_prompts(items, pad_token_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]))
    assert batch["input_ids"].dtype == torch.long
    for key in ("data_source", "ground_truth", "extra_info", "raw_prompt", "index"):
        assert batch[key].dtype == object and batch[key].shape == (3,)
    assert batch["ground_truth"][1] == [1, 2] and batch["ground_truth"][2] == {"target": 3}
    assert list(batch["index"]) == [0, 4, 9]
    assert isinstance(batch["data_source"], np.ndarray)


def test_collate_dataset_items(tok) -> None:
    ds = RLDataset([_row("ab"), _row("abcd")], tok, max_prompt_length=8, **RAW)
    batch = collate_prompts([ds[0], ds[1]], tok.pad_token_id)
    assert batch["input_ids"][0].tolist() == [tok.pad_token_id] * 2 + _char_ids(tok, "ab")


def test_build_rl_dataset(tok, tmp_path: Path) -> None:
    cfg = DataConfig(task_train_size=40, task_val_size=10, max_prompt_length=128)
    train = build_rl_dataset(cfg, tok, "train", seed=1)
    val = build_rl_dataset(cfg, tok, "val", seed=1)
    assert (len(train), len(val)) == (40, 10)
    assert {it["extra_info"]["split"] for it in val} == {"test"}
    assert train.source == "built-in arithmetic (train)"
    save_rows([_row("q", truth="2")], tmp_path / "t.jsonl")
    cfg = DataConfig(
        train_files=[str(tmp_path / "t.jsonl")], max_prompt_length=8, template_text_prompts=False
    )
    files = build_rl_dataset(cfg, tok, "train", seed=1)
    assert len(files) == 1 and files.where(0) == f"{tmp_path / 't.jsonl'}: row 0 (line 1)"
