"""Datasets as users hold them become RLDataset rows: lists, paths, datasets.Dataset, prompts, conversations."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.data import DataError, RLDataset, save_rows
from hybridflow.data.user_rows import DEFAULT_SOURCE, as_rows

CHAT = [{"role": "user", "content": "2+2?"}]
VERL_ROWS = [
    {
        "data_source": "mine",
        "prompt": CHAT,
        "reward_model": {"ground_truth": "4"},
        "extra_info": {"index": 7},
    },
    {"data_source": "mine", "prompt": "3+3?", "reward_model": {"ground_truth": "6"}},
]


def _dataset(data, tok, require_ground_truth=True, **kwargs) -> RLDataset:
    rows, source = as_rows(data, **kwargs)
    return RLDataset(rows, tok, source=source, require_ground_truth=require_ground_truth)


def test_a_list_of_dicts_in_verl_schema_is_kept(tok) -> None:
    ds = _dataset(VERL_ROWS, tok)
    assert [ds[i]["ground_truth"] for i in range(2)] == ["4", "6"]
    assert ds[0]["raw_prompt"] == CHAT and ds[0]["index"] == 7 and ds[1]["data_source"] == "mine"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_path_names_the_file_in_errors(tok, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"train{suffix}"
    rows = [
        dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) if isinstance(r["prompt"], str) else r
        for r in VERL_ROWS
    ]
    save_rows([{k: v for k, v in r.items() if k != "extra_info"} for r in rows], path)  # one type per column
    assert [_dataset(str(path), tok)[i]["ground_truth"] for i in range(2)] == ["4", "6"]
    save_rows([{"data_source": "mine", "prompt": "x"}], path)  # no ground truth for a reward that reads it
    with pytest.raises(DataError, match=rf"train{suffix}: row 0.*ground_truth"):
        _dataset(path, tok)


def test_plain_prompts_and_chat_lists_need_no_ground_truth_when_the_reward_does_not(tok) -> None:
    ds = _dataset(["say hi", CHAT], tok, require_ground_truth=False)
    assert ds[0]["raw_prompt"] == "say hi" and ds[1]["raw_prompt"] == CHAT
    assert ds[0]["ground_truth"] is None and ds[0]["data_source"] == DEFAULT_SOURCE
    with pytest.raises(DataError, match=r"row 0: missing column reward_model.ground_truth"):
        _dataset(["say hi"], tok, require_ground_truth=True)


def test_a_conversation_prompts_with_every_turn_up_to_the_last_user_turn(tok) -> None:
    row = {
        "prompt_id": "a1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ciao"},
        ],
    }
    ds = _dataset([row], tok, require_ground_truth=False)
    assert [(m["role"], m["content"]) for m in ds[0]["raw_prompt"]] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "bye"),
    ]
    assert ds[0]["extra_info"]["answer"] == "ciao" and ds[0]["ground_truth"] == "ciao"


def test_a_top_level_ground_truth_and_other_columns_for_trl(tok) -> None:
    rows, _ = as_rows([{"prompt": "2+2?", "ground_truth": "4", "solution": "4"}], columns_as_extra_info=True)
    ds = RLDataset(rows, tok)
    assert ds[0]["ground_truth"] == "4"
    assert ds[0]["extra_info"] == {"ground_truth": "4", "solution": "4", "prompt": "2+2?"}


def test_a_hugging_face_dataset(tok) -> None:
    datasets = pytest.importorskip("datasets")
    ds = _dataset(datasets.Dataset.from_list([{"prompt": "2+2?", "ground_truth": "4"}]), tok)
    assert ds[0]["ground_truth"] == "4" and ds[0]["raw_prompt"] == "2+2?"


def test_something_that_is_not_a_dataset_is_refused(tok) -> None:
    with pytest.raises(DataError, match="give a list of dicts"):
        as_rows(42)
    with pytest.raises(DataError, match="no rows"):
        as_rows([])
