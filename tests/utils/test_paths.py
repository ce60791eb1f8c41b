"""The light path checks: what they refuse, and that they create nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.utils.errors import MissingFileError, UserError
from hybridflow.utils.paths import check_local_dir, check_readable_file, check_writable_dir


def test_a_writable_directory_is_checked_without_being_made(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "exp" / "1"
    assert check_writable_dir(target, "the run directory") == target
    assert list(tmp_path.iterdir()) == []


def test_a_directory_under_a_file_or_on_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(UserError, match=f"the run directory {file} is a file, not a directory"):
        check_writable_dir(file, "the run directory")
    with pytest.raises(UserError, match=f"lies under {file}, which is a file"):
        check_writable_dir(file / "run", "the run directory")


def test_a_model_directory_names_the_setting_and_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(
        MissingFileError, match=r"^--model '/no/such/model': no such directory; pass the local"
    ):
        check_local_dir("/no/such/model", what="--model")
    with pytest.raises(UserError, match=f"^model.path '{tmp_path}' has no config.json"):
        check_local_dir(tmp_path, what="model.path")
    (tmp_path / "config.json").write_text("{}")
    assert check_local_dir(tmp_path, what="model.path") == tmp_path


def test_a_file_to_read_is_checked_for_its_type(tmp_path: Path) -> None:
    rows = tmp_path / "rows.csv"
    rows.write_text("a,b\n")
    with pytest.raises(UserError, match=r"unsupported file type '\.csv'; use \.parquet or \.jsonl"):
        check_readable_file(rows, "data.train_files", (".parquet", ".jsonl"))
    assert check_readable_file(rows, "data.train_files") == rows
