"""Preference and KTO datasets: rendering, collate layout, bad rows, length handling, arithmetic pairs."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from hybridflow.data import DataError, load_rows, make_task
from hybridflow.data.preference_dataset import (
    KTODataset,
    PreferenceDataset,
    collate_kto,
    collate_pairs,
    make_arithmetic_preferences,
)
from hybridflow.rewards.arithmetic import compute_score

CHAT = [{"role": "user", "content": "What is 1 + 2?"}]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pairs_render_responses_like_sft(tok) -> None:
    rows = [
        {"prompt": CHAT, "chosen": "#### 3", "rejected": "#### 4"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]
    ds = PreferenceDataset(rows, tok, max_prompt_length=64, max_response_length=16)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ds[0]
    assert chat["prompt_ids"] == _ids(
        tok, "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat["chosen_ids"] == [*_ids(tok, "#### 3"), im_end]  # the assistant turn ends at the end token
    assert chat["rejected_ids"] == [*_ids(tok, "#### 4"), im_end]
    text = ds[1]  # a text prompt gets EOS, as in SFT
    assert text == {
        "prompt_ids": _ids(tok, "2+2="),
        "chosen_ids": [*_ids(tok, "4"), tok.eos_token_id],
        "rejected_ids": [*_ids(tok, "5"), tok.eos_token_id],
    }
    assert ds.num_dropped_equal == ds.num_filtered == ds.num_truncated == 0
    # TRL's conversational format: the completion as one assistant message
    msg = [{"prompt": CHAT, "chosen": [{"role": "assistant", "content": "#### 3"}], "rejected": "#### 4"}]
    assert PreferenceDataset(msg, tok, 64, 16)[0] == chat


def test_collate_pairs_layout_by_hand() -> None:
    items = [
        {"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]},
        {"prompt_ids": [10, 11, 12], "chosen_ids": [13, 14, 15], "rejected_ids": [16]},
    ]
    batch = collate_pairs(items, pad_token_id=0)
    # Rows: (p0, c0), (p1, c1), (p0, r0), (p1, r1); prompt width 3 (left pad), response width 3 (right pad).
    assert batch["input_ids"].tolist() == [
        [0, 5, 6, 7, 0, 0],
        [10, 11, 12, 13, 14, 15],
        [0, 5, 6, 8, 9, 0],
        [10, 11, 12, 16, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [
        [0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
    ]
    assert batch["position_ids"].tolist() == [
        [0, 0, 1, 2, 2, 2],
        [0, 1, 2, 3, 4, 5],
        [0, 0, 1, 2, 3, 3],
        [0, 1, 2, 3, 3, 3],
    ]
    assert batch["responses"].tolist() == [[7, 0, 0], [13, 14, 15], [8, 9, 0], [16, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert batch["response_mask"].dtype == torch.float32
    assert batch.meta["num_pairs"] == 2
    with pytest.raises(ValueError, match="at least one"):
        collate_pairs([], 0)


def test_collate_pairs_from_the_dataset(tok) -> None:
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "11"},
        {"prompt": "10+1=", "chosen": "11", "rejected": "9"},
    ]
    ds = PreferenceDataset(rows, tok, 8, 8)
    batch = collate_pairs([ds[0], ds[1]], tok.pad_token_id)
    eos = tok.eos_token
    texts = [tok.decode(r[m.bool()].tolist()) for r, m in zip(batch["responses"], batch["response_mask"])]
    assert texts == ["2" + eos, "11" + eos, "11" + eos, "9" + eos]
    prompts = [
        tok.decode(ids[m.bool()].tolist())
        for ids, m in zip(batch["input_ids"][:, :5], batch["attention_mask"][:, :5])
    ]
    assert prompts == ["1+1=", "10+1=", "1+1=", "10+1="]


def test_collate_kto_appends_mismatched_kl_rows() -> None:
    items = [
        {"prompt_ids": [5], "completion_ids": [6, 7], "label": True},
        {"prompt_ids": [8, 9], "completion_ids": [10], "label": False},
    ]
    batch = collate_kto(items, pad_token_id=0)
    # KL row 2 = prompt 0 + completion 1, KL row 3 = prompt 1 + completion 0 ((i + 1) mod 2)
    assert batch["input_ids"].tolist() == [[0, 5, 6, 7], [8, 9, 10, 0], [0, 5, 10, 0], [8, 9, 6, 7]]
    assert batch["response_mask"].tolist() == [[1, 1], [1, 0], [1, 0], [1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 2], [0, 0, 1, 1], [0, 1, 2, 3]]
    assert batch["labels"].tolist() == [True, False, False, False]
    assert batch["is_kl"].tolist() == [False, False, True, True]
    assert batch.meta["num_examples"] == 2
    with pytest.raises(ValueError, match="at least 2"):
        collate_kto(items[:1], 0)


def test_missing_rejected_names_file_and_row(tok, tmp_path) -> None:
    path = _jsonl(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}])
    with pytest.raises(DataError, match="missing column 'rejected'") as err:
        PreferenceDataset(load_rows(path), tok, 8, 8)
    assert f"{path}: row 1 (line 2)" in str(err.value)
    assert (err.value.file, err.value.row) == (path, 1)
    with pytest.raises(DataError, match="row 0: column 'chosen' must be a non-empty str"):
        PreferenceDataset([{"prompt": "a", "chosen": "  ", "rejected": "c"}], tok, 8, 8)


def test_equal_pairs_are_dropped_counted_and_warned_once(tok, tmp_path, caplog) -> None:
    rows = [
        {"prompt": "a", "chosen": "x", "rejected": "y"},
        {"prompt": "b", "chosen": "same", "rejected": "same"},
        {"prompt": "c", "chosen": "u", "rejected": "v"},
        {"prompt": "d", "chosen": "z", "rejected": "z"},
    ]
    path = _jsonl(tmp_path, rows)
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.preference_dataset"):
        ds = PreferenceDataset(load_rows(path), tok, 8, 8)
    assert ds.num_dropped_equal == 2 and len(ds) == 2
    assert [ds.where(i) for i in range(2)] == [f"{path}: row 0 (line 1)", f"{path}: row 2 (line 3)"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"{path}: row 1 (line 2)" in message and f"{path}: row 3 (line 4)" in message
    assert "dropped 2 of 4" in message
    with pytest.raises(DataError, match="no preference pair is left"):
        PreferenceDataset([rows[1]], tok, 8, 8)


def _length_rows() -> list[dict]:
    # Text prompts: one token per char; responses get EOS (+1 token).
    return [
        {"prompt": "abc", "chosen": "x", "rejected": "yz"},  # 3 / 2 / 3 tokens: fits
        {"prompt": "abcdef", "chosen": "x", "rejected": "y"},  # prompt 6 > 4
        {"prompt": "ab", "chosen": "wxyz", "rejected": "q"},  # chosen 5 > 3
    ]


def test_overlong_rows_error_filter_truncate(tok) -> None:
    with pytest.raises(DataError, match=r"row 1: the prompt has 6 tokens \(max_prompt_length=4\)"):
        PreferenceDataset(_length_rows(), tok, 4, 3, truncation="error")
    filtered = PreferenceDataset(_length_rows(), tok, 4, 3, truncation="filter")
    assert (len(filtered), filtered.num_filtered, filtered.num_truncated) == (1, 2, 0)
    assert filtered[0]["prompt_ids"] == _ids(tok, "abc")
    left = PreferenceDataset(_length_rows(), tok, 4, 3, truncation="left")
    assert (len(left), left.num_filtered, left.num_truncated) == (3, 0, 2)
    assert left[1]["prompt_ids"] == _ids(tok, "cdef")  # 'left' keeps the end of the prompt
    assert left[2]["chosen_ids"] == _ids(tok, "wxy")  # responses keep their start; EOS is cut
    assert left[2]["rejected_ids"] == [*_ids(tok, "q"), tok.eos_token_id]
    right = PreferenceDataset(_length_rows(), tok, 4, 3, truncation="right")
    assert right[1]["prompt_ids"] == _ids(tok, "abcd")
    with pytest.raises(ValueError, match="truncation must be one of"):
        PreferenceDataset(_length_rows(), tok, 4, 3, truncation="middle")


def test_truncation_that_makes_a_pair_equal_drops_it(tok) -> None:
    rows = [
        {"prompt": "p", "chosen": "abcd1", "rejected": "abcd2"},
        {"prompt": "p", "chosen": "a", "rejected": "b"},
    ]
    ds = PreferenceDataset(rows, tok, 4, 3, truncation="right")
    assert (len(ds), ds.num_dropped_equal, ds.num_truncated) == (1, 1, 1)


def test_kto_dataset_items_and_labels(tok, tmp_path) -> None:
    rows = [
        {"prompt": CHAT, "completion": "#### 3", "label": True},
        {"prompt": "2+2=", "completion": "5", "label": np.bool_(False)},  # parquet/pandas booleans
        {"prompt": "abcdefgh", "completion": "1", "label": True},  # prompt 8 > 6: filtered
    ]
    ds = KTODataset(rows, tok, 64, 16)
    assert ds[0]["completion_ids"] == [*_ids(tok, "#### 3"), tok.convert_tokens_to_ids("<|im_end|>")]
    assert ds[1] == {
        "prompt_ids": _ids(tok, "2+2="),
        "completion_ids": [*_ids(tok, "5"), tok.eos_token_id],
        "label": False,
    }
    assert isinstance(ds[1]["label"], bool)
    small = KTODataset(rows[1:], tok, 6, 16, truncation="filter")
    assert (len(small), small.num_filtered) == (1, 1)


@pytest.mark.parametrize("label", ["yes", 1, "true", None])
def test_kto_rejects_non_bool_labels(tok, tmp_path, label) -> None:
    rows = [
        {"prompt": "a", "completion": "b", "label": True},
        {"prompt": "a", "completion": "c", "label": label},
    ]
    path = _jsonl(tmp_path, rows)
    with pytest.raises(DataError, match="column 'label' must be a bool") as err:
        KTODataset(load_rows(path), tok, 8, 8)
    assert f"{path}: row 1 (line 2)" in str(err.value)


@pytest.mark.parametrize("style", ["question", "short"])
def test_arithmetic_preferences_score_one_and_zero(tok, style) -> None:
    rows = make_task("arithmetic", "train", 40, seed=3, style=style)
    pairs = make_arithmetic_preferences(rows, seed=0)
    assert len(pairs) == len(rows)
    for row, pair in zip(rows, pairs):
        truth = row["reward_model"]["ground_truth"]
        assert pair["prompt"] == row["prompt"] and pair["reward_model"] == row["reward_model"]
        assert pair["chosen"] == row["extra_info"]["answer"]
        assert compute_score(pair["chosen"], truth) == 1.0
        assert compute_score(pair["rejected"], truth) == 0.0
        wrong = int(pair["rejected"].removeprefix("#### "))
        assert 0 < abs(wrong - int(truth)) <= 3 and wrong >= 0
    assert make_arithmetic_preferences(rows, seed=0) == pairs  # deterministic for a seed
    assert make_arithmetic_preferences(rows, seed=1) != pairs
    ds = PreferenceDataset(pairs, tok, 64, 16)
    assert len(ds) == len(rows) and ds.num_dropped_equal == 0


def test_arithmetic_preferences_refuse_a_mismatched_answer() -> None:
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "extra_info": {"answer": "#### 3"}}]
    with pytest.raises(DataError, match=r"row 0: extra_info\.answer '#### 3' does not state '#### 2'"):
        make_arithmetic_preferences(rows, seed=0)
