"""Durable outputs: written beside their place and renamed in; nothing of the user's is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.utils.errors import UserError
from hybridflow.utils.storage import ensure_writable_dir, read_utf8_lines, staged_dir, staged_file


def test_a_staged_directory_appears_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), staged_dir(out) as staged:
        (staged / "weights").write_text("half")
        raise RuntimeError("killed mid-write")
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written is left
    with staged_dir(out) as staged:
        (staged / "weights").write_text("new")
    assert (out / "weights").read_text() == "new"


def test_a_staged_directory_over_a_full_one_keeps_the_users_other_files(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    (out / "notes.txt").write_text("mine")
    with staged_dir(out) as staged:
        (staged / "weights").write_text("new")
    assert (out / "weights").read_text() == "new" and (out / "notes.txt").read_text() == "mine"


def test_a_staged_file_replaces_the_old_one_only_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with pytest.raises(RuntimeError), staged_file(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_unusable_directories_and_bad_utf8_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        ensure_writable_dir(tmp_path / "f", "the run directory")
    with pytest.raises(UserError, match="which is a file"):
        ensure_writable_dir(tmp_path / "f" / "run", "the run directory")
    (tmp_path / "d.jsonl").write_bytes(b"ok\nalso ok\nbad \xe9 here\n")
    with pytest.raises(UserError, match=r"d\.jsonl: line 3 is not valid UTF-8 \(byte 0xe9 at column 5\)"):
        read_utf8_lines(tmp_path / "d.jsonl")
