"""Durable outputs: written beside their place and renamed in; nothing of the user's is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.utils import storage
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


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_staged_directory_replaces_a_full_one_whole_and_only_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    # issue 59: files were renamed in one by one, so an old adapter_config.json stayed beside a merged model
    if not exchange:  # a filesystem without RENAME_EXCHANGE (NFS): renamed aside, then the new one in
        monkeypatch.setattr(storage, "_exchange", lambda a, b: False)
    out = tmp_path / "model"
    out.mkdir()
    (out / "adapter_config.json").write_text("old adapter")
    (out / "adapter_model.safetensors").write_text("old weights")
    with pytest.raises(RuntimeError), staged_dir(out) as staged:
        (staged / "model.safetensors").write_text("half")
        raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with staged_dir(out) as staged:
        (staged / "config.json").write_text("{}")
        (staged / "model.safetensors").write_text("merged")
        assert (out / "adapter_config.json").read_text() == "old adapter"  # untouched until complete
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging or old copy left beside it


def test_a_swap_interrupted_between_its_renames_puts_the_old_output_back(tmp_path: Path) -> None:
    out = tmp_path / "model"
    aside = tmp_path / ".model.old"  # where the two-rename swap parks the old output
    aside.mkdir()
    (aside / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), staged_dir(out):
        raise RuntimeError("this write fails too")
    assert (out / "model.safetensors").read_text() == "old" and not aside.exists()


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
