"""Loading parquet/jsonl rows, and validation errors that name the file and the row (and jsonl line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data import DataError, RLDataset, load_rows, save_rows


def _row(i: int, **changes) -> dict:
    row = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(changes)
    return row


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_round_trip(tmp_path: Path, ext: str) -> None:
    rows = [_row(0), _row(1, reward_model={"style": "rule", "ground_truth": "2"})]
    path = tmp_path / f"d.{ext}"
    save_rows(rows, path)
    loaded = load_rows(path)
    assert list(loaded) == rows
    assert [o.row for o in loaded.origins] == [0, 1]
    assert {o.file for o in loaded.origins} == {str(path)}


def test_parquet_nested_ground_truth(tmp_path: Path) -> None:
    truth = [{"target": i, "numbers": [1, i]} for i in (3, 4)]
    rows = [_row(i, reward_model={"style": "rule", "ground_truth": t}) for i, t in zip((3, 4), truth)]
    save_rows(rows, tmp_path / "c.parquet")
    assert list(load_rows(tmp_path / "c.parquet")) == rows
    with pytest.raises(ValueError, match="one type per column"):
        save_rows([_row(0), _row(1, prompt="text")], tmp_path / "mixed.parquet")


def test_jsonl_lines_and_several_files(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", [json.dumps(_row(0)), "", "   ", json.dumps(_row(1))])
    b = tmp_path / "b.parquet"
    save_rows([_row(2)], b)
    loaded = load_rows([a, b])
    assert [r["extra_info"]["index"] for r in loaded] == [0, 1, 2]
    assert [(o.file, o.row, o.line) for o in loaded.origins] == [
        (str(a), 0, 1),
        (str(a), 1, 4),  # blank lines are skipped but still counted
        (str(b), 0, None),
    ]


def test_file_level_errors(tmp_path: Path) -> None:
    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no rows"):
        load_rows(empty)
    empty_pq = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_pq)
    with pytest.raises(DataError, match=r"empty\.parquet: the file has no rows"):
        load_rows(empty_pq)
    with pytest.raises(DataError, match="not found"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"use \.parquet or \.jsonl"):
        load_rows(tmp_path / "d.csv")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps(_row(0)), "", "{not json"])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1 \(line 3\): invalid JSON") as e:
        load_rows(bad)
    assert (e.value.row, e.value.line) == (1, 3)
    scalar = _write_jsonl(tmp_path / "scalar.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match="row 0 \\(line 1\\): expected a JSON object"):
        load_rows(scalar)
    with pytest.raises(DataError, match="no rows"):
        RLDataset([], None, source="mine.jsonl")


def _without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


BAD_ROWS = {
    "no data_source": (_without(_row(2), "data_source"), "missing column 'data_source'"),
    "no prompt": (_without(_row(2), "prompt"), "missing column 'prompt'"),
    "no reward_model": (_without(_row(2), "reward_model"), "missing column reward_model.ground_truth"),
    "no ground_truth": (_row(2, reward_model={"style": "rule"}), "missing column reward_model.ground_truth"),
    "empty str prompt": (_row(2, prompt="  "), "empty prompt"),
    "empty messages": (_row(2, prompt=[]), "empty prompt"),
    "empty content": (_row(2, prompt=[{"role": "user", "content": ""}]), "empty prompt"),
    "prompt type": (_row(2, prompt=7), "must be a list of chat messages or a str, got int"),
    "message type": (_row(2, prompt=["hi"]), r"prompt\[0\] must be a message dict"),
    "content type": (_row(2, prompt=[{"role": "user", "content": 3}]), r"\['content'\] must be a str"),
    "bool truth": (_row(2, reward_model={"ground_truth": True}), "ground_truth must be .* got bool"),
    "empty truth": (_row(2, reward_model={"ground_truth": ""}), "ground_truth must be .* got str"),
    "empty list truth": (_row(2, reward_model={"ground_truth": []}), "ground_truth must be .* got list"),
    "data_source type": (_row(2, data_source=5), "'data_source' must be a non-empty str"),
    "extra_info type": (_row(2, extra_info="x"), "'extra_info' must be a dict"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_row_errors_name_file_row_and_line(tmp_path: Path, tok, case: str) -> None:
    bad, message = BAD_ROWS[case]
    # Row 2 is bad and sits on line 4 because of the blank line 2.
    path = _write_jsonl(
        tmp_path / "train.jsonl", [json.dumps(_row(0)), "", json.dumps(_row(1)), json.dumps(bad)]
    )
    with pytest.raises(DataError, match=message) as e:
        RLDataset(load_rows(path), tok, max_prompt_length=64)
    assert str(e.value).startswith(f"{path}: row 2 (line 4): ")
    assert (e.value.file, e.value.row, e.value.line) == (str(path), 2, 4)


def test_row_errors_in_parquet_and_in_memory(tmp_path: Path, tok) -> None:
    path = tmp_path / "val.parquet"
    save_rows([_row(0), _row(1, prompt=[{"role": "user", "content": " "}])], path)
    with pytest.raises(DataError, match=rf"^{path}: row 1: empty prompt"):
        RLDataset(load_rows(path), tok, max_prompt_length=64)
    nan_truth = _row(0, reward_model={"ground_truth": math.nan})
    with pytest.raises(DataError, match=r"^my rows: row 1: reward_model.ground_truth must be .* got float"):
        RLDataset([_row(0), nan_truth], tok, max_prompt_length=64, source="my rows")
    with pytest.raises(DataError, match=r"^built-in: row 0: a row must be a dict"):
        RLDataset(["text"], tok, max_prompt_length=64)
